"""Micro-batching: one forward pass for the calls of several sessions.

Each session keeps its own KV cache (batch 1, ``start`` positions). The lean forward
(services/lean_llama.py) runs such a batch as one ragged pass: the projections over all the
rows' new tokens at once, attention over each row's own cache in place (many rows in one
call where their caches are pool slots: services/ragged_attention.py). For any other model
(transformers' forward) the caches of a pass over B sessions are left-padded to the longest
one and stacked, the new tokens are right-padded, and a 2-D attention mask hides both
paddings:

    row b:  [ 0 … 0 | past_b (L_b) | new_b (m_b) | 0 … 0 ]
             L_max-L_b               L_max        m_max-m_b

Keys carry their rotary position already, so moving them along the sequence axis changes
nothing; queries get their true positions through ``position_ids``. Each real query sees
exactly its own past and the new tokens before it, so a row's logits are those of the
same call run alone (up to float summation order). After the pass each session's cache
gets its own new keys and values appended.

A call is a :class:`StepJob`: it feeds tokens, gets their logits, and says what to feed
next (the verifier: one step; the drafter: k steps). :func:`run_step` advances a batch of
jobs by one pass; jobs that fail are reported, the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from services.plain_threads import PlainThreads


@dataclass
class Row:
    tokens: Sequence[int]  # [m] tokens to append
    kv: Any  # the session's KV cache (DynamicCache or SlabCache), ``start`` positions
    start: int
    keep: int  # logits wanted for the last ``keep`` new tokens
    # the chained hashes of the prefix-cache blocks the cache begins with, and the tokens
    # they cover (services/kv_cache.py SessionCache.hashes / .published): rows whose caches
    # begin with the same blocks attend to them once (``shared_prefixes``)
    chain: Sequence[int] = ()
    chain_tokens: int = 0


SHARED_MIN_TOKENS = 128  # a shared prefix shorter than this is attended per row as before


def shared_prefixes(rows: Sequence[Row], min_tokens: int = SHARED_MIN_TOKENS
                    ) -> list[tuple[list[int], int]]:
    """Groups of two or more rows whose caches begin with the same ``P >= min_tokens``
    positions, as (row indices, P): those rows' caches hold the same keys and values there
    (copies of the same prefix-cache blocks, or computed from the same tokens), which the
    lean forward reads once for the whole group (cascade attention). Rows are grouped by
    their first block, and a group's P is the deepest block all of its rows share (a
    block's hash covers every block before it), at most each row's cached length."""
    by_first: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if r.chain and r.chain_tokens >= min_tokens:
            by_first.setdefault(r.chain[0], []).append(i)
    groups = []
    for idx in by_first.values():
        if len(idx) < 2:
            continue
        lo, hi = 1, min(len(rows[i].chain) for i in idx)
        while lo < hi:  # the deepest depth at which every row's block hash is the same
            mid = (lo + hi + 1) // 2
            if len({rows[i].chain[mid - 1] for i in idx}) == 1:
                lo = mid
            else:
                hi = mid - 1
        first = rows[idx[0]]
        shared = min(lo * (first.chain_tokens // len(first.chain)),
                     *(rows[i].start for i in idx))
        if shared >= min_tokens:
            groups.append((idx, shared))
    return groups


@torch.inference_mode()
def forward_one(model, row: Row, device: torch.device) -> torch.Tensor:
    """One session, no padding: logits [keep, V] float32 on the CPU."""
    m = len(row.tokens)
    input_ids = torch.tensor([list(row.tokens)], dtype=torch.long, device=device)  # [1, m]
    positions = torch.arange(row.start, row.start + m, device=device)[None]  # [1, m]
    out = model(input_ids=input_ids, position_ids=positions, past_key_values=row.kv,
                use_cache=True, logits_to_keep=row.keep)
    return out.logits[0, -row.keep:].float().cpu()  # [keep, V]


def forward_row(model, row: Row, device: torch.device) -> torch.Tensor:
    """One session's pass as ``forward_rows`` runs a pass of one row: logits [keep, V]."""
    return forward_rows(model, [row], device, _one_row)[0]


def _one_row():
    raise AssertionError("a pass of one row builds no batch cache")


def _layer_kv(kv, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if layer >= len(kv.layers):
        return None, None
    lay = kv.layers[layer]
    if not lay.is_initialized or lay.keys is None or lay.keys.numel() == 0:
        return None, None
    return lay.keys, lay.values  # [1, H, L, D]


@torch.inference_mode()
def forward_rows(model, rows: Sequence[Row], device: torch.device,
                 new_cache: Callable[[], Any]) -> list[torch.Tensor]:
    """One forward pass over ``rows`` (B sessions); returns per row logits [keep_b, V].

    Appends each row's tokens to its own cache, as ``forward_one`` would. On a CPU the lean
    forward's ragged pass runs one row too: its fused rotary and cache writes and the pooled
    attention kernel made a one-session decode pass of the demo target 13-18% shorter than
    its dense ``forward`` (2.32-2.51 against 2.84-2.87 ms), a 4-token verify 11-13%, the demo
    drafter's 9% (docs/performance.md), and a session's floats no longer depend on whether it
    shares its pass. Elsewhere (a GPU's eager passes) one row keeps the dense forward.
    """
    graphs = getattr(model, "graphs", None)  # decode and verify passes as CUDA graphs
    logits = graphs.run(rows) if graphs is not None else None
    if logits is not None:
        return logits
    ragged = getattr(model, "forward_ragged", None)
    if len(rows) == 1 and (ragged is None or torch.device(device).type != "cpu"):
        return [forward_one(model, rows[0], device)]
    if ragged is not None:  # the lean forward: each cache read in place, nothing stacked
        logits = ragged(rows, shared_prefixes(rows))
        if logits[0].device.type == "cpu":
            return logits
        # from an accelerator in one copy (one wait for the pass), not one per row
        return list(torch.cat(logits).cpu().split([len(lg) for lg in logits]))
    B = len(rows)
    lengths = [r.start for r in rows]
    sizes = [len(r.tokens) for r in rows]
    L, M = max(lengths), max(sizes)
    input_ids = torch.zeros(B, M, dtype=torch.long)  # [B, M] right-padded
    positions = torch.zeros(B, M, dtype=torch.long)  # [B, M]
    mask = torch.zeros(B, L + M, dtype=torch.long)  # [B, L+M] 1 = real key
    for b, r in enumerate(rows):
        m = sizes[b]
        input_ids[b, :m] = torch.tensor(list(r.tokens), dtype=torch.long)
        positions[b] = torch.arange(r.start, r.start + M)  # padded queries: ignored
        mask[b, L - lengths[b]: L + m] = 1

    batch_kv = new_cache()
    n_layers = model.config.num_hidden_layers
    if L:
        for layer in range(n_layers):
            held = [_layer_kv(r.kv, layer) for r in rows]
            ref = next(k for k, _ in held if k is not None)  # [1, H, L_b, D]
            keys, values = [], []
            for b, (k, v) in enumerate(held):
                pad = L - lengths[b]
                shape = (1, ref.shape[1], pad, ref.shape[3])
                if k is None:
                    k, v = ref.new_zeros(shape), ref.new_zeros(shape)
                elif pad:
                    k = torch.cat([k.new_zeros(shape), k], dim=2)
                    v = torch.cat([v.new_zeros(shape), v], dim=2)
                keys.append(k)
                values.append(v)
            batch_kv.update(torch.cat(keys), torch.cat(values), layer)  # [B, H, L, D]

    out = model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                position_ids=positions.to(device), past_key_values=batch_kv, use_cache=True,
                logits_to_keep=M)
    logits = out.logits.float().cpu()  # [B, M, V]
    result = []
    for b, r in enumerate(rows):
        m = sizes[b]
        for layer in range(n_layers):
            lay = batch_kv.layers[layer]
            r.kv.update(lay.keys[b:b + 1, :, L:L + m], lay.values[b:b + 1, :, L:L + m], layer)
        result.append(logits[b, m - r.keep: m])  # [keep, V]
    return result


class StepJob:
    """One call's work on the model thread, in steps. Subclasses set what to feed
    (``next_row``) and use the logits (``take``); ``done`` ends the job."""

    # a drafter works beside this job's pass (a verify beside a speculation tree): the pass
    # runs on the process's own threads (services/plain_threads.py)
    beside = False

    def next_row(self) -> Row:
        raise NotImplementedError

    def take(self, logits: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError


class FeedJob(StepJob):
    """A job that first feeds ``pending`` onto a session's cache (``entry``, a
    SessionCache). A run longer than ``chunk`` tokens goes ``chunk`` at a time, one pass
    each (chunked prefill), so a long prompt does not hold back the other sessions' calls
    that share its passes for its whole prefill; the last ``chunk`` or fewer go with the
    job's own first row (``row``/``use``). chunk 0: all at once."""

    def __init__(self, entry, pending: list[int], chunk: int) -> None:
        self.entry, self.pending, self.chunk = entry, list(pending), chunk  # its own: it shrinks
        self.feeds = len(self.pending)  # tokens it feeds in all
        self._feeding = False

    def next_row(self) -> Row:
        self._feeding = 0 < self.chunk < len(self.pending)
        if self._feeding:
            return self.row_of(self.pending[:self.chunk], keep=1)
        return self.row()

    def row_of(self, tokens: Sequence[int], keep: int) -> Row:
        """A row that feeds ``tokens`` onto the session's cache."""
        e = self.entry
        return Row(tokens=tokens, kv=e.kv, start=len(e.tokens), keep=keep, chain=e.hashes,
                   chain_tokens=e.published)

    def take(self, logits: torch.Tensor) -> None:
        if self._feeding:
            self.entry.tokens.extend(self.pending[:self.chunk])
            del self.pending[:self.chunk]
            return
        self.use(logits)

    def row(self) -> Row:
        raise NotImplementedError

    def use(self, logits: torch.Tensor) -> None:
        raise NotImplementedError


PREFILL_ROW = 16  # a row of at least this many tokens is a prompt's (prefill_threads)


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads raised to ``threads`` inside the block, then put back (no
    change when ``threads`` is not more than the current number)."""
    old = torch.get_num_threads()
    if threads <= old:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_step(model, jobs: Sequence[StepJob], device: torch.device,
             new_cache: Callable[[], Any], prefill_threads: int = 0,
             plain: PlainThreads | None = None, drafter: Any = None
             ) -> tuple[list[BaseException | None], float]:
    """One forward pass over each job's next row; returns (per job its error or None, the
    pass's milliseconds). A job that fails is reported and the others go on; a failed pass
    fails every job in it. The caller (services/model_runner.py) decides which jobs run the
    next step: jobs that are done leave, new ones join.

    ``prefill_threads``: torch threads for a pass with a row of PREFILL_ROW tokens or more
    (a prompt, or a chunk of one), when more than the service's own: such a pass is bound
    by compute, which a second core speeds up (docs/performance.md).

    ``plain``: a verifier's choice of threads for a decode pass (services/plain_threads.py),
    when it has more cores for them, made apart for passes that verify no drafts (every row
    one logit) and passes that verify drafts; a pass beside which a drafter drafts the next
    round (a job's ``beside``) runs on the service's own threads.

    ``drafter``: a verifier's own draft model (verifier_svc/local_drafts.py), which first
    drafts for the jobs that may take drafts (its passes count as the step's) and hears
    when the step ends (``finish``) and when its pass runs on threads its kind does not
    keep."""
    start = time.perf_counter()
    if drafter is not None:
        drafter.prepare(jobs, start)
    errors: list[BaseException | None] = [None] * len(jobs)
    rows, live = [], []
    for i, job in enumerate(jobs):
        try:
            rows.append(job.next_row())
            live.append(i)
        except Exception as exc:  # noqa: BLE001 - a bad job must not fail the others
            errors[i] = exc
    prompt = any(len(r.tokens) >= PREFILL_ROW for r in rows)
    wide = prefill_threads if prompt else 0
    if plain is not None:
        if rows and not prompt and not any(job.beside for job in jobs):
            drafts = any(r.keep > 1 for r in rows)
            wide = plain.plain(start, len(rows), drafts=drafts)
            if drafter is not None and wide != plain.kept(plain.level(len(rows)), drafts):
                drafter.other_threads()
        else:
            plain.other()
    try:
        with torch_threads(wide):
            logits = forward_rows(model, rows, device, new_cache) if rows else []
    except Exception as exc:  # noqa: BLE001 - the pass failed: every job in it did
        for i in live:
            errors[i] = exc
        if drafter is not None:
            drafter.finish(time.perf_counter(), failed=True)
        return errors, (time.perf_counter() - start) * 1000.0
    for i, lg in zip(live, logits, strict=True):
        try:
            jobs[i].take(lg)
        except Exception as exc:  # noqa: BLE001
            errors[i] = exc
    if drafter is not None:
        drafter.finish(time.perf_counter())
    return errors, (time.perf_counter() - start) * 1000.0
