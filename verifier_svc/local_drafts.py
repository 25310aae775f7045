"""Drafts beside the target: a verifier's own draft model (``--local-drafter``).

The drafter tier pays where a verify is dear next to the hops of a round: the drafter works
on other cores or hardware while the verifier works, and each round's calls cost the
gateway a few milliseconds. Where the target's pass is cheap, those hops are the round: on
the demo pair at one stream on a 2-core CPU a drafting round of ~2.9 tokens took ~10.7 ms,
5.3 ms of it neither drafting nor verifying, against a target pass of 2.4-2.8 ms, so the
gateway's defaults decoded without drafts, while llama.cpp, drafting the same pair in one
process, served 1.45x its own plain decoding (docs/performance.md).

So a verifier may hold the draft model too. A plain round (a call without drafts asking for
several tokens, ``VerifyCall.local``) then decodes its tokens k at a time: before a step of
the running batch, this drafts k tokens for every such job together (the drafter's passes
over those sessions, on the model thread), and the step verifies them with the target's
usual acceptance rule (verifier_svc/engine.py), so each job gains between 1 and k + 1
tokens a pass instead of 1. The tokens are the target's: greedy, exactly the tokens of a
pass per token; sampled, drawn from the target's distribution (the drafts' q travel with
them as a drafter's would), but not the same draws, which is why the gateway asks only for
greedy requests and unseeded ones that speculate.

Whether it pays depends on the batch: with many sessions a pass is bound by compute, and
k + 1 tokens a session cost nearly k + 1 times one. Steps of more than ``step_sessions``
sessions (``--local-draft-sessions``, 1) do not draft: on the demo pair on a 2-core CPU,
forced in process, drafting served 0.8-1.0x at 2 sessions, 0.6-0.7x at 4, 0.5-0.6x at 8, and
in the mesh with every level's switch deciding, 8 streams served 0.86-0.88x target-only
against 1.01x without local drafts: a drafting step ends its calls in fewer passes, so
sessions spend more of their time between calls and the batch breaks up, which a
comparison of steps of one level cannot see (docs/performance.md). Up to that, one switch
per level of batch size (the sessions a step carries: 1, 2-3, 4-7, ...) interleaves steps
with and without drafts now and then (services/paired_switch.py) and keeps whichever serves
more tokens per second of the steps' own time, drafting included (all of the step's
sessions' tokens: a longer pass delays them all; ``finish`` says why not their cycles),
drafting only when it serves ``MIN_GAIN`` times more: it costs the drafter's passes. A
step whose pass runs on threads its kind does not keep (the thread switch explores) is not
counted, nor one that feeds a prompt to the target (both modes pay it). A drafting step that
feeds a session's context to the draft model (its first) is counted: that is what drafting
costs a session, and behind long prompts it is what loses. Left out, drafting read 356
against 379 tokens/s on the bench's 385-820-token prompts while serving 0.85x target-only
(a feed of ~800 tokens for each request of 128); the first exploration of a fresh
`specmesh up` may then read drafting low (297 against 431 tokens/s, cold), and the next one,
two epochs later, corrects it. An exploration in which the drafting
steps serve less than ``CUT_BELOW`` of the others ends after a quarter of an epoch, and
where drafting was not kept before it the next one comes 16 epochs later: under load, where
drafts lose by about half, an exploration's drafting steps are the cost (at 16 streams in
the mesh a defaults cell's passes ran 10-14% longer than target-only's with explorations of
whole epochs every 2, 4, 8 ... epochs). Where drafting was kept, such a loss stops it and the
next exploration comes as after any change (services/paired_switch.py ``_losing``). And the
kept mode is watched between explorations: an epoch of it serving less than the other mode
did at the last exploration calls the next one at once (``recheck``): the work changed, as
when long prompts, on which the demo drafts are accepted a third as often, follow short ones.

The draft model's caches are this module's, one per session, kept in step with the
target's by the tokens alone: before drafting, a session's cache is cropped to the longest
prefix it shares with the session's tokens (the drafts the target rejected go) and fed the
rest. At most ``max_sessions`` are kept, the least recently drafted dropped first; a
dropped or released one is fed again from the start when next needed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.batching import PREFILL_ROW, Row, forward_rows
from services.kv_cache import SessionCache
from services.paired_switch import PairedSwitch
from services.sampling import SparseDraft, sparse_draft_sample_rows, warp_logits
from verifier_svc.draft_gate import DraftGate

log = logging.getLogger(__name__)

MIN_GAIN = 1.05  # drafting costs the drafter's passes: taken when it serves this much more
CUT_BELOW = 0.7  # an exploration whose drafting steps serve less than this share ends early
MAX_SUPPORT = 32  # a sampled draft's q: its most likely tokens (the gateway's default too)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class _Unit:
    """A step that carried jobs that may draft: when it began, its jobs and the tokens each
    had decoded before it, its switch's level; ``cut``: it fed a prompt to the target, a cost
    that comes once a session in either mode, not counted."""

    started: float
    jobs: list
    before: list[int]
    level: int
    cut: bool = False
    fed: bool = False  # it fed a session's context to the draft model
    # a drafting step's: per job, its local drafts verified and accepted before it (None: the
    # step did not draft)
    local_before: list[tuple[int, int]] | None = None


class LocalDrafter:
    """A draft model beside a verifier's target, with its own per-session caches.

    A job that may draft (verifier_svc/engine.py ``_VerifyJob``) tells how many drafts its
    next step can take (``wants_drafts``), its session (``session_id``), the tokens the
    drafts continue (``draft_context``), how many tokens it decoded (``produced``), and
    takes its drafts as a ``SparseDraft`` (``local``)."""

    def __init__(self, model, device: torch.device, new_cache: Callable[[], Any], k: int,
                 max_sessions: int, epoch_s: float = 1.0, min_steps: int = 16,
                 step_sessions: int = 1) -> None:
        if k < 1:
            raise ValueError(f"local draft tokens must be >= 1, got {k}")
        self.model, self.device, self.new_cache, self.k = model, device, new_cache, k
        self.step_sessions = step_sessions  # steps of more sessions do not draft
        self.max_tokens: int | None = None  # tokens the caches hold at most (--kv-budget-mb)
        self.max_sessions = max_sessions
        self._epoch_s, self._min_steps = epoch_s, min_steps
        self.caches: OrderedDict[str, SessionCache] = OrderedDict()  # the model thread's
        self._released: list[str] = []  # sessions released since the last step (any thread)
        self.switches: dict[int, PairedSwitch] = {}
        self._unit: _Unit | None = None
        self.steps = {True: 0, False: 0}  # steps with jobs that may draft: drafted, not
        self.drafted = 0  # draft tokens proposed
        self.uncounted = 0  # steps left out of the rates: a context fed, other threads, failed
        self.fused = 0  # drafting steps whose passes (all or all but the first) ran as one
        self.gate = DraftGate(max_sessions=max_sessions)  # which sessions of a step draft
        self.held_back = 0  # sessions the gate kept from drafting in a drafting step

    @staticmethod
    def level(jobs: int) -> int:
        """1, 2-3, 4-7, ... jobs in a step: levels 1, 2, 3, ..."""
        return max(1, jobs).bit_length()

    def switch(self, level: int) -> PairedSwitch:
        """The switch of steps of ``level``. A new one starts from what the others keep,
        where they tell: drafts cost more the more sessions a pass carries, so a level above
        one where drafting lost starts without drafting, and one below a level where it won
        starts drafting, either way exploring only after ``max_explore`` epochs (an
        exploration's steps are half in the worse mode: at 16 streams a bench cell of a
        second was one); else its first epoch explores."""
        found = self.switches.get(level)
        if found is None:
            settings = dict(epoch_s=self._epoch_s, min_rounds=self._min_steps,
                            on_margin=MIN_GAIN, cut_below=CUT_BELOW, recheck=True)
            kept = {at: s.incumbent for at, s in self.switches.items() if s.rate}
            lost = any(not on for at, on in kept.items() if at < level)
            won = any(on for at, on in kept.items() if at > level)
            found = self.switches[level] = (PairedSwitch.keeping(won, **settings)
                                            if lost != won else PairedSwitch(**settings))
        return found

    def release(self, session_id: str) -> None:
        """Drops a session's draft cache (the verifier released the session) before the
        next step: the caches are the model thread's."""
        self._released.append(session_id)

    def prepare(self, jobs: Sequence[Any], now: float) -> None:
        """On the model thread, before a step's rows are built: accounts the last step that
        carried jobs that may draft, then, if this one carries some and its level's switch
        drafts, gives each of them its drafts (``job.local``)."""
        while self._released:
            released = self._released.pop()
            self.caches.pop(released, None)
            self.gate.release(released)
        self._observe(now)
        if len(jobs) > self.step_sessions:
            return
        wanting = [(job, k) for job in jobs
                   if (k := getattr(job, "wants_drafts", lambda: 0)()) > 0]
        if not wanting:
            return
        level = self.level(len(jobs))  # (drafts cost what the whole pass carries)
        switch = self.switch(level)
        on = switch.mode(now)
        counted = [job for job in jobs if hasattr(job, "produced")]
        prompt = any(getattr(job, "feeding", 1) >= PREFILL_ROW for job in jobs)
        self._unit = _Unit(now, counted, [job.produced for job in counted], level, prompt)
        if switch.kept_changed():
            low = 1 << (level - 1)
            log.info("plain rounds of %d-%d sessions a step now %s (tokens per second: "
                     "%.0f drafting, %.0f not)", low, 2 * low - 1,
                     "draft locally" if switch.incumbent else "do not draft",
                     switch.rate[True], switch.rate[False])
        self.steps[on] += 1
        if on and not switch.exploring:  # (an exploration's drafting steps measure drafting)
            drafting = [(job, k) for job, k in wanting
                        if self.gate.allows(job.session_id, level, k)]
            self.held_back += len(wanting) - len(drafting)
            wanting = drafting
        if on and wanting:
            self._unit.local_before = [(job.local_drafted, job.local_accepted)
                                       for job in counted]
            try:
                self._draft(wanting)
            except Exception:  # noqa: BLE001 - drafts are optional: the step runs without
                log.exception("local drafting failed: this step runs without drafts")
                for job, _ in wanting:
                    job.local = None
                    self.caches.pop(job.session_id, None)

    def other_threads(self) -> None:
        """This step's pass runs on other threads than its kind's kept count (the verifier's
        thread switch explores: services/plain_threads.py): not what either mode costs where
        the threads are kept, so not counted. (One exploring beside the other had this
        switch read a one-stream drafting rate of 261 against 618 tokens/s where others
        read 683-815 against 441-591, and stop drafting.)"""
        if self._unit is not None:
            self._unit.cut = True

    def finish(self, now: float, failed: bool = False) -> None:
        """On the model thread, once the step's pass has ended and its jobs took their
        logits: rates the step by its own time, from its drafting to the pass's end, not by
        its cycle to the next step. After a step that ends calls the model thread may wait
        for the next ones (a round that probes the drafter tier has no decode-ahead), a wait
        that the cycle charged to the step before it, and drafting steps end calls about
        three times as often (~2.7 tokens a pass against one, 8-token calls): one
        exploration read 162 against 417 tokens/s for drafting at one stream where the
        others read 617-834 against 373-602. Between-call costs come once a call either
        way, so per token they weigh alike on both modes. A failed pass is not counted."""
        if self._unit is not None:
            self._unit.cut |= failed
        self._observe(now)

    def _observe(self, now: float) -> None:
        """Rates the last step with jobs that may draft (``finish``, or its cycle where a
        step began before it was finished)."""
        unit, self._unit = self._unit, None
        if unit is None:
            return
        tokens = sum(max(0, job.produced - before)
                     for job, before in zip(unit.jobs, unit.before, strict=True))
        self.uncounted += unit.cut
        self.switch(unit.level).observe(unit.started, now - unit.started, tokens, unit.cut)
        drafted = unit.local_before is not None
        if not (unit.cut or unit.fed):
            self.gate.observe_step(unit.level, drafted, now - unit.started)
        for job, (verified, accepted) in zip(unit.jobs, unit.local_before or (), strict=drafted):
            if job.local_drafted > verified:
                self.gate.observe_drafts(job.session_id, unit.level,
                                         job.local_drafted - verified,
                                         job.local_accepted - accepted)

    def _entry(self, session_id: str) -> SessionCache:
        entry = self.caches.get(session_id)
        if entry is None:
            entry = self.caches[session_id] = SessionCache(tokens=[], kv=self.new_cache())
            while len(self.caches) > self.max_sessions:
                self.caches.popitem(last=False)
        self.caches.move_to_end(session_id)
        return entry

    def _draft(self, wanting: list[tuple[Any, int]]) -> None:
        """k passes of the draft model over the wanting jobs' sessions (each fewer where its
        job wants fewer): the first feeds what each cache lacks of its session's tokens, each
        next one the draft before; the last draft is not fed."""
        feeds, drafts = [], []
        for job, _ in wanting:
            entry = self._entry(job.session_id)
            context = job.draft_context()  # [n]
            keep = min(common_prefix(entry.tokens, context), len(context) - 1)
            entry.crop(keep)
            feeds.append((entry, context[keep:]))
            if len(context) - keep >= PREFILL_ROW:  # (a session's context, not a step's tokens)
                self._unit.fed = True
            drafts.append([])
        while True:
            live = [i for i, (_, k) in enumerate(wanting) if len(drafts[i]) < k]
            if not live:
                break
            rows = []
            for i in live:
                entry, feed = feeds[i]
                tokens = feed if not drafts[i] else [drafts[i][-1][0]]
                rows.append(Row(tokens=tokens, kv=entry.kv, start=len(entry.tokens), keep=1))
            if self._greedy(live, rows, wanting, feeds, drafts):
                break
            logits = forward_rows(self.model, rows, self.device, self.new_cache)
            for i, row, lg in zip(live, rows, logits, strict=True):
                feeds[i][0].tokens.extend(row.tokens)
                drafts[i].append(self._draw(wanting[i][0], lg))  # lg [1, V]
        for (job, _), drawn in zip(wanting, drafts, strict=True):
            job.local = _sparse(drawn)
            self.drafted += len(drawn)
        self._trim({job.session_id for job, _ in wanting})

    def _trim(self, keep: set[str]) -> None:
        """Drops the least recently drafted caches, other than ``keep``'s, while the caches
        hold more than ``max_tokens`` tokens (a dropped one is fed again when next needed)."""
        if self.max_tokens is None:
            return
        held = sum(len(entry.tokens) for entry in self.caches.values())
        for session_id in [s for s in self.caches if s not in keep]:
            if held <= self.max_tokens:
                break
            held -= len(self.caches.pop(session_id).tokens)

    def _greedy(self, live: list[int], rows: list[Row], wanting: list[tuple[Any, int]],
                feeds: list, drafts: list[list]) -> bool:
        """Where every live job is greedy, the rest of their drafts in one call of the draft
        model's ``greedy_drafts`` (services/lean_llama.py: its passes in one operator), which
        feeds each row and then its drafts but the last: a job that wants fewer drafts than
        another takes its first ones (the others stay in its cache, as a rejected draft's
        would, and go at its next crop). False where it does not run: the passes go one by one."""
        run = getattr(self.model, "greedy_drafts", None)
        if run is None or not all(wanting[i][0].call.params.greedy for i in live):
            return False
        chosen = run(rows, max(wanting[i][1] - len(drafts[i]) for i in live))
        if chosen is None:
            return False
        self.fused += 1
        for i, row, tokens in zip(live, rows, chosen, strict=True):
            feeds[i][0].tokens.extend([*row.tokens, *tokens[:-1]])
            drafts[i] += [(t, [t], [1.0]) for t in tokens[:wanting[i][1] - len(drafts[i])]]
        return True

    @staticmethod
    def _draw(job, logits: torch.Tensor) -> tuple[int, list[int], list[float]]:
        """One draft token from the draft model's logits [1, V], warped as the target's
        (the drafter's sampler: services/sampling.py)."""
        params = job.call.params
        if params.greedy:
            return sparse_draft_sample_rows(logits, 1, [None], greedy=True)[0]
        probs = warp_logits(logits, params)  # [1, V]
        return sparse_draft_sample_rows(probs, MAX_SUPPORT, [job.draft_generator])[0]


def build_local_drafter(config, target_meta) -> LocalDrafter | None:
    """The verifier's ``--local-drafter`` (None without one), loaded as the drafter tier
    loads its model, on the target's device; a model of another vocabulary is refused
    (StartupError: its drafts would be other tokens)."""
    if not config.local_drafter:
        return None
    from services.errors import StartupError
    from services.models import load_for_serving

    model, meta, device = load_for_serving(config.local_drafter, config.device, config.dtype,
                                           config.threads, config.forward)
    if (meta.vocab_size, meta.vocab_hash) != (target_meta.vocab_size, target_meta.vocab_hash):
        raise StartupError(
            f"--local-drafter {config.local_drafter} has another vocabulary than the target "
            f"{config.model} ({meta.vocab_size} tokens against {target_meta.vocab_size}, or "
            "other tokens): give a draft model of the target's tokenizer")
    pool = getattr(model, "pool", None)  # the lean forward's KV slots (services/kv_slab.py)
    if pool is not None:
        pool.bound(config.max_sessions)
    own = getattr(model, "new_cache", None)
    if own is None:
        from transformers import DynamicCache

        def own():
            return DynamicCache(config=model.config)
    log.info("plain rounds in passes of up to %d sessions may draft %d tokens a pass with %s",
             config.local_draft_sessions, config.local_draft_tokens, config.local_drafter)
    return LocalDrafter(model, device, own, config.local_draft_tokens, config.max_sessions,
                        step_sessions=config.local_draft_sessions)


def share_budget(config, runner, caches, local: LocalDrafter | None) -> None:
    """``--kv-budget-mb`` covers the target's caches and the local draft model's together
    (services/model_service.py ``budget_tokens``): both are bounded to the budget over the
    two models' bytes a token (the target's alone had the whole budget, the draft model's
    caches none: a 1B drafter beside a 70B target holds ~1/10 of its bytes)."""
    if local is None or not config.kv_budget_mb:
        return
    from services.model_service import budget_tokens

    max_tokens = budget_tokens(config, [runner.model, local.model], runner.meta.max_context,
                               " of the target's and --local-drafter's caches together")
    caches.bound_tokens(max_tokens)
    local.max_tokens = max_tokens


def _sparse(drawn: list[tuple[int, list[int], list[float]]]) -> SparseDraft:
    """Draws as the verifier's acceptance rule takes them: ids [k], q over supports
    [k, S] (zero-padded)."""
    k = len(drawn)
    width = max(len(ids) for _, ids, _ in drawn)
    if width == 1:  # (greedy: each q is one token's; 3 tensors, not 3 + 2k: ~43 us a step)
        return SparseDraft(token_ids=torch.tensor([t for t, _, _ in drawn], dtype=torch.long),
                           q_ids=torch.tensor([ids for _, ids, _ in drawn], dtype=torch.long),
                           q_probs=torch.tensor([probs for _, _, probs in drawn],
                                                dtype=torch.float32))
    q_ids = torch.zeros(k, width, dtype=torch.long)  # [k, S]
    q_probs = torch.zeros(k, width)  # [k, S]
    for i, (_, ids, probs) in enumerate(drawn):
        q_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        q_probs[i, : len(probs)] = torch.tensor(probs, dtype=torch.float32)
    return SparseDraft(token_ids=torch.tensor([t for t, _, _ in drawn], dtype=torch.long),
                       q_ids=q_ids, q_probs=q_probs)
