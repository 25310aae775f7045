"""Runs a causal LM's forward passes on one worker thread, with a bounded queue.

Both the drafter and the verifier use it: model calls never block the event
loop, never run concurrently on one model, and a full queue answers
RESOURCE_EXHAUSTED at once instead of growing without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from services.errors import InvalidArgument, Overloaded
from services.messages import check_token_ids
from services.models import ModelMeta

T = TypeVar("T")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, meta: ModelMeta, device: torch.device,
                 max_queue: int) -> None:
        self.model = model
        self.meta = meta
        self.device = device
        self._max_queue = max_queue
        self._pending = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    @property
    def queue_depth(self) -> int:
        return self._pending

    def new_kv(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    async def run(self, fn: Callable[[], T]) -> tuple[T, float]:
        """Runs ``fn`` on the model thread; returns (result, compute milliseconds)."""
        if self._pending >= self._max_queue:
            raise Overloaded(f"model queue is full ({self._max_queue} calls waiting): retry later")
        self._pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, _timed, fn)
        finally:
            self._pending -= 1

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], kv: Any, start: int, keep: int) -> torch.Tensor:
        """Appends ``tokens`` at positions start.. to ``kv``; returns the last ``keep`` logits.

        tokens: [m] -> logits [keep, V] float32 on the CPU.
        """
        input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, m]
        positions = torch.arange(start, start + len(tokens), device=self.device)[None]  # [1, m]
        out = self.model(input_ids=input_ids, position_ids=positions, past_key_values=kv,
                         use_cache=True, logits_to_keep=keep)
        return out.logits[0, -keep:].float().cpu()  # [keep, V]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1000.0


def check_delta(meta: ModelMeta, session_id: str, base_len: int, new_tokens: Sequence[int],
                extra: int) -> None:
    """Validates a cache delta before any cache is touched; ``extra`` = tokens appended after it."""
    if not 1 <= len(session_id) <= 128 or not session_id.isprintable():
        raise InvalidArgument("session_id must be 1..128 printable characters")
    if base_len < 0:
        raise InvalidArgument(f"base_len must be >= 0, got {base_len}")
    if not new_tokens:
        raise InvalidArgument(
            "new_tokens is empty: send at least the last committed token (its distribution "
            "is what the next token is drawn from)")
    check_token_ids(new_tokens, meta.vocab_size, "new_tokens")
    total = base_len + len(new_tokens) + extra
    if total > meta.max_context:
        raise InvalidArgument(
            f"sequence of {total} tokens exceeds the model's context of {meta.max_context}: "
            "shorten the prompt or max_new_tokens")


class ModelEngine:
    """What a drafter or verifier engine built on a ModelRunner shares."""

    kind = "model"

    def __init__(self, runner: ModelRunner, caches, max_draft_tokens: int) -> None:
        from services.messages import ReplicaStats

        self.runner = runner
        self.caches = caches
        self.max_draft_tokens = max_draft_tokens
        self.stats = ReplicaStats()

    @property
    def meta(self) -> ModelMeta:
        return self.runner.meta

    @property
    def queue_depth(self) -> int:
        return self.runner.queue_depth

    def close(self) -> None:
        self.runner.close()


def check_num_tokens(num_tokens: int, limit: int) -> None:
    if not 1 <= num_tokens <= limit:
        raise InvalidArgument(f"num_tokens must be in 1..{limit}, got {num_tokens}")
