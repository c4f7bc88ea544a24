// Native ElasticLinear: y = x · W over the active prefix of unit-major storage, no copies.
//
// Row units (q/k/v/gate/up): storage W [rows, in]; the first `active` rows are the active
//   outputs, y[m, n] = Σ_k x[m, k] · W[n, k].
// Column units (o/down): storage Wt [rows, out] (transposed); the first `active` rows are
//   the active inputs, y[m, n] = Σ_k x[m, k] · Wt[k, n].
//
// Storage is fp32 or fp16. Threads split the output channels (OpenMP); M == 1 (decode) runs a
// GEMV, M > 1 (prefill) a GEMM that converts each weight tile once and reuses it for every
// input row.
//
// Block-quantised storage (quant.h: int8 and int4 blocks of 32 along the reduction) runs
// `quant_linear`: each input row is quantised to int8 blocks and multiplied with integer dot
// products; `dequantize` unpacks an active prefix to fp32 for the many-row (prefill) path.
//
// The module also exports the whole-model decode step (decoder.h) as `Decoder`.

#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#ifdef __F16C__
#include <immintrin.h>
#endif

#include "decoder.h"

namespace {

// --- convert a run of weights into fp32

inline void to_float(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }

inline void to_float(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Enough multiply-adds per thread that waking it pays off; small layers stay on one core
// (an OpenMP barrier on a busy machine can cost a scheduler slice, far more than a
// 1536x576 GEMV takes on one core).
constexpr int64_t MACS_PER_THREAD = 1 << 22;

int threads_for(int64_t work_items, int64_t macs) {
  const int64_t useful = std::max<int64_t>(1, macs / MACS_PER_THREAD);
  return static_cast<int>(std::max<int64_t>(1, std::min({static_cast<int64_t>(at::get_num_threads()), work_items, useful})));
}

// --- row units: each output is a dot product with one contiguous row of W

constexpr int64_t ROW_TILE = 8;  // weight rows dequantized together and reused across x rows

template <typename T>
void rows_kernel(const float* x, const T* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel num_threads(threads_for(tiles, M * N * K))
  {
    std::vector<float> buffer(std::is_same<T, float>::value ? 0 : ROW_TILE * K);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t n0 = tile * ROW_TILE, rows = std::min(ROW_TILE, N - n0);
      if (M == 1) {  // decode: convert inside the dot product, each weight read once
        elastic::gemv_rows(x, w, K, n0, n0 + rows, y);
        continue;
      }
      const float* wt;
      if constexpr (std::is_same<T, float>::value) {
        wt = w + n0 * K;
      } else {
        to_float(w + n0 * K, buffer.data(), rows * K);
        wt = buffer.data();
      }
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) {  // 2 x-rows × 4 w-rows of accumulators fit the registers
        const float* x0 = x + m * K;
        const float* x1 = x0 + K;
        int64_t j = 0;
        for (; j + 4 <= rows; j += 4) {
          const float *w0 = wt + j * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
          float a00 = 0, a01 = 0, a02 = 0, a03 = 0, a10 = 0, a11 = 0, a12 = 0, a13 = 0;
#pragma omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13)
          for (int64_t k = 0; k < K; ++k) {
            a00 += x0[k] * w0[k]; a01 += x0[k] * w1[k]; a02 += x0[k] * w2[k]; a03 += x0[k] * w3[k];
            a10 += x1[k] * w0[k]; a11 += x1[k] * w1[k]; a12 += x1[k] * w2[k]; a13 += x1[k] * w3[k];
          }
          float* y0 = y + m * N + n0 + j;
          float* y1 = y0 + N;
          y0[0] = a00; y0[1] = a01; y0[2] = a02; y0[3] = a03;
          y1[0] = a10; y1[1] = a11; y1[2] = a12; y1[3] = a13;
        }
        for (; j < rows; ++j) {
          const float* wj = wt + j * K;
          float a0 = 0, a1 = 0;
#pragma omp simd reduction(+ : a0, a1)
          for (int64_t k = 0; k < K; ++k) { a0 += x0[k] * wj[k]; a1 += x1[k] * wj[k]; }
          y[m * N + n0 + j] = a0;
          y[(m + 1) * N + n0 + j] = a1;
        }
      }
      for (; m < M; ++m) {  // an odd last x row
        const float* xm = x + m * K;
        for (int64_t j = 0; j < rows; ++j) {
          const float* wj = wt + j * K;
          float acc = 0;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < K; ++k) acc += xm[k] * wj[k];
          y[m * N + n0 + j] = acc;
        }
      }
    }
  }
}

// --- column units: each input row k of Wt adds x[m, k] · Wt[k, :] to a block of outputs

// Prefill: pack (and dequantize) the [K, NB] weight panel once, then sweep MR x rows at a
// time over it with an MR x NB block of accumulators.
template <int64_t MR, int64_t NB, typename T>
void columns_gemm_block(const float* x, const T* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                        std::vector<float>& panel) {
  const int64_t width = std::min(NB, N - n0);
  panel.assign(K * NB, 0.0f);
  for (int64_t k = 0; k < K; ++k) to_float(w + k * N + n0, panel.data() + k * NB, width);
  for (int64_t m = 0; m < M; m += MR) {
    const int64_t rows = std::min(MR, M - m);
    float acc[MR][NB] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float* wrow = panel.data() + k * NB;
      for (int64_t r = 0; r < MR; ++r) {
        const float xv = r < rows ? x[(m + r) * K + k] : 0.0f;
#pragma omp simd
        for (int64_t j = 0; j < NB; ++j) acc[r][j] += xv * wrow[j];
      }
    }
    for (int64_t r = 0; r < rows; ++r) std::copy(acc[r], acc[r] + width, y + (m + r) * N + n0);
  }
}

template <typename T>
void columns_kernel(const float* x, const T* w, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t GEMM_BLOCK = 16, GEMM_ROWS = 4;
  if (M == 1) {  // decode: each thread streams whole runs of its output columns down the rows
    const int64_t parts = threads_for((N + 15) / 16, N * K);
#pragma omp parallel for num_threads(parts) schedule(static)
    for (int64_t part = 0; part < parts; ++part) {
      const auto range = elastic::split(N, parts, part, 16);
      elastic::gemv_columns(x, w, N, K, range.first, range.second, y);
    }
  } else {
    const int64_t blocks = (N + GEMM_BLOCK - 1) / GEMM_BLOCK;
#pragma omp parallel num_threads(threads_for(blocks, M * N * K))
    {
      std::vector<float> panel;
#pragma omp for schedule(static)
      for (int64_t b = 0; b < blocks; ++b)
        columns_gemm_block<GEMM_ROWS, GEMM_BLOCK>(x, w, y, M, N, K, b * GEMM_BLOCK, panel);
    }
  }
}

template <typename T>
void dispatch(bool row_units, const float* x, const T* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (row_units)
    rows_kernel<T>(x, w, y, M, N, K);
  else
    columns_kernel<T>(x, w, y, M, N, K);
}

}  // namespace

// x: [M, in_active] fp32. storage: the whole unit-major tensor. active: leading rows in use.
torch::Tensor elastic_linear(torch::Tensor x, torch::Tensor storage, int64_t active, bool row_units,
                             c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(storage.dim() == 2 && storage.is_contiguous() && storage.device().is_cpu(), "storage must be contiguous 2-D CPU");
  TORCH_CHECK(0 <= active && active <= storage.size(0), "active rows out of range");
  const int64_t M = x.size(0);
  const int64_t K = row_units ? storage.size(1) : active;
  const int64_t N = row_units ? active : storage.size(1);
  TORCH_CHECK(x.size(1) == K, "input has ", x.size(1), " features, the active width needs ", K);
  auto y = torch::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    if (K == 0) {
      y.zero_();
    } else {
      const float* xp = x.data_ptr<float>();
      float* yp = y.data_ptr<float>();
      switch (storage.scalar_type()) {
        case torch::kFloat: dispatch(row_units, xp, storage.data_ptr<float>(), yp, M, N, K); break;
        case torch::kHalf: dispatch(row_units, xp, storage.data_ptr<at::Half>(), yp, M, N, K); break;
        default: TORCH_CHECK(false, "storage must be fp32 or fp16 (block-quantised storage runs quant_linear)");
      }
    }
  }
  if (bias.has_value()) y.add_(row_units ? bias->narrow(0, 0, N) : *bias);
  return y;
}

namespace {

using elastic::quant::block_bytes;
using elastic::quant::blocks_for;

// Shape checks of a packed tensor: row units [rows, ceil(cols/32)·B], column units [ceil(in/32), cols·B].
void check_packed(const torch::Tensor& packed, int64_t fmt, int64_t cols, bool row_units) {
  TORCH_CHECK(fmt == elastic::quant::Q8 || fmt == elastic::quant::Q4, "unknown block format ", fmt);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kByte && packed.is_contiguous() &&
                  packed.device().is_cpu(), "packed storage must be contiguous 2-D uint8 on the CPU");
  const int64_t expected = row_units ? blocks_for(cols) * block_bytes(fmt) : cols * block_bytes(fmt);
  TORCH_CHECK(packed.size(1) == expected, "packed storage has ", packed.size(1), " bytes a row, expected ", expected);
}

}  // namespace

// x: [M, K] fp32; packed: the whole packed tensor; active: stored rows in use (outputs of row
// units, inputs of column units); cols: the unpacked storage's columns (in, or out).
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t active, int64_t cols,
                           bool row_units, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  check_packed(packed, fmt, cols, row_units);
  const int64_t stored = row_units ? packed.size(0) : packed.size(0) * elastic::quant::BLOCK;
  TORCH_CHECK(0 <= active && active <= stored, "active rows out of range");
  const int64_t M = x.size(0), K = row_units ? cols : active, N = row_units ? active : cols;
  TORCH_CHECK(x.size(1) == K, "input has ", x.size(1), " features, the active width needs ", K);
  auto y = torch::zeros({M, N}, x.options());
  if (M > 0 && N > 0 && K > 0) {
    const int64_t isa = elastic::quant::active_isa();
    std::vector<elastic::quant::Activations> rows(M);
    for (int64_t m = 0; m < M; ++m) rows[m].set(x.data_ptr<float>() + m * K, K, isa);
    const uint8_t* w = packed.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    constexpr int64_t TILE = 16;
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads_for(M * tiles, M * N * K)) schedule(static)
    for (int64_t item = 0; item < M * tiles; ++item) {
      const int64_t m = item / tiles, begin = (item % tiles) * TILE, end = std::min(N, begin + TILE);
      if (row_units)
        elastic::quant::gemv_rows(fmt, w, cols, rows[m], begin, end, yp + m * N, isa);
      else
        elastic::quant::gemv_columns(fmt, w, cols, rows[m], begin, end, yp + m * N, isa);
    }
  }
  if (bias.has_value()) y.add_(row_units ? bias->narrow(0, 0, N) : *bias);
  return y;
}

// The active prefix as an fp32 weight in [out, in] form (what torch's linear takes): row units
// W[:active], column units Wt[:active]ᵀ, so both write whole blocks contiguously.
torch::Tensor dequantize(torch::Tensor packed, int64_t fmt, int64_t active, int64_t cols, bool row_units) {
  check_packed(packed, fmt, cols, row_units);
  const int64_t size = block_bytes(fmt);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (row_units) {
    TORCH_CHECK(0 <= active && active <= packed.size(0), "active rows out of range");
    auto out = torch::empty({active, cols}, torch::kFloat);
    float* o = out.data_ptr<float>();
    const int64_t nb = blocks_for(cols);
#pragma omp parallel for num_threads(threads_for(active, active * cols * 4)) schedule(static)
    for (int64_t r = 0; r < active; ++r) {
      float block[elastic::quant::BLOCK];
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t first = b * elastic::quant::BLOCK, count = std::min<int64_t>(elastic::quant::BLOCK, cols - first);
        elastic::quant::dequantize_block(fmt, w + (r * nb + b) * size, block);
        std::copy(block, block + count, o + r * cols + first);
      }
    }
    return out;
  }
  TORCH_CHECK(0 <= active && blocks_for(active) <= packed.size(0), "active rows out of range");
  auto out = torch::empty({cols, active}, torch::kFloat);
  float* o = out.data_ptr<float>();
  const int64_t nb = blocks_for(active);
  // Block-rows in storage order (reading each output's block in turn down the block-row was
  // strided and ~3x slower); each block lands as a contiguous run of output n's row.
#pragma omp parallel for num_threads(threads_for(nb, active * cols * 4)) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    float block[elastic::quant::BLOCK];
    const int64_t first = b * elastic::quant::BLOCK, count = std::min<int64_t>(elastic::quant::BLOCK, active - first);
    for (int64_t n = 0; n < cols; ++n) {
      elastic::quant::dequantize_block(fmt, w + (b * cols + n) * size, block);
      std::copy(block, block + count, o + n * active + first);
    }
  }
  return out;
}

const char* const ISA_NAMES[] = {"scalar", "avx2", "vnni"};

// The instruction sets this build and CPU can run, best last.
std::vector<std::string> quant_isas() {
  std::vector<std::string> names;
  for (int64_t i = 0; i <= elastic::quant::best_isa(); ++i) names.emplace_back(ISA_NAMES[i]);
  return names;
}

// Use `name` ("auto" for the best) for every quantised kernel from now on; returns the one in use.
std::string set_quant_isa(const std::string& name) {
  int64_t chosen = elastic::quant::best_isa();
  if (name != "auto") {
    const auto names = quant_isas();
    const auto found = std::find(names.begin(), names.end(), name);
    TORCH_CHECK(found != names.end(), "instruction set ", name, " is not available here (this build and CPU run: ",
                c10::Join(", ", names), ")");
    chosen = found - names.begin();
  }
  elastic::quant::active_isa() = chosen;
  return ISA_NAMES[chosen];
}

// (storage, bias, block format, unpacked columns) of one ElasticLinear, as the decoder keeps it.
using ProjectionSpec = std::tuple<torch::Tensor, c10::optional<torch::Tensor>, int64_t, int64_t>;

elastic::Projection make_projection(const ProjectionSpec& spec, bool row_units) {
  elastic::Projection p;
  p.storage = std::get<0>(spec);
  TORCH_CHECK(p.storage.dim() == 2 && p.storage.is_contiguous() && p.storage.device().is_cpu(),
              "storage must be contiguous 2-D CPU");
  if (std::get<1>(spec).has_value()) p.bias = std::get<1>(spec)->to(torch::kFloat).contiguous();
  p.fmt = std::get<2>(spec);
  p.logical_cols = std::get<3>(spec);
  if (p.quantized())
    check_packed(p.storage, p.fmt, p.logical_cols, row_units);
  else
    TORCH_CHECK(p.logical_cols == p.storage.size(1), "unpacked storage has ", p.storage.size(1), " columns, not ", p.logical_cols);
  return p;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("elastic_linear", &elastic_linear, "ElasticLinear over a unit-major prefix (fp32/fp16)");
  m.def("quant_linear", &quant_linear, "ElasticLinear over a block-quantised prefix, integer dot products");
  m.def("dequantize", &dequantize, "a block-quantised prefix as fp32 [out, in]");
  m.def("quant_isas", &quant_isas, "instruction sets the quantised kernels can use here, best last");
  m.def("set_quant_isa", &set_quant_isa, "choose the quantised kernels' instruction set (\"auto\": the best)");
  pybind11::class_<elastic::Decoder>(m, "Decoder")
      .def(pybind11::init([](int64_t head_dim, int64_t n_rep, double eps, int64_t window, torch::Tensor inv_freq,
                             torch::Tensor embed, int64_t embed_fmt, torch::Tensor final_norm,
                             const ProjectionSpec& lm_head) {
        return new elastic::Decoder(head_dim, n_rep, eps, window, inv_freq, embed, embed_fmt, final_norm,
                                    make_projection(lm_head, true));
      }))
      .def("add_layer", [](elastic::Decoder& d, torch::Tensor attn_norm, torch::Tensor mlp_norm,
                           const std::vector<ProjectionSpec>& projections) {
        std::vector<elastic::Projection> made;
        // decoder.h's slot order: q k v o gate up down; o and down are column units.
        for (size_t i = 0; i < projections.size(); ++i) made.push_back(make_projection(projections[i], i != 3 && i != 6));
        d.add_layer(attn_norm, mlp_norm, made);
      })
      .def("set_widths", &elastic::Decoder::set_widths)
      .def("set_lora", &elastic::Decoder::set_lora)
      .def("step", &elastic::Decoder::step, pybind11::call_guard<pybind11::gil_scoped_release>());
}
