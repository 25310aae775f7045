"""The demo pair's model card (models/README.md), rendered only from the three JSON reports
written by the runs that made the committed weights:

- ``models/demo-target/training_report.json`` (``training.demo``)
- ``models/demo-drafter/distill_report.json`` (``specmesh distill``)
- ``models/demo-eval.json`` (``training.evaluate``, with the sha256 of both models' weights)

    python -m training.card --models models   # rewrites models/README.md

tests/test_demo_models.py re-renders the card and compares it with the committed one, and
checks every sha256 against the committed files, so the figures cannot drift from the weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_reports(models: Path) -> tuple[dict, dict, dict]:
    return (json.loads((models / "demo-target" / "training_report.json").read_text()),
            json.loads((models / "demo-drafter" / "distill_report.json").read_text()),
            json.loads((models / "demo-eval.json").read_text()))


def render(target: dict, drafter: dict, ev: dict) -> str:
    t, d = target["config"], drafter["config"]
    curve = ", ".join(f"{int(s)}: {v:.3f}" for s, v in sorted(
        ((int(k), v) for k, v in target["held_out_curve"].items())))
    sha = "\n".join(f"| {role} | `{name}` | `{digest}` |"
                    for role, key in (("target", "target_sha256"), ("drafter", "draft_sha256"))
                    for name, digest in sorted(ev[key].items()))
    hours = target["train_seconds_this_run"] / 3600
    arch_t = (f"Llama, {t['layers']} layers, hidden {t['hidden']}, {t['heads']} heads "
              f"({t['kv_heads']} KV), MLP {t['intermediate']}")
    arch_d = (f"Llama, {d['layers']} layers, hidden {d['hidden']}, {d['heads']} heads, "
              f"MLP {d['intermediate']}")
    train_t = (f"{target['steps_done']} steps × {t['batch_size']} × {t['seq_len']} tokens = "
               f"{target['tokens_seen']:,} tokens ({target['epochs']:.2f} epochs), AdamW lr "
               f"{t['lr']:g}, {hours:.2f} h on {target['torch_threads']} CPU thread(s) "
               f"({target['tokens_per_second_this_run']:.0f} tokens/s), bf16 {target['bf16']}")
    train_d = (f"{drafter['steps_done']} steps × {d['batch_size']} × {d['seq_len']} tokens, KL "
               f"to the target at T={d['temperature']:g}, lr {d['lr']:g}, "
               f"{drafter['train_seconds_this_run'] / 60:.1f} min")
    loss_t = (f"held-out {target['initial_held_out_loss']:.3f} → "
              f"{target['final_held_out_loss']:.3f} nats/token "
              f"(train {target['final_train_loss']:.3f})")
    loss_d = (f"held-out KL {drafter['held_out_kl_before']:.3f} → "
              f"{drafter.get('held_out_kl_after', float('nan')):.3f} nats/token")
    return f"""# The SpecMesh demo pair

A Llama target trained from scratch on the Python standard library and a drafter distilled
from it with `specmesh distill`. Built on this project's CPU machines; no model hub involved.
Every figure below is rendered by `python -m training.card` from the JSON reports next to the
weights; `tests/test_demo_models.py` checks them against the committed files.

## Data

The `.py` files of the CPython {target.get("python", "3.11")} standard library without test suites:
{target["train_files"]} training files ({target["train_tokens"]:,} tokens) and
{target["held_out_files"]} held-out files ({target["held_out_tokens"]:,} tokens), split by the
fixed rule `{target["split_rule"]}` on the relative path (docs/models.md). Held-out files were
never used for the tokenizer, the target or the drafter.

## Models

| | target (`demo-target`) | drafter (`demo-drafter`) |
|---|---|---|
| architecture | {arch_t} | {arch_d} |
| parameters | {target["params"]:,} | {drafter["draft_params"]:,} |
| vocabulary | byte-level BPE, {t["vocab_size"]:,} tokens (shared) | the target's tokenizer |
| training | {train_t} | {train_d} |
| loss | {loss_t} | {loss_d} |
| saved as | {target["save_dtype"]} safetensors | {drafter["save_dtype"]} safetensors |

Target held-out loss by step: {curve}.

## Acceptance and latency (held-out stdlib files)

Measured by `python -m training.evaluate --target models/demo-target --draft models/demo-drafter
--threads {ev["latency_threads"]} --json models/demo-eval.json` on {ev["positions"]:,} positions
({ev["eval_windows"]} windows × {ev["eval_seq_len"]} tokens):

| | value |
|---|---|
| α greedy (draft argmax == target argmax) | {ev["alpha_greedy"]:.3f} |
| α at temperature 1 (E[Σ min(p, q)]) | {ev["alpha_t1"]:.3f} |
| KL(target ‖ draft) | {ev["kl"]:.3f} nats/token |
| target per-token forward (KV cache, context {ev["latency_context"]}) | {ev["target_ms_per_token"]:.2f} ms |
| drafter per-token forward | {ev["draft_ms_per_token"]:.2f} ms |
| drafter / target time (c) | {ev["latency_ratio"]:.3f} ({_goal(ev)} the 1/8 = 0.125 goal) |

{_latency_note(ev)}

## Weights these figures belong to

| model | file | sha256 |
|---|---|---|
{sha}

## Rebuild

`make demo-models` (see docs/models.md for the flags used and the time it takes), then
`python -m training.card --models models`.
"""


def _goal(ev: dict) -> str:
    return "meets" if ev["latency_ratio"] <= 0.125 else "misses"


def _latency_note(ev: dict) -> str:
    """Why c is what it is: on a small CPU model the per-token time is mostly fixed per-forward
    overhead (Python, kernel launches), not arithmetic, so it does not shrink with the size."""
    if ev["latency_ratio"] <= 0.125:
        return ""
    return (f"The drafter has {ev['draft_params'] / 1e6:.1f}M parameters against the "
            f"target's {ev['target_params'] / 1e6:.1f}M, yet costs "
            f"{ev['latency_ratio']:.2f} of its time per token: at these sizes a KV-cached "
            "single-token forward on this CPU is dominated by per-layer fixed costs (HF module "
            "calls, small-matrix kernels), not by arithmetic. A 1/8 ratio needs a target whose "
            "per-token time is mostly arithmetic, i.e. a much larger one (docs/performance.md).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Render models/README.md from the reports.")
    ap.add_argument("--models", type=Path, default=Path("models"))
    args = ap.parse_args(argv)
    (args.models / "README.md").write_text(render(*load_reports(args.models)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
