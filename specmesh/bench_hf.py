"""The HF baseline of `specmesh bench`: transformers' own assisted generation, in process, on
the same (target, draft) pair, greedy, with the same fixed k.

``target.generate(..., assistant_model=draft, do_sample=False)`` with the assistant's
generation config set to ``num_assistant_tokens=k``, ``num_assistant_tokens_schedule="constant"``
and ``assistant_confidence_threshold=0`` (transformers' defaults are 20, "constant" and 0.4: a
threshold > 0 stops drafting early when the draft is unsure, so k would not be fixed).
Assisted generation supports batch size 1 only, so prompts run one after another
(concurrency 1).

Counted with forward hooks on both models: the target's forward passes (one per round: the
first one also prefills the prompt) and the draft's (one per drafted token). So rounds = target
passes, draft tokens = draft passes, and accepted draft tokens = completion tokens − rounds
(each round yields its accepted drafts plus one token of the target's). TTFT is the time to the
first ``streamer.put`` after the prompt's.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ForwardMeter:
    """Forward passes of a module and their total wall time (ms), from forward hooks."""

    passes: int = 0
    forward_ms: float = 0.0
    _start: float = 0.0

    def attach(self, module) -> list:
        def before(*_):
            self._start = time.perf_counter()

        def after(*_):
            self.passes += 1
            self.forward_ms += (time.perf_counter() - self._start) * 1000

        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


class _FirstTokenClock:
    """A generate() streamer that notes when the first generated tokens arrive (the first
    put() is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def load_pair(target_path: str, draft_path: str, device: str = "cpu"):
    """(target, draft, tokenizer) in fp32, eval mode, the tokenizer the target's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    models = []
    for path in (target_path, draft_path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        model.eval()
        model.requires_grad_(False)
        models.append(model)
    return models[0], models[1], AutoTokenizer.from_pretrained(target_path)


def set_fixed_k(draft, k: int) -> None:
    """Makes HF assisted generation draft exactly k tokens per round."""
    config = copy.deepcopy(draft.generation_config)
    config.num_assistant_tokens = k
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    draft.generation_config = config


def run_assisted(target_path: str, draft_path: str, prompts: list[str], *, k: int,
                 max_new_tokens: int, threads: int, device: str = "cpu", seed: int = 0,
                 warmup: bool = True, progress: Callable[[], None] | None = None
                 ) -> tuple[list[dict], float, dict]:
    """Runs every prompt once, one after another. Returns (records, wall seconds of the whole
    set, {"target": {passes, forward_ms}, "draft": {...}}); a record has the keys of
    specmesh.bench.stream_one's, "chunks" aside."""
    import torch
    from transformers.utils import logging as hf_logging

    old_threads = torch.get_num_threads()
    old_verbosity = hf_logging.get_verbosity()
    if threads > 0:
        torch.set_num_threads(threads)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # no pad-token or generation-flag warnings per call
    hf_logging.disable_progress_bar()  # no "Loading weights" bars under bench's own progress
    try:
        torch.manual_seed(seed)
        target, draft, tok = load_pair(target_path, draft_path, device)
        set_fixed_k(draft, k)
        eos = target.generation_config.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else (
            eos[0] if isinstance(eos, list) else eos)

        def generate(prompt: str, n: int, clock=None):
            enc = tok(prompt, return_tensors="pt").to(device)
            with torch.inference_mode():
                out = target.generate(**enc, assistant_model=draft, do_sample=False,
                                      max_new_tokens=n, pad_token_id=pad, streamer=clock)
            return enc["input_ids"].shape[1], out[0].tolist()

        if warmup and prompts:
            generate(prompts[0], min(8, max_new_tokens))
        meters = {"target": ForwardMeter(), "draft": ForwardMeter()}
        hooks = meters["target"].attach(target) + meters["draft"].attach(draft)
        records = []
        try:
            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                rounds0, drafts0 = meters["target"].passes, meters["draft"].passes
                clock = _FirstTokenClock()
                t0 = time.perf_counter()
                n_prompt, ids = generate(prompt, max_new_tokens, clock)
                latency = time.perf_counter() - t0
                tokens = ids[n_prompt:]
                rounds = meters["target"].passes - rounds0
                records.append({
                    "prompt_index": i, "token_ids": tokens, "completion_tokens": len(tokens),
                    "rounds": rounds, "draft_tokens": meters["draft"].passes - drafts0,
                    "accepted_draft_tokens": max(0, len(tokens) - rounds),
                    "ttft_s": (clock.first_token_at - t0) if clock.first_token_at else None,
                    "latency_s": latency, "error": ""})
                if progress:
                    progress()
            wall = time.perf_counter() - start
        finally:
            for h in hooks:
                h.remove()
        forward = {name: {"forward_passes": m.passes, "forward_ms": m.forward_ms}
                   for name, m in meters.items()}
        return records, wall, forward
    finally:
        torch.set_num_threads(old_threads)
        hf_logging.set_verbosity(old_verbosity)
        if bars:
            hf_logging.enable_progress_bar()
