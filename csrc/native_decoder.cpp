// The native decoder: one forward step of a Llama-family model (RMSNorm, q/k/v projections with
// rotary embeddings, grouped-query attention over a static KV cache, a SiLU-gated MLP, the LM head)
// in C++ over the quantized weights, for generation on the CPU. A compiled decode step still pays
// Python between its ~7 matrix products per block (inductor's wrapper, the dispatcher, guards): on
// SmolLM2 about half of a step. Here a step is one call: embeddings in, last-position logits out,
// every product on the kernels' thread pool, the projections that share an input (q/k/v, gate/up)
// in one parallel region. torch_lowbit/native_decode.py builds it from a transformers model (only
// after checking it against the model's own forward) and owns the cache it writes.
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <atomic>
#include <memory>
#include <tuple>
#include <vector>

#include "common/decoder_rows.h"
#include "common/lut_i8_prepared.h"
#include "common/parallel.h"

namespace torch_lowbit {
namespace {

constexpr const char* kOp = "native decoder";
// From this many tokens per row a step's attention is torch's SDPA (blocked matrix products) instead
// of one dot product per query and key.
constexpr int64_t kSdpaTokens = 16;

// One projection: a lut_i8 weight (the kernels) or a dense fp32 one (at::linear).
struct NativeLinear {
  bool quantized = false;
  LutI8Prepared q;
  at::Tensor dense, dense_bias;  // fp32 [N, K], [N] or undefined
  int64_t N = 0, K = 0;
};

// x [M, n] -> out = x * rsqrt(mean(x^2) + eps) * weight (transformers' RMSNorm in fp32).
void rms_norm(const float* x, int64_t M, int64_t n, const float* weight, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += row[i] * row[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    float* o = out + m * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = weight[i] * (row[i] * r);
  }
}

void add_into(float* x, const float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// transformers' rotate_half convention: x * cos + cat(-x2, x1) * sin over one head of D features.
void rotate(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

}  // namespace

class NativeDecoder {
 public:
  NativeDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                double attention_scale)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
        scale_(static_cast<float>(attention_scale)) {
    TORCH_CHECK(hidden > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0 &&
                    intermediate > 0,
                kOp, ": bad shape: hidden ", hidden, ", heads ", heads, ", kv_heads ", kv_heads, ", head_dim ", head_dim,
                ", intermediate ", intermediate);
  }

  // A stalled pool worker may still be reading a decode region's buffers.
  ~NativeDecoder() { quiesce_pool(); }
  NativeDecoder(const NativeDecoder&) = delete;
  NativeDecoder& operator=(const NativeDecoder&) = delete;

  int64_t add_quant_linear(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                           const at::Tensor& lut, int64_t code_bits, int64_t group, int64_t out_features,
                           const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& sub_groups,
                           const c10::optional<at::Tensor>& sub_scales, const c10::optional<at::Tensor>& sub_mins) {
    NativeLinear l;
    l.quantized = true;
    l.q = prepare_lut_i8(kOp, qweight, scales, mins, lut, code_bits, group, out_features, bias, sub_groups, sub_scales,
                         sub_mins);
    TORCH_CHECK(!l.q.w.pairs, kOp, ": pair codebooks (vq) reorder their activations: not supported");
    l.N = l.q.w.N, l.K = l.q.w.K;
    forget_decode_state();
    linears_.push_back(std::move(l));
    return static_cast<int64_t>(linears_.size()) - 1;
  }

  int64_t add_dense_linear(const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(), kOp,
                ": a dense weight must be fp32 [N, K] on the CPU");
    NativeLinear l;
    l.dense = weight.contiguous();
    l.N = weight.size(0), l.K = weight.size(1);
    if (bias.has_value()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == l.N, kOp, ": bias must be [N]");
      l.dense_bias = bias->to(at::kFloat).contiguous();
    }
    forget_decode_state();
    linears_.push_back(std::move(l));
    return static_cast<int64_t>(linears_.size()) - 1;
  }

  void add_block(const at::Tensor& in_norm, double in_eps, const at::Tensor& post_norm, double post_eps,
                 std::vector<int64_t> qkv, std::vector<int64_t> o, std::vector<int64_t> gate_up,
                 std::vector<int64_t> down) {
    const int64_t D = head_dim_;
    Block b{norm_weight(in_norm), static_cast<float>(in_eps), norm_weight(post_norm), static_cast<float>(post_eps),
            group(qkv, hidden_, (heads_ + 2 * kv_heads_) * D, "q/k/v"), group(o, heads_ * D, hidden_, "o"),
            group(gate_up, hidden_, 2 * intermediate_, "gate/up"), group(down, intermediate_, hidden_, "down")};
    forget_decode_state();
    blocks_.push_back(std::move(b));
  }

  // Per-head RMSNorms of the last block's queries and keys before the rotary embedding (Qwen3's
  // q_norm / k_norm: a weight of head_dim).
  void set_qk_norms(const at::Tensor& q_norm, double q_eps, const at::Tensor& k_norm, double k_eps) {
    TORCH_CHECK(!blocks_.empty(), kOp, ": add_block first");
    for (const at::Tensor* w : {&q_norm, &k_norm})
      TORCH_CHECK(w->dim() == 1 && w->size(0) == head_dim_ && w->is_floating_point(), kOp,
                  ": q/k norm weights must be [", head_dim_, "]");
    forget_decode_state();
    Block& b = blocks_.back();
    b.q_norm = q_norm.to(at::kFloat).contiguous(), b.k_norm = k_norm.to(at::kFloat).contiguous();
    b.q_eps = static_cast<float>(q_eps), b.k_eps = static_cast<float>(k_eps);
  }

  void set_head(const at::Tensor& final_norm, double eps, std::vector<int64_t> head) {
    TORCH_CHECK(head.size() == 1, kOp, ": the LM head is one projection");
    forget_decode_state();
    final_norm_ = norm_weight(final_norm);
    final_eps_ = static_cast<float>(eps);
    vocab_ = linears_.at(head[0]).N;
    head_ = group(head, hidden_, vocab_, "lm_head");
  }

  // The input embedding as lut_i8 tiles (a QuantEmbedding's packed rows: q8_0, q4_0, int4_g32, ...), so
  // forward_ids looks rows up here: row r = table[code] * scale (+ min) per group, as the format's
  // reference dequantizer computes it (the same floats).
  void set_embedding(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                     const at::Tensor& lut, int64_t code_bits, int64_t group, int64_t rows) {
    embedding_ = prepare_lut_i8(kOp, qweight, scales, mins, lut, code_bits, group, rows, c10::nullopt, c10::nullopt);
    TORCH_CHECK(!embedding_.w.pairs && embedding_.w.K == hidden_, kOp, ": the embedding must be lut_i8 tiles of ",
                hidden_, " features (no pair codebooks)");
    has_embedding_ = true;
  }

  // ids int64 [B, T]: forward on their embeddings (set_embedding first).
  at::Tensor forward_ids(const at::Tensor& ids, int64_t pos0) {
    TORCH_CHECK(has_embedding_, kOp, ": set_embedding first");
    TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.device().is_cpu(), kOp,
                ": ids must be int64 [B, T] on the CPU");
    const at::Tensor idc = ids.contiguous();
    const int64_t* id = idc.data_ptr<int64_t>();
    const LutI8Weights& w = embedding_.w;
    at::Tensor embeds = at::empty({ids.size(0), ids.size(1), hidden_}, ids.options().dtype(at::kFloat));
    float* out = embeds.data_ptr<float>();
    const int64_t groups = w.K / w.group;
    for (int64_t i = 0; i < idc.numel(); ++i) {
      const int64_t r = id[i];
      TORCH_CHECK(r >= 0 && r < w.N, kOp, ": token id ", r, " is outside the vocabulary [0, ", w.N, ")");
      const int64_t t = r / kI8TileRows, rr = r % kI8TileRows;
      float* row = out + i * hidden_;
      for (int64_t b = 0; b < w.K / 32; ++b) {
        const int64_t at_scale = (t * groups + b * 32 / w.group) * kI8TileRows + rr;
        const float scale = static_cast<float>(w.scales[at_scale]);
        const float mn = w.mins ? static_cast<float>(w.mins[at_scale]) : 0.f;
        const uint8_t* p = lut_i8_block(w, t, b);
        for (int k = 0; k < 32; ++k) {
          const float v = static_cast<float>(static_cast<int>(w.utable[lut_i8_code(p, w.bits, static_cast<int>(rr), k)]) -
                                             w.offset) * scale;
          row[b * 32 + k] = w.mins ? v + mn : v;
        }
      }
    }
    return forward(embeds, pos0);
  }

  // cos, sin: fp32 [positions, head_dim], the model's own rotary embedding of positions 0, 1, ...
  void set_rotary(const at::Tensor& cos, const at::Tensor& sin) {
    TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == head_dim_ &&
                    cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
                kOp, ": rotary tables must be fp32 [positions, ", head_dim_, "]");
    cos_ = cos.contiguous(), sin_ = sin.contiguous();
  }

  // One fp32 [B, kv_heads, L, head_dim] key and value tensor per block; written in place.
  void bind_cache(std::vector<at::Tensor> keys, std::vector<at::Tensor> values) {
    TORCH_CHECK(keys.size() == blocks_.size() && values.size() == blocks_.size(), kOp, ": one key and value cache per "
                "block (", blocks_.size(), "), got ", keys.size(), " and ", values.size());
    for (size_t i = 0; i < keys.size(); ++i)
      for (const at::Tensor* t : {&keys[i], &values[i]})
        TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu() &&
                        t->size(0) == keys[0].size(0) && t->size(1) == kv_heads_ && t->size(2) == keys[0].size(2) &&
                        t->size(3) == head_dim_,
                    kOp, ": cache tensors must be contiguous fp32 [B, ", kv_heads_, ", L, ", head_dim_,
                    "] of one shape, got ", t->sizes());
    forget_decode_state();
    keys_ = std::move(keys), values_ = std::move(values);
  }

  // embeds fp32 [B, T, hidden]: the tokens at positions pos0 .. pos0 + T - 1 of each row (their keys and
  // values are written to the cache); returns the last position's logits, fp32 [B, vocab].
  at::Tensor forward(const at::Tensor& embeds, int64_t pos0) {
    TORCH_CHECK(!blocks_.empty() && vocab_ > 0 && cos_.defined(), kOp, ": blocks, head and rotary tables must be set");
    TORCH_CHECK(!keys_.empty(), kOp, ": bind_cache first");
    TORCH_CHECK(embeds.dim() == 3 && embeds.size(2) == hidden_ && embeds.scalar_type() == at::kFloat &&
                    embeds.device().is_cpu() && embeds.size(1) >= 1,
                kOp, ": embeds must be fp32 [B, T >= 1, ", hidden_, "] on the CPU, got ", embeds.sizes());
    const int64_t B = embeds.size(0), T = embeds.size(1), M = B * T, L = keys_[0].size(2);
    TORCH_CHECK(B == keys_[0].size(0), kOp, ": batch ", B, " but the cache holds ", keys_[0].size(0), " rows");
    TORCH_CHECK(pos0 >= 0 && pos0 + T <= L && pos0 + T <= cos_.size(0), kOp, ": positions ", pos0, "..",
                pos0 + T - 1, " exceed the cache (", L, ") or the rotary table (", cos_.size(0), ")");
    const int64_t D = head_dim_, qN = heads_ * D, kvN = kv_heads_ * D;
    const int64_t qkvN = qN + 2 * kvN;
    auto f32 = embeds.options();
    // decode steps keep their buffers and run on reclaimable jobs; prompts allocate per call
    DecodeState* st = T == 1 ? &decode_state(M) : nullptr;
    auto buffer = [&](at::Tensor DecodeState::*kept, int64_t n) { return st ? st->*kept : at::empty({M, n}, f32); };
    at::Tensor h = buffer(&DecodeState::h, hidden_);  // the residual stream
    h.copy_(embeds.reshape({M, hidden_}));
    at::Tensor xn = buffer(&DecodeState::xn, hidden_), qkv = buffer(&DecodeState::qkv, qkvN);
    at::Tensor attn = buffer(&DecodeState::attn, qN), delta = buffer(&DecodeState::delta, hidden_);
    at::Tensor gu = buffer(&DecodeState::gu, 2 * intermediate_), act = buffer(&DecodeState::act, intermediate_);
    auto job = [&](size_t i) { return st ? st->projections[i].get() : nullptr; };
    float* hp = h.data_ptr<float>();
    Laps lap{profiling_ && T == 1, phase_s_, Clock::now()};  // decode steps only
    for (size_t li = 0; li < blocks_.size(); ++li) {
      const Block& blk = blocks_[li];
      rms_norm(hp, M, hidden_, blk.in_norm.data_ptr<float>(), blk.in_eps, xn.data_ptr<float>());
      lap(kOther);
      project(blk.qkv, job(4 * li), xn, qkv.data_ptr<float>());
      lap(kProjections);
      float* kc = keys_[li].data_ptr<float>();
      float* vc = values_[li].data_ptr<float>();
      float* qp = qkv.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) {  // rotary on q and k, then k and v into the cache
        const int64_t b = m / T, pos = pos0 + m % T;
        const float* c = cos_.data_ptr<float>() + pos * D;
        const float* s = sin_.data_ptr<float>() + pos * D;
        float* row = qp + m * qkvN;
        if (blk.q_norm.defined()) {  // in place: rms_norm reads each value before writing it
          rms_norm(row, heads_, D, blk.q_norm.data_ptr<float>(), blk.q_eps, row);
          rms_norm(row + qN, kv_heads_, D, blk.k_norm.data_ptr<float>(), blk.k_eps, row + qN);
        }
        for (int64_t hd = 0; hd < heads_ + kv_heads_; ++hd) rotate(row + hd * D, c, s, D);
        for (int64_t hk = 0; hk < kv_heads_; ++hk) {
          const int64_t at_pos = ((b * kv_heads_ + hk) * L + pos) * D;
          std::copy_n(row + qN + hk * D, D, kc + at_pos);
          std::copy_n(row + qN + kvN + hk * D, D, vc + at_pos);
        }
      }
      float* ap = attn.data_ptr<float>();
      lap(kOther);
      if (st) {
        st->attention.layer.store(static_cast<int64_t>(li), std::memory_order_relaxed);
        st->attention.pos0.store(pos0, std::memory_order_relaxed);
        parallel_for_reclaimable(0, M * kv_heads_, 1, st->attention);
      } else if (T >= kSdpaTokens) {
        prefill_attention(qkv, keys_[li], values_[li], B, T, pos0, attn);
      } else {
        decode_attention(qp, qkvN, kc, vc, M, T, L, pos0, ap);
      }
      lap(kAttention);
      project(blk.o, job(4 * li + 1), attn, delta.data_ptr<float>());
      lap(kProjections);
      add_into(hp, delta.data_ptr<float>(), M * hidden_);
      rms_norm(hp, M, hidden_, blk.post_norm.data_ptr<float>(), blk.post_eps, xn.data_ptr<float>());
      lap(kOther);
      project(blk.gate_up, job(4 * li + 2), xn, gu.data_ptr<float>());
      lap(kProjections);
      silu_mul(gu.data_ptr<float>(), M, act.data_ptr<float>());
      lap(kOther);
      project(blk.down, job(4 * li + 3), act, delta.data_ptr<float>());
      lap(kProjections);
      add_into(hp, delta.data_ptr<float>(), M * hidden_);
    }
    at::Tensor last = h.view({B, T, hidden_}).select(1, T - 1).contiguous();
    at::Tensor normed = st ? st->normed : at::empty({B, hidden_}, f32);
    rms_norm(last.data_ptr<float>(), B, hidden_, final_norm_.data_ptr<float>(), final_eps_, normed.data_ptr<float>());
    at::Tensor logits = at::empty({B, vocab_}, f32);
    lap(kOther);
    project(head_, job(4 * blocks_.size()), normed, logits.data_ptr<float>());
    lap(kProjections);
    return logits;
  }

  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }

  // Profiling: seconds spent in each phase of the decode steps (one token per row) since the last reset
  // (projections: activation rounding and the kernels; attention; other: norms, rotary, cache writes,
  // residuals, the SiLU gate).
  void set_profiling(bool on) { profiling_ = on; }
  std::vector<double> phase_seconds() const { return {phase_s_[kProjections], phase_s_[kAttention], phase_s_[kOther]}; }
  void reset_phases() { std::fill(std::begin(phase_s_), std::end(phase_s_), 0.0); }

 private:
  // Projections that read one input, their outputs side by side in one [M, N] buffer.
  struct Group {
    std::vector<int64_t> ids;
    int64_t K = 0, N = 0;
  };
  struct Block {
    at::Tensor in_norm;
    float in_eps;
    at::Tensor post_norm;
    float post_eps;
    Group qkv, o, gate_up, down;
    at::Tensor q_norm, k_norm;  // per-head norms before rotary, or undefined
    float q_eps = 0.f, k_eps = 0.f;
  };

  at::Tensor norm_weight(const at::Tensor& w) const {
    TORCH_CHECK(w.dim() == 1 && w.size(0) == hidden_ && w.is_floating_point(), kOp, ": a norm weight must be [",
                hidden_, "]");
    return w.to(at::kFloat).contiguous();
  }

  Group group(const std::vector<int64_t>& ids, int64_t K, int64_t N, const char* what) const {
    Group g{ids, K, 0};
    for (int64_t id : ids) {
      TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(linears_.size()), kOp, ": unknown projection ", id);
      const NativeLinear& l = linears_[id];
      TORCH_CHECK(l.K == K, kOp, ": ", what, " projection reads ", l.K, " features, expected ", K);
      g.N += l.N;
    }
    TORCH_CHECK(g.N == N, kOp, ": ", what, " projections give ", g.N, " outputs, expected ", N);
    return g;
  }

  // One lut_i8 projection of a group: tiles [first_tile, first_tile + p->tiles) of the group's region,
  // written to columns [col, col + N) of the group's [M, g.N] output.
  struct Segment {
    const LutI8Prepared* p;
    size_t acts;  // which of the group's activation roundings it reads
    LutI8Fn kernel;
    int64_t col, first_tile;
  };
  // A group's lut_i8 segments (tiles numbered one after another) and the distinct activation roundings
  // they read (per group size, group mins, sub-groups, half sums: usually one), each with a linear
  // that asks for it.
  struct GroupPlan {
    std::vector<Segment> segments;
    std::vector<const LutI8Prepared*> act_owner;
    int64_t tiles = 0;
  };

  GroupPlan plan(const Group& g) const {
    GroupPlan plan;
    std::vector<std::tuple<int64_t, bool, bool, bool>> keys;
    int64_t col = 0;
    for (int64_t id : g.ids) {
      const NativeLinear& l = linears_[id];
      if (l.quantized) {
        const LutI8Weights& w = l.q.w;
        const auto key = std::make_tuple(w.group, w.mins != nullptr && !w.sub_scales, w.sub_groups != nullptr,
                                         w.sub_scales != nullptr && w.sub_block == 16);
        const size_t a = std::find(keys.begin(), keys.end(), key) - keys.begin();
        if (a == keys.size()) {
          keys.push_back(key);
          plan.act_owner.push_back(&l.q);
        }
        plan.segments.push_back({&l.q, a, lut_i8_kernel(w), col, plan.tiles});
        plan.tiles += l.q.tiles;
      }
      col += l.N;
    }
    return plan;
  }

  // The dense (fp32 nn.Linear) projections of g, into their columns of out [M, g.N].
  void run_dense(const Group& g, const at::Tensor& x, float* out) const {
    const int64_t M = x.size(0);
    int64_t col = 0;
    for (int64_t id : g.ids) {
      const NativeLinear& l = linears_[id];
      if (!l.quantized) {
        at::Tensor y = at::linear(x, l.dense, l.dense_bias.defined() ? c10::optional<at::Tensor>(l.dense_bias)
                                                                      : c10::optional<at::Tensor>());
        at::from_blob(out, {M, g.N}).narrow(1, col, l.N).copy_(y);
      }
      col += l.N;
    }
  }

  // Tiles [t0, t1) of a group's segments into out [M, ldo].
  static void run_tiles(const GroupPlan& plan, const ActBuffers* acts, int64_t t0, int64_t t1, float* out,
                        int64_t ldo) {
    for (const Segment& sg : plan.segments) {
      const int64_t lo = std::max(t0, sg.first_tile), hi = std::min(t1, sg.first_tile + sg.p->tiles);
      if (lo < hi) sg.kernel(sg.p->w, acts[sg.acts].acts, lo - sg.first_tile, hi - sg.first_tile, out + sg.col, ldo);
    }
  }

  // out [M, g.N] = x [M, g.K] through every projection of g: one parallel region over all their tiles.
  void run(const Group& g, const at::Tensor& x, float* out) const {
    run_dense(g, x, out);
    const GroupPlan p = plan(g);
    if (p.segments.empty() || x.size(0) == 0) return;
    std::vector<ActBuffers> acts;
    for (const LutI8Prepared* owner : p.act_owner) acts.push_back(lut_i8_activations(kOp, *owner, x));
    parallel_for(0, p.tiles, 1, [&](int64_t t0, int64_t t1) { run_tiles(p, acts.data(), t0, t1, out, g.N); });
  }

  // Tasks [r0, r1) of (row, KV head): the G query heads that read it, causal (position p sees keys 0..p);
  // row m's outputs at ap + m * qN.
  void attend_rows(const float* qp, int64_t qkvN, const float* kc, const float* vc, int64_t T, int64_t L,
                   int64_t pos0, int64_t r0, int64_t r1, float* ap) const {
    const int64_t D = head_dim_, G = heads_ / kv_heads_, qN = heads_ * D;
    const AttendGroupFn attend = attend_group_kernel();
    std::vector<float> p(static_cast<size_t>(G * (pos0 + T)));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t m = r / kv_heads_, hk = r % kv_heads_, b = m / T, pos = pos0 + m % T;
      const int64_t base = (b * kv_heads_ + hk) * L * D;
      attend(qp + m * qkvN + hk * G * D, G, kc + base, vc + base, D, pos + 1, D, scale_, p.data(),
             ap + m * qN + hk * G * D);
    }
  }

  // One task per (row, KV head).
  void decode_attention(const float* qp, int64_t qkvN, const float* kc, const float* vc, int64_t M, int64_t T,
                        int64_t L, int64_t pos0, float* ap) const {
    parallel_for(0, M * kv_heads_, 1,
                 [&](int64_t r0, int64_t r1) { attend_rows(qp, qkvN, kc, vc, T, L, pos0, r0, r1, ap); });
  }

  // A long prompt: torch's blocked SDPA (a matrix product per block of queries) over the cache's first
  // pos0 + T positions, causal with the queries at pos0.. (a bool mask when pos0 > 0).
  void prefill_attention(const at::Tensor& qkv, const at::Tensor& keys, const at::Tensor& values, int64_t B,
                         int64_t T, int64_t pos0, at::Tensor& attn) const {
    const int64_t D = head_dim_, qN = heads_ * D, S = pos0 + T;
    const at::Tensor q = qkv.narrow(1, 0, qN).view({B, T, heads_, D}).transpose(1, 2);
    const at::Tensor k = keys.narrow(2, 0, S), v = values.narrow(2, 0, S);
    c10::optional<at::Tensor> mask;
    if (pos0 > 0)  // query t sees keys 0 .. pos0 + t
      mask = at::arange(S, qkv.options().dtype(at::kLong)).unsqueeze(0) <=
             at::arange(pos0, S, qkv.options().dtype(at::kLong)).unsqueeze(1);
    const at::Tensor out = at::scaled_dot_product_attention(q, k, v, mask, 0.0, /*is_causal=*/pos0 == 0, scale_,
                                                            /*enable_gqa=*/true);
    attn.view({B, T, heads_, D}).copy_(out.transpose(1, 2));
  }

  // gu [M, 2I] (gate | up) -> act [M, I] = silu(gate) * up
  void silu_mul(const float* gu, int64_t M, float* act) const {
    const int64_t I = intermediate_;
    const SiluMulFn gate = silu_mul_kernel();
    parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) gate(gu + m * 2 * I, gu + m * 2 * I + I, I, act + m * I);
    });
  }

  // ---- Decode steps (one token per row) on reclaimable jobs (parallel.h) ----
  // A worker preempted beside a busy program would hold its chunk of a region for a whole scheduler
  // slice; on reclaimable jobs the calling thread takes such chunks back and goes on. The stalled
  // worker may then still read a region's inputs after the region: so every buffer a decode region
  // reads is kept in DecodeState, built for one batch size, and replaced only after quiesce_pool().

  static float* worker_buffer(const std::vector<float*>& own, int slot) {
    TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(own.size()), kOp, ": pool worker ", slot,
                " has no buffer (the thread count changed during a step)");
    return own[slot];
  }

  // A group's region: its plan, the activation roundings it reads (storage kept from step to step) and
  // the [M, N] output; workers compute into their own [M, N] buffers and publish their tiles' columns.
  struct ProjectionJob final : ReclaimableJob {
    GroupPlan plan;
    std::vector<ActBuffers> acts;
    float* out = nullptr;  // read by the caller and by publishing workers only, so it may change per call
    int64_t M = 0, N = 0;
    const std::vector<float*>* own = nullptr;
    void compute(int64_t b, int64_t e, int slot) const override {
      run_tiles(plan, acts.data(), b, e, slot < 0 ? out : worker_buffer(*own, slot), N);
    }
    void publish(int64_t b, int64_t e, int slot) const override {
      const float* from = worker_buffer(*own, slot);
      for (const Segment& sg : plan.segments) {
        const int64_t lo = std::max(b, sg.first_tile), hi = std::min(e, sg.first_tile + sg.p->tiles);
        if (lo >= hi) continue;
        const int64_t c0 = sg.col + (lo - sg.first_tile) * kI8TileRows;
        const int64_t c1 = sg.col + std::min((hi - sg.first_tile) * kI8TileRows, sg.p->w.N);
        for (int64_t m = 0; m < M; ++m) std::copy(from + m * N + c0, from + m * N + c1, out + m * N + c0);
      }
    }
  };

  // Decode attention: task r = (row, KV head) of the layer and position the caller set last.
  struct AttentionJob final : ReclaimableJob {
    const NativeDecoder* d = nullptr;
    const float* qp = nullptr;
    float* ap = nullptr;
    int64_t qkvN = 0, L = 0;
    std::atomic<int64_t> layer{0}, pos0{0};  // a stalled worker may read them as they change: each in range
    const std::vector<float*>* own = nullptr;
    void compute(int64_t b, int64_t e, int slot) const override {
      const int64_t li = layer.load(std::memory_order_relaxed), p0 = pos0.load(std::memory_order_relaxed);
      d->attend_rows(qp, qkvN, d->keys_[li].data_ptr<float>(), d->values_[li].data_ptr<float>(), 1, L, p0, b, e,
                     slot < 0 ? ap : worker_buffer(*own, slot));
    }
    void publish(int64_t b, int64_t e, int slot) const override {
      const int64_t GD = d->heads_ / d->kv_heads_ * d->head_dim_, qN = d->heads_ * d->head_dim_;
      const float* from = worker_buffer(*own, slot);
      for (int64_t r = b; r < e; ++r) {
        const int64_t at = r / d->kv_heads_ * qN + r % d->kv_heads_ * GD;
        std::copy(from + at, from + at + GD, ap + at);
      }
    }
  };

  struct DecodeState {
    int64_t M = 0, slots = 0;
    at::Tensor h, xn, qkv, attn, delta, gu, act, normed;  // a step's [M, ...] buffers
    std::vector<at::Tensor> own_storage;                  // the workers' output buffers
    std::vector<float*> own;
    std::vector<std::unique_ptr<ProjectionJob>> projections;  // per block: q/k/v, o, gate/up, down; then the head
    AttentionJob attention;
  };

  // Waits for stalled workers, then drops the decode state (before anything it points into changes).
  void forget_decode_state() {
    quiesce_pool();
    decode_.reset();
  }

  std::unique_ptr<ProjectionJob> projection_job(const Group& g, const at::Tensor& x, float* out,
                                                const std::vector<float*>& own) const {
    auto job = std::make_unique<ProjectionJob>();
    job->plan = plan(g);
    for (const LutI8Prepared* owner : job->plan.act_owner) job->acts.push_back(lut_i8_activations(kOp, *owner, x));
    job->out = out, job->M = x.size(0), job->N = g.N, job->own = &own;
    return job;
  }

  // The decode state for M rows and the pool's current workers, built when either changed.
  DecodeState& decode_state(int64_t M) {
    const int64_t slots = pool_worker_slots();
    if (decode_ && decode_->M == M && decode_->slots >= slots) return *decode_;
    forget_decode_state();
    auto st = std::make_unique<DecodeState>();
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    const int64_t qN = heads_ * head_dim_, qkvN = qN + 2 * kv_heads_ * head_dim_;
    st->M = M, st->slots = slots;
    st->h = at::zeros({M, hidden_}, f32), st->xn = at::zeros({M, hidden_}, f32);
    st->qkv = at::zeros({M, qkvN}, f32), st->attn = at::zeros({M, qN}, f32);
    st->delta = at::zeros({M, hidden_}, f32), st->gu = at::zeros({M, 2 * intermediate_}, f32);
    st->act = at::zeros({M, intermediate_}, f32), st->normed = at::zeros({M, hidden_}, f32);
    const int64_t widest = std::max({qkvN, hidden_, 2 * intermediate_, vocab_});
    for (int64_t i = 0; i < slots; ++i) {
      st->own_storage.push_back(at::empty({M, widest}, f32));
      st->own.push_back(st->own_storage.back().data_ptr<float>());
    }
    for (const Block& blk : blocks_) {
      st->projections.push_back(projection_job(blk.qkv, st->xn, st->qkv.data_ptr<float>(), st->own));
      st->projections.push_back(projection_job(blk.o, st->attn, st->delta.data_ptr<float>(), st->own));
      st->projections.push_back(projection_job(blk.gate_up, st->xn, st->gu.data_ptr<float>(), st->own));
      st->projections.push_back(projection_job(blk.down, st->act, st->delta.data_ptr<float>(), st->own));
    }
    st->projections.push_back(projection_job(head_, st->normed, nullptr, st->own));
    AttentionJob& a = st->attention;
    a.d = this, a.qp = st->qkv.data_ptr<float>(), a.ap = st->attn.data_ptr<float>(), a.qkvN = qkvN;
    a.L = keys_[0].size(2), a.own = &st->own;
    decode_ = std::move(st);
    return *decode_;
  }

  // out [M, g.N] = x [M, g.K] through g: as run(), on a decode job when there is one.
  void project(const Group& g, ProjectionJob* job, const at::Tensor& x, float* out) {
    if (job == nullptr) return run(g, x, out);
    run_dense(g, x, out);
    job->out = out;
    for (size_t a = 0; a < job->acts.size(); ++a) {
      const ActBuffers again = lut_i8_activations(kOp, *job->plan.act_owner[a], x, 0, 1.0, 0, job->acts[a].storage);
      TORCH_CHECK(again.acts.q == job->acts[a].acts.q && again.acts.M == job->acts[a].acts.M, kOp,
                  ": decode activations moved");
    }
    if (!job->plan.segments.empty() && x.size(0) > 0) parallel_for_reclaimable(0, job->plan.tiles, 1, *job);
  }

  using Clock = std::chrono::steady_clock;
  enum Phase { kProjections = 0, kAttention = 1, kOther = 2 };
  // Adds the time since the last lap to a phase (when profiling).
  struct Laps {
    bool on;
    double* seconds;
    Clock::time_point last;
    void operator()(Phase phase) {
      if (!on) return;
      const Clock::time_point now = Clock::now();
      seconds[phase] += std::chrono::duration<double>(now - last).count();
      last = now;
    }
  };

  LutI8Prepared embedding_;
  bool has_embedding_ = false;
  bool profiling_ = false;
  double phase_s_[3] = {};
  int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_, vocab_ = 0;
  float scale_;
  std::vector<NativeLinear> linears_;
  std::vector<Block> blocks_;
  at::Tensor final_norm_;
  float final_eps_ = 0.f;
  Group head_;
  at::Tensor cos_, sin_;
  std::vector<at::Tensor> keys_, values_;
  std::unique_ptr<DecodeState> decode_;
};

void register_native_decoder(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<NativeDecoder>(m, "NativeDecoder",
                            "A Llama-family forward step in C++ over lut_i8 / fp32 projections "
                            "(torch_lowbit/native_decode.py builds it)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double>(), py::arg("hidden"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("attention_scale"))
      .def("add_quant_linear", &NativeDecoder::add_quant_linear)
      .def("add_dense_linear", &NativeDecoder::add_dense_linear)
      .def("add_block", &NativeDecoder::add_block)
      .def("set_head", &NativeDecoder::set_head)
      .def("set_qk_norms", &NativeDecoder::set_qk_norms)
      .def("set_rotary", &NativeDecoder::set_rotary)
      .def("bind_cache", &NativeDecoder::bind_cache)
      .def("forward", &NativeDecoder::forward, py::call_guard<py::gil_scoped_release>())
      .def("set_embedding", &NativeDecoder::set_embedding)
      .def("forward_ids", &NativeDecoder::forward_ids, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("blocks", &NativeDecoder::blocks)
      .def("set_profiling", &NativeDecoder::set_profiling)
      .def("phase_seconds", &NativeDecoder::phase_seconds, "[projections, attention, other] seconds of decode steps since reset_phases")
      .def("reset_phases", &NativeDecoder::reset_phases);
}

}  // namespace torch_lowbit
