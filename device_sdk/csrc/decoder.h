// The native decode step: one call runs a whole Llama-family token (batch 1, one position),
// the same computation as llama.py's forward, at the active widths, on the same unit-major
// (memory-mapped, possibly fp16 or block-quantised) storage. Per layer:
//
//   h = RMSNorm(x); q, k, v = prefix GEMVs of h (+ bias, + LoRA); RoPE(q, k); append k, v to
//   the KV cache; attention of each query head over its KV group (GQA, sliding window);
//   x += o-proj(attention); h = RMSNorm(x); x += down(silu(gate(h)) · up(h))
//
// then logits = lm_head(RMSNorm(x)). A sub-layer of width 0 is skipped. Threads share one
// OpenMP region for the whole token: each GEMV splits its output rows (or, for the
// transposed o/down storage, its input rows: `add_columns`) between them, with a barrier
// between ops; RMSNorm is cheap enough that every thread computes its own copy instead of
// waiting. The barriers are our own spinning ones (SpinBarrier): a token has seven per layer,
// and the OpenMP barrier under OMP_WAIT_POLICY=PASSIVE (which the SDK sets) puts waiting
// threads to sleep, whose wake-up cost ate most of the second thread's gain.

#pragma once

#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "quant.h"
#include "simd.h"

namespace elastic {

// One ElasticLinear: its whole storage ([rows, in] row units, or transposed [in, out]; or those
// packed in quant.h's blocks, `fmt`), an optional bias, and the active LoRA, y += s·B·(A·x) with
// A [r, in_active], B [out_active, r].
struct Projection {
  torch::Tensor storage, bias, lora_a, lora_b;
  float lora_scale = 0;
  int64_t fmt = quant::NONE;
  int64_t logical_cols = 0;  // in (row units) or out (column units): the unpacked storage's columns

  int64_t cols() const { return logical_cols; }
  bool quantized() const { return fmt != quant::NONE; }
  bool has_lora() const { return lora_a.defined(); }
  int64_t rank() const { return has_lora() ? lora_a.size(0) : 0; }

  template <typename F>
  void with_weights(F&& f) const {  // f(const T* storage) for the stored type T
    switch (storage.scalar_type()) {
      case torch::kFloat: f(storage.data_ptr<float>()); break;
      case torch::kHalf: f(storage.data_ptr<c10::Half>()); break;
      default: TORCH_CHECK(false, "storage must be fp32 or fp16, or fmt block-quantised");
    }
  }

  // t = A·x for this projection's LoRA (t has rank() entries).
  void lora_down(const float* x, float* t) const {
    const int64_t in = lora_a.size(1);
    const float* a = lora_a.data_ptr<float>();
    for (int64_t j = 0; j < rank(); ++j) t[j] = dot(x, a + j * in, in);
  }

  // The per-output-channel tail of a GEMV for outputs [begin, end): bias, LoRA.
  void finish(float* y, int64_t begin, int64_t end, const float* t) const {
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    const float* lb = has_lora() ? lora_b.data_ptr<float>() : nullptr;
    const int64_t r = rank();
    for (int64_t n = begin; n < end; ++n) {
      float value = y[n];
      if (b != nullptr) value += b[n];
      if (lb != nullptr) {
        float delta = 0;
        for (int64_t j = 0; j < r; ++j) delta += lb[n * r + j] * t[j];
        value += lora_scale * delta;
      }
      y[n] = value;
    }
  }

  // Row units: y[n] for active output rows [begin, end) (a prefix of the stored rows); `xq` is x
  // quantised, which block-quantised storage reads instead of x.
  void rows(const float* x, const quant::Activations& xq, float* y, int64_t begin, int64_t end, const float* t) const {
    if (quantized())
      quant::gemv_rows(fmt, storage.data_ptr<uint8_t>(), cols(), xq, begin, end, y, quant::active_isa());
    else
      with_weights([&](auto* w) { gemv_rows(x, w, cols(), begin, end, y); });
    finish(y, begin, end, t);
  }

  // Block-quantised column units: y[n] for outputs [begin, end) over the active inputs, whose
  // quantised blocks are `xq` (its block count is the active width, rounded up).
  void columns_quantized(const quant::Activations& xq, float* y, int64_t begin, int64_t end) const {
    quant::gemv_columns(fmt, storage.data_ptr<uint8_t>(), cols(), xq, begin, end, y, quant::active_isa());
  }

  // Column units, one run [k_begin, k_end) of the active stored rows (inputs): partial[n] =
  // Σ_k x[k]·W[k, n] over every output n, before `finish`.
  void column_partial(const float* x, int64_t k_begin, int64_t k_end, float* partial) const {
    with_weights([&](auto* w) {
      gemv_columns(x + k_begin, w + k_begin * cols(), cols(), k_end - k_begin, 0, cols(), partial);
    });
  }

  void check_lora(int64_t in_active, int64_t out_active, const char* name) const {
    if (!has_lora()) return;
    TORCH_CHECK(lora_a.size(1) == in_active && lora_b.size(0) == out_active, name, " LoRA is ",
                lora_b.size(0), "x", lora_a.size(1), " but the active width is ", out_active, "x", in_active);
  }
};

enum Slot { Q, K, V, O, GATE, UP, DOWN, SLOTS };

struct Layer {
  torch::Tensor attn_norm, mlp_norm;
  Projection proj[SLOTS];
  int64_t groups = 0, neurons = 0;  // active KV groups and SwiGLU neurons
};

// [begin, end) of `n` items for part `index` of `parts`, cut at multiples of `align`.
inline std::pair<int64_t, int64_t> split(int64_t n, int64_t parts, int64_t index, int64_t align) {
  const int64_t chunk = ((n + parts - 1) / parts + align - 1) / align * align;
  return {std::min(n, index * chunk), std::min(n, (index + 1) * chunk)};
}

// A reusable barrier for one OpenMP team. Waiting threads spin (a barrier is a few
// microseconds apart from the next), then yield the core after ~0.5 ms (20,000 pauses on
// Zen 5), so that a thread descheduled on a busy device does not leave the others burning it.
class SpinBarrier {
 public:
  void wait(int64_t team) {
    if (team == 1) return;
    const int64_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == team - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < kSpins)
        _mm_pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  static constexpr int64_t kSpins = 20000;
  std::atomic<int64_t> arrived_{0}, generation_{0};
};

class Decoder {
 public:
  // `embed` is [vocab, hidden] in a float type, or (embed_fmt a quant::Format) packed rows of blocks, as
  // the tied LM head of a quantised model keeps it.
  Decoder(int64_t head_dim, int64_t n_rep, double eps, int64_t window, torch::Tensor inv_freq, torch::Tensor embed,
          int64_t embed_fmt, torch::Tensor final_norm, Projection lm_head)
      : head_dim_(head_dim), n_rep_(n_rep), eps_(static_cast<float>(eps)), window_(window),
        inv_freq_(inv_freq.contiguous()), embed_(embed), embed_fmt_(embed_fmt), final_norm_(final_norm.contiguous()),
        lm_head_(lm_head) {
    TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(), "embeddings must be a contiguous matrix");
    hidden_ = final_norm_.numel();
    if (embed_fmt_ == quant::NONE) {
      TORCH_CHECK(embed.size(1) == hidden_, "embeddings have ", embed.size(1), " columns, the model ", hidden_);
    } else {
      TORCH_CHECK(embed_fmt_ == quant::Q8 || embed_fmt_ == quant::Q4, "unknown block format ", embed_fmt_);
      TORCH_CHECK(embed.scalar_type() == torch::kByte &&
                      embed.size(1) == quant::blocks_for(hidden_) * quant::block_bytes(embed_fmt_),
                  "packed embeddings need ", quant::blocks_for(hidden_) * quant::block_bytes(embed_fmt_),
                  " uint8 a row");
    }
  }

  void add_layer(torch::Tensor attn_norm, torch::Tensor mlp_norm, std::vector<Projection> projections) {
    TORCH_CHECK(projections.size() == SLOTS, "a layer has 7 projections (q k v o gate up down)");
    Layer layer;
    layer.attn_norm = attn_norm.contiguous();
    layer.mlp_norm = mlp_norm.contiguous();
    std::copy(projections.begin(), projections.end(), layer.proj);
    for (const Projection& p : layer.proj) quantized_ = quantized_ || p.quantized();
    layer.groups = layer.proj[K].storage.size(0) / head_dim_;
    layer.neurons = layer.proj[UP].storage.size(0);
    max_q_ = std::max(max_q_, layer.proj[Q].storage.size(0));
    max_kv_ = std::max(max_kv_, layer.proj[K].storage.size(0));
    max_neurons_ = std::max(max_neurons_, layer.neurons);
    layers_.push_back(std::move(layer));
  }

  void set_widths(const std::vector<int64_t>& groups, const std::vector<int64_t>& neurons) {
    TORCH_CHECK(groups.size() == layers_.size() && neurons.size() == layers_.size(), "one width per layer");
    for (size_t i = 0; i < layers_.size(); ++i) {
      Layer& layer = layers_[i];
      TORCH_CHECK(0 <= groups[i] && groups[i] * head_dim_ <= layer.proj[K].storage.size(0), "layer ", i,
                  ": KV groups out of range");
      TORCH_CHECK(0 <= neurons[i] && neurons[i] <= layer.proj[UP].storage.size(0), "layer ", i, ": neurons out of range");
      layer.groups = groups[i];
      layer.neurons = neurons[i];
    }
  }

  void set_lora(int64_t layer, int64_t slot, c10::optional<torch::Tensor> a, c10::optional<torch::Tensor> b,
                double scale) {
    TORCH_CHECK(0 <= layer && layer < static_cast<int64_t>(layers_.size()) && 0 <= slot && slot < SLOTS,
                "no such projection");
    Projection& p = layers_[layer].proj[slot];
    if (!a.has_value()) {
      p.lora_a = p.lora_b = torch::Tensor();
      return;
    }
    TORCH_CHECK(b.has_value() && a->dim() == 2 && b->dim() == 2 && a->size(0) == b->size(1), "LoRA needs A [r, in], B [out, r]");
    p.lora_a = a->to(torch::kFloat).contiguous();
    p.lora_b = b->to(torch::kFloat).contiguous();
    p.lora_scale = static_cast<float>(scale);
    max_rank_ = std::max(max_rank_, a->size(0));
  }

  // Logits [vocab] of `token` at `position`; its keys and values go to keys/values
  // [layers, 1, kv_heads, max_len, head_dim] at `position`, which already hold the earlier ones.
  torch::Tensor step(int64_t token, int64_t position, torch::Tensor keys, torch::Tensor values) {
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(keys.dim() == 5 && keys.sizes() == values.sizes() && keys.size(0) == L && keys.size(1) == 1 &&
                    keys.size(4) == head_dim_ && keys.scalar_type() == torch::kFloat && values.scalar_type() == torch::kFloat &&
                    keys.is_contiguous() && values.is_contiguous(),
                "the KV cache must be contiguous fp32 [layers, 1, kv_heads, max_len, head_dim]");
    TORCH_CHECK(0 <= position && position < keys.size(3), "position ", position, " is outside the cache (",
                keys.size(3), ")");
    TORCH_CHECK(0 <= token && token < embed_.size(0), "token ", token, " is outside the vocabulary");
    for (int64_t i = 0; i < L; ++i) {
      const Layer& layer = layers_[i];
      TORCH_CHECK(layer.groups <= keys.size(2), "the KV cache has fewer heads than layer ", i, " uses");
      const int64_t q_rows = layer.groups * n_rep_ * head_dim_, kv_rows = layer.groups * head_dim_;
      layer.proj[Q].check_lora(hidden_, q_rows, "q_proj");
      layer.proj[K].check_lora(hidden_, kv_rows, "k_proj");
      layer.proj[V].check_lora(hidden_, kv_rows, "v_proj");
      layer.proj[O].check_lora(q_rows, hidden_, "o_proj");
      layer.proj[GATE].check_lora(hidden_, layer.neurons, "gate_proj");
      layer.proj[UP].check_lora(hidden_, layer.neurons, "up_proj");
      layer.proj[DOWN].check_lora(layer.neurons, hidden_, "down_proj");
    }
    x_.resize(hidden_);
    q_.resize(max_q_);
    k_.resize(max_kv_);
    v_.resize(max_kv_);
    attention_.resize(max_q_);
    activation_.resize(max_neurons_);
    up_.resize(max_neurons_);
    update_.resize(hidden_);
    partial_.resize((std::max(max_q_, max_neurons_) + kColumnChunk - 1) / kColumnChunk * hidden_);
    read_embedding(token);
    rope_angles(position);
    const int64_t vocab = lm_head_.storage.size(0);
    auto logits = torch::empty({vocab}, torch::kFloat);
    float* out = logits.data_ptr<float>();
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());

#pragma omp parallel num_threads(threads)
    {
      const int64_t team = omp_get_num_threads();
      std::vector<float> h(hidden_), t(3 * max_rank_ + 1), scores(keys.size(3));
      // h quantised for block-quantised projections, and the input of o/down (each thread
      // quantises its own copy: a few hundred values, cheaper than another barrier).
      quant::Activations hq, inq;
      const int64_t isa = quant::active_isa();
      float* tq = t.data();
      float* tk = tq + max_rank_;
      float* tv = tk + max_rank_;
      for (int64_t i = 0; i < L; ++i) {
        const Layer& layer = layers_[i];
        const Projection* p = layer.proj;
        if (layer.groups > 0) {
          const int64_t q_rows = layer.groups * n_rep_ * head_dim_, kv_rows = layer.groups * head_dim_;
          rms_norm(layer.attn_norm, h.data());
          if (quantized_) hq.set(h.data(), hidden_, isa);
          if (p[Q].has_lora()) p[Q].lora_down(h.data(), tq);
          if (p[K].has_lora()) p[K].lora_down(h.data(), tk);
          if (p[V].has_lora()) p[V].lora_down(h.data(), tv);
          // q, k and v rows as one list of 16-row blocks, shared out between the threads.
          const int64_t q_blocks = (q_rows + 15) / 16, kv_blocks = (kv_rows + 15) / 16;
#pragma omp for schedule(static) nowait
          for (int64_t b = 0; b < q_blocks + 2 * kv_blocks; ++b) {
            if (b < q_blocks) {
              p[Q].rows(h.data(), hq, q_.data(), b * 16, std::min(q_rows, b * 16 + 16), tq);
            } else {
              const bool is_k = b < q_blocks + kv_blocks;
              const int64_t first = (b - q_blocks - (is_k ? 0 : kv_blocks)) * 16, last = std::min(kv_rows, first + 16);
              if (is_k)
                p[K].rows(h.data(), hq, k_.data(), first, last, tk);
              else
                p[V].rows(h.data(), hq, v_.data(), first, last, tv);
            }
          }
          barrier_.wait(team);
#pragma omp for schedule(static) nowait
          for (int64_t g = 0; g < layer.groups; ++g) attend(i, g, position, keys, values, scores.data());
          barrier_.wait(team);
          if (p[O].has_lora()) p[O].lora_down(attention_.data(), tq);
          add_columns(p[O], attention_.data(), q_rows, tq, team, inq);
        }
        if (layer.neurons > 0) {
          const int64_t neurons = layer.neurons;
          rms_norm(layer.mlp_norm, h.data());
          if (quantized_) hq.set(h.data(), hidden_, isa);
          if (p[GATE].has_lora()) p[GATE].lora_down(h.data(), tq);
          if (p[UP].has_lora()) p[UP].lora_down(h.data(), tk);
#pragma omp for schedule(static) nowait
          for (int64_t b = 0; b < (neurons + 15) / 16; ++b) {
            const int64_t first = b * 16, last = std::min(neurons, first + 16);
            p[GATE].rows(h.data(), hq, activation_.data(), first, last, tq);
            p[UP].rows(h.data(), hq, up_.data(), first, last, tk);
            for (int64_t n = first; n < last; ++n) {
              const float gate = activation_[n];
              activation_[n] = gate / (1.0f + std::exp(-gate)) * up_[n];
            }
          }
          barrier_.wait(team);
          if (p[DOWN].has_lora()) p[DOWN].lora_down(activation_.data(), tq);
          add_columns(p[DOWN], activation_.data(), neurons, tq, team, inq);
        }
      }
      rms_norm(final_norm_, h.data());
      if (lm_head_.quantized()) hq.set(h.data(), hidden_, isa);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < (vocab + 63) / 64; ++b) lm_head_.rows(h.data(), hq, out, b * 64, std::min(vocab, b * 64 + 64), nullptr);
    }
    return logits;
  }

 private:
  static constexpr int64_t kColumnChunk = 32;  // input rows per partial sum of o/down
  SpinBarrier barrier_;

  // x += proj(input) for a column-unit projection (o, down), called by every thread of the
  // team. The active input rows are cut into fixed chunks, each folded into its own partial
  // sums over all outputs; a thread takes a contiguous run of chunks, so it streams one block of
  // the transposed storage (splitting by output columns instead gave each thread short strided
  // pieces of every row). Then each thread adds up the chunks of its run of outputs, in chunk
  // order: the chunks do not depend on the team size, so neither does any bit of the result.
  //
  // Block-quantised storage is split by outputs instead: there block-row b holds every output's
  // 32-input block side by side, so a thread's run of outputs is one contiguous piece of each
  // block-row, and each output is still summed by one thread in one order.
  void add_columns(const Projection& proj, const float* input, int64_t active, const float* lora_t, int64_t team,
                   quant::Activations& inq) {
    const int64_t thread = omp_get_thread_num(), chunks = (active + kColumnChunk - 1) / kColumnChunk;
    if (proj.quantized()) {
      inq.set(input, active, quant::active_isa());
      const auto [begin, end] = split(hidden_, team, thread, 16);
      proj.columns_quantized(inq, update_.data(), begin, end);
      proj.finish(update_.data(), begin, end, lora_t);
      for (int64_t n = begin; n < end; ++n) x_[n] += update_[n];
      barrier_.wait(team);
      return;
    }
    const auto [first, last] = split(chunks, team, thread, 1);
    for (int64_t c = first; c < last; ++c)
      proj.column_partial(input, c * kColumnChunk, std::min(active, (c + 1) * kColumnChunk), partial_.data() + c * hidden_);
    barrier_.wait(team);
    const auto [begin, end] = split(hidden_, team, thread, 16);
    for (int64_t n = begin; n < end; ++n) {
      float total = 0;
      for (int64_t c = 0; c < chunks; ++c) total += partial_[c * hidden_ + n];
      update_[n] = total;
    }
    proj.finish(update_.data(), begin, end, lora_t);
    for (int64_t n = begin; n < end; ++n) x_[n] += update_[n];
    barrier_.wait(team);
  }

  void read_embedding(int64_t token) {
    const int64_t d = hidden_;
    if (embed_fmt_ != quant::NONE) {
      const int64_t size = quant::block_bytes(embed_fmt_);
      const uint8_t* row = embed_.data_ptr<uint8_t>() + token * embed_.size(1);
      float block[quant::BLOCK];
      for (int64_t b = 0; b * quant::BLOCK < d; ++b) {
        quant::dequantize_block(embed_fmt_, row + b * size, block);
        std::copy_n(block, std::min<int64_t>(quant::BLOCK, d - b * quant::BLOCK), x_.data() + b * quant::BLOCK);
      }
      return;
    }
    switch (embed_.scalar_type()) {
      case torch::kFloat: std::copy_n(embed_.data_ptr<float>() + token * d, d, x_.data()); break;
      case torch::kHalf: std::copy_n(embed_.data_ptr<c10::Half>() + token * d, d, x_.data()); break;
      case torch::kBFloat16: std::copy_n(embed_.data_ptr<c10::BFloat16>() + token * d, d, x_.data()); break;
      default: TORCH_CHECK(false, "embeddings must be fp32, fp16 or bf16");
    }
  }

  void rope_angles(int64_t position) {
    const int64_t half = head_dim_ / 2;
    cos_.resize(half);
    sin_.resize(half);
    const float* inv_freq = inv_freq_.data_ptr<float>();
    for (int64_t j = 0; j < half; ++j) {
      const float angle = static_cast<float>(position) * inv_freq[j];
      cos_[j] = std::cos(angle);
      sin_[j] = std::sin(angle);
    }
  }

  // Rotate the two halves of one head, as llama.py's apply_rope.
  void rope(float* head) const {
    const int64_t half = head_dim_ / 2;
    for (int64_t j = 0; j < half; ++j) {
      const float a = head[j], b = head[j + half];
      head[j] = a * cos_[j] - b * sin_[j];
      head[j + half] = b * cos_[j] + a * sin_[j];
    }
  }

  void rms_norm(const torch::Tensor& weight, float* out) const {
    float squares = 0;
    for (int64_t n = 0; n < hidden_; ++n) squares += x_[n] * x_[n];
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(hidden_) + eps_);
    const float* w = weight.data_ptr<float>();
    for (int64_t n = 0; n < hidden_; ++n) out[n] = w[n] * (x_[n] * inverse);
  }

  // KV group g of layer i: rotate and cache its key and value, then its n_rep query heads attend.
  void attend(int64_t i, int64_t g, int64_t position, torch::Tensor& keys, torch::Tensor& values, float* scores) {
    const int64_t hd = head_dim_, max_len = keys.size(3);
    float* key_rows = keys.data_ptr<float>() + (i * keys.size(2) + g) * max_len * hd;
    float* value_rows = values.data_ptr<float>() + (i * values.size(2) + g) * max_len * hd;
    rope(k_.data() + g * hd);
    std::copy_n(k_.data() + g * hd, hd, key_rows + position * hd);
    std::copy_n(v_.data() + g * hd, hd, value_rows + position * hd);
    const int64_t first = window_ > 0 ? std::max<int64_t>(0, position - window_ + 1) : 0;
    const int64_t count = position + 1 - first;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (int64_t r = 0; r < n_rep_; ++r) {
      float* q = q_.data() + (g * n_rep_ + r) * hd;
      rope(q);
      // The cached keys and values are row-major [count, hd]: scores are a row GEMV, the
      // output a column GEMV (its accumulators stay in registers across keys).
      gemv_rows(q, key_rows + first * hd, hd, 0, count, scores);
      float top = -INFINITY;
      for (int64_t s = 0; s < count; ++s) top = std::max(top, scores[s] *= scale);
      float total = 0;
      for (int64_t s = 0; s < count; ++s) total += (scores[s] = std::exp(scores[s] - top));
      for (int64_t s = 0; s < count; ++s) scores[s] /= total;
      gemv_columns(scores, value_rows + first * hd, hd, count, 0, hd, attention_.data() + (g * n_rep_ + r) * hd);
    }
  }

  int64_t head_dim_, n_rep_;
  float eps_;
  int64_t window_, hidden_ = 0, max_q_ = 0, max_kv_ = 0, max_neurons_ = 0, max_rank_ = 0;
  bool quantized_ = false;  // some layer projection is block-quantised: quantise h once per sub-layer
  torch::Tensor inv_freq_, embed_;
  int64_t embed_fmt_;
  torch::Tensor final_norm_;
  Projection lm_head_;
  std::vector<Layer> layers_;
  std::vector<float> x_, q_, k_, v_, attention_, activation_, up_, update_, partial_, cos_, sin_;
};

}  // namespace elastic
