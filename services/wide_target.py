"""A random-weight target shaped like real models, to measure what the mesh does where the
weights, not attention or Python, are most of a pass (docs/performance.md, "Long contexts on
a target shaped like real models"): the demo target's tokenizer, vocabulary and generation
settings, with a 4-to-1 grouped-query Llama body of hidden size 2,048 (4 layers, 32 query and
8 key heads of 64, MLP 5,632: 214M parameters), saved in float16 as a checkpoint would be.

    python -m services.wide_target OUT [--source models/demo-target] [--layers 4]

Its outputs are noise, so a bench against it measures speed only (target-only rows; any
drafter completes the command). Deterministic for a seed.
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


def build_wide_target(source: Path, out: Path, seed: int = 0, **shape) -> Path:
    """Saves the wide target in ``out`` from the Llama checkpoint ``source`` (its config
    with ``SHAPE``, overridden by ``shape``; its tokenizer files copied); returns ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((source / "config.json").read_text())
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        config.pop(key, None)
    config.update(SHAPE, **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float16)
    model.save_pretrained(out)
    for name in COPIED:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m services.wide_target",
        description="Build a random-weight target shaped like real models (see the module).")
    ap.add_argument("out", type=Path, help="directory to save it in")
    ap.add_argument("--source", type=Path, default=Path("models/demo-target"),
                    help="the Llama checkpoint whose tokenizer and vocabulary it takes")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                    help="decoder layers (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not (args.source / "config.json").is_file():
        print(f"error: --source {args.source} holds no config.json: give a Llama checkpoint "
              "directory (the demo target is models/demo-target)", file=sys.stderr)
        return 2
    if args.layers < 1:
        print(f"error: --layers must be at least 1, got {args.layers}", file=sys.stderr)
        return 2
    out = build_wide_target(args.source, args.out, seed=args.seed,
                            num_hidden_layers=args.layers)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
