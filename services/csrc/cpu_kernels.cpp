// The CPU kernels of services/cpu_kernels.py: a linear layer over 16-bit weights, a row argmax,
// the attention of a pass's pooled decode and verify rows (pooled_attention.h) and of a shared
// prefix (prefix_attention.h), RMS norm, a layer's rotary embedding with its cache writes, and
// a layer's steps as one operator each, and the layers of a pass whose rows hold
// as many tokens each as one (layer_parts.h), and a draft model's greedy passes of a drafting
// step as one (draft_loop.h).
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
// with AVX2) by B blocks: 32 outputs with AVX-512, 16 with AVX2, and 64 for one row (32 for two
// rows with AVX2); each output is one accumulator summed over k = 0..K-1 in order, so a row's
// result does not depend on the batch it is in, nor on the threads.
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
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>
#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 16;  // output features per block of the layout
constexpr int64_t kPad = 32;    // N is padded to a multiple of this (two AVX-512 vectors)
constexpr int64_t kPrefetch = 48;  // input features ahead: 1.5 KB of a block's 16-bit weights

#define AVX512 __attribute__((target("avx512f,avx512bw,fma,f16c")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))

// ---- AVX-512: 16 floats a vector, a tile is R rows x B blocks of 16 outputs
template <bool BF16> AVX512 inline __m512 load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}

// R rows x B blocks (16 B outputs, one vector each). Two blocks suit most calls; one row takes
// four (Kernel::few): a tile of one row over two blocks keeps two sums in flight, each FMA
// waiting for the one before it. Each output is one accumulator summed over k in order
// whatever R and B: the same floats. The demo target's 25 layers over one row, one thread, on
// a 2-core AMD EPYC with AVX-512 (family 26): 0.82 -> 0.65 ms with four blocks, eight blocks
// no better (alternated processes, medians of 50; docs/performance.md, 2026-11-28).
template <bool BF16, int R, int B = 2> AVX512 void tile512(const float* x, int64_t ldx, const uint16_t* w,
                                                           int64_t K, float* y, int64_t ldy) {
  // w: the tile's first block [K, 16]; block b follows at w + b K 16
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 1) == 0)  // a 64-byte line of each block's stream every second feature
      for (int b = 0; b < B; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(w + (b * K + k + kPrefetch) * kBlock), _MM_HINT_T0);
    for (int b = 0; b < B; ++b) {
      const __m512 wv = load16<BF16>(w + (b * K + k) * kBlock);
      for (int r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(y + r * ldy + b * kBlock, acc[r][b]);
}

// ---- AVX2: 8 floats a vector, a tile is R rows x B blocks of 16 outputs
template <bool BF16> AVX2 inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

// R rows x B blocks (16 B outputs). One block suits most calls; one or two rows take several
// (Kernel::few): a one-block tile of one row keeps two sums in flight, each FMA waiting for the
// one before it (4 cycles), so a decode pass's layers ran at that latency, not at the rate the
// weights arrive. Each output is one accumulator summed over k in order whatever R and B: the
// same floats. The demo target's 25 layers over one row, one thread, on a 2-core AVX2 EPYC:
// 1.87 -> 1.54 ms and 2.41 -> 2.01 with four blocks (alternated processes, medians of 30;
// docs/performance.md, 2026-11-28).
template <bool BF16, int R, int B = 1> AVX2 void tile256(const float* x, int64_t ldx, const uint16_t* w,
                                                         int64_t K, float* y, int64_t ldy) {
  // w: the tile's first block [K, 16]; block b follows at w + b K 16
  __m256 acc[R][B][2];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 1) == 0)  // each block's one stream: a 64-byte line every second feature
      for (int b = 0; b < B; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(w + (b * K + k + kPrefetch) * kBlock), _MM_HINT_T0);
    for (int b = 0; b < B; ++b) {
      const __m256 w0 = load8<BF16>(w + (b * K + k) * kBlock), w1 = load8<BF16>(w + (b * K + k) * kBlock + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
        acc[r][b][0] = _mm256_fmadd_ps(xv, w0, acc[r][b][0]);
        acc[r][b][1] = _mm256_fmadd_ps(xv, w1, acc[r][b][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      _mm256_storeu_ps(y + r * ldy + b * kBlock, acc[r][b][0]);
      _mm256_storeu_ps(y + r * ldy + b * kBlock + 8, acc[r][b][1]);
    }
}

using Tile = void (*)(const float*, int64_t, const uint16_t*, int64_t, float*, int64_t);

struct Kernel {
  int rows;        // the most rows a tile takes
  int64_t width;   // outputs a tile covers
  Tile tiles[9];   // tiles[r] for r = 1..rows
  // batches of one or two rows, where set (else tiles[1], tiles[2] over ``width``):
  // [one row over 64 outputs, over 32; two rows over 32]
  Tile few[3];
};

template <bool BF16> Kernel avx512_kernel() {
  return {8, 32, {nullptr, tile512<BF16, 1>, tile512<BF16, 2>, tile512<BF16, 3>, tile512<BF16, 4>,
                  tile512<BF16, 5>, tile512<BF16, 6>, tile512<BF16, 7>, tile512<BF16, 8>},
          {tile512<BF16, 1, 4>, nullptr, nullptr}};  // (tiles[1], tiles[2] are 32 wide)
}

template <bool BF16> Kernel avx2_kernel() {
  return {6, 16, {nullptr, tile256<BF16, 1>, tile256<BF16, 2>, tile256<BF16, 3>, tile256<BF16, 4>,
                  tile256<BF16, 5>, tile256<BF16, 6>, nullptr, nullptr},
          {tile256<BF16, 1, 4>, tile256<BF16, 1, 2>, tile256<BF16, 2, 2>}};
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

constexpr float kExpLow = -87.3365447f;  // below this, expf is 0 here (2^n would be denormal)
constexpr float kExpHigh = 88.3762626f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
// the polynomial's coefficients, highest degree first
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, then 2^n
// (exp512 in prefix_attention.h is the same steps on 16 lanes)
AVX2 inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kExpLow);
  const __m256 live = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  x = _mm256_min_ps(x, _mm256_set1_ps(kExpHigh));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The sums of four vectors' lanes, as four floats (each vector's lanes added in a fixed order)
AVX2 inline __m128 hsum4x256(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// One row of RMS norm: y = (x * 1 / sqrt(mean(x^2) + eps)) * w, as transformers' LlamaRMSNorm
// orders it, the squares summed in four vectors of lanes (PyTorch's rms_norm is six operators
// on a CPU, ~40 us a call inside a pass: 15% of a one-session pass of the demo target).
AVX2 void rms_row(const float* x, const float* w, float* y, int64_t h, float eps) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 32 <= h; k += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(x + k + 8 * j);
      acc[j] = _mm256_fmadd_ps(v, v, acc[j]);
    }
  for (; k + 8 <= h; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
  }
  float total = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; k < h; ++k) total += x[k] * x[k];
  const float r = 1.0f / std::sqrt(total / static_cast<float>(h) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  k = 0;
  for (; k + 8 <= h; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), rv), _mm256_loadu_ps(w + k)));
  for (; k < h; ++k) y[k] = (x[k] * r) * w[k];
}

// One head's rotary embedding, as services/rotary.py ``rope`` computes it:
// out[i] = x[i] cos[i] + x[(i + D/2) mod D] ssin[i], each product rounded, then their sum
// (no fused multiply-add: the library is built with -ffp-contract=off), so the floats are
// PyTorch's for x * cos + x.roll(D / 2) * ssin.
AVX2 void rope_head(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t part = 0; part < 2; ++part) {  // the first half pairs with the second, and back
    const int64_t lo = part * half, other = part ? -half : half;
    int64_t i = lo;
    for (; i + 8 <= lo + half; i += 8) {
      const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(c + i));
      const __m256 b = _mm256_mul_ps(_mm256_loadu_ps(x + i + other), _mm256_loadu_ps(s + i));
      _mm256_storeu_ps(out + i, _mm256_add_ps(a, b));
    }
    for (; i < lo + half; ++i) {
      const float a = x[i] * c[i];
      const float b = x[i + other] * s[i];
      out[i] = a + b;
    }
  }
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

// Runs body(each) on each of torch's threads, where each(f) calls f(i, end) for every index i
// of 0..total - 1 the thread claims, once in all, the thread's claim being [.., end): a thread
// claims the next run when it has finished its last, each run a share of what is left
// ("guided", as OpenMP calls it: long runs first, so a thread streams its weights in order,
// then shorter ones to even out the end). at::parallel_for splits the range evenly up front,
// so a thread that the OS deschedules for a while (the gateway and Redis share these cores)
// held up the whole call with its half undone; here the other threads take that work. Which
// thread computes an output changes nothing in it: each is summed by one thread in a fixed
// order.
template <typename Body>
void parallel_claims(int64_t total, const Body& body) {
  const int threads = at::get_num_threads();
  std::atomic<int64_t> next{0};
  const auto each = [&](const auto& f) {
    for (int64_t i = next.load(std::memory_order_relaxed); i < total;) {
      const int64_t take = std::max<int64_t>(1, (total - i) / (2 * threads));
      if (!next.compare_exchange_weak(i, i + take, std::memory_order_relaxed)) continue;
      for (int64_t j = i; j < i + take; ++j) f(j, i + take);
      i = next.load(std::memory_order_relaxed);
    }
  };
  if (threads <= 1 || total <= 1 || at::in_parallel_region()) {
    body(each);
    return;
  }
  at::parallel_for(0, std::min<int64_t>(threads, total), 1, [&](int64_t, int64_t) { body(each); });
}

// The operators below need AVX2 at least (the Python side asks ``isa`` before it calls them)
void check_isa(const char* op) {
  static const bool runs = !isa().empty();
  TORCH_CHECK(runs, op, ": this CPU has neither AVX-512 nor AVX2");
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
  // one or two rows: tiles of several blocks where the kernel has them (Kernel::few)
  const bool four = M == 1 && Np % 64 == 0;
  const Tile few = M == 1 ? kern.few[four ? 0 : 1] : M == 2 ? kern.few[2] : nullptr;
  const int64_t width = few == nullptr ? kern.width : four ? 64 : 32;
  if (M > 0) {
    parallel_claims(Np / width, [&](const auto& each) {
      each([&](int64_t t, int64_t) {
        const int64_t col = t * width;  // the tile's first output
        const uint16_t* wt = w + (col / kBlock) * K * kBlock;
        if (few != nullptr) return few(xp, K, wt, K, yp + col, Np);
        for (int64_t m = 0; m < M; m += kern.rows) {
          const int r = static_cast<int>(std::min<int64_t>(kern.rows, M - m));
          kern.tiles[r](xp + m * K, K, wt, K, yp + m * Np + col, Np);
        }
      });
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

#include "pooled_attention.h"
#include "prefix_attention.h"

// x [..., h] float32, weight [h] float32 -> [..., h]: each row's RMS norm (``rms_row``)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
              weight.device().is_cpu() && weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0),
              "rms_norm: x must be float32 [..., h] and weight float32 [h] on the CPU");
  check_isa("rms_norm");
  const auto xs = x.contiguous();
  const auto ws = weight.contiguous();
  auto y = at::empty_like(xs);
  const int64_t h = ws.size(0), rows = h ? xs.numel() / h : 0;
  const float* xp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) rms_row(xp + r * h, ws.data_ptr<float>(), yp + r * h, h, static_cast<float>(eps));
  return y;
}

// qkv [T, (H + 2 KV) D] float32, a layer's fused projection; cos, ssin [T, D]; keys, values
// [S, KV, L, D] float32, a pool segment's buffers; slot, pos [T] int64. Returns the rotated
// queries [T, H, D] and writes token t's rotated keys and its values at [slot[t], :, pos[t]]:
// the rotary module, the split into heads and the two cache writes of a layer in one call.
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& ssin,
                      int64_t heads, int64_t kv_heads, at::Tensor keys, at::Tensor values,
                      const at::Tensor& slot, const at::Tensor& pos) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&qkv, &cos, &ssin, &keys, &values})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "rope_store: float32 CPU tensors only");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.is_contiguous() && values.is_contiguous() &&
              keys.size(1) == kv_heads, "rope_store: keys and values must be contiguous [S, KV, L, D]");
  const int64_t D = keys.size(3), T = qkv.size(0), S = keys.size(0), L = keys.size(2);
  TORCH_CHECK(D % 2 == 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "rope_store: bad head counts");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * D && qkv.stride(1) == 1,
              "rope_store: qkv must be [T, (H + 2 KV) D] with unit stride");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D && cos.is_contiguous() &&
              ssin.sizes() == cos.sizes() && ssin.is_contiguous(), "rope_store: cos and ssin must be [T, D]");
  TORCH_CHECK(slot.scalar_type() == at::kLong && pos.scalar_type() == at::kLong && slot.numel() == T &&
              pos.numel() == T, "rope_store: slot and pos must be int64 [T]");
  check_isa("rope_store");
  const auto sl = slot.contiguous();
  const auto ps = pos.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S && pp[t] >= 0 && pp[t] < L, "rope_store: slot or position out of range");
  auto q = at::empty({T, heads, D}, qkv.options());
  float* qp = q.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = ssin.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* row = qkv.data_ptr<float>() + t * qkv.stride(0);
    const float* c = cp + t * D;
    const float* sn = snp + t * D;
    for (int64_t h = 0; h < heads; ++h) rope_head(row + h * D, c, sn, qp + (t * heads + h) * D, D);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = ((sp[t] * kv_heads + h) * L + pp[t]) * D;
      rope_head(row + (heads + h) * D, c, sn, kp + at, D);
      std::copy_n(row + (heads + kv_heads + h) * D, D, vp + at);
    }
  }
  return q;
}

#include "layer_parts.h"
#include "draft_loop.h"

std::string cpu_isa() { return isa(); }

TORCH_LIBRARY(specmesh_cpu, m) {
  m.def("linear(Tensor x, Tensor wp, int n, str isa=\"\") -> Tensor", &half_linear);
  m.def("argmax(Tensor x, str isa=\"\") -> Tensor", &argmax_rows);
  m.def("attention(Tensor q, Tensor keys, Tensor values, Tensor last, int since, float scale) "
        "-> (Tensor, Tensor)", &pooled_attention);
  m.def("prefix_attention(Tensor q, Tensor keys, Tensor values, Tensor rest_out, Tensor rest_lse, "
        "float scale, str isa=\"\") -> Tensor", &prefix_attention);
  m.def("prefix_attention_isa() -> str", &prefix_attention_isa);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor ssin, int heads, int kv_heads, Tensor(a!) keys, "
        "Tensor(b!) values, Tensor slot, Tensor pos) -> Tensor", &rope_store);
  m.def("mlp_tail(Tensor x, Tensor attn, Tensor o, Tensor ln2, float eps, Tensor gate_up, int gu_n, "
        "Tensor down) -> Tensor", &mlp_tail);
  m.def("norm_qkv_store(Tensor x, Tensor ln1, float eps, Tensor qkv, int qkv_n, Tensor cos, Tensor ssin, "
        "int heads, int kv_heads, Tensor(a!) keys, Tensor(b!) values, Tensor slot, Tensor pos) -> Tensor",
        &norm_qkv_store);
  m.def("dense_layers(Tensor x, Tensor[] ln1, Tensor[] qkv, int qkv_n, Tensor[] o, Tensor[] ln2, "
        "Tensor[] gate_up, int gu_n, Tensor[] down, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor cos, "
        "Tensor ssin, int heads, int kv_heads, float eps, float scale, Tensor slot, Tensor pos, int lo, "
        "int width, int since, int keys_end, Tensor last, Tensor rows_at, Tensor[] prefix_keys, "
        "Tensor[] prefix_values, Tensor prefix_of) -> Tensor", &dense_layers);
  m.def("greedy_drafts(Tensor x, Tensor[] ln1, Tensor[] qkv, int qkv_n, Tensor[] o, Tensor[] ln2, "
        "Tensor[] gate_up, int gu_n, Tensor[] down, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor cos, "
        "Tensor ssin, int heads, int kv_heads, float eps, float scale, Tensor slot, Tensor pos, int lo, "
        "int width, int keys_end, Tensor last, Tensor rows_at, Tensor embed, Tensor norm, Tensor head, "
        "int vocab, Tensor cos_table, Tensor ssin_table, int steps) -> Tensor", &greedy_drafts);
  m.def("isa() -> str", &cpu_isa);
}
