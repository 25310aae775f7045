"""A random-weight target shaped like real models, to measure what the mesh does where the
weights, not attention or Python, are most of a pass (docs/performance.md, "Long contexts on
a target shaped like real models"): the demo target's tokenizer, vocabulary and generation
settings, with a 4-to-1 grouped-query Llama body of hidden size 2,048 (4 layers, 32 query and
8 key heads of 64, MLP 5,632: 214M parameters), saved in float16 as a checkpoint would be.

    python -m services.wide_target OUT [--source models/demo-target] [--layers 4]

Its outputs are noise, so a bench against it measures speed only (target-only rows; any
drafter completes the command). Deterministic for a seed.

``--widen F`` builds instead a heavy copy of the source that computes the source's own
function (``widen_target``): every width times F (hidden size, heads, key-value heads, MLP)
with the source's weights in the first block of each matrix and zeros elsewhere, plus
``--extra-layers`` layers whose output projections are zero. Its passes cost what a model of
its size costs (a CPU multiplies zeros as fast as anything), and its logits are the source's
up to float rounding, so the demo drafter's drafts are accepted as on the demo target: a
target on which to measure what speculation buys where the pass, not the serving path, is
the cost, as with real models.

    python -m services.wide_target OUT --widen 4 --extra-layers 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64)


def _fresh_config(config: dict) -> dict:
    """A checkpoint's config without the keys a new model of another shape must not keep."""
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        config.pop(key, None)
    return config


def _save(model, source: Path, out: Path) -> Path:
    """Saves ``model`` in float16, as a checkpoint would be, with ``source``'s tokenizer files."""
    import torch

    model.to(torch.float16).save_pretrained(out)
    for name in COPIED:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def build_wide_target(source: Path, out: Path, seed: int = 0, **shape) -> Path:
    """Saves the wide target in ``out`` from the Llama checkpoint ``source`` (its config
    with ``SHAPE``, overridden by ``shape``; its tokenizer files copied); returns ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = _fresh_config(json.loads((source / "config.json").read_text()))
    config.update(SHAPE, **shape)
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(LlamaConfig(**config)), source, out)


def widen_target(source: Path, out: Path, factor: int = 4, extra_layers: int = 0,
                 seed: int = 0) -> Path:
    """Saves in ``out`` the Llama checkpoint ``source`` widened ``factor`` times (4 or 16: a
    power-of-two square, see below) with ``extra_layers`` more layers, computing the same
    logits; returns ``out``.

    Zeros in the new columns of the embedding keep the new hidden dims at zero through
    every layer: each projection reads the old dims with the old block and writes zeros to
    the new ones, the new heads' and MLP rows' outputs meet zero columns of o_proj and
    down_proj, and an extra layer adds nothing to the residual (its o_proj and down_proj
    are zero; its other weights are random, so that it computes as a layer does). Only the
    RMS norms see the width: the mean square over F times the dims is 1/F of the old one,
    so the norms' epsilon is divided by F and their weights by sqrt(F), a power of two for
    F = 4 or 16, which keeps the 16-bit weights exact."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if factor not in (4, 16):
        raise ValueError(f"factor must be 4 or 16 (its square root a power of two), got {factor}")
    if extra_layers < 0:
        raise ValueError(f"extra_layers must be >= 0, got {extra_layers}")
    small = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    c = small.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    hidden, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    config = _fresh_config(c.to_dict())
    config.update(hidden_size=hidden * factor, num_attention_heads=heads * factor,
                  num_key_value_heads=kv_heads * factor, head_dim=head_dim,
                  intermediate_size=inter * factor, num_hidden_layers=layers + extra_layers,
                  rms_norm_eps=c.rms_norm_eps / factor)
    torch.manual_seed(seed)
    wide = LlamaForCausalLM(LlamaConfig(**config))
    root = factor ** 0.5
    with torch.no_grad():
        def put(dst: torch.Tensor, src: torch.Tensor) -> None:
            dst.zero_()  # the old block, zeros elsewhere
            dst[tuple(slice(0, n) for n in src.shape)] = src

        put(wide.model.embed_tokens.weight, small.model.embed_tokens.weight)
        put(wide.lm_head.weight, small.lm_head.weight)
        put(wide.model.norm.weight, small.model.norm.weight / root)
        for i, w in enumerate(wide.model.layers):
            a, m = w.self_attn, w.mlp
            if i >= layers:  # an extra layer: computes, adds nothing
                a.o_proj.weight.zero_()
                m.down_proj.weight.zero_()
                continue
            o = small.model.layers[i]
            # GQA keeps its group size (heads / kv_heads), so old query head j still reads
            # old key-value head j // group: the old heads come first in each projection
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                put(getattr(a, name).weight, getattr(o.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                put(getattr(m, name).weight, getattr(o.mlp, name).weight)
            for name in ("input_layernorm", "post_attention_layernorm"):
                put(getattr(w, name).weight, getattr(o, name).weight / root)
    return _save(wide, source, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m services.wide_target",
        description="Build a random-weight target shaped like real models, or (--widen) a "
                    "heavy copy of the source with its logits (see the module).")
    ap.add_argument("out", type=Path, help="directory to save it in")
    ap.add_argument("--source", type=Path, default=Path("models/demo-target"),
                    help="the Llama checkpoint whose tokenizer and vocabulary it takes")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                    help="decoder layers (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--widen", type=int, default=0, metavar="F",
                    help="instead: the source itself, F (4 or 16) times as wide, with the "
                         "same logits (see the module)")
    ap.add_argument("--extra-layers", type=int, default=0,
                    help="with --widen: layers added that compute and change nothing")
    args = ap.parse_args(argv)
    if not (args.source / "config.json").is_file():
        print(f"error: --source {args.source} holds no config.json: give a Llama checkpoint "
              "directory (the demo target is models/demo-target)", file=sys.stderr)
        return 2
    if args.layers < 1:
        print(f"error: --layers must be at least 1, got {args.layers}", file=sys.stderr)
        return 2
    if args.extra_layers and not args.widen:
        print("error: --extra-layers adds layers to a widened copy: give --widen 4 or 16 too "
              "(a random target takes its depth from --layers)", file=sys.stderr)
        return 2
    if args.widen:
        if args.widen not in (4, 16) or args.extra_layers < 0:
            print(f"error: --widen must be 4 or 16 and --extra-layers at least 0, got "
                  f"{args.widen} and {args.extra_layers}", file=sys.stderr)
            return 2
        print(widen_target(args.source, args.out, args.widen, args.extra_layers, args.seed))
        return 0
    out = build_wide_target(args.source, args.out, seed=args.seed,
                            num_hidden_layers=args.layers)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
