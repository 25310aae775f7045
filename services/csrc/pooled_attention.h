// Included by cpu_kernels.cpp (after its helpers exp256, hsum256, hsum4x256, parallel_claims and
// check_isa): the attention of a pass's pooled rows, each (row, key head) over its own visible
// keys only (services/ragged_attention.py). A row's G M queries share the head's keys; query r
// (token r % M) sees keys 0..count[r]-1 of the row's view. Per query: its scores (four keys'
// dot products reduced together), their exponentials and sum, then the values, with the
// query's and the output's vectors in registers. Keys past a row's own length are never read,
// so a row costs what its own cache holds, whatever the batch pads to. Each query's sums run
// over its keys in order: its output does not depend on the batch, the other queries of its
// row, or the threads.
//
// The G query heads of one token see the same keys. One query at a time, a row's later queries
// read its keys and values again (from L2, or from L3 where a head's exceed it); where the CPU
// has AVX-512VL (32 vector registers: two queries' vectors and their accumulators fit), the
// heads of a token go two at a time: each key's and value's vectors are loaded once for both,
// and every operation on either query's numbers is the one it runs alone, in the same order
// (the same floats; a test compares them). Alone over six layers' caches (3 key heads x 2
// queries x 950 keys) that took 32-33 us a layer against 50-55 with the caches in L2/L3, and
// a 4-token verify pass at 950 positions 1-6% less; inside a one-session decode pass, where
// the keys and values come from memory (~90 us a layer), it changed nothing
// (docs/performance.md, 2026-11-27).
// An AVX-512 build of the one-query kernel (16 lanes) ran whole passes within the noise of this
// one, so 8 lanes it is, on AVX2 CPUs too.
// Prefetch: the hardware's stops at every 4 KB page of a head's keys, so the kernel asks for
// the keys 64 ahead (16 KB at D = 64; none past the query's last), each key's values (read
// next) and the next head's first 4 KB of keys, to L2. On a 2-core AVX2 EPYC VM whose one
// thread streams ~6-9 GB/s from memory, a page ahead (16 keys, 2 KB of the next head) left
// whole passes 4-7% longer: 16 sessions at 150 positions, 8 at 950 and one at 950 (alternated
// processes, medians of 20; docs/performance.md, 2026-11-28).

namespace {

constexpr int64_t kNextLines = 64;  // the next pair's first keys prefetched
constexpr int64_t kAhead = 64;  // keys read ahead (16 KB at D = 64)

#define AVX512VL __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))

// One (row, key head): q [R, D]; keys and values: rows of D floats ``step`` apart; count [R]
// (R = G M: query r is token r % M's); s: scratch of R Lp floats (Lp: the longest count
// rounded up to 16, at least 16); o [R, D]; lse [R]. D = 8 NV, compiled per head size.
struct Pair {
  const float* q; const float* k; const float* v; int64_t kstep, vstep;
  int64_t R, M; const int64_t* count; float scale; float* s; int64_t Lp; float* o; float* lse;
};

// A query's scores sr[0..c) (c > 0) become their exponentials minus the largest, ``m``; the
// lanes up to the next multiple of 8 become 0. Returns their sum.
AVX2 inline float softmax_scores(float* sr, int64_t c, float& m) {
  for (int64_t j = c; j < (c + 7) / 8 * 8; ++j) sr[j] = -INFINITY;  // exp gives 0 there
  // the largest score, in four vectors of lanes (a scalar loop waited 4 cycles a key on
  // each max: a tenth of the kernel's time over 1,000 keys); the same float in any order
  __m256 top[4] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY),
                   _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
  for (int64_t j = 0; j < c; j += 8)
    top[(j >> 3) & 3] = _mm256_max_ps(top[(j >> 3) & 3], _mm256_loadu_ps(sr + j));
  const __m256 top8 = _mm256_max_ps(_mm256_max_ps(top[0], top[1]), _mm256_max_ps(top[2], top[3]));
  __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
  top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
  m = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < c; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mv));
    _mm256_storeu_ps(sr + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum256(sum);
}

// Key j's prefetches: its values (read next) and the keys kAhead further, to L2.
template <int NV> AVX2 inline void prefetch_key(const Pair& a, int64_t j, int64_t c) {
  const char* kj = reinterpret_cast<const char*>(a.k + (j + kAhead) * a.kstep);
  const char* vj = reinterpret_cast<const char*>(a.v + j * a.vstep);
  for (int t = 0; t < NV; t += 2) _mm_prefetch(vj + 32 * t, _MM_HINT_T1);
  if (j + kAhead < c)
    for (int t = 0; t < NV; t += 2) _mm_prefetch(kj + 32 * t, _MM_HINT_T1);
}

// The dot product of a query's vectors q and key j, in 8 lanes: q[0] k[0], then + q[t] k[t].
template <int NV> AVX2 inline __m256 dot8(const __m256* q, const float* kj) {
  __m256 acc = _mm256_mul_ps(q[0], _mm256_loadu_ps(kj));
  for (int t = 1; t < NV; ++t) acc = _mm256_fmadd_ps(q[t], _mm256_loadu_ps(kj + 8 * t), acc);
  return acc;
}

AVX2 inline void no_keys(const Pair& a, int64_t r, int64_t D) {
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(a.o + r * D + d, _mm256_setzero_ps());
  a.lse[r] = -INFINITY;
}

template <int NV> AVX2 void attend_one(const Pair& a, int64_t r) {
  constexpr int64_t D = 8 * NV;
  const int64_t c = a.count[r];
  float* sr = a.s + r * a.Lp;
  if (c <= 0) return no_keys(a, r, D);
  __m256 q[NV];
  for (int t = 0; t < NV; ++t) q[t] = _mm256_loadu_ps(a.q + r * D + 8 * t);
  auto dot = [&](int64_t j) AVX2 {
    prefetch_key<NV>(a, j, c);
    return dot8<NV>(q, a.k + j * a.kstep);
  };
  const __m128 scale4 = _mm_set1_ps(a.scale);
  int64_t j = 0;
  for (; j + 4 <= c; j += 4)
    _mm_storeu_ps(sr + j, _mm_mul_ps(hsum4x256(dot(j), dot(j + 1), dot(j + 2), dot(j + 3)), scale4));
  for (; j < c; ++j) sr[j] = hsum256(dot(j)) * a.scale;
  float m;
  const float total = softmax_scores(sr, c, m);
  a.lse[r] = m + std::log(total);
  __m256 acc[NV];
  for (int t = 0; t < NV; ++t) acc[t] = _mm256_setzero_ps();
  for (j = 0; j < c; ++j) {
    const float* vj = a.v + j * a.vstep;
    const __m256 p = _mm256_set1_ps(sr[j]);
    for (int t = 0; t < NV; ++t) acc[t] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * t), acc[t]);
  }
  const __m256 d = _mm256_set1_ps(total);
  for (int t = 0; t < NV; ++t) _mm256_storeu_ps(a.o + r * D + 8 * t, _mm256_div_ps(acc[t], d));
}

template <int NV> AVX2 void attend_each(const Pair& a) {
  for (int64_t r = 0; r < a.R; ++r) attend_one<NV>(a, r);
}

// Queries r0 and r1, which see the same c keys, as attend_one runs each: the same operations
// on each one's numbers, each key's and value's vectors loaded once for both.
template <int NV> AVX512VL void attend_two(const Pair& a, int64_t r0, int64_t r1) {
  constexpr int64_t D = 8 * NV;
  const int64_t c = a.count[r0];
  float* s0 = a.s + r0 * a.Lp;
  float* s1 = a.s + r1 * a.Lp;
  __m256 q0[NV], q1[NV];
  for (int t = 0; t < NV; ++t) {
    q0[t] = _mm256_loadu_ps(a.q + r0 * D + 8 * t);
    q1[t] = _mm256_loadu_ps(a.q + r1 * D + 8 * t);
  }
  const __m128 scale4 = _mm_set1_ps(a.scale);
  int64_t j = 0;
  for (; j + 4 <= c; j += 4) {
    __m256 d0[4], d1[4];
    for (int i = 0; i < 4; ++i) {
      prefetch_key<NV>(a, j + i, c);
      const float* kj = a.k + (j + i) * a.kstep;
      d0[i] = dot8<NV>(q0, kj);
      d1[i] = dot8<NV>(q1, kj);
    }
    _mm_storeu_ps(s0 + j, _mm_mul_ps(hsum4x256(d0[0], d0[1], d0[2], d0[3]), scale4));
    _mm_storeu_ps(s1 + j, _mm_mul_ps(hsum4x256(d1[0], d1[1], d1[2], d1[3]), scale4));
  }
  for (; j < c; ++j) {
    prefetch_key<NV>(a, j, c);
    const float* kj = a.k + j * a.kstep;
    s0[j] = hsum256(dot8<NV>(q0, kj)) * a.scale;
    s1[j] = hsum256(dot8<NV>(q1, kj)) * a.scale;
  }
  float m0, m1;
  const float total0 = softmax_scores(s0, c, m0);
  const float total1 = softmax_scores(s1, c, m1);
  a.lse[r0] = m0 + std::log(total0);
  a.lse[r1] = m1 + std::log(total1);
  __m256 acc0[NV], acc1[NV];
  for (int t = 0; t < NV; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
  for (j = 0; j < c; ++j) {
    const float* vj = a.v + j * a.vstep;
    const __m256 p0 = _mm256_set1_ps(s0[j]), p1 = _mm256_set1_ps(s1[j]);
    for (int t = 0; t < NV; ++t) {
      const __m256 v = _mm256_loadu_ps(vj + 8 * t);
      acc0[t] = _mm256_fmadd_ps(p0, v, acc0[t]);
      acc1[t] = _mm256_fmadd_ps(p1, v, acc1[t]);
    }
  }
  const __m256 e0 = _mm256_set1_ps(total0), e1 = _mm256_set1_ps(total1);
  for (int t = 0; t < NV; ++t) {
    _mm256_storeu_ps(a.o + r0 * D + 8 * t, _mm256_div_ps(acc0[t], e0));
    _mm256_storeu_ps(a.o + r1 * D + 8 * t, _mm256_div_ps(acc1[t], e1));
  }
}

// Each token's G query heads two at a time (a last one alone), where both see keys.
template <int NV> AVX512VL void attend_pairs(const Pair& a) {
  const int64_t G = a.R / a.M;
  for (int64_t m = 0; m < a.M; ++m) {
    int64_t g = 0;
    if (a.count[m] > 0)
      for (; g + 1 < G; g += 2) attend_two<NV>(a, g * a.M + m, (g + 1) * a.M + m);
    for (; g < G; ++g) attend_one<NV>(a, g * a.M + m);
  }
}

bool pairs_run() {  // (asked once)
  static const bool runs = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  }();
  return runs;
}

using AttendFn = void (*)(const Pair&);

template <int... NV> constexpr auto attend_table(std::integer_sequence<int, NV...>, bool pairs) {
  return std::array<AttendFn, sizeof...(NV)>{(pairs ? attend_pairs<NV + 1> : attend_each<NV + 1>)...};
}

}  // namespace

// q [n, KV, R, D] float32; keys, values [n, KV, L, D] float32 with unit stride in D and one
// stride between positions (views of a pool segment's buffers from position ``since`` on);
// last [n, M] int64 with R a multiple of M: query r of row i sees the positions
// firsts[i]..last[i][r % M] (keys firsts[i] - since.. of the views), firsts [n] int64, each at
// least since, or empty: since for every row (a row behind a shared prefix attended apart
// starts after it, one sharing nothing at 0: services/csrc/layer_parts.h). D a multiple of 8,
// at most 128. Returns the outputs [n, KV, R, D] and their log-sum-exps [n, KV, R] (natural;
// -inf and zeros for a query that sees no key).
std::tuple<at::Tensor, at::Tensor> pooled_attention_from(const at::Tensor& q, const at::Tensor& keys,
                                                         const at::Tensor& values, const at::Tensor& last,
                                                         int64_t since, const at::Tensor& firsts, double scale) {
  for (const auto* t : {&q, &keys, &values})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->dim() == 4,
                "attention: q, keys and values must be 4-D float32 CPU tensors");
  const int64_t n = q.size(0), KV = q.size(1), R = q.size(2), D = q.size(3), L = keys.size(2);
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == n && keys.size(1) == KV && keys.size(3) == D,
              "attention: keys and values must be [n, KV, L, D] for q [n, KV, R, D]");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "attention: keys and values need unit stride in D");
  TORCH_CHECK(D % 8 == 0 && D > 0 && D <= 128, "attention: D must be a multiple of 8, at most 128, got ", D);
  TORCH_CHECK(last.scalar_type() == at::kLong && last.dim() == 2 && last.size(0) == n && last.size(1) > 0 &&
              R % last.size(1) == 0, "attention: last must be int64 [n, M] with M dividing q's R");
  TORCH_CHECK(firsts.numel() == 0 || (firsts.scalar_type() == at::kLong && firsts.dim() == 1 &&
                                      firsts.size(0) == n && firsts.min().item<int64_t>() >= since),
              "attention: firsts must be empty or int64 [n], each at least since");
  check_isa("attention");
  static const auto each = attend_table(std::make_integer_sequence<int, 16>{}, false);
  static const auto pairs = attend_table(std::make_integer_sequence<int, 16>{}, true);
  const auto qs = q.contiguous();
  const auto lst = last.contiguous();
  const int64_t M = lst.size(1);
  const AttendFn fn = (R / M >= 2 && pairs_run() ? pairs : each)[D / 8 - 1];
  auto out = at::empty({n, KV, R, D}, q.options());
  auto lse = at::empty({n, KV, R}, q.options());
  const float* qp = qs.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t* lp = lst.data_ptr<int64_t>();
  const auto fst = firsts.numel() ? firsts.contiguous() : firsts;
  const int64_t* fp = fst.numel() ? fst.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  float* sp = lse.data_ptr<float>();
  if (n * KV * R == 0) return {out, lse};
  parallel_claims(n * KV, [&](const auto& each_claim) {
    std::vector<int64_t> count(R);
    std::vector<float> scratch;
    int64_t row = -1, Lp = 0, skip = 0;
    each_claim([&](int64_t p, int64_t end) {
      const int64_t i = p / KV, h = p % KV;
      if (i != row) {  // the row's queries' counts, the same for each of its heads
        row = i;
        skip = fp ? fp[i] - since : 0;  // the view's keys before the row's first
        int64_t longest = 0;
        for (int64_t r = 0; r < R; ++r) {
          count[r] = std::clamp<int64_t>(lp[i * M + r % M] - since - skip + 1, 0, std::max<int64_t>(0, L - skip));
          longest = std::max(longest, count[r]);
        }
        Lp = std::max<int64_t>(16, (longest + 15) / 16 * 16);
        scratch.resize(static_cast<size_t>(R * Lp));
      }
      if (p + 1 < end) {  // the next pair's first keys, while this pair runs
        const int64_t i2 = (p + 1) / KV, h2 = (p + 1) % KV;
        const char* k2 = reinterpret_cast<const char*>(kp + i2 * keys.stride(0) + h2 * keys.stride(1));
        for (int64_t line = 0; line < kNextLines; ++line) _mm_prefetch(k2 + 64 * line, _MM_HINT_T1);
      }
      const Pair a{qp + (i * KV + h) * R * D, kp + i * keys.stride(0) + h * keys.stride(1) + skip * keys.stride(2),
                   vp + i * values.stride(0) + h * values.stride(1) + skip * values.stride(2), keys.stride(2),
                   values.stride(2),
                   R, M, count.data(), static_cast<float>(scale), scratch.data(), Lp,
                   op + (i * KV + h) * R * D, sp + (i * KV + h) * R};
      fn(a);
    });
  });
  return {out, lse};
}

// The op: every row from ``since`` on (``pooled_attention_from`` without firsts).
std::tuple<at::Tensor, at::Tensor> pooled_attention(const at::Tensor& q, const at::Tensor& keys,
                                                    const at::Tensor& values, const at::Tensor& last,
                                                    int64_t since, double scale) {
  return pooled_attention_from(q, keys, values, last, since, at::empty({0}, last.options()), scale);
}
