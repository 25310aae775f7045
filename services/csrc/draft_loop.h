// Included by cpu_kernels.cpp after layer_parts.h: a draft model's greedy drafts, all of a
// drafting step's passes in one operator (services/lean_llama.py ``greedy_drafts``).
//
// A verifier's local drafts (verifier_svc/local_drafts.py) take k passes of the draft model a
// step, each of one token a session but the first. On the demo drafter (2 layers, hidden 128)
// such a pass's arithmetic is ~0.18 ms and the pass took ~0.45-0.6 ms: the rest was the
// interpreter and PyTorch's dispatch around ``dense_layers`` (embedding, rotary table, the
// plan's indices, the head, the argmax, the draws' lists), paid k times a step. Here each pass
// is the very operators the Python side runs, called from C++: the same floats.
//
// x [T, h]: the first pass's embedded tokens, ``width`` a row, as ``dense_layers`` takes them
// (with since = 0 and no prefix), its cos and ssin [T, D], slot, pos [T], last [n, width],
// rows_at [rows]. embed [V, h] float32: the embedding; norm [h]: the final norm; head: the LM
// head's 16-bit blocks (``half_linear``) with ``vocab`` outputs; cos_table, ssin_table [P, D]:
// each position's cos and signed sin (services/rotary.py ``RopeTable``). Runs ``steps``
// passes: the first over x, each next over the token the one before chose for each row (the
// argmax of its last token's logits, torch.argmax's answer), one token a row at its next
// position. Returns the chosen tokens [rows, steps] int64; the caches hold the fed positions.
at::Tensor greedy_drafts(at::Tensor x, at::TensorList ln1, at::TensorList qkv, int64_t qkv_n, at::TensorList o,
                         at::TensorList ln2, at::TensorList gate_up, int64_t gu_n, at::TensorList down,
                         at::TensorList keys, at::TensorList values, at::Tensor cos, at::Tensor ssin,
                         int64_t heads, int64_t kv_heads, double eps, double scale, at::Tensor slot, at::Tensor pos,
                         int64_t lo, int64_t width, int64_t keys_end, at::Tensor last, const at::Tensor& rows_at,
                         const at::Tensor& embed, const at::Tensor& norm, const at::Tensor& head, int64_t vocab,
                         const at::Tensor& cos_table, const at::Tensor& ssin_table, int64_t steps) {
  TORCH_CHECK(steps >= 1, "greedy_drafts: steps must be >= 1, got ", steps);
  TORCH_CHECK(x.dim() == 2 && width > 0 && x.size(0) % width == 0 && x.size(0) > 0,
              "greedy_drafts: x must be [T, h] with T a positive multiple of width");
  TORCH_CHECK(embed.scalar_type() == at::kFloat && embed.dim() == 2 && embed.size(1) == x.size(1),
              "greedy_drafts: embed must be float32 [V, h] of x's width");
  TORCH_CHECK(cos_table.dim() == 2 && ssin_table.sizes() == cos_table.sizes() && cos.dim() == 2 &&
              cos_table.size(1) == cos.size(1), "greedy_drafts: cos_table and ssin_table must be [P, D]");
  TORCH_CHECK(pos.scalar_type() == at::kLong && slot.scalar_type() == at::kLong && last.scalar_type() == at::kLong,
              "greedy_drafts: slot, pos and last must be int64");
  const int64_t h = x.size(1), rows = x.size(0) / width, n = last.size(0);
  {  // every position a pass writes must be tabled (rope_store checks it fits its slot)
    const int64_t top = pos.view({rows, width}).select(1, width - 1).max().item<int64_t>() + steps - 1;
    TORCH_CHECK(top < cos_table.size(0), "greedy_drafts: position ", top, " is past the rotary table (",
                cos_table.size(0), " positions)");
  }
  auto out = at::empty({rows, steps}, pos.options());
  for (int64_t s = 0;; ++s) {
    x = dense_layers(x, ln1, qkv, qkv_n, o, ln2, gate_up, gu_n, down, keys, values, cos, ssin, heads, kv_heads, eps,
                     scale, slot, pos, lo, width, 0, keys_end, last, rows_at, {}, {},
                     at::empty({0}, pos.options()));
    const auto ends = x.view({rows, width, h}).select(1, width - 1);  // [rows, h]: each row's last token
    const auto next = argmax_rows(half_linear(rms_norm(ends, norm, eps), head, vocab, ""), "");  // [rows]
    out.select(1, s).copy_(next);
    if (s + 1 == steps) break;
    // the next pass: each row's chosen token at the position after its last one
    pos = pos.view({rows, width}).select(1, width - 1) + 1;  // [rows]
    slot = slot.view({rows, width}).select(1, width - 1).contiguous();  // [rows]
    last = at::zeros({n, 1}, last.options()).index_copy_(0, rows_at, pos.unsqueeze(1));  // [n, 1]
    keys_end += 1;  // (every row gains one position)
    cos = cos_table.index_select(0, pos);  // [rows, D]
    ssin = ssin_table.index_select(0, pos);
    x = embed.index_select(0, next);  // [rows, h]
    width = 1;
  }
  return out;
}
