"""Measure a (draft, target) pair: acceptance α and per-token forward latency.

α is measured with teacher forcing on held-out text: both models see the same real prefix at
every position of held-out windows, and we compare their next-token distributions p (target)
and q (draft):

* **α greedy** = fraction of positions where ``argmax q == argmax p`` (the probability that
  greedy speculative decoding accepts the draft token at a position);
* **α at temperature 1** = mean over positions of ``Σ_x min(p(x), q(x))`` — the exact
  expected acceptance probability of a draft token sampled from q under the lossless
  speculative-sampling rule (Leviathan et al. 2023, §3), computed without sampling noise.

**Latency** is the mean wall time of one KV-cached single-token forward (decode step) after a
prefill of ``context`` tokens, fp32, ``threads`` torch threads (the same for both models), after
a few warm-up steps.

``python -m training.evaluate --target T --draft D`` prints both (default text: the held-out
standard-library files, see ``training.corpus``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from training import corpus
from training.demo import weights_sha256

__all__ = ["acceptance_from_logits", "evaluate_alpha", "measure_latency", "held_out_windows",
           "evaluate_pair", "main"]


def acceptance_from_logits(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                           mask: torch.Tensor | None = None) -> dict:
    """Sums over positions (not means): greedy matches, Σ min(p, q), KL(p||q), count."""
    t = target_logits.float().reshape(-1, target_logits.shape[-1])
    d = draft_logits.float().reshape(-1, draft_logits.shape[-1])
    if t.shape != d.shape:
        raise ValueError(f"logit shapes differ: target {tuple(t.shape)}, draft {tuple(d.shape)}")
    if mask is not None:
        keep = mask.reshape(-1).bool()
        t, d = t[keep], d[keep]
    logp, logq = torch.log_softmax(t, -1), torch.log_softmax(d, -1)
    p, q = logp.exp(), logq.exp()
    return {
        "greedy": float((t.argmax(-1) == d.argmax(-1)).sum()),
        "t1": float(torch.minimum(p, q).sum(-1).clamp(max=1.0).sum()),
        "kl": float((p * (logp - logq)).sum(-1).sum()),
        "n": int(t.shape[0]),
    }


@torch.inference_mode()
def evaluate_alpha(target, draft, windows: torch.Tensor, batch_size: int = 8) -> dict:
    """α greedy, α at temperature 1 and mean KL(target||draft) over every window position."""
    target.eval()
    draft.eval()
    tot = {"greedy": 0.0, "t1": 0.0, "kl": 0.0, "n": 0}
    for i in range(0, len(windows), batch_size):
        ids = windows[i:i + batch_size]
        s = acceptance_from_logits(target(input_ids=ids).logits, draft(input_ids=ids).logits)
        for k in tot:
            tot[k] += s[k]
    n = max(1, tot["n"])
    return {"alpha_greedy": tot["greedy"] / n, "alpha_t1": tot["t1"] / n,
            "kl": tot["kl"] / n, "positions": tot["n"]}


@torch.inference_mode()
def measure_latency(model, context: int = 128, tokens: int = 32, warmup: int = 4,
                    threads: int | None = None, vocab_size: int | None = None,
                    seed: int = 0) -> dict:
    """Mean/median ms of one KV-cached single-token forward after a ``context``-token prefill."""
    from transformers import DynamicCache

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        model.eval()
        vocab = vocab_size or model.get_output_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, vocab, (1, context), generator=gen)
        steps = torch.randint(3, vocab, (warmup + tokens,), generator=gen)
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        times = []
        for i, tok in enumerate(steps.tolist()):
            pos = torch.tensor([[context + i]])
            t0 = time.perf_counter()
            model(input_ids=torch.tensor([[tok]]), past_key_values=cache, position_ids=pos,
                  use_cache=True)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1000)
    finally:
        torch.set_num_threads(old_threads)
    return {"mean_ms": statistics.fmean(times), "median_ms": statistics.median(times),
            "context": context, "tokens": tokens, "threads": threads or old_threads}


def held_out_windows(tokenizer, files=None, seq_len: int = 256,
                     max_windows: int | None = 64) -> torch.Tensor:
    """Windows of held-out text (default: the held-out stdlib files)."""
    files = corpus.held_out_files() if files is None else files
    stream = corpus.token_stream(tokenizer, files)
    w = corpus.make_windows(stream, seq_len)
    if max_windows is not None:
        w = w[:max_windows]
    return torch.from_numpy(w.astype("int64"))


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def evaluate_pair(target, draft, windows: torch.Tensor, *, batch_size: int = 8,
                  latency_context: int = 128, latency_tokens: int = 32,
                  threads: int | None = None) -> dict:
    """α figures plus per-token latencies of both models (same thread count)."""
    res = evaluate_alpha(target, draft, windows, batch_size)
    lt = measure_latency(target, latency_context, latency_tokens, threads=threads)
    ld = measure_latency(draft, latency_context, latency_tokens, threads=threads)
    res.update({
        "target_ms_per_token": lt["mean_ms"], "draft_ms_per_token": ld["mean_ms"],
        "latency_ratio": ld["mean_ms"] / lt["mean_ms"],
        "latency_context": latency_context, "latency_threads": lt["threads"],
        "target_params": count_params(target), "draft_params": count_params(draft),
        "eval_windows": int(windows.shape[0]), "eval_seq_len": int(windows.shape[1]),
    })
    return res


def format_table(res: dict) -> str:
    rows = [
        ("α greedy", f"{res['alpha_greedy']:.4f}"),
        ("α temperature 1 (E[Σ min(p,q)])", f"{res['alpha_t1']:.4f}"),
        ("KL(target || draft), nats/token", f"{res['kl']:.4f}"),
        ("positions", f"{res['positions']}"),
        ("target ms / token", f"{res['target_ms_per_token']:.3f}"),
        ("draft ms / token", f"{res['draft_ms_per_token']:.3f}"),
        ("draft / target time", f"{res['latency_ratio']:.3f}"),
        ("params target / draft", f"{res['target_params']:,} / {res['draft_params']:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    model.requires_grad_(False)
    return model


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description="Measure α and per-token latency of a draft/target "
                                             "pair on held-out text.")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--files", nargs="*", default=None,
                    help="held-out files/directories (default: held-out stdlib files)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--latency-context", type=int, default=128)
    ap.add_argument("--latency-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    tok_t = AutoTokenizer.from_pretrained(args.target)
    tok_d = AutoTokenizer.from_pretrained(args.draft)
    if tok_t.get_vocab() != tok_d.get_vocab():
        raise SystemExit("error: draft and target do not share a vocabulary")
    files = None
    if args.files:
        files = [f for f, _ in corpus.expand_paths(args.files)]
    windows = held_out_windows(tok_t, files, args.seq_len, args.max_windows)
    res = evaluate_pair(load_model(args.target), load_model(args.draft), windows,
                        batch_size=args.batch_size, latency_context=args.latency_context,
                        latency_tokens=args.latency_tokens, threads=args.threads or None)
    print(format_table(res))
    for role, path in (("target", args.target), ("draft", args.draft)):
        if Path(path).is_dir():  # which weights the figures belong to
            res[f"{role}_sha256"] = weights_sha256(Path(path))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
