// Included by cpu_kernels.cpp (after half_linear, rms_norm and rope_store): a decoder layer's
// parts that run on few rows as one operator each, so a pass does not pay PyTorch's dispatch
// and the interpreter for every step of them. Each is the very sequence of operators the
// Python side runs (services/lean_llama.py ``finish_layer`` and its fused head), called
// from here: the same floats.

// x [..., h] and attn [..., H D] float32 (the layer's input and its attention); o, gate_up and
// down: 16-bit weight blocks (``half_linear``), o and down giving h outputs and gate_up gu_n =
// 2 I; ln2 [h]. Returns the next layer's input: x + o(attn) = r, then r + down(silu(g) * u)
// where g, u are the halves of gate_up(rms_norm(r)).
at::Tensor mlp_tail(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& o, const at::Tensor& ln2,
                    double eps, const at::Tensor& gate_up, int64_t gu_n, const at::Tensor& down) {
  TORCH_CHECK(gu_n % 2 == 0, "mlp_tail: gate_up must give an even number of outputs, got ", gu_n);
  const int64_t h = x.size(-1);
  const auto r = at::add(x, half_linear(attn, o, h, ""));
  const auto gu = half_linear(rms_norm(r, ln2, eps), gate_up, gu_n, "");
  const auto halves = gu.split_with_sizes({gu_n / 2, gu_n / 2}, -1);
  return at::add(r, half_linear(at::mul(at::silu(halves[0]), halves[1]), down, h, ""));
}

// x [T, h] float32; ln1 [h]; qkv: the fused projection's blocks with qkv_n = (H + 2 KV) D
// outputs; the rest as ``rope_store``. Returns the rotated queries [T, H, D] and writes the
// keys and values: rope_store(qkv(rms_norm(x)), ...).
at::Tensor norm_qkv_store(const at::Tensor& x, const at::Tensor& ln1, double eps, const at::Tensor& qkv,
                          int64_t qkv_n, const at::Tensor& cos, const at::Tensor& ssin, int64_t heads,
                          int64_t kv_heads, at::Tensor keys, at::Tensor values, const at::Tensor& slot,
                          const at::Tensor& pos) {
  return rope_store(half_linear(rms_norm(x, ln1, eps), qkv, qkv_n, ""), cos, ssin, heads, kv_heads,
                    std::move(keys), std::move(values), slot, pos);
}

// A pass's layers where its rows hold ``width`` new tokens each, in slot order, row j in slot
// lo + rows_at[j] of the segment (services/uniform_pass.py: every pass of one stream, decode or
// verify), and every layer's weights have 16-bit copies. Per layer the very operators the
// Python side runs: ``norm_qkv_store``, the pooled rows' ``pooled_attention`` over the window's
// n slots (positions since..keys_end - 1, query r of slot i seeing those up to
// last[i][r % width]) on the queries in its padded order (head g's width rows in turn; zeros for
// a slot of the window without a row of the pass) and ``mlp_tail``: the same floats, one call
// for the pass (the interpreter and the dispatch of three operators and their views a layer,
// ~20 us on one row).
// x [T, h] with T = rows width; per layer i: ln1, qkv (qkv_n = (H + 2 KV) D outputs), o, ln2,
// gate_up (gu_n outputs), down, and the segment's key and value buffers [S, KV, slot_len, D];
// last [n, width]; rows_at [rows] (n = rows: the window has no gaps, and it is not read).
// prefix_keys, prefix_values: none, or per layer a shared prefix [KV, since, D] that every row's
// cache begins with (services/cascade_attention.py): the rows' own queries then attend it and
// merge with what they attended from ``since`` on in ``prefix_attention``, as the layer loop
// does for such a pass. Or several such prefixes a layer (layer i's group g at i prefixes + g),
// where the rows fall in groups that each share their own (several system prompts): prefix_of
// [rows] holds each row's group, and each group's queries attend its prefix in a call of their
// own (empty prefix_of: one group). Returns the last layer's output [T, h].
namespace {

constexpr int64_t kGroupTokens = 8;  // tokens of a group of rows on more than one thread

// dense_layers' layers over one run of its rows (all of them, or one group of them): the window
// lo..lo+n-1 with last [n, width], rows_at [rows] (gaps: n != rows).
at::Tensor layers_over(at::Tensor x, at::TensorList ln1, at::TensorList qkv, int64_t qkv_n, at::TensorList o,
                       at::TensorList ln2, at::TensorList gate_up, int64_t gu_n, at::TensorList down,
                       at::TensorList keys, at::TensorList values, const at::Tensor& cos, const at::Tensor& ssin,
                       int64_t heads, int64_t kv_heads, double eps, double scale, const at::Tensor& slot,
                       const at::Tensor& pos, int64_t lo, int64_t width, int64_t since, int64_t keys_end,
                       const at::Tensor& last, const at::Tensor& rows_at, at::TensorList prefix_keys,
                       at::TensorList prefix_values, const at::Tensor& prefix_of, const at::Tensor& firsts) {
  const int64_t T = x.size(0), D = qkv_n / (heads + 2 * kv_heads), G = heads / kv_heads;
  const int64_t rows = T / width, n = last.size(0);
  const bool gaps = n != rows;
  const int64_t prefixes = static_cast<int64_t>(prefix_keys.size() / ln1.size());
  // with each row's prefix (several, or rows sharing none): each prefix's rows (none: skipped)
  std::vector<at::Tensor> members;
  for (int64_t g = 0; prefix_of.numel() && g < prefixes; ++g) members.push_back(at::nonzero(prefix_of == g).view(-1));
  const auto span = [&](const at::Tensor& b) { return b.narrow(0, lo, n).narrow(2, since, keys_end - since); };
  const auto grouped = [&](const at::Tensor& t, int64_t count) {  // [count, width, H, D] -> [count, KV, G width, D]
    return t.transpose(1, 2).contiguous().view({count, kv_heads, G * width, D});
  };
  for (size_t i = 0; i < ln1.size(); ++i) {
    const auto q = norm_qkv_store(x, ln1[i], eps, qkv[i], qkv_n, cos, ssin, heads, kv_heads, keys[i],
                                  values[i], slot, pos);  // [T, H, D]
    auto queries = q.view({rows, width, heads, D});
    const auto padded = grouped(
        gaps ? at::zeros({n, width, heads, D}, q.options()).index_copy_(0, rows_at, queries) : queries, n);
    auto [out, lse] = pooled_attention_from(padded, span(keys[i]), span(values[i]), last, since, firsts, scale);
    if (gaps) out = out.index_select(0, rows_at);
    if (prefixes == 1 && !prefix_of.numel()) {  // the rows' own queries over the prefix, merged with their rests
      out = prefix_attention(gaps ? grouped(queries, rows) : padded, prefix_keys[i], prefix_values[i], out,
                             gaps ? lse.index_select(0, rows_at) : lse, scale, "");
    } else if (prefixes) {  // each group's rows over their own prefix (rows of none: as they are)
      const auto mine = gaps ? grouped(queries, rows) : padded;
      const auto rest_lse = gaps ? lse.index_select(0, rows_at) : lse;
      for (int64_t g = 0; g < prefixes; ++g) {
        const auto& at_g = members[g];
        if (at_g.numel() == 0) continue;
        out.index_copy_(0, at_g, prefix_attention(mine.index_select(0, at_g), prefix_keys[i * prefixes + g],
                                                  prefix_values[i * prefixes + g], out.index_select(0, at_g),
                                                  rest_lse.index_select(0, at_g), scale, ""));
      }
    }
    const auto attn = out.view({rows, heads, width, D}).transpose(1, 2).reshape({T, heads * D});
    x = mlp_tail(x, attn, o[i], ln2[i], eps, gate_up[i], gu_n, down[i]);
  }
  return x;
}

// dense_layers' layers where the rows fall in several prefix groups, or in groups and rows that
// share no prefix (prefix_of -1), on more than one thread: a claim takes rows of one group (at
// most ``cap``), wherever they lie in the window, so each claim reads its group's prefix once a
// layer for all of its queries; rows of the window outside the claim see no keys (their last
// position before the claim's first) and their outputs are dropped. A group's rows in
// alternate slots, split into runs of kGroupTokens rows, had each run read every group's prefix
// for a few queries: two groups of 8 demo-target sessions sharing 800 positions ran 1.09x as
// fast as without their prefixes on two threads (1.46x on one), now 1.51x; sharing 400, 1.06x,
// now 1.22x (docs/performance.md, 2026-11-29). Rows that share no prefix go, one at a time, to
// the claim that costs least so far (at least as many claims as threads: lone ones added where
// the groups give fewer), a row costing its projections (kRowKeys keys) and the keys it reads
// (a group's prefix once a claim): a group's claim reads few keys, and a claim of the lone rows
// alone beside it held the pass (8 sessions behind 800 shared positions and 8 sharing none:
// 1.02x as fast as without the prefix on two threads, 1.22x on one).
constexpr double kRowKeys = 1024.0;

// Each slot of a window of ``n`` slots' first position for ``pooled_attention_from``: since,
// but 0 at ``lone`` (the slots of the rows that share no prefix).
at::Tensor firsts_of(int64_t n, int64_t since, const at::Tensor& lone, const at::TensorOptions& options) {
  return at::full({n}, since, options).index_fill_(0, lone, 0);
}

at::Tensor layers_by_prefix(const at::Tensor& x, at::TensorList ln1, at::TensorList qkv, int64_t qkv_n,
                            at::TensorList o, at::TensorList ln2, at::TensorList gate_up, int64_t gu_n,
                            at::TensorList down, at::TensorList keys, at::TensorList values, const at::Tensor& cos,
                            const at::Tensor& ssin, int64_t heads, int64_t kv_heads, double eps, double scale,
                            const at::Tensor& slot, const at::Tensor& pos, int64_t lo, int64_t width, int64_t since,
                            int64_t keys_end, const at::Tensor& last, const at::Tensor& rows_at,
                            at::TensorList prefix_keys, at::TensorList prefix_values, const at::Tensor& prefix_of,
                            int64_t cap) {
  const int64_t rows = x.size(0) / width, n = last.size(0), layers = static_cast<int64_t>(ln1.size());
  const int64_t prefixes = static_cast<int64_t>(prefix_keys.size()) / layers;
  const auto at_cpu = (n != rows ? rows_at : at::arange(rows, rows_at.options())).to(at::kLong).contiguous();
  const int64_t* where = at_cpu.data_ptr<int64_t>();
  const auto of_cpu = prefix_of.to(at::kLong).contiguous();
  const int64_t* of = of_cpu.data_ptr<int64_t>();
  const auto ends = last.select(1, width - 1).to(at::kLong).contiguous();  // each slot's last position
  const int64_t* end = ends.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> claims;  // each claim's rows (indices into the pass's rows)
  std::vector<int64_t> claim_group;  // its group (-1: rows that share no prefix only)
  std::vector<double> cost;
  for (int64_t g = 0; g < prefixes; ++g) {
    std::vector<int64_t> mine;
    for (int64_t j = 0; j < rows; ++j)
      if (of[j] == g) mine.push_back(j);
    for (size_t j = 0; j < mine.size(); j += static_cast<size_t>(cap)) {
      claims.emplace_back(mine.begin() + j, mine.begin() + std::min(mine.size(), j + static_cast<size_t>(cap)));
      claim_group.push_back(g);
      double c = since / kRowKeys;
      for (const int64_t r : claims.back()) c += 1.0 + (end[where[r]] + 1 - since) / kRowKeys;
      cost.push_back(c);
    }
  }
  std::vector<int64_t> lone;
  for (int64_t j = 0; j < rows; ++j)
    if (of[j] < 0) lone.push_back(j);
  const auto threads = static_cast<size_t>(at::get_num_threads());
  for (size_t k = 0; k < lone.size() && claims.size() < threads; ++k) {
    claims.emplace_back();
    claim_group.push_back(-1);
    cost.push_back(0.0);
  }
  for (const int64_t r : lone) {
    const auto c = static_cast<size_t>(std::min_element(cost.begin(), cost.end()) - cost.begin());
    claims[c].push_back(r);
    cost[c] += 1.0 + (end[where[r]] + 1) / kRowKeys;
  }
  auto result = at::empty_like(x);
  const at::ThreadLocalState caller;  // inference mode, on the threads that take claims too
  parallel_claims(static_cast<int64_t>(claims.size()), [&](const auto& each) {
    const at::ThreadLocalStateGuard same(caller);
    each([&](int64_t c, int64_t) {
      auto order = claims[c];
      std::sort(order.begin(), order.end());  // (rows in slot order: their slots ascending)
      const auto mine = at::tensor(order, at_cpu.options());
      const int64_t g = claim_group[c];
      const bool mixed = g >= 0 && std::any_of(order.begin(), order.end(), [&](int64_t r) { return of[r] < 0; });
      const int64_t from = g < 0 || mixed ? 0 : since;  // rows sharing none: every key
      const auto slots = at_cpu.index_select(0, mine);  // each row's slot in the window, ascending
      const int64_t first = slots.min().item<int64_t>(), final = slots.max().item<int64_t>();
      const auto toks = (mine.unsqueeze(1) * width + at::arange(width, mine.options())).view(-1);
      const auto sub = [&](const at::Tensor& t) { return t.index_select(0, toks); };
      auto seen = at::full({final - first + 1, last.size(1)}, from - 1, last.options());
      seen.index_copy_(0, slots - first, last.index_select(0, slots));
      auto none = at::empty({0}, prefix_of.options()), own = none, firsts = none;
      if (mixed) {  // the group's rows from since (after its prefix), the others from 0
        own = of_cpu.index_select(0, mine).clamp_max(0).to(prefix_of.device());
        firsts = firsts_of(final - first + 1, since, (slots - first).index_select(0, at::nonzero(own < 0).view(-1)),
                           last.options());
      }
      std::vector<at::Tensor> pk, pv;
      for (int64_t i = 0; g >= 0 && i < layers; ++i) {
        pk.push_back(prefix_keys[i * prefixes + g]);
        pv.push_back(prefix_values[i * prefixes + g]);
      }
      result.index_copy_(0, toks, layers_over(sub(x), ln1, qkv, qkv_n, o, ln2, gate_up, gu_n, down, keys, values,
                                              sub(cos), sub(ssin), heads, kv_heads, eps, scale, sub(slot),
                                              sub(pos), lo + first, width, from, keys_end, seen, slots - first, pk,
                                              pv, own, firsts));
    });
  });
  return result;
}

}  // namespace

at::Tensor dense_layers(at::Tensor x, at::TensorList ln1, at::TensorList qkv, int64_t qkv_n,
                        at::TensorList o, at::TensorList ln2, at::TensorList gate_up, int64_t gu_n,
                        at::TensorList down, at::TensorList keys, at::TensorList values,
                        const at::Tensor& cos, const at::Tensor& ssin, int64_t heads, int64_t kv_heads,
                        double eps, double scale, const at::Tensor& slot, const at::Tensor& pos, int64_t lo,
                        int64_t width, int64_t since, int64_t keys_end, const at::Tensor& last,
                        const at::Tensor& rows_at, at::TensorList prefix_keys, at::TensorList prefix_values,
                        const at::Tensor& prefix_of) {
  const size_t layers = ln1.size();
  for (const auto* list : {&qkv, &o, &ln2, &gate_up, &down, &keys, &values})
    TORCH_CHECK(list->size() == layers, "dense_layers: one weight and buffer of each kind a layer");
  TORCH_CHECK(prefix_keys.size() == prefix_values.size() && prefix_keys.size() % layers == 0,
              "dense_layers: prefix_keys and prefix_values must be empty or groups [KV, since, D] a layer");
  const int64_t prefixes = static_cast<int64_t>(prefix_keys.size() / layers);
  const int64_t lowest = prefix_of.numel() ? prefix_of.min().item<int64_t>() : 0;
  TORCH_CHECK(prefix_of.numel() == 0
                  ? prefixes <= 1
                  : prefixes >= 1 && prefix_of.dim() == 1 && prefix_of.scalar_type() == at::kLong &&
                        prefix_of.numel() == x.size(0) / std::max<int64_t>(width, 1) && lowest >= -1 &&
                        prefix_of.max().item<int64_t>() < prefixes,
              "dense_layers: prefix_of must be empty for one prefix that every row shares, else each row's "
              "group [rows] (int64, 0..groups - 1, or -1 for a row that shares none)");
  for (size_t i = 0; i < prefix_keys.size(); ++i)
    TORCH_CHECK(prefix_keys[i].dim() == 3 && prefix_keys[i].size(1) == since,
                "dense_layers: a layer's prefix must be [KV, since, D]: its rows' positions before since");
  TORCH_CHECK(x.dim() == 2, "dense_layers: x must be [T, h]");
  TORCH_CHECK(heads % kv_heads == 0, "dense_layers: heads must be a multiple of kv_heads");
  const int64_t T = x.size(0);
  TORCH_CHECK(width > 0 && T % width == 0, "dense_layers: T must be a multiple of width");
  TORCH_CHECK(since >= 0 && since < keys_end, "dense_layers: since must be in 0..keys_end - 1");
  // rows of the pass, and slots of the window lo..lo+n-1 (more where sessions between rounds
  // hold slots inside it: their queries are zeros, and their outputs are not read)
  const int64_t rows = T / width, n = last.size(0);
  TORCH_CHECK(n >= rows && rows_at.numel() == rows,
              "dense_layers: rows_at must hold each row's slot in the window of last's rows");
  const bool gaps = n != rows;
  // On more than one thread, groups of rows run all their layers each, one group a claim: rows
  // do not mix within a layer, and a group's tiles are the ones its rows have in the whole
  // pass (a tile takes at most kGroupTokens rows), so each output is the same float. A layer's
  // operators over all rows would meet the other threads at every operator's end (~30 a pass):
  // a thread the OS lends to another process for a while (the gateway, Redis and the drafter
  // share these cores) held up each of them.
  const int64_t per_group = std::max<int64_t>(1, kGroupTokens / width);
  const int64_t groups = (rows + per_group - 1) / per_group;
  // rows that share no prefix (prefix_of -1) attend their slots from position 0, the others
  // from since (``firsts``, per slot of the window: gaps' queries see no keys either way)
  const bool lone = lowest < 0;
  if ((prefixes > 1 || lone) && at::get_num_threads() > 1 && !at::in_parallel_region())
    return layers_by_prefix(x, ln1, qkv, qkv_n, o, ln2, gate_up, gu_n, down, keys, values, cos, ssin, heads,
                            kv_heads, eps, scale, slot, pos, lo, width, since, keys_end, last, rows_at, prefix_keys,
                            prefix_values, prefix_of, std::max(per_group, (rows + at::get_num_threads() - 1) /
                                                                            at::get_num_threads()));
  if (lone) {
    const auto firsts = firsts_of(n, since, (gaps ? rows_at.to(at::kLong) : at::arange(rows, last.options()))
                                                .index_select(0, at::nonzero(prefix_of < 0).view(-1)),
                                  last.options());
    return layers_over(x, ln1, qkv, qkv_n, o, ln2, gate_up, gu_n, down, keys, values, cos, ssin, heads,
                       kv_heads, eps, scale, slot, pos, lo, width, 0, keys_end, last, rows_at, prefix_keys,
                       prefix_values, prefix_of, firsts);
  }
  if (at::get_num_threads() <= 1 || at::in_parallel_region() || groups < 2)
    return layers_over(x, ln1, qkv, qkv_n, o, ln2, gate_up, gu_n, down, keys, values, cos, ssin, heads,
                       kv_heads, eps, scale, slot, pos, lo, width, since, keys_end, last, rows_at, prefix_keys,
                       prefix_values, prefix_of, at::empty({0}, last.options()));
  const auto at_cpu = rows_at.to(at::kLong).contiguous();
  const int64_t* where = at_cpu.data_ptr<int64_t>();
  auto result = at::empty_like(x);
  const at::ThreadLocalState caller;  // inference mode, on the threads that take groups too
  parallel_claims(groups, [&](const auto& each) {
    const at::ThreadLocalStateGuard same(caller);
    each([&](int64_t g, int64_t) {
      const int64_t j0 = g * per_group, j1 = std::min(rows, j0 + per_group);
      const int64_t first = gaps ? where[j0] : j0, final = gaps ? where[j1 - 1] : j1 - 1;
      const int64_t t0 = j0 * width, tn = (j1 - j0) * width;
      const auto sub = [&](const at::Tensor& t) { return t.narrow(0, t0, tn); };
      const auto at_rows = gaps ? at_cpu.narrow(0, j0, j1 - j0) - first : at_cpu.narrow(0, 0, j1 - j0);
      result.narrow(0, t0, tn).copy_(layers_over(
          sub(x), ln1, qkv, qkv_n, o, ln2, gate_up, gu_n, down, keys, values, sub(cos), sub(ssin), heads,
          kv_heads, eps, scale, sub(slot), sub(pos), lo + first, width, since, keys_end,
          last.narrow(0, first, final - first + 1), at_rows, prefix_keys, prefix_values,
          prefix_of.numel() ? prefix_of.narrow(0, j0, j1 - j0) : prefix_of, at::empty({0}, last.options())));
    });
  });
  return result;
}
