// Included by cpu_kernels.cpp at file scope, after its helpers (exp256's constants,
// parallel_claims):
// a cascade's shared prefix attended by all of its queries at once, merged with what each
// query attended on its own (services/cascade_attention.py ``cascade``).
//
// Rows that share a prefix of P positions attend to it with every query of the group: per key
// head, Q = n R queries against the same P keys. The per-query kernel above reads each key
// once per query (a decode pass is bound by that); here a block of 16 or 32 queries
// (``block_width``) is held transposed, QT [D][32], so each key's element is
// broadcast once and multiplies them all in one or two AVX-512 vectors: scores S [keys][32] =
// K QT by outer products (8 keys x 2 vectors in registers), a running max and sum per query
// (online softmax, blocks of 64 keys), and the outputs O^T [D][32] += V^T P the same way.
// Every query's sums run over the keys and D in a fixed order, so its output does not depend
// on the others in its block, the block's width or the threads. (Blocks of 64, which read the
// prefix once for 16 sessions of 4 queries a key head, were no faster: docs/performance.md.)
// At the end each query's prefix part (o_p, lse_p) is merged with its own part (o_s, lse_s),
//
//     o = o_p exp(lse_p - lse) + o_s exp(lse_s - lse),  lse = logaddexp(lse_p, lse_s),
//
// which the Python side did in eight operators over the group's outputs.
// With AVX2 the same steps run on 8-lane vectors (a block of 16 queries as 2 vectors with 4
// keys or output features in registers, of 32 as 4 with 2: AVX2 has 16 registers), each
// query's sums in the same order and the exponentials by the same steps: the very floats of
// the AVX-512 path (a test), which an AVX2 CPU's passes otherwise replaced by PyTorch's
// matrix products and merge (8 demo-target sessions behind 800 shared positions: passes 1.98x
// a short pass's time with those, 1.42x with this path, 1.36x with AVX-512's;
// docs/performance.md 2026-11-28).

constexpr int64_t kQueries = 32;  // queries a task holds at most: two AVX-512 vectors
constexpr int64_t kKeys = 64;     // keys per online-softmax block
constexpr int64_t kTile = 8;      // keys (scores) or output features (values) in registers

// expf as exp256 above (its constants), 16 lanes
AVX512 inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpLow);
  const __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpHigh));
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, y, _mm512_castsi512_ps(e));
}

// One task: a key head's keys and values (rows ``kstep`` / ``vstep`` floats apart, P of them)
// for the block's queries, QT [D][32] (already scaled); scratch S [kKeys][32]; O^T [D][32] out
// (not yet divided by the sum); m, l [32] out: each query's max score and sum of exponentials.
struct PrefixTask {
  const float* k; const float* v; int64_t kstep, vstep, P, D;
  const float* qt; float* s; float* ot; float* m; float* l;
};

// Keys (or values) from .. to - 1 read once, a load a cache line, before their blocks' work:
// a pass's prefix comes from memory (the weights streamed through since), and a plain run of
// loads lets the hardware's prefetcher stream it at the memory's rate, where the blocks' own
// reads, among their multiply-adds, stalled on it, software prefetches a tile ahead included.
// Demo target, 16 sessions behind 800 shared positions, one layer's call, from memory: 243 ->
// 143 us on one thread, 167 -> 107 on two; hot in cache 103 -> 117 and 69 -> 79
// (docs/performance.md, 2026-11-29). K's rows, then V's: the two as one interleaved run were
// slower. A chunk of kWarmBytes of both, read at its first block, stays in L2 until used.
constexpr int64_t kWarmBytes = 256 * 1024;

inline void warm_rows(const float* base, int64_t step, int64_t from, int64_t to, int64_t D) {
  int acc = 0;
  for (int64_t r = from; r < to; ++r) {
    const int* row = reinterpret_cast<const int*>(base + r * step);
    for (int64_t d = 0; d < D; d += 16) acc |= row[d];  // (16 floats: one 64-byte line)
  }
  static std::atomic<int> sink;  // (the loads are kept; threads store to it freely)
  sink.store(acc, std::memory_order_relaxed);
}

// At the first block of each chunk (a multiple of kKeys keys): its keys and values warmed
inline void warm_chunk(const PrefixTask& t, int64_t j0) {
  // (a key's and a value's D floats: 8 D bytes a position)
  const int64_t chunk = std::max<int64_t>(kKeys, kWarmBytes / (8 * t.D) / kKeys * kKeys);
  if (j0 % chunk != 0) return;
  const int64_t end = std::min(t.P, j0 + chunk);
  warm_rows(t.k, t.kstep, j0, end, t.D);
  warm_rows(t.v, t.vstep, j0, end, t.D);
}

// C vectors of queries (16 C, QT rows that far apart): one where a call has at most 16
template <int C> AVX512 void prefix_block(const PrefixTask& t) {
  constexpr int64_t W = 16 * C;  // queries: QT's and S's rows are W floats
  const int64_t D = t.D;
  __m512 m[C], l[C];
  for (int c = 0; c < C; ++c) m[c] = _mm512_set1_ps(-INFINITY), l[c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D * W; i += 16) _mm512_storeu_ps(t.ot + i, _mm512_setzero_ps());
  for (int64_t j0 = 0; j0 < t.P; j0 += kKeys) {
    const int64_t jn = std::min(kKeys, t.P - j0);
    warm_chunk(t, j0);
    // scores of keys j0.. for the 32 queries: S[j] = sum_d K[j][d] QT[d], d in order
    for (int64_t j = 0; j < jn; j += kTile) {
      const int64_t tn = std::min(kTile, jn - j);
      const float* kj = t.k + (j0 + j) * t.kstep;
      __m512 acc[kTile][C];
      for (int r = 0; r < kTile; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
      const auto tile = [&](int rows) AVX512 {  // (a constant count in the full tiles' loop)
        for (int64_t d = 0; d < D; ++d) {
          __m512 qd[C];
          for (int c = 0; c < C; ++c) qd[c] = _mm512_loadu_ps(t.qt + d * W + 16 * c);
          for (int r = 0; r < rows; ++r) {
            const __m512 b = _mm512_set1_ps(kj[r * t.kstep + d]);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(b, qd[c], acc[r][c]);
          }
        }
      };
      if (tn == kTile) tile(kTile);
      else tile(static_cast<int>(tn));
      for (int r = 0; r < tn; ++r)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(t.s + (j + r) * W + 16 * c, acc[r][c]);
    }
    // the block's max, the running sums rescaled to it, the scores' exponentials
    __m512 alpha[C];
    for (int c = 0; c < C; ++c) {
      __m512 top = m[c];
      for (int64_t j = 0; j < jn; ++j) top = _mm512_max_ps(top, _mm512_loadu_ps(t.s + j * W + 16 * c));
      alpha[c] = exp512(_mm512_sub_ps(m[c], top));  // 0 for the first block (m = -inf)
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < jn; ++j) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(t.s + j * W + 16 * c), top));
        _mm512_storeu_ps(t.s + j * W + 16 * c, e);
        sum = _mm512_add_ps(sum, e);
      }
      l[c] = _mm512_fmadd_ps(l[c], alpha[c], sum);
      m[c] = top;
    }
    // O^T[d] = O^T[d] alpha + sum_j V[j][d] S[j], keys in order
    for (int64_t d0 = 0; d0 < D; d0 += kTile) {
      __m512 acc[kTile][C];
      for (int r = 0; r < kTile; ++r)
        for (int c = 0; c < C; ++c)
          acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(t.ot + (d0 + r) * W + 16 * c), alpha[c]);
      for (int64_t j = 0; j < jn; ++j) {
        const float* vj = t.v + (j0 + j) * t.vstep + d0;
        __m512 pj[C];
        for (int c = 0; c < C; ++c) pj[c] = _mm512_loadu_ps(t.s + j * W + 16 * c);
        for (int r = 0; r < kTile; ++r) {
          const __m512 b = _mm512_set1_ps(vj[r]);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(b, pj[c], acc[r][c]);
        }
      }
      for (int r = 0; r < kTile; ++r)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(t.ot + (d0 + r) * W + 16 * c, acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    _mm512_storeu_ps(t.m + 16 * c, m[c]);
    _mm512_storeu_ps(t.l + 16 * c, l[c]);
  }
}

// prefix_block's steps on 8-lane vectors: C vectors of queries (8 C), TILE keys (scores) or
// output features (values) in registers
template <int C, int TILE> AVX2 void prefix_block256(const PrefixTask& t) {
  constexpr int64_t W = 8 * C;  // queries: QT's and S's rows are W floats
  const int64_t D = t.D;
  __m256 m[C], l[C];
  for (int c = 0; c < C; ++c) m[c] = _mm256_set1_ps(-INFINITY), l[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D * W; i += 8) _mm256_storeu_ps(t.ot + i, _mm256_setzero_ps());
  for (int64_t j0 = 0; j0 < t.P; j0 += kKeys) {
    const int64_t jn = std::min(kKeys, t.P - j0);
    warm_chunk(t, j0);
    for (int64_t j = 0; j < jn; j += TILE) {
      const int64_t tn = std::min<int64_t>(TILE, jn - j);
      const float* kj = t.k + (j0 + j) * t.kstep;
      __m256 acc[TILE][C];
      for (int r = 0; r < TILE; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
      const auto tile = [&](int rows) AVX2 {
        for (int64_t d = 0; d < D; ++d) {
          __m256 qd[C];
          for (int c = 0; c < C; ++c) qd[c] = _mm256_loadu_ps(t.qt + d * W + 8 * c);
          for (int r = 0; r < rows; ++r) {
            const __m256 b = _mm256_set1_ps(kj[r * t.kstep + d]);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(b, qd[c], acc[r][c]);
          }
        }
      };
      if (tn == TILE) tile(TILE);
      else tile(static_cast<int>(tn));
      for (int r = 0; r < tn; ++r)
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(t.s + (j + r) * W + 8 * c, acc[r][c]);
    }
    __m256 alpha[C];
    for (int c = 0; c < C; ++c) {
      __m256 top = m[c];
      for (int64_t j = 0; j < jn; ++j) top = _mm256_max_ps(top, _mm256_loadu_ps(t.s + j * W + 8 * c));
      alpha[c] = exp256(_mm256_sub_ps(m[c], top));
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < jn; ++j) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(t.s + j * W + 8 * c), top));
        _mm256_storeu_ps(t.s + j * W + 8 * c, e);
        sum = _mm256_add_ps(sum, e);
      }
      l[c] = _mm256_fmadd_ps(l[c], alpha[c], sum);
      m[c] = top;
    }
    for (int64_t d0 = 0; d0 < D; d0 += TILE) {
      __m256 acc[TILE][C];
      for (int r = 0; r < TILE; ++r)
        for (int c = 0; c < C; ++c)
          acc[r][c] = _mm256_mul_ps(_mm256_loadu_ps(t.ot + (d0 + r) * W + 8 * c), alpha[c]);
      for (int64_t j = 0; j < jn; ++j) {
        const float* vj = t.v + (j0 + j) * t.vstep + d0;
        __m256 pj[C];
        for (int c = 0; c < C; ++c) pj[c] = _mm256_loadu_ps(t.s + j * W + 8 * c);
        for (int r = 0; r < TILE; ++r) {
          const __m256 b = _mm256_set1_ps(vj[r]);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(b, pj[c], acc[r][c]);
        }
      }
      for (int r = 0; r < TILE; ++r)
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(t.ot + (d0 + r) * W + 8 * c, acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    _mm256_storeu_ps(t.m + 8 * c, m[c]);
    _mm256_storeu_ps(t.l + 8 * c, l[c]);
  }
}

// Queries a task: 32 (each key element multiplies two vectors of them), or 16 where a call has
// at most 16 (a half-empty block costs as much) or where blocks of 16 spread the KV heads'
// tasks over the threads more evenly. A block of 16 costs about half of one of 32 (0.53 on a
// Zen 4, one thread, hot), so over T threads the pass waits for ceil(tasks / T) blocks of
// either: 16 sessions of the demo target (3 key heads, 32 queries each) made 3 tasks of 32 on
// 2 threads, 144 us a call against 214 on one thread; as 6 tasks of 16, the threads take
// three each (docs/performance.md, 2026-11-29). The width changes no query's floats.
int64_t block_width(int64_t Q, int64_t KV, int64_t threads) {
  if (Q <= 16) return 16;
  const int64_t t = std::max<int64_t>(threads, 1);
  const auto waits = [&](int64_t w) { return (KV * ((Q + w - 1) / w) + t - 1) / t * (w / 16); };
  return waits(16) < waits(kQueries) ? 16 : kQueries;
}

// "avx512" or "avx2": the best path this CPU runs (``isa``); "" for none
std::string prefix_attention_isa() { return isa(); }

// q, rest_out [n, KV, R, D] float32 (any strides, unit stride in D for rest_out); rest_lse
// [n, KV, R]; keys, values [KV, P, D] float32 with unit stride in D: the shared prefix, seen
// whole by every query. Returns [n, KV, R, D]: each query's attention over the prefix merged
// with its rest (rest_out, rest_lse: what it attended apart; lse -inf for none).
// ``want``: "" for the best path this CPU runs, or "avx2" (tests compare the two).
at::Tensor prefix_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& rest_out, const at::Tensor& rest_lse, double scale,
                            const std::string& want) {
  for (const auto* t : {&q, &keys, &values, &rest_out, &rest_lse})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "prefix_attention: every tensor must be float32 on the CPU");
  TORCH_CHECK(q.dim() == 4 && rest_out.sizes() == q.sizes(),
              "prefix_attention: q and rest_out must be [n, KV, R, D], the same shape");
  const int64_t n = q.size(0), KV = q.size(1), R = q.size(2), D = q.size(3);
  TORCH_CHECK(rest_lse.dim() == 3 && rest_lse.size(0) == n && rest_lse.size(1) == KV && rest_lse.size(2) == R,
              "prefix_attention: rest_lse must be [n, KV, R] for q [n, KV, R, D]");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes() && keys.size(0) == KV && keys.size(2) == D,
              "prefix_attention: keys and values must be [KV, P, D] for q [n, KV, R, D]");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1 && rest_out.stride(3) == 1,
              "prefix_attention: keys, values and rest_out need unit stride in D");
  TORCH_CHECK(D % kTile == 0 && D > 0 && D <= 256, "prefix_attention: D must be a multiple of 8, at most 256, got ", D);
  static const std::string found = isa();
  TORCH_CHECK(!found.empty(), "prefix_attention: this CPU has neither AVX-512 nor AVX2");
  TORCH_CHECK(want.empty() || want == "avx2" || want == found,
              "prefix_attention: isa must be \"\", \"avx2\" or this CPU's (", found, "), got ", want);
  const bool wide = found == "avx512" && want != "avx2";
  const int64_t P = keys.size(1), Q = n * R;
  const int64_t width = block_width(Q, KV, at::get_num_threads());
  const int64_t blocks = (Q + width - 1) / width;
  auto out = at::empty({n, KV, R, D}, q.options());
  if (Q == 0 || KV == 0) return out;
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const float* rp = rest_out.data_ptr<float>();
  const float* lp = rest_lse.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto qs = q.strides(), rs = rest_out.strides(), ls = rest_lse.strides();
  const float sc = static_cast<float>(scale);
  parallel_claims(KV * blocks, [&](const auto& each) {
    std::vector<float> qt(D * width), s(kKeys * width), ot(D * width), m(width), l(width);
    each([&](int64_t task, int64_t) {
      const int64_t h = task / blocks, first = task % blocks * width;
      const int64_t lanes = std::min(width, Q - first);
      std::fill(qt.begin(), qt.end(), 0.0f);
      for (int64_t c = 0; c < lanes; ++c) {  // query first + c: row i, query r of the head
        const int64_t i = (first + c) / R, r = (first + c) % R;
        const float* qc = qp + i * qs[0] + h * qs[1] + r * qs[2];
        for (int64_t d = 0; d < D; ++d) qt[d * width + c] = qc[d * qs[3]] * sc;
      }
      if (P > 0) {
        const PrefixTask t{kp + h * keys.stride(0), vp + h * values.stride(0), keys.stride(1),
                           values.stride(1), P, D, qt.data(), s.data(), ot.data(), m.data(), l.data()};
        if (wide) (width == 16 ? prefix_block<1> : prefix_block<2>)(t);
        else (width == 16 ? prefix_block256<2, 4> : prefix_block256<4, 2>)(t);
      }
      for (int64_t c = 0; c < lanes; ++c) {
        const int64_t i = (first + c) / R, r = (first + c) % R;
        const float* rc = rp + i * rs[0] + h * rs[1] + r * rs[2];
        const float lse_s = lp[i * ls[0] + h * ls[1] + r * ls[2]];
        const float lse_p = P > 0 ? m[c] + std::log(l[c]) : -INFINITY;
        const float top = std::max(lse_p, lse_s);
        // the two parts' weights; a part with lse -inf weighs 0 (none: the output is zeros)
        const float lse = top == -INFINITY ? top : top + std::log(std::exp(lse_p - top) + std::exp(lse_s - top));
        const float wp = lse_p == -INFINITY ? 0.0f : std::exp(lse_p - lse) / l[c];
        const float ws = lse_s == -INFINITY ? 0.0f : std::exp(lse_s - lse);
        float* oc = op + ((i * KV + h) * R + r) * D;
        for (int64_t d = 0; d < D; ++d) oc[d] = ot[d * width + c] * wp + rc[d] * ws;
      }
    });
  });
  return out;
}
