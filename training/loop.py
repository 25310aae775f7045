"""The training loop shared by the demo target and ``distill``.

AdamW, linear warmup then cosine decay to ``min_lr_ratio * lr``, optional bf16 autocast on CPU,
gradient clipping, deterministic seeds, resumable checkpoints (model + optimizer + step + RNG
state, written atomically) and a rich progress bar with loss, tokens/s and ETA.

The batch for a step must be a pure function of the step (see ``corpus.WindowSampler``): then a
run resumed from a checkpoint computes exactly the losses an uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = ["TrainResult", "set_seed", "lr_at", "autocast", "save_checkpoint",
           "load_checkpoint", "train", "sha256_file"]

CHECKPOINT_NAME = "checkpoint.pt"


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def lr_at(step: int, total: int, lr: float, warmup: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step ``step`` (0-based): warmup, then cosine decay."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)


def bf16_is_fast() -> bool:
    """Whether bf16 autocast is expected to train faster than fp32 on this CPU.

    On an AVX-512 EPYC bf16 autocast trained ~2x faster than fp32 (shared/MEASUREMENTS.md); on an
    AVX2-only EPYC one 32M-parameter step took 76 s in bf16 vs 2.9 s in fp32 (emulated bf16).
    A micro-benchmark of one matmul does not show this, so decide by the CPU capability.
    """
    cap = torch.backends.cpu.get_cpu_capability().upper()
    return "AVX512" in cap or "AMX" in cap


def resolve_bf16(option) -> bool:
    """``True``/``"on"``, ``False``/``"off"``, or ``"auto"`` (bf16 only where it is faster)."""
    if isinstance(option, bool):
        return option
    option = str(option).lower()
    if option in ("on", "true", "1", "yes"):
        return True
    if option in ("off", "false", "0", "no"):
        return False
    if option == "auto":
        return bf16_is_fast()
    raise ValueError(f"bf16 must be on, off or auto, not {option!r}")


def sha256_file(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(path: Path, model, optimizer, step: int, extra: dict | None = None) -> None:
    """Atomically writes model + optimizer + step + RNG state to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng_torch": torch.get_rng_state(),
        "rng_numpy": np.random.get_state(),
        "rng_python": random.getstate(),
        "extra": extra or {},
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, optimizer) -> tuple[int, dict]:
    """Restores a checkpoint written by :func:`save_checkpoint`; returns ``(step, extra)``."""
    # Our own file (it holds numpy/python RNG state, which weights_only refuses).
    state = torch.load(Path(path), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_torch"])
    np.random.set_state(state["rng_numpy"])
    random.setstate(state["rng_python"])
    return int(state["step"]), dict(state.get("extra") or {})


@dataclass
class TrainResult:
    start_step: int  # step the run (re)started at
    step: int  # steps completed in total
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss
    evals: dict[int, float] = field(default_factory=dict)  # step -> held-out metric
    seconds: float = 0.0
    stopped_early: bool = False
    bf16: bool = False


def make_optimizer(model, lr: float, weight_decay: float):
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _progress(enabled: bool, desc: str):
    if not enabled:
        return None
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn(f"[bold]{desc}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                    TextColumn("eval {task.fields[ev]}"), TimeElapsedColumn(), TextColumn("ETA"),
                    TimeRemainingColumn())


def train(model, loss_fn: Callable[[int], torch.Tensor], *, steps: int, lr: float,
          warmup: int = 0, min_lr_ratio: float = 0.1, weight_decay: float = 0.1,
          grad_clip: float = 1.0, bf16="auto", ckpt_dir: Path | None = None,
          ckpt_every: int = 200, resume: bool = False, seed: int = 0,
          eval_fn: Callable[[], float] | None = None, eval_every: int = 0,
          max_minutes: float | None = None, stop_after: int | None = None,
          tokens_per_step: int = 0, desc: str = "train", show_progress: bool = True,
          log: Callable[[str], None] | None = None) -> TrainResult:
    """Runs optimizer steps ``[start, steps)``; ``loss_fn(step)`` computes the step's loss.

    ``resume``: continue from ``ckpt_dir/checkpoint.pt`` when it exists. ``stop_after``: stop
    after this many steps in this invocation (the LR schedule still spans ``steps``);
    ``max_minutes``: stop when the wall-clock budget is spent. Either early stop writes a
    checkpoint, so the run can be resumed later.
    """
    bf16 = resolve_bf16(bf16)
    if log:
        log(f"bf16 autocast: {'on' if bf16 else 'off'}")
    set_seed(seed)
    optimizer = make_optimizer(model, lr, weight_decay)
    ckpt = Path(ckpt_dir) / CHECKPOINT_NAME if ckpt_dir is not None else None
    start = 0
    if resume and ckpt is not None and ckpt.exists():
        start, _ = load_checkpoint(ckpt, model, optimizer)
        if log:
            log(f"resumed from {ckpt} at step {start}")
    result = TrainResult(start_step=start, step=start, bf16=bf16)
    model.train()
    t0 = time.perf_counter()
    deadline = t0 + max_minutes * 60 if max_minutes else None
    end = steps if stop_after is None else min(steps, start + stop_after)
    bar = _progress(show_progress, desc)
    task = None
    if bar is not None:
        bar.start()
        task = bar.add_task(desc, total=steps, completed=start, loss="-", tps="-", ev="-")
    ema = None
    try:
        step = start
        while step < end:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, steps, lr, warmup, min_lr_ratio)
            with autocast(bf16):
                loss = loss_fn(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip and grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"loss is {value} at step {step}")
            step += 1
            result.step = step
            result.losses[step] = value
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            if eval_fn is not None and eval_every and (step % eval_every == 0 or step == steps):
                model.eval()
                result.evals[step] = float(eval_fn())
                model.train()
                if log:
                    log(f"step {step}: train loss {ema:.4f}, held-out {result.evals[step]:.4f}")
            if ckpt is not None and ckpt_every and step % ckpt_every == 0:
                save_checkpoint(ckpt, model, optimizer, step)
            if bar is not None:
                elapsed = time.perf_counter() - t0
                tps = tokens_per_step * (step - start) / elapsed if elapsed > 0 else 0
                ev = f"{result.evals[max(result.evals)]:.3f}" if result.evals else "-"
                bar.update(task, completed=step, loss=f"{ema:.3f}", tps=f"{tps:,.0f}", ev=ev)
            if deadline is not None and time.perf_counter() > deadline and step < steps:
                result.stopped_early = True
                break
        if step < steps:
            result.stopped_early = True
        if ckpt is not None and step > start:
            save_checkpoint(ckpt, model, optimizer, step)
    except KeyboardInterrupt:
        if ckpt is not None and result.step > start:
            save_checkpoint(ckpt, model, optimizer, result.step)
        raise
    finally:
        if bar is not None:
            bar.stop()
        model.eval()
    result.seconds = time.perf_counter() - t0
    return result
