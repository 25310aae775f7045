"""`specmesh distill`: train a drafter for any target (training/distill.py does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def distill(
    target: Annotated[str, typer.Option("--target", help="Target model: directory or hub name.")],
    out: Annotated[Path, typer.Option("--out", help="Where the drafter is saved.")],
    corpus: Annotated[list[str] | None, typer.Option(
        "--corpus", help="Text files or folders (repeatable); default: the stdlib train split.")
    ] = None,
    layers: Annotated[int, typer.Option(help="Drafter layers.")] = 2,
    hidden: Annotated[int, typer.Option(help="Drafter hidden size.")] = 128,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 1000,
    seq_len: Annotated[int, typer.Option(help="Tokens per training window.")] = 256,
    batch_size: Annotated[int, typer.Option(help="Windows per step.")] = 8,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 2e-3,
    temperature: Annotated[float, typer.Option(help="Distillation temperature.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the initial weights and of the "
                                           "batch order.")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint.")
                      ] = False,
    bf16: Annotated[str, typer.Option(help="auto (when the CPU has AVX-512/AMX), on or off.")
                    ] = "auto",
    max_minutes: Annotated[float | None, typer.Option(help="Stop (and save) after this long.")
                           ] = None,
    save_dtype: Annotated[str, typer.Option(help="float32 or float16.")] = "float32",
    threads: Annotated[int, typer.Option(help="torch CPU threads (0 = default).")] = 0,
) -> None:
    """Distill a drafter that shares TARGET's tokenizer (KL to the target's next-token
    distribution); prints the acceptance rate and latencies at the end."""
    import torch

    from training.distill import distill as run_distill

    if threads:
        torch.set_num_threads(threads)
    run_distill(target, corpus or None, out, layers=layers, hidden=hidden, steps=steps,
                seq_len=seq_len, batch_size=batch_size, lr=lr, temperature=temperature,
                seed=seed, resume=resume, bf16=bf16, max_minutes=max_minutes,
                save_dtype=save_dtype, threads=threads or None)
