// Threading of torch_lowbit's CPU kernels: parallel_for(begin, end, grain, f), a drop-in for
// at::parallel_for (same thread count: at::get_num_threads()) that does not wait for threads that
// are not running.
//
// Why not at::parallel_for: it splits the range statically, one piece per OpenMP thread, and the
// region ends when every thread has done its piece. When another program keeps a core busy, the
// thread placed there runs only when the scheduler gives it a slice, and every kernel call waits
// for it: SmolLM2 decode on 2 threads fell to 0.28x of its quiet speed with the other core busy
// (fp32: 0.35x), below its 1-thread speed. The pool cuts the range into several chunks per thread
// and the calling thread claims chunks itself alongside the pool's workers; it waits only for
// chunks a worker has actually claimed, so a worker that is not scheduled costs nothing. Idle
// workers spin briefly (decode issues a kernel every ~100 µs) and then sleep.
//
// But with OpenMP's default wait policy, torch's own OpenMP threads spin for about a millisecond
// after every ATen region, and a second set of spinning threads fights them for the cores: measured
// 17% slower SmolLM2 decode on a quiet machine than OpenMP kernels. So the pool runs only where the
// OpenMP threads do not spin: OMP_WAIT_POLICY=passive (then OpenMP kernels pay a futex wake per call
// and the pool is 40% faster), or when forced with TORCH_LOWBIT_THREADS=pool (openmp forces
// at::parallel_for), or TORCH_LOWBIT_POOL_THREADS=N: the pool on N threads whatever torch's count, for
// torch.set_num_threads(1) on a shared machine (SmolLM2 q4_0 decode kept 0.93x of its quiet speed with
// the other core busy, against 0.34x by default). docs/kernels/cpu.md has the measurements.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace torch_lowbit {

using RangeFn = std::function<void(int64_t, int64_t)>;

// Calls f(b, e) on disjoint sub-ranges covering [begin, end), each at least `grain` long (except
// the last), from the calling thread and up to at::get_num_threads() - 1 pool workers. Inline (one
// call) for one thread, a range of one grain, inside an ATen parallel region, or while another
// call is using the pool.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& f);

// A job whose chunks the calling thread may take back from a worker that stalls (a worker preempted
// beside a busy program waits a whole scheduler slice, milliseconds). A worker computes a chunk into
// its own buffer (slot >= 0) and publishes it only if the caller has not taken the chunk; the caller
// computes its own and the taken chunks straight into the output (slot -1) and never waits for a
// worker longer than two of its own chunks take. So a worker may still be computing a taken chunk
// after parallel_for_reclaimable returns: everything compute() reads must stay allocated until
// quiesce_pool() (inputs rewritten meanwhile only feed a result that is thrown away), and compute()
// must read the job's per-call fields once, at its start.
struct ReclaimableJob {
  virtual ~ReclaimableJob() = default;
  // chunk [b, e): into the output (slot < 0) or into worker `slot`'s own buffer
  virtual void compute(int64_t b, int64_t e, int slot) const = 0;
  // worker `slot`'s result of [b, e), computed for this call, into the output
  virtual void publish(int64_t b, int64_t e, int slot) const = 0;
};

// parallel_for for a ReclaimableJob. On the pool it ignores the stall back-off (nobody waits for a
// stalled worker); with the pool off, at::parallel_for over job.compute(b, e, -1).
void parallel_for_reclaimable(int64_t begin, int64_t end, int64_t grain, const ReclaimableJob& job);

// The buffers a ReclaimableJob needs: one per pool worker that may run it (slots 0 .. n - 1).
int64_t pool_worker_slots();

// Returns once no pool worker is inside a ReclaimableJob's compute(): before what one reads is freed.
void quiesce_pool();

// Test hook: pool workers sleep this long after claiming each chunk of a reclaimable job (0: off), so
// that tests see chunks taken back and late results thrown away.
void set_reclaim_test_delay_us(int64_t us);

// Whether parallel_for uses the pool (else at::parallel_for): from the environment on first use
// (TORCH_LOWBIT_THREADS, TORCH_LOWBIT_POOL_THREADS, OMP_WAIT_POLICY), then as set_threading sets it.
bool uses_own_thread_pool();

// The pool's thread count; 0: at::get_num_threads() (what torch uses).
int64_t pool_threads();

// scheduler "pool" (threads: 0 follows torch, N fixes the count) or "openmp" (threads must be 0).
// Takes effect at the next kernel call; the Python side is torch_lowbit.set_num_threads.
void set_threading(const std::string& scheduler, int64_t threads);

// Since the process started: jobs the pool ran, those where the caller waited on a stalled worker,
// jobs run on the calling thread alone while backing off after a stall (parallel.cpp), chunks of
// reclaimable jobs the caller took back from a stalled worker, and the taken chunks whose late
// worker result was thrown away.
std::vector<int64_t> pool_stats();

}  // namespace torch_lowbit
