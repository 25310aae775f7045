"""Runs a causal LM's forward passes on one worker thread, micro-batched, with a bounded queue.

Both the drafter and the verifier use it: model calls never block the event loop, never
run concurrently on one model, and a full queue answers RESOURCE_EXHAUSTED at once instead
of growing without bound. Calls that arrive while the model is busy wait in the queue and
join the running batch at its next step, up to ``max_batch`` of them in one forward pass
(services/batching.py; continuous batching): under load each pass serves many sessions at
once, and a call that needs several steps (a drafter's k tokens) neither holds back calls
that arrive after it nor waits for the calls it started with.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from services.batching import StepJob, run_step
from services.errors import InvalidArgument, Overloaded
from services.kv_cache import SessionCache
from services.messages import CacheDelta, ReplicaStats, check_token_ids
from services.models import ModelMeta
from services.plain_threads import PlainThreads

MAX_PASSES = 64  # passes the model thread runs before it hands back to the event loop


class SoloJob:
    """Work that runs alone on the model thread (not micro-batched with other calls), e.g.
    the drafter's tree of branches, whose passes already hold many tokens each."""

    def __init__(self, run: Callable[[Any, torch.device], Any], passes: int) -> None:
        self.run = run  # (model, device) -> result
        self.passes = passes  # forward passes it makes, for the stats


def _capturing(fn, *args) -> tuple[Any, Exception | None]:
    """(fn(*args), None), or (None, the exception it raised): a job's failure comes back as a
    value, as run_steps reports a batched job's, never through the executor's future."""
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - reported to the job's caller by _fail
        return None, exc


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    """Fails a job's future with ``exc``. An asyncio future refuses a StopIteration (e.g.
    ``next()`` on an empty iterator in model code): it is carried as a RuntimeError, where it
    would otherwise raise in the runner and fail every call waiting behind it."""
    if isinstance(exc, StopIteration):
        wrapped = RuntimeError(f"the model thread's job raised StopIteration: {exc!r}")
        wrapped.__cause__ = exc
        exc = wrapped
    if not future.done():
        future.set_exception(exc)


@dataclass
class _Active:
    """A step job in the running batch, with what its caller is told: the compute of the
    passes it took part in and the largest batch it ran in."""

    job: StepJob
    future: asyncio.Future
    compute_ms: float = 0.0
    batch: int = 0


class ModelRunner:
    def __init__(self, model: torch.nn.Module, meta: ModelMeta, device: torch.device,
                 max_queue: int, max_batch: int, prefill_threads: int = 0,
                 plain: PlainThreads | None = None) -> None:
        """``prefill_threads``: torch threads for a pass that feeds a prompt
        (services/batching.py ``run_step``); 0: the process's own. ``plain``: a verifier's
        choice of threads for its passes without drafts (services/plain_threads.py)."""
        self.model = model
        self.meta = meta
        self.device = device
        self.stats = ReplicaStats()  # the engine's counters; forward_* are kept here
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._prefill_threads = prefill_threads
        self.plain = plain
        # a verifier's own draft model, which drafts before a step for the jobs that may
        # take drafts (verifier_svc/local_drafts.py ``LocalDrafter.prepare``); None: none
        self.drafter: Any = None
        self._pending = 0
        self._waiting: list[tuple[StepJob, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        # when the model thread's current pass began (None: it runs none): a stall watch
        # reads it (services/stall_watch.py)
        self.pass_started: float | None = None

    @property
    def queue_depth(self) -> int:
        return self._pending

    def new_kv(self) -> Any:
        """An empty KV cache: the model's own kind (the lean forward's is written in place),
        else transformers' DynamicCache."""
        own = getattr(self.model, "new_cache", None)
        if own is not None:
            return own()
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    async def submit(self, job: StepJob | SoloJob) -> tuple[Any, float, int]:
        """Runs ``job`` (a step job joins the running batch at its next step); returns (its
        result, the compute milliseconds of the passes it took part in, the largest batch it
        ran in). Errors of the job are raised here."""
        return await self.submit_many([job])[0]

    def submit_many(self, jobs: Sequence[StepJob | SoloJob]) -> list[asyncio.Future]:
        """Queues ``jobs`` together (step jobs join the same next step); per job a future of
        what ``submit`` returns, or of its error: Overloaded for each job past a full queue.
        Cancelling a job's future takes it out of the batch."""
        loop = asyncio.get_running_loop()
        futures = []
        for job in jobs:
            future = loop.create_future()
            futures.append(future)
            if self._pending >= self._max_queue:
                future.set_exception(Overloaded(
                    f"model queue is full ({self._max_queue} calls waiting): retry later"))
                continue
            self._pending += 1
            future.add_done_callback(self._leave)
            self._waiting.append((job, future))
        if self._waiting and self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        return futures

    def _leave(self, _: asyncio.Future) -> None:
        self._pending -= 1

    async def _drain(self) -> None:
        """Continuous batching: each pass is one step of every active job; between passes
        jobs that are done leave (their callers are answered at once) and queued ones join,
        up to ``max_batch``. A solo job at the head of the queue runs alone between steps."""
        loop = asyncio.get_running_loop()
        active: list[_Active] = []
        try:
            while self._waiting or active:
                if self._waiting and isinstance(self._waiting[0][0], SoloJob):
                    await self._run_solo(*self._waiting.pop(0))
                    continue
                while (self._waiting and len(active) < self._max_batch
                       and not isinstance(self._waiting[0][0], SoloJob)):
                    job, fut = self._waiting.pop(0)
                    if not fut.done():  # not cancelled while it waited
                        active.append(_Active(job, fut))
                if not active:
                    continue
                passes = await loop.run_in_executor(self._executor, self._passes, active)
                # every job took part in every pass, and only the last can have ended one
                # (``_passes``): each is settled once, with all of their compute
                ms = sum(pass_ms for _, pass_ms in passes)
                errors = passes[-1][0]
                self.stats.forward_ms += ms
                self.stats.forward_passes += len(passes)
                active = [a for a, error in zip(active, errors, strict=True)
                          if not self._settle(a, error, ms, len(active))]
        except BaseException as exc:  # the model thread is gone (shutdown): fail every waiter
            for fut in [a.future for a in active] + [fut for _, fut in self._waiting]:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else
                                      RuntimeError("the model runner stopped"))
            self._waiting.clear()
            raise
        finally:
            self._drainer = None

    def _passes(self, active: list[_Active]) -> list[tuple[list[BaseException | None], float]]:
        """On the model thread: passes over ``active`` (run_step), one after another while
        none of its jobs is done or failed, none was cancelled and no call waits to join,
        at most MAX_PASSES; each pass's (errors, ms). A job of several steps (a drafter's k
        tokens, a verifier's plain tokens) so goes on without handing each pass back to the
        event loop and the next one to this thread: two thread switches a pass, which the
        loop's other work (answers, new calls) delays. The flags read here are the event
        loop's (a list's length, a future's state): a stale one costs at most one pass."""
        jobs = [a.job for a in active]
        out = []
        try:
            while True:
                self.pass_started = time.monotonic()
                errors, ms = run_step(self.model, jobs, self.device, self.new_kv,
                                      self._prefill_threads, self.plain, self.drafter)
                out.append((errors, ms))
                if (len(out) >= MAX_PASSES or self._waiting or any(e is not None for e in errors)
                        or any(j.done for j in jobs) or any(a.future.done() for a in active)):
                    return out
        finally:
            self.pass_started = None

    def _solo(self, job: SoloJob) -> tuple[Any, Exception | None]:
        """On the model thread: a solo job, timed as one pass (``pass_started``)."""
        self.pass_started = time.monotonic()
        try:
            return _capturing(job.run, self.model, self.device)
        finally:
            self.pass_started = None

    def _settle(self, a: _Active, error: BaseException | None, ms: float, batch: int) -> bool:
        """Accounts a run of passes (``ms``, their compute together) to an active job; True
        when it leaves the batch (done, failed, or its caller went away: a cancelled call's
        cache was dropped by its checkout)."""
        a.compute_ms += ms
        a.batch = max(a.batch, batch)
        if error is not None:
            _fail(a.future, error)
            return True
        if a.future.done():
            return True
        if not a.job.done:
            return False
        if a.batch > 1:
            self.stats.batched_calls += 1
        a.future.set_result((a.job.result(), a.compute_ms, a.batch))
        return True

    async def _run_solo(self, job: SoloJob, future: asyncio.Future) -> None:
        if future.done():  # cancelled while it waited
            return
        start = time.perf_counter()
        try:
            result, error = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._solo, job)
        except Exception as exc:  # noqa: BLE001 - the executor could not run it (shut down)
            result, error = None, exc
        if error is not None:
            _fail(future, error)
            return
        ms = (time.perf_counter() - start) * 1000.0
        self.stats.forward_ms += ms
        self.stats.forward_passes += job.passes
        if not future.done():
            future.set_result((result, ms, 1))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


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

    def __init__(self, runner: ModelRunner, caches, max_draft_tokens: int,
                 prefill_chunk: int = 0) -> None:
        """``prefill_chunk``: tokens of a long prompt fed per forward pass (0: all in one)."""
        self.runner = runner
        self.caches = caches
        self.max_draft_tokens = max_draft_tokens
        self.prefill_chunk = prefill_chunk
        self.stats = runner.stats

    @property
    def meta(self) -> ModelMeta:
        return self.runner.meta

    @property
    def queue_depth(self) -> int:
        return self.runner.queue_depth

    def close(self) -> None:
        self.runner.close()

    def checked_out(self, delta: CacheDelta, job: Callable[[SessionCache, list[int]], Any]
                    ) -> tuple[AbstractContextManager, Any]:
        """Checks out ``delta``'s session cache and makes its job from (the entry, the tokens
        still to feed): (the checkout, entered, to exit once the job is done, the job)."""
        checkout = self.caches.checkout(delta.session_id, delta.base_len, delta.base_hash,
                                        delta.new_tokens)
        entry = checkout.__enter__()
        try:
            return checkout, job(entry, entry.unfed(delta.base_len, delta.new_tokens))
        except BaseException as exc:
            checkout.__exit__(type(exc), exc, exc.__traceback__)
            raise

    async def run_one(self, call: Any, begin: Callable[[Any], tuple[AbstractContextManager, Any]],
                      finish: Callable[[Any, Any, tuple[Any, float, int]], Any]) -> Any:
        """``run_many`` of one call: its result, or its error raised."""
        outcome, = await self.run_many([call], begin, finish)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def release(self, session_id: str) -> bool:
        """Frees the session's cache (Release); False when none is held at rest."""
        return self.caches.release(session_id)

    async def run_many(self, calls: Sequence[Any],
                       begin: Callable[[Any], tuple[AbstractContextManager, Any]],
                       finish: Callable[[Any, Any, tuple[Any, float, int]], Any],
                       adopt: Callable[[Any], tuple[AbstractContextManager, Any,
                                                    asyncio.Future] | None] | None = None
                       ) -> list:
        """Each call's result, or the error it alone fails with. ``begin(call)`` validates it
        and checks out its session: (the checkout, its job), or raises. The jobs of the calls
        that began are queued together (ModelRunner.submit_many: they share the next step),
        with no task per call; once a job is done its checkout is exited and
        ``finish(call, job, (its result, compute ms, batch))`` makes the call's result. A job
        that failed exits its checkout with the error (the session's cache is dropped); so
        does every job when the caller is cancelled. ``adopt(call)``: the checkout, job and
        future of a job already submitted that serves the call (a verifier's decode-ahead),
        or None to begin one."""
        outcomes: list = [None] * len(calls)
        started: list[tuple[int, AbstractContextManager, Any]] = []
        adopted: dict[int, asyncio.Future] = {}  # index in started -> its running job's future
        for i, call in enumerate(calls):
            self.stats.calls += 1
            try:
                taken = adopt(call) if adopt is not None else None
                if taken is not None:
                    adopted[len(started)] = taken[2]
                    started.append((i, taken[0], taken[1]))
                else:
                    started.append((i, *begin(call)))
            except Exception as exc:  # noqa: BLE001 - this call's own answer
                outcomes[i] = exc
        fresh = iter(self.runner.submit_many(
            [job for n, (_, _, job) in enumerate(started) if n not in adopted]))
        futures = [adopted[n] if n in adopted else next(fresh) for n in range(len(started))]
        try:
            answers = await asyncio.gather(*futures, return_exceptions=True)
        except BaseException as exc:  # cancelled: each checkout drops its half-written cache
            for _, checkout, _ in started:
                checkout.__exit__(type(exc), exc, exc.__traceback__)
            raise
        for (i, checkout, job), answer in zip(started, answers, strict=True):
            if isinstance(answer, BaseException):
                checkout.__exit__(type(answer), answer, answer.__traceback__)
                outcomes[i] = answer
                continue
            checkout.__exit__(None, None, None)
            outcomes[i] = finish(calls[i], job, answer)
        return outcomes


def check_num_tokens(num_tokens: int, limit: int) -> None:
    if not 1 <= num_tokens <= limit:
        raise InvalidArgument(f"num_tokens must be in 1..{limit}, got {num_tokens}")
