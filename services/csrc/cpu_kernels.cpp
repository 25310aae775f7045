// The CPU kernels of services/cpu_kernels.py: a linear layer over 16-bit weights, and a row argmax.
//
// y = x @ W^T for float32 activations and weights stored in 16 bits (fp16 or bf16), computed in
// float32: each weight is widened exactly and every product and sum is a float32 FMA, so the
// result is a float32 linear layer over the same numbers (services/half_linear.py says when
// the weights are exactly representable, which is when this is used).
//
// Why: a decode or verify pass over a few rows reads every weight once and does little else
// with it, so its linear layers are bound by memory traffic; 16-bit weights halve it.
//
// Layout: the weight [N, K] is stored as blocks of 16 output features, wp [NB, K, 16]
// (N padded with zeros to a multiple of 32), so a block's weights for one input feature are
// 32 contiguous bytes and a tile walks K in order. A tile is R rows (at most 8 with AVX-512, 6
// with AVX2) by 2 vectors of outputs; each output is one accumulator summed over k = 0..K-1
// in order, so a row's result does not depend on the batch it is in, nor on the threads.
// The kernels are compiled for AVX-512 and for AVX2 + F16C + FMA and chosen at run time.
//
// Prefetch: a tile asks for the weights kPrefetch input features ahead of the ones it reads,
// one cache line per stream every second feature. Inside a pass the weights come from
// memory, not from the caches (the pass reads ~20 MB of them for the demo target); with the
// hardware prefetcher alone the layers streamed them at ~5 GB/s on a 2-core Xeon VM, and with
// this the model's 25 linear layers took 1.3-2.0 ms against 2.2-4.0 at one row and 2.7-3.1
// against 3.7-5.3 at eight (medians of alternated builds)
// (docs/performance.md, 2026-11-27).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 16;  // output features per block of the layout
constexpr int64_t kPad = 32;    // N is padded to a multiple of this (two AVX-512 vectors)
constexpr int64_t kPrefetch = 48;  // input features ahead: 1.5 KB of a block's 16-bit weights

#define AVX512 __attribute__((target("avx512f,avx512bw,fma,f16c")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))

// ---- AVX-512: 16 floats a vector, a tile is R rows x 32 outputs (two blocks)
template <bool BF16> AVX512 inline __m512 load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}

template <bool BF16, int R> AVX512 void tile512(const float* x, int64_t ldx, const uint16_t* w,
                                                int64_t K, float* y, int64_t ldy) {
  // w: the tile's first block [K, 16]; the second block follows it at w + K * 16
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 1) == 0) {  // a 64-byte line of each block's stream every second feature
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetch) * kBlock), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + (K + k + kPrefetch) * kBlock), _MM_HINT_T0);
    }
    __m512 w0 = load16<BF16>(w + k * kBlock), w1 = load16<BF16>(w + (K + k) * kBlock);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc[r][0]);
    _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
  }
}

// ---- AVX2: 8 floats a vector, a tile is R rows x 16 outputs (one block)
template <bool BF16> AVX2 inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

template <bool BF16, int R> AVX2 void tile256(const float* x, int64_t ldx, const uint16_t* w,
                                              int64_t K, float* y, int64_t ldy) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 1) == 0)  // the block's one stream: a 64-byte line every second feature
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetch) * kBlock), _MM_HINT_T0);
    __m256 w0 = load8<BF16>(w + k * kBlock), w1 = load8<BF16>(w + k * kBlock + 8);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
  }
}

using Tile = void (*)(const float*, int64_t, const uint16_t*, int64_t, float*, int64_t);

struct Kernel {
  int rows;        // the most rows a tile takes
  int64_t width;   // outputs a tile covers
  Tile tiles[9];   // tiles[r] for r = 1..rows
};

template <bool BF16> Kernel avx512_kernel() {
  return {8, 32, {nullptr, tile512<BF16, 1>, tile512<BF16, 2>, tile512<BF16, 3>, tile512<BF16, 4>,
                  tile512<BF16, 5>, tile512<BF16, 6>, tile512<BF16, 7>, tile512<BF16, 8>}};
}

template <bool BF16> Kernel avx2_kernel() {
  return {6, 16, {nullptr, tile256<BF16, 1>, tile256<BF16, 2>, tile256<BF16, 3>, tile256<BF16, 4>,
                  tile256<BF16, 5>, tile256<BF16, 6>, nullptr, nullptr}};
}

// ---- argmax of a row: the first index of its largest value, the first NaN's if it has one
// (torch.argmax's answer): a vector max, then the first index that holds it
// The first NaN's index (a NaN is torch.argmax's largest value), or -1.
inline int64_t first_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (x[j] != x[j]) return j;
  return -1;
}

AVX512 int64_t argmax512(const float* x, int64_t n) {
  int64_t i = 0;
  float best = x[0];
  __mmask16 nan = 0;
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(x);
    for (i = 0; i + 16 <= n; i += 16) {
      __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, v);
    }
    best = _mm512_reduce_max_ps(m);
  }
  for (int64_t j = i; j < n; ++j) {
    if (x[j] != x[j]) nan = 1;
    best = x[j] > best ? x[j] : best;
  }
  if (nan || best != best) return first_nan(x, n);
  const __m512 b = _mm512_set1_ps(best);
  for (i = 0; i + 16 <= n; i += 16) {
    __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), b, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (x[i] == best) return i;
  return 0;
}

AVX2 int64_t argmax256(const float* x, int64_t n) {
  int64_t i = 0;
  float best = x[0];
  int nan = 0;
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    for (i = 0; i + 8 <= n; i += 8) {
      __m256 v = _mm256_loadu_ps(x + i);
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m = _mm256_max_ps(m, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (float v : lanes) best = v > best ? v : best;
  }
  for (int64_t j = i; j < n; ++j) {
    if (x[j] != x[j]) nan = 1;
    best = x[j] > best ? x[j] : best;
  }
  if (nan || best != best) return first_nan(x, n);
  const __m256 b = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (x[i] == best) return i;
  return 0;
}

// "avx512", "avx2" or "" (neither: the Python side then keeps float32 weights)
std::string isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) return "avx2";
  return "";
}

// ``want``: "" for the best this CPU has, or "avx2" (tests compare the two paths' results)
Kernel kernel_for(bool bf16, const std::string& want) {
  static const std::string found = isa();
  TORCH_CHECK(!found.empty(), "half_linear: this CPU has neither AVX-512 nor AVX2 with F16C and FMA");
  TORCH_CHECK(want.empty() || want == "avx2" || want == found,
              "half_linear: isa must be \"\", \"avx2\" or this CPU's (", found, "), got ", want);
  if (found == "avx512" && want != "avx2") return bf16 ? avx512_kernel<true>() : avx512_kernel<false>();
  return bf16 ? avx2_kernel<true>() : avx2_kernel<false>();
}

}  // namespace

// x [..., K] float32; wp [NB, K, 16] float16 or bfloat16 (NB * 16 a multiple of 32); n: the
// layer's N <= NB * 16; isa: "" (the CPU's best) or "avx2". Returns [..., n] float32.
at::Tensor half_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n, const std::string& isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "half_linear: x must be float32 on the CPU");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == kBlock && wp.is_contiguous() && (wp.size(0) * kBlock) % kPad == 0,
              "half_linear: wp must be contiguous [NB, K, 16] with NB * 16 a multiple of 32");
  TORCH_CHECK(wp.scalar_type() == at::kHalf || wp.scalar_type() == at::kBFloat16,
              "half_linear: wp must be float16 or bfloat16");
  const int64_t K = wp.size(1), Np = wp.size(0) * kBlock;
  TORCH_CHECK(x.size(-1) == K, "half_linear: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(n > 0 && n <= Np, "half_linear: n out of range");
  const auto xs = x.reshape({-1, K}).contiguous();
  const int64_t M = xs.size(0);
  auto y = at::empty({M, Np}, x.options());
  const Kernel kern = kernel_for(wp.scalar_type() == at::kBFloat16, isa);
  const float* xp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto* w = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  const int64_t tiles = Np / kern.width;
  if (M > 0) {
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t col = t * kern.width;  // the tile's first output
        const uint16_t* wt = w + (col / kBlock) * K * kBlock;
        for (int64_t m = 0; m < M; m += kern.rows) {
          const int r = static_cast<int>(std::min<int64_t>(kern.rows, M - m));
          kern.tiles[r](xp + m * K, K, wt, K, yp + m * Np + col, Np);
        }
      }
    });
  }
  auto shape = x.sizes().vec();
  shape.back() = n;
  return (n == Np ? y : y.narrow(1, 0, n).contiguous()).view(shape);
}

// x [R, V] float32 -> [R] int64: each row's argmax, as torch.argmax(x, -1) gives it
at::Tensor argmax_rows(const at::Tensor& x, const std::string& want) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 && x.size(1) > 0,
              "argmax: x must be a float32 [rows, V] CPU tensor with V > 0");
  static const std::string found = isa();
  TORCH_CHECK(!found.empty(), "argmax: this CPU has neither AVX-512 nor AVX2");
  TORCH_CHECK(want.empty() || want == "avx2" || want == found,
              "argmax: isa must be \"\", \"avx2\" or this CPU's (", found, "), got ", want);
  auto fn = (found == "avx512" && want != "avx2") ? argmax512 : argmax256;
  const auto xs = x.contiguous();
  auto out = at::empty({xs.size(0)}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < xs.size(0); ++r) o[r] = fn(xs.data_ptr<float>() + r * xs.size(1), xs.size(1));
  return out;
}

std::string cpu_isa() { return isa(); }

TORCH_LIBRARY(specmesh_cpu, m) {
  m.def("linear(Tensor x, Tensor wp, int n, str isa=\"\") -> Tensor", &half_linear);
  m.def("argmax(Tensor x, str isa=\"\") -> Tensor", &argmax_rows);
  m.def("isa() -> str", &cpu_isa);
}
