"""Distill a small drafter from any HF causal-LM target.

The drafter is a ``LlamaForCausalLM`` with the target's tokenizer (copied into ``out_dir``),
trained to match the target's next-token distribution with

    loss = T² · KL( softmax(z_target / T) || softmax(z_draft / T) )

averaged over every position of the training windows (soft cross-entropy on the target's logits,
minus the target's entropy, so a perfect drafter reaches 0). The target runs in eval mode under
``torch.no_grad`` (under bf16 autocast too when ``bf16`` is on).

Initialisation trick: the drafter's embeddings and ``lm_head`` start from the target's. When the
hidden sizes match they are copied; when the drafter is narrower, both are projected onto the
top-``hidden`` right singular vectors of the target's matrices (the target's final RMSNorm gain is
folded into ``lm_head`` first), i.e. the best rank-``hidden`` approximation of the target's
output/input geometry. This typically removes most of the early loss and lets the small drafter
spend its steps on the decoder layers.

At the end the drafter is saved with ``save_pretrained`` + tokenizer (served as is by
``specmesh drafter --model DIR``), and ``distill_report.json`` records α (greedy and temperature
1) on held-out text, per-token latencies of both models and the sha256 of the weight files.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from training import corpus
from training.demo import generation_config, save_model, weights_sha256
from training.evaluate import evaluate_alpha, evaluate_pair, format_table, load_model
from training.loop import train

__all__ = ["draft_config", "init_from_target", "kd_loss", "distill", "main"]

REPORT_NAME = "distill_report.json"


def draft_config(target, tokenizer, layers: int, hidden: int, heads: int | None = None,
                 intermediate: int | None = None):
    from transformers import LlamaConfig

    tc = target.config
    vocab = int(target.get_output_embeddings().weight.shape[0])
    heads = heads or max(1, hidden // 64)
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
    kv = heads // 2 if heads % 2 == 0 and heads >= 4 else heads
    inter = intermediate or int(round(hidden * 8 / 3 / 32)) * 32 or hidden * 2
    max_pos = getattr(tc, "max_position_embeddings", None) or 2048
    kwargs = {}
    for name in ("rope_parameters", "rope_theta", "rms_norm_eps"):
        if getattr(tc, name, None) is not None and tc.model_type == "llama":
            kwargs[name] = getattr(tc, name)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=max_pos, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **kwargs)


def _project(matrix: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of ``matrix`` (V×H) in the basis of its top-k right singular vectors: V×k."""
    _, _, vh = torch.linalg.svd(matrix.float(), full_matrices=False)
    return matrix.float() @ vh[:k].T


@torch.no_grad()
def init_from_target(draft, target) -> str:
    """Copy (same width) or SVD-project (narrower) embeddings and lm_head; returns what it did."""
    te = target.get_input_embeddings().weight
    th = target.get_output_embeddings().weight
    de = draft.get_input_embeddings().weight
    dh = draft.get_output_embeddings().weight
    if te.shape[0] != de.shape[0] or th.shape[0] != dh.shape[0]:
        return "none (vocab sizes differ)"
    h_t, h_d = te.shape[1], de.shape[1]
    if h_d == h_t:
        de.copy_(te)
        dh.copy_(th)
        return "copied"
    if h_d > h_t:
        return "none (draft wider than target)"
    head = th.float()
    norm = getattr(getattr(target, "model", None), "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None \
            and norm.weight.shape == (h_t,):
        head = head * norm.weight.float()  # fold the final RMSNorm gain into lm_head
    e, h = _project(te, h_d), _project(head, h_d)
    # A unit-RMS h_d-dim draft state has norm sqrt(h_d), the target's sqrt(h_t): rescale the
    # head so that initial logits have the target's scale. Embeddings keep the draft init std.
    de.copy_(e * (de.float().std() / e.std()))
    dh.copy_(h * (h_t / h_d) ** 0.5)
    return f"svd-projected {h_t}->{h_d}"


def kd_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """T² · mean over positions of KL(p_target^T || q_draft^T), computed in fp32."""
    t = target_logits.float() / temperature
    d = draft_logits.float() / temperature
    logp = torch.log_softmax(t, -1)
    logq = torch.log_softmax(d, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return kl.mean() * temperature**2


def _prepare(tokenizer, corpus_paths, seq_len: int, held_windows: int):
    """Train windows and held-out windows from a user corpus (default: the stdlib split)."""
    if corpus_paths:
        train_list, held_list = corpus.split_paths(corpus_paths)
    else:
        train_list, held_list = corpus.train_files(), corpus.held_out_files()
    train_stream = corpus.token_stream(tokenizer, train_list)
    held_stream = corpus.token_stream(tokenizer, held_list)
    if len(held_stream) < seq_len or len(train_stream) < seq_len * 2:
        # too few files for the per-file rule: hold out the last 5% of the token stream
        stream = np.concatenate([train_stream, held_stream])
        cut = max(seq_len, int(len(stream) * 0.05))
        train_stream, held_stream = stream[:-cut], stream[-cut:]
    train_w = corpus.make_windows(train_stream, seq_len)
    held_w = corpus.make_windows(held_stream, seq_len)[:held_windows]
    info = {"train_files": len(train_list), "held_out_files": len(held_list),
            "train_tokens": int(len(train_stream)), "held_out_tokens": int(len(held_stream))}
    return train_w, torch.from_numpy(held_w.astype(np.int64)), info


def distill(target: str | Path, corpus_paths=None, out_dir: str | Path = "drafter", *,
            layers: int = 2, hidden: int = 128, heads: int | None = None,
            intermediate: int | None = None, steps: int = 1000, seq_len: int = 256,
            batch_size: int = 8, lr: float = 2e-3, warmup: int = 50,
            temperature: float = 1.0, resume: bool = False, seed: int = 0,
            bf16="auto", init_embeddings: bool = True, ckpt_every: int = 100,
            eval_every: int = 0, held_windows: int = 32, max_minutes: float | None = None,
            stop_after: int | None = None, save_dtype: str = "float32",
            latency_context: int = 128, latency_tokens: int = 32,
            threads: int | None = None, measure: bool = True,
            show_progress: bool = True, log=print) -> dict:
    """Train a drafter for ``target`` on ``corpus_paths``; save it to ``out_dir``; report."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir = out_dir / ".distill"
    target_model = load_model(str(target))
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    train_w, held, info = _prepare(tokenizer, corpus_paths, seq_len, held_windows)
    sampler = corpus.WindowSampler(train_w, batch_size, seed)

    torch.manual_seed(seed)
    draft = LlamaForCausalLM(draft_config(target_model, tokenizer, layers, hidden, heads,
                                          intermediate))
    init = init_from_target(draft, target_model) if init_embeddings else "none"
    n_params = sum(p.numel() for p in draft.parameters())
    log(f"draft: {n_params / 1e6:.2f}M params ({layers} layers x {hidden}), init {init}; "
        f"{info['train_tokens']:,} train tokens, {steps} steps = "
        f"{sampler.epochs(steps):.2f} epochs")

    def step_loss(step: int) -> torch.Tensor:  # runs under the loop's autocast
        ids = sampler.batch(step)
        with torch.no_grad():
            t_logits = target_model(input_ids=ids).logits
        return kd_loss(draft(input_ids=ids).logits, t_logits, temperature)

    @torch.no_grad()
    def held_kl() -> float:
        total = 0.0
        for i in range(0, len(held), 8):
            ids = held[i:i + 8]
            total += float(kd_loss(draft(input_ids=ids).logits,
                                   target_model(input_ids=ids).logits)) * len(ids)
        return total / len(held)

    before = evaluate_alpha(target_model, draft, held)
    res = train(draft, step_loss, steps=steps, lr=lr, warmup=warmup, weight_decay=0.0,
                bf16=bf16, ckpt_dir=work_dir, ckpt_every=ckpt_every, resume=resume,
                seed=seed, eval_fn=held_kl, eval_every=eval_every, max_minutes=max_minutes,
                stop_after=stop_after, tokens_per_step=batch_size * seq_len, desc="distill",
                show_progress=show_progress, log=log)
    draft.generation_config = generation_config(tokenizer)
    files = save_model(draft, tokenizer, out_dir, save_dtype)
    report = {
        "target": str(target), "steps_done": res.step, "steps": steps,
        "finished": res.step >= steps, "start_step": res.start_step,
        "train_losses": res.losses, "held_out_kl_before": before["kl"],
        "alpha_greedy_before": before["alpha_greedy"], "held_out_curve": res.evals,
        "config": {"layers": layers, "hidden": hidden, "heads": draft.config.num_attention_heads,
                   "intermediate": draft.config.intermediate_size, "seq_len": seq_len,
                   "batch_size": batch_size, "lr": lr, "warmup": warmup,
                   "temperature": temperature, "seed": seed, "bf16": res.bf16,
                   "init": init},
        "draft_params": n_params, "data": info, "train_seconds_this_run": res.seconds,
        "tokens_per_second_this_run": (res.step - res.start_step) * batch_size * seq_len
        / max(res.seconds, 1e-9),
        "weights": files, "save_dtype": save_dtype,
    }
    if measure:
        saved = load_model(str(out_dir))  # measure what was saved, not what is in memory
        ev = evaluate_pair(target_model, saved, held, latency_context=latency_context,
                           latency_tokens=latency_tokens, threads=threads)
        report.update({"held_out_kl_after": ev["kl"], "evaluation": ev})
        log(format_table(ev))
    report["sha256"] = weights_sha256(out_dir)
    report["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    (out_dir / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    log(f"saved drafter to {out_dir}")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Distill a drafter from a target causal LM.")
    ap.add_argument("--target", required=True)
    ap.add_argument("--corpus", nargs="*", default=None,
                    help="files/directories (default: the stdlib training split)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--bf16", default="auto", choices=["auto", "on", "off"],
                    help="bf16 autocast (auto: only where it is faster than fp32 on this CPU)")
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--save-dtype", default="float32",
                    choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    distill(a.target, a.corpus, a.out, layers=a.layers, hidden=a.hidden, steps=a.steps,
            seq_len=a.seq_len, batch_size=a.batch_size, lr=a.lr, temperature=a.temperature,
            seed=a.seed, resume=a.resume, bf16=a.bf16, max_minutes=a.max_minutes,
            eval_every=a.eval_every, save_dtype=a.save_dtype, threads=a.threads or None,
            show_progress=not a.no_progress)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
