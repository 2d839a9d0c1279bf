// The work-claiming thread pool behind torch_lowbit::parallel_for (see parallel.h for why).
//
// One job at a time: a caller publishes (generation, chunk count, range, f) and claims chunks with a
// compare-and-swap on one 64-bit word, generation << 32 | next chunk, as the workers do. A worker
// whose CAS succeeds owns that chunk of that generation, and the caller returns only when every
// chunk is done; a worker that wakes after the job finds no chunk and goes back to waiting. Before
// the fields of the next job are written the word is closed (next = kClosed), so a worker holding
// a stale copy of the word can never claim against fields that are being rewritten.
//
// Reclaimable jobs (parallel.h) add one state word per chunk, generation << 2 | state: a worker that
// has computed a chunk into its own buffer moves the word from an older generation to (gen, publishing),
// copies, and marks it (gen, done); the caller, tired of waiting, moves it from an older generation to
// (gen, taken) and computes the chunk itself. Whoever moves the word first owns the chunk's output;
// a late worker sees the word at its generation or past it and throws its result away.
#include "common/parallel.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <pthread.h>

#include <cctype>
#include <cstdlib>
#include <string>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace torch_lowbit {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

constexpr uint32_t kClosed = 0xFFFFFFFFu;
constexpr int64_t kChunksPerThread = 4;  // slack for a thread that is descheduled mid-job
// How long an idle worker spins for the next job before it sleeps: a decode step calls a kernel
// every ~50-200 µs, and waking a sleeping thread costs tens of µs.
constexpr auto kWorkerSpin = std::chrono::microseconds(100);

using Clock = std::chrono::steady_clock;

enum ChunkState : uint64_t { kPublishing = 1, kDone = 2, kTaken = 3 };
inline uint64_t chunk_word(uint32_t gen, ChunkState st) { return uint64_t{gen} << 2 | st; }
// Whether a chunk word was written in an earlier job than gen (generations wrap at 2^32).
inline bool before(uint64_t word, uint32_t gen) { return static_cast<int32_t>(static_cast<uint32_t>(word >> 2) - gen) < 0; }

// Workers inside a reclaimable job's compute()/publish() (or about to claim one): quiesce_pool waits for 0.
std::atomic<int> workers_in_reclaimable{0};
std::atomic<int64_t> reclaim_test_delay_us{0};
std::atomic<int64_t> reclaimed_chunks{0}, discarded_results{0};

// How long the caller waits for workers before it calls a worker stalled: two of its own chunks' time
// plus 50 µs of slack.
constexpr auto kStallSlack = std::chrono::microseconds(50);

// How a job went for the calling thread: the time it spent on its own chunks (and how many), and the
// time it then waited for chunks workers had claimed.
struct JobTimes {
  Clock::duration own{}, wait{};
  uint32_t own_chunks = 0;
};

class Pool {
 public:
  explicit Pool(int workers) : states_(new std::atomic<uint64_t>[(workers + 1) * kChunksPerThread]) {
    for (int64_t i = 0; i < (workers + 1) * kChunksPerThread; ++i) states_[i].store(0);
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this, i] { worker(i); });
  }

  int workers() const { return static_cast<int>(threads_.size()); }

  void stop_and_join() {
    {
      std::lock_guard<std::mutex> lk(sleep_mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // Runs the job (f, or rj when not null) on the calling thread plus the workers; returns when every
  // chunk is done (reclaimable: done by its owner, the caller taking back chunks of stalled workers).
  JobTimes run(int64_t begin, int64_t end, int64_t chunk, uint32_t chunks, const RangeFn* f,
               const ReclaimableJob* rj = nullptr) {
    const uint64_t gen = (claim_.load() >> 32) + 1;
    claim_.store(gen << 32 | kClosed);  // workers holding the previous word cannot claim any more
    f_.store(f, std::memory_order_relaxed);
    rj_.store(rj, std::memory_order_relaxed);
    begin_.store(begin, std::memory_order_relaxed);
    end_.store(end, std::memory_order_relaxed);
    chunk_.store(chunk, std::memory_order_relaxed);
    chunks_.store(chunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    // every chunk word one generation back: `before` then never compares across a wrap of the counter
    // (a worker late from the last job finds its chunks at that generation, taken or done, and backs off)
    if (rj != nullptr)
      for (uint32_t i = 0; i < chunks; ++i)
        states_[i].store(chunk_word(static_cast<uint32_t>(gen - 1), kDone), std::memory_order_relaxed);
    claim_.store(gen << 32);  // seq_cst: ordered before the sleepers_ read (no lost wake-up)
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lk(sleep_mutex_); }
      wake_.notify_all();
    }
    JobTimes times;
    const auto start = Clock::now();
    times.own_chunks = work(static_cast<uint32_t>(gen), -1);
    const auto own_done = Clock::now();
    times.own = own_done - start;
    const auto patience = 2 * (times.own / std::max<uint32_t>(times.own_chunks, 1)) + kStallSlack;
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (rj != nullptr && Clock::now() - own_done > patience) {
        reclaim(static_cast<uint32_t>(gen), chunks);  // then wait only for chunks being published
        cpu_relax();
        continue;
      }
      if (spins < 4096) cpu_relax();
      else std::this_thread::yield();  // a worker that claimed a chunk is not running: let it
    }
    times.wait = Clock::now() - own_done;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));  // f's first exception, any thread
    return times;
  }

 private:
  // Claims and runs chunks of generation `gen` until none is left; how many it ran. slot: the worker's
  // index, -1 for the caller.
  uint32_t work(uint32_t gen, int slot) {
    for (uint32_t ran = 0;;) {
      // a worker counts itself in before it can claim a reclaimable chunk: quiesce_pool then also
      // waits for one that claimed and was preempted before it started
      const bool counted = slot >= 0;
      if (counted) workers_in_reclaimable.fetch_add(1);
      const int outcome = claim_and_run(gen, slot);
      if (counted) workers_in_reclaimable.fetch_sub(1);
      if (outcome < 0) return ran;
      ran += outcome;
    }
  }

  // One claim attempt: -1 when no chunk of `gen` is left, 0 when the CAS lost, 1 when a chunk ran.
  int claim_and_run(uint32_t gen, int slot) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    const uint32_t next = static_cast<uint32_t>(word);
    if ((word >> 32) != gen || next == kClosed) return -1;
    const uint32_t chunks = chunks_.load(std::memory_order_relaxed);
    if (next >= chunks) return -1;
    const RangeFn* f = f_.load(std::memory_order_relaxed);
    const ReclaimableJob* rj = rj_.load(std::memory_order_relaxed);
    const int64_t begin = begin_.load(std::memory_order_relaxed), end = end_.load(std::memory_order_relaxed);
    const int64_t chunk = chunk_.load(std::memory_order_relaxed);
    // success means the word was still (gen, next): the fields read above are this job's
    if (!claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel)) return 0;
    const int64_t b = begin + next * chunk, e = std::min(end, b + chunk);
    if (rj == nullptr) {
      guarded([&] { (*f)(b, e); });
      done_.fetch_add(1, std::memory_order_release);
      return 1;
    }
    if (slot < 0) {  // the caller's own chunk: nobody else may take it
      guarded([&] { rj->compute(b, e, -1); });
      states_[next].store(chunk_word(gen, kDone), std::memory_order_relaxed);
      done_.fetch_add(1, std::memory_order_release);
      return 1;
    }
    if (const int64_t us = reclaim_test_delay_us.load(std::memory_order_relaxed))
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    std::exception_ptr failed;
    try {
      rj->compute(b, e, slot);
    } catch (...) {
      failed = std::current_exception();
    }
    for (uint64_t st = states_[next].load(std::memory_order_acquire); before(st, gen);) {
      if (!states_[next].compare_exchange_weak(st, chunk_word(gen, kPublishing), std::memory_order_acq_rel)) continue;
      if (failed) keep_error(failed);
      else guarded([&] { rj->publish(b, e, slot); });
      states_[next].store(chunk_word(gen, kDone), std::memory_order_release);
      done_.fetch_add(1, std::memory_order_release);
      return 1;
    }
    discarded_results.fetch_add(1, std::memory_order_relaxed);  // the caller took it: its result stands
    return 1;
  }

  // The caller takes every chunk of `gen` that no worker has finished or started publishing, and
  // computes it into the output itself.
  void reclaim(uint32_t gen, uint32_t chunks) {
    const ReclaimableJob* rj = rj_.load(std::memory_order_relaxed);
    const int64_t begin = begin_.load(std::memory_order_relaxed), end = end_.load(std::memory_order_relaxed);
    const int64_t chunk = chunk_.load(std::memory_order_relaxed);
    for (uint32_t i = 0; i < chunks; ++i) {
      uint64_t st = states_[i].load(std::memory_order_acquire);
      if (!before(st, gen) || !states_[i].compare_exchange_strong(st, chunk_word(gen, kTaken), std::memory_order_acq_rel))
        continue;
      const int64_t b = begin + i * chunk;
      guarded([&] { rj->compute(b, std::min(end, b + chunk), -1); });
      reclaimed_chunks.fetch_add(1, std::memory_order_relaxed);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  template <typename F>
  void guarded(F&& run) {
    try {
      run();
    } catch (...) {  // kept for the caller: the job's other chunks still run and are waited for
      keep_error(std::current_exception());
    }
  }

  void keep_error(std::exception_ptr e) {
    std::lock_guard<std::mutex> lk(error_mutex_);
    if (!error_) error_ = e;
  }

  void worker(int slot) {
    uint32_t seen = static_cast<uint32_t>(claim_.load() >> 32);
    for (;;) {
      const auto spin_until = std::chrono::steady_clock::now() + kWorkerSpin;
      int spins = 0;
      while (static_cast<uint32_t>(claim_.load() >> 32) == seen && !stop_.load()) {
        cpu_relax();
        if (++spins % 64 == 0 && std::chrono::steady_clock::now() > spin_until) {
          std::unique_lock<std::mutex> lk(sleep_mutex_);
          sleepers_.fetch_add(1);
          wake_.wait(lk, [&] { return stop_.load() || static_cast<uint32_t>(claim_.load() >> 32) != seen; });
          sleepers_.fetch_sub(1);
        }
      }
      if (stop_.load()) return;
      seen = static_cast<uint32_t>(claim_.load() >> 32);
      work(seen, slot);
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<uint64_t> claim_{uint64_t{0} << 32 | kClosed};
  std::atomic<uint32_t> done_{0};
  std::atomic<const RangeFn*> f_{nullptr};
  std::atomic<const ReclaimableJob*> rj_{nullptr};
  std::unique_ptr<std::atomic<uint64_t>[]> states_;  // per chunk, reclaimable jobs
  std::atomic<int64_t> begin_{0}, end_{0}, chunk_{1};
  std::atomic<uint32_t> chunks_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

// The pool is never destroyed (its threads may still be waiting at exit), and a forked child gets a
// fresh one: the parent's threads do not exist there.
std::mutex pool_mutex;  // one caller at a time; others run inline
Pool* pool = nullptr;

void forget_pool_after_fork() {
  pool = nullptr;  // leaked: its threads are gone in the child
  new (&pool_mutex) std::mutex();
}

Pool* pool_with(int workers) {
  static const bool registered = (pthread_atfork(nullptr, nullptr, forget_pool_after_fork), true);
  (void)registered;
  if (pool == nullptr || pool->workers() != workers) {
    if (pool != nullptr) {
      pool->stop_and_join();
      delete pool;
    }
    pool = new Pool(workers);
  }
  return pool;
}

std::string lower(const char* v) {
  std::string s = v ? v : "";
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// TORCH_LOWBIT_POOL_THREADS=N: the pool runs the kernels on N threads whatever torch's own count, so
// torch can run its ops on one thread (torch.set_num_threads(1): no OpenMP threads spinning on a busy
// core) while the quantized linears keep two or more; 0 when unset (follow at::get_num_threads()).
int64_t pool_threads_from_env() {
  const char* v = std::getenv("TORCH_LOWBIT_POOL_THREADS");
  if (!v) return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0' && n >= 1 && n <= 1024, "torch_lowbit: TORCH_LOWBIT_POOL_THREADS must be a "
              "thread count from 1 to 1024, got '", v, "'");
  return n;
}

// The settings, read from the environment on first use and changed by set_threading afterwards.
struct Settings {
  std::atomic<bool> pool;
  std::atomic<int64_t> pool_threads;  // 0: follow at::get_num_threads()
};

Settings& settings() {
  static Settings s = [] {
    const std::string mode = lower(std::getenv("TORCH_LOWBIT_THREADS"));
    const int64_t threads = pool_threads_from_env();
    TORCH_CHECK(mode.empty() || mode == "auto" || mode == "pool" || mode == "openmp", "torch_lowbit: unknown "
                "TORCH_LOWBIT_THREADS '", mode, "'; choose one of auto, pool, openmp");
    TORCH_CHECK(!(mode == "openmp" && threads > 0), "torch_lowbit: TORCH_LOWBIT_POOL_THREADS sizes the pool, which "
                "TORCH_LOWBIT_THREADS=openmp turns off; unset one of them");
    const bool pool = mode == "pool" || (mode != "openmp" && (threads > 0 ||
                                                               lower(std::getenv("OMP_WAIT_POLICY")) == "passive"));
    return Settings{{pool}, {threads}};
  }();
  return s;
}

}  // namespace

bool uses_own_thread_pool() { return settings().pool.load(std::memory_order_relaxed); }

int64_t pool_threads() { return settings().pool_threads.load(std::memory_order_relaxed); }

void set_threading(const std::string& scheduler, int64_t threads) {
  const std::string mode = lower(scheduler.c_str());
  TORCH_CHECK(mode == "pool" || mode == "openmp", "torch_lowbit: unknown scheduler '", scheduler,
              "'; choose pool or openmp");
  TORCH_CHECK(threads >= 0 && threads <= 1024, "torch_lowbit: threads must be 0 (follow torch.get_num_threads()) "
              "or a count from 1 to 1024, got ", threads);
  TORCH_CHECK(mode == "pool" || threads == 0, "torch_lowbit: the openmp scheduler runs on torch's threads "
              "(torch.set_num_threads); pass threads=0 or choose the pool");
  settings().pool_threads.store(threads);
  settings().pool.store(mode == "pool");
}

namespace {

// Beside a busy program, a worker that claimed a chunk may be preempted for a whole scheduler slice
// (milliseconds) while the caller waits for it; one thread alone is then faster than two (SmolLM2
// decode with the other core busy: 77 tok/s on one thread, 61 on two; docs/kernels/cpu.md). So when
// the caller waits for a worker longer than two of its own chunks took (plus 50 µs of slack), later
// calls run on the calling thread alone for 20x the time lost (1 to 200 ms): a stall then costs at
// most ~5% against running on one thread, and on a quiet machine a rare one costs little. Decided by
// the caller holding the pool; read by any caller.
constexpr int kBackOffPerLost = 20;
// A stall with none other in the 50 ms before it is a hiccup (a quiet VM's worker descheduled once:
// 3-6 per 1B decode of 48 tokens on Zen 4), not a busy core, whose stalls come every scheduler slice:
// backing off after each lone one ran ~8% of a quiet decode's jobs on one thread.
constexpr auto kLoneStall = std::chrono::milliseconds(50);
constexpr auto kShortestBackOff = std::chrono::milliseconds(1), kLongestBackOff = std::chrono::milliseconds(200);
std::atomic<int64_t> inline_until{0};  // Clock ticks
std::atomic<int64_t> last_stall{0};    // Clock ticks of the last stall
std::atomic<int64_t> pool_jobs{0}, stalled_jobs{0}, inline_jobs{0};  // for pool_stats()

bool backing_off() { return Clock::now().time_since_epoch().count() < inline_until.load(std::memory_order_relaxed); }

void note_job(const JobTimes& t) {
  const auto expected = 2 * (t.own / std::max<uint32_t>(t.own_chunks, 1)) + kStallSlack;
  pool_jobs.fetch_add(1, std::memory_order_relaxed);
  if (t.wait <= expected) return;
  stalled_jobs.fetch_add(1, std::memory_order_relaxed);
  const int64_t now = Clock::now().time_since_epoch().count();
  if (now - last_stall.exchange(now, std::memory_order_relaxed) > Clock::duration(kLoneStall).count()) return;
  const auto back_off = std::clamp<Clock::duration>(kBackOffPerLost * (t.wait - expected), kShortestBackOff,
                                                    kLongestBackOff);
  inline_until.store((Clock::now() + back_off).time_since_epoch().count(), std::memory_order_relaxed);
}

}  // namespace

std::vector<int64_t> pool_stats() {
  return {pool_jobs.load(), stalled_jobs.load(), inline_jobs.load(), reclaimed_chunks.load(), discarded_results.load()};
}

namespace {

// The threads a parallel_for would use now: 1 inside an ATen parallel region.
int64_t call_threads() {
  const int64_t fixed = pool_threads();
  return at::in_parallel_region() ? 1 : fixed > 0 ? fixed : at::get_num_threads();
}

// [begin, end) in chunks of at least `grain`, kChunksPerThread a thread.
std::pair<int64_t, int64_t> chunking(int64_t range, int64_t grain, int64_t threads) {
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunk = std::max(grain, (range + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
  return {chunk, (range + chunk - 1) / chunk};
}

}  // namespace

void parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& f) {
  if (begin >= end) return;
  if (!uses_own_thread_pool()) return at::parallel_for(begin, end, grain, f);
  const int64_t threads = call_threads();
  const auto [chunk, chunks] = chunking(end - begin, grain, threads);
  if (threads <= 1 || chunks <= 1) return f(begin, end);
  if (backing_off()) {
    inline_jobs.fetch_add(1, std::memory_order_relaxed);
    return f(begin, end);
  }
  std::unique_lock<std::mutex> lk(pool_mutex, std::try_to_lock);
  if (!lk.owns_lock()) return f(begin, end);  // another thread's call holds the pool
  note_job(pool_with(static_cast<int>(threads - 1))->run(begin, end, chunk, static_cast<uint32_t>(chunks), &f));
}

void parallel_for_reclaimable(int64_t begin, int64_t end, int64_t grain, const ReclaimableJob& job) {
  if (begin >= end) return;
  const int64_t threads = call_threads();
  const auto [chunk, chunks] = chunking(end - begin, grain, threads);
  if (!uses_own_thread_pool())
    return at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { job.compute(b, e, -1); });
  if (threads <= 1 || chunks <= 1) return job.compute(begin, end, -1);
  std::unique_lock<std::mutex> lk(pool_mutex, std::try_to_lock);
  if (!lk.owns_lock()) return job.compute(begin, end, -1);
  pool_with(static_cast<int>(threads - 1))->run(begin, end, chunk, static_cast<uint32_t>(chunks), nullptr, &job);
  pool_jobs.fetch_add(1, std::memory_order_relaxed);
}

int64_t pool_worker_slots() { return std::max<int64_t>(call_threads() - 1, 0); }

void quiesce_pool() {
  for (int spins = 0; workers_in_reclaimable.load() > 0; ++spins) {
    if (spins < 1024) cpu_relax();
    else std::this_thread::yield();
  }
}

void set_reclaim_test_delay_us(int64_t us) {
  TORCH_CHECK(us >= 0 && us <= 1000000, "torch_lowbit: the reclaim test delay must be 0 to 1e6 µs, got ", us);
  reclaim_test_delay_us.store(us);
}

}  // namespace torch_lowbit
