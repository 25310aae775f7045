"""The HF rows of `specmesh bench`: the target's own ``generate`` and transformers' assisted
generation, in process, on the same (target, draft) pair and prompts, greedy, one prompt after
another (concurrency 1: assisted generation supports batch size 1 only).

One loop, ``generate_set``, runs every setting (``HfSetting``):

* plain (``hf-plain``): ``target.generate(..., do_sample=False)``, no assistant;
* plain with a static cache (``hf-static``): the same with ``cache_implementation="static"``;
* assisted with a fixed k (``hf``): ``assistant_model=draft`` with the assistant's generation
  config set to ``num_assistant_tokens=k``, ``num_assistant_tokens_schedule="constant"`` and
  ``assistant_confidence_threshold=0`` (a threshold > 0 stops drafting early when the draft is
  unsure, so k would not be fixed), restored afterwards;
* assisted with HF's defaults (``hf-default``, k = 0): the draft's generation config as saved.
  transformers reads these three settings from the *assistant's* generation config, its
  defaults being 20, "constant" and 0.4; ``assistant_settings`` says which values apply.

Counted with forward hooks on both models: the target's forward passes (one per round: the
first one also prefills the prompt) and the draft's (one per drafted token). So rounds = target
passes, draft tokens = draft passes, and accepted draft tokens = completion tokens − rounds
(each round yields its accepted drafts plus one token of the target's; plain generate: one
token per pass, none accepted). TTFT is the time to the first ``streamer.put`` after the
prompt's.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule",
                    "assistant_confidence_threshold")


@dataclass(frozen=True)
class HfSetting:
    key: str  # the bench's mode key
    assistant: bool = False  # with the draft as assistant
    k: int = 0  # with the assistant: a fixed k; 0 = the assistant's config as saved
    static_cache: bool = False  # plain generate with cache_implementation="static"


@dataclass
class HfResult:
    records: list[dict]  # the keys of specmesh.bench_gateway.stream_one's, "chunks" aside
    wall_s: float  # the whole prompt set
    forward: dict  # {"target": {forward_passes, forward_ms}, "draft": {...} (assisted)}
    assistant: dict | None  # ASSISTANT_FIELDS as applied (assisted settings only)


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


def load_model(path: str, device: str = "cpu"):
    """A causal LM in fp32, eval mode, no gradients."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def set_fixed_k(draft, k: int) -> None:
    """Makes HF assisted generation draft exactly k tokens per round (a new config object: the
    old one is left as it was)."""
    config = copy.deepcopy(draft.generation_config)
    config.num_assistant_tokens = k
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    draft.generation_config = config


def assistant_settings(config) -> dict:
    """ASSISTANT_FIELDS as assisted generation applies them: the assistant config's own values,
    else transformers' global defaults (which it fills in the same way)."""
    defaults_of = getattr(config, "_get_default_generation_params", None)
    defaults = defaults_of() if callable(defaults_of) else {}
    return {f: getattr(config, f, None) if getattr(config, f, None) is not None
            else defaults.get(f) for f in ASSISTANT_FIELDS}


@contextlib.contextmanager
def _quiet_threads(threads: int) -> Iterator[None]:
    """torch threads set (0: left as they are), transformers' per-call warnings and progress
    bars off; all restored afterwards."""
    import torch
    from transformers.utils import logging as hf_logging

    old_threads, old_verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    if threads > 0:
        torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()  # no pad-token or generation-flag warnings per call
    hf_logging.disable_progress_bar()  # no "Loading weights" bars under bench's own progress
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        hf_logging.set_verbosity(old_verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def generate_set(target, tok, prompts: list[str], *, draft=None, max_new_tokens: int,
                 device: str = "cpu", warmup: bool = True, static_cache: bool = False,
                 temperature: float = 0.0,
                 progress: Callable[[], None] | None = None) -> HfResult:
    """Every prompt once, one after another, greedy (or sampled at ``temperature`` > 0):
    plain generate without ``draft`` (with a static KV cache if ``static_cache``), assisted
    generation with it (under the draft's generation config as it is now)."""
    import torch

    if static_cache and draft is not None:
        raise ValueError("a static cache is measured for plain generate only")
    eos = target.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (
        eos[0] if isinstance(eos, list) else eos)
    extra = ({"assistant_model": draft} if draft is not None
             else {"cache_implementation": "static"} if static_cache else {})
    extra |= ({"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0
              else {"do_sample": False})

    def generate(prompt: str, n: int, clock=None):
        enc = tok(prompt, return_tensors="pt").to(device)
        with torch.inference_mode():
            out = target.generate(**enc, **extra, max_new_tokens=n,
                                  pad_token_id=pad, streamer=clock)
        return enc["input_ids"].shape[1], out[0].tolist()

    if warmup and prompts:
        generate(prompts[0], min(8, max_new_tokens))
    meters = {"target": ForwardMeter()} | ({"draft": ForwardMeter()} if draft is not None else {})
    hooks = meters["target"].attach(target) + (meters["draft"].attach(draft) if draft is not None
                                            else [])
    records = []
    try:
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            rounds0 = meters["target"].passes
            drafts0 = meters["draft"].passes if draft is not None else 0
            clock = _FirstTokenClock()
            t0 = time.perf_counter()
            n_prompt, ids = generate(prompt, max_new_tokens, clock)
            latency = time.perf_counter() - t0
            tokens = ids[n_prompt:]
            rounds = meters["target"].passes - rounds0
            drafted = meters["draft"].passes - drafts0 if draft is not None else 0
            records.append({
                "prompt_index": i, "token_ids": tokens, "completion_tokens": len(tokens),
                "rounds": rounds, "draft_tokens": drafted,
                "accepted_draft_tokens": max(0, len(tokens) - rounds) if draft is not None else 0,
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
    return HfResult(records, wall, forward,
                    assistant_settings(draft.generation_config) if draft is not None else None)


def run_hf(target_path: str, draft_path: str | None, prompts: list[str],
           settings: list[HfSetting], *, max_new_tokens: int, threads: int,
           device: str = "cpu", seed: int | None = None, temperature: float = 0.0,
           warmup: bool = True,
           progress: Callable[[HfSetting], Callable[[], None] | None] | None = None
           ) -> dict[str, HfResult]:
    """Each setting's run of the prompt set, in order, with the models loaded once (the draft
    only when a setting needs it) and ``threads`` torch threads (0: torch's default).
    ``progress(setting)`` returns the advance() of that setting's run."""
    import torch
    from transformers import AutoTokenizer

    results = {}
    with _quiet_threads(threads):
        target = load_model(target_path, device)
        tok = AutoTokenizer.from_pretrained(target_path)
        draft = (load_model(draft_path, device)
                 if draft_path and any(s.assistant for s in settings) else None)
        for s in settings:
            if s.assistant and draft is None:
                raise ValueError(f"{s.key}: assisted generation needs a draft model")
            saved = draft.generation_config if draft is not None else None
            if s.assistant and s.k:
                set_fixed_k(draft, s.k)
            try:
                torch.manual_seed(0 if seed is None else seed)
                results[s.key] = generate_set(
                    target, tok, prompts, draft=draft if s.assistant else None,
                    max_new_tokens=max_new_tokens, device=device, warmup=warmup,
                    static_cache=s.static_cache, temperature=temperature,
                    progress=progress(s) if progress else None)
            finally:
                if draft is not None:
                    draft.generation_config = saved
    return results
