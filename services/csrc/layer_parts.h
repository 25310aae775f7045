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
