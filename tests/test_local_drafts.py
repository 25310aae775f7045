"""Drafts beside the target (verifier_svc/local_drafts.py): a verifier's plain rounds draft
with its own draft model and verify the drafts in its passes. The tokens stay the target's
(greedy: HF ``generate``'s; sampled: the target's distribution), the caches stay exact
(rejected drafts leave no trace, an end-of-sequence token inside the accepted drafts ends
the call there), and each level of batch size decides for itself.

In process with the real tiny pair loaded as the services load it (the lean forward); the
mesh's processes in test_mesh.py."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.batching import PREFILL_ROW
from services.config import ModelServiceConfig, ServerConfig
from services.hashing import token_hash
from services.kv_cache import SessionCaches
from services.messages import CacheDelta, VerifyCall
from services.model_runner import ModelRunner
from services.models import load_for_serving
from services.paired_switch import PairedSwitch
from services.params import SamplingParams
from services.sampling import warp_logits
from tests.conftest import hf_greedy
from verifier_svc.engine import VerifierEngine
from verifier_svc.local_drafts import LocalDrafter, build_local_drafter, common_prefix

GREEDY = SamplingParams()


def _engine(target: str, drafter: str, k: int = 3, sessions: int = 256,
            step_sessions: int = 64) -> VerifierEngine:
    model, meta, device = load_for_serving(target, "cpu", "float32", 1)
    config = ModelServiceConfig(server=ServerConfig(port=1), model=target, threads=1,
                                local_drafter=drafter, local_draft_tokens=k,
                                max_sessions=sessions, local_draft_sessions=step_sessions)
    runner = ModelRunner(model, meta, device, max_queue=64, max_batch=16)
    return VerifierEngine(runner, SessionCaches(64, runner.new_kv), max_draft_tokens=16,
                          local=build_local_drafter(config, meta))


@pytest.fixture(scope="module")
def half_pair(tiny_pair, tmp_path_factory) -> tuple[str, str]:
    """The tiny pair with every weight rounded to a float16 number (the demo pair's are), so
    the lean forward keeps 16-bit copies and runs its one-operator passes."""
    out = []
    for path in tiny_pair:
        dest = tmp_path_factory.mktemp("half") / "model"
        shutil.copytree(path, dest)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for p in model.parameters():
            p.data = p.data.half().float()
        model.save_pretrained(dest)
        out.append(str(dest))
    return out[0], out[1]


def _always(local: LocalDrafter, on: bool = True) -> None:
    """Every level keeps ``on`` and never explores: the steps' mode is fixed (the switch's
    own choice is timing's, tested in test_paired_switch.py)."""
    for level in range(1, 10):
        local.switches[level] = PairedSwitch.keeping(on, max_explore=10**9)


def _call(session: str, tokens, base: int = 0, max_tokens: int = 8, params=GREEDY,
          seed: int = 1, local: bool = True, drafts=(), logprobs: int = -1) -> VerifyCall:
    return VerifyCall(cache=CacheDelta(session_id=session, base_len=base,
                                       base_hash=token_hash(list(tokens[:base])),
                                       new_tokens=tuple(tokens[base:])),
                      draft_ids=tuple(drafts), q_ids=(), q_probs=(), params=params, seed=seed,
                      logprobs=logprobs, max_tokens=max_tokens, local=local)


async def _decode(engine: VerifierEngine, session: str, prompt, n: int, per_call: int = 8,
                  local: bool = True) -> list[int]:
    """n tokens of ``session`` in plain rounds of ``per_call``, each call sending only what
    the verifier's cache lacks (its cursor, as the gateway keeps it)."""
    tokens, base = list(prompt), 0
    while len(tokens) - len(prompt) < n:
        r = await engine.verify(_call(session, tokens, base, per_call, local=local))
        assert r.num_accepted == 0, "a call without drafts accepts none of its own"
        tokens += [r.extra_token, *r.more]
        assert r.cached_len == len(tokens) - 1, "the cache holds every token but the last"
        base = r.cached_len
    return tokens[len(prompt):][:n]


def _prompts(vocab: int, sizes=(7, 12, 5, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in sizes]


@pytest.mark.parametrize("fused", [True, False], ids=["one-operator", "pass-by-pass"])
@pytest.mark.parametrize("own", [True, False], ids=["drafter-is-target", "tiny-drafter"])
def test_plain_rounds_with_local_drafts_give_hf_greedys_tokens(tiny_pair, half_pair, own,
                                                               fused):
    """Four sessions at once, plain rounds of 8 tokens, every step drafting 3: each
    session's tokens are HF greedy's. With the target as its own drafter every draft is
    accepted (a pass gives 4 tokens: the last step of a round fewer); with the tiny drafter
    some are rejected, and the caches the rejected drafts were fed to go on exact. Greedy
    drafts run the draft model's passes in one operator where the rows allow
    (``greedy_drafts``: the pair's weights are 16-bit numbers; ``fused``), else pass by
    pass (the pair's float32 weights): the same tokens either way."""
    pair = half_pair if fused else tiny_pair
    model = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    engine = _engine(pair[0], pair[0] if own else pair[1])
    _always(engine.local)
    prompts = _prompts(model.config.vocab_size)
    eos = engine.runner.meta.eos_token_ids
    want = [hf_greedy(model, p, 24) for p in prompts]
    for w in want:
        assert not set(w) & set(eos), "the reference must not end early"

    async def run():
        return await asyncio.gather(*(_decode(engine, f"s{i}", p, 24)
                                      for i, p in enumerate(prompts)))

    got = asyncio.run(run())
    assert got == want
    stats, local = engine.stats, engine.local
    assert local.drafted > 0 and stats.draft_tokens == local.drafted
    # (four sessions' rows run as one once their first drafting steps fed their contexts)
    assert (local.fused >= local.steps[True] // 2) if fused else local.fused == 0
    for entry in local.caches.values():  # each draft cache holds the tokens it says it does
        assert entry.kv.get_seq_length() == len(entry.tokens)
    if own:
        assert stats.accepted_tokens == stats.draft_tokens
        # 3 rounds of 8 a session: passes of 4, 4 (the round's last), ... far fewer than 24
        assert stats.forward_passes <= 4 * 3 * 2
    else:
        assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_the_same_calls_without_local_drafts_take_one_pass_a_token(tiny_pair, target_model):
    """The control: calls that do not allow local drafts (target-only, seeded sampling)
    decode one token a pass, whatever the switch keeps."""
    model, _ = target_model
    engine = _engine(tiny_pair[0], tiny_pair[0])
    _always(engine.local)
    prompt = _prompts(model.config.vocab_size)[0]
    got = asyncio.run(_decode(engine, "plain", prompt, 16, local=False))
    assert got == hf_greedy(model, prompt, 16)
    assert engine.local.drafted == 0 and engine.stats.forward_passes == 16


def test_a_switch_that_keeps_not_drafting_drafts_nothing(tiny_pair, target_model):
    model, _ = target_model
    engine = _engine(tiny_pair[0], tiny_pair[1])
    _always(engine.local, on=False)
    prompt = _prompts(model.config.vocab_size)[1]
    assert asyncio.run(_decode(engine, "off", prompt, 16)) == hf_greedy(model, prompt, 16)
    assert engine.local.drafted == 0 and engine.local.steps[False] > 0


def test_an_end_of_sequence_token_among_accepted_drafts_ends_the_call_there(
        tiny_pair, target_model):
    """The target drafting for itself accepts every draft; with a greedy token that first
    comes 3rd or later made the end-of-sequence token, an 8-token call returns the tokens up
    to it only, its cache holds all but the last, and the next call goes on from there."""
    model, _ = target_model
    engine = _engine(tiny_pair[0], tiny_pair[0])
    _always(engine.local)
    prompt, want = next((p, w) for p in _prompts(model.config.vocab_size, (4, 6, 8, 10, 12))
                        if len(set((w := hf_greedy(model, p, 12))[:4])) >= 3)
    end = next(i for i in range(2, 4) if want[i] not in want[:i])
    engine.runner.meta = dataclasses.replace(engine.runner.meta, eos_token_ids=(want[end],))

    async def run():
        r = await engine.verify(_call("eos", prompt, max_tokens=8, logprobs=1))
        got = [r.extra_token, *r.more]
        assert got == want[:end + 1]
        assert r.cached_len == len(prompt) + end
        assert [lp.token_id for lp in r.logprobs] == got
        tokens = [*prompt, *got]
        again = await engine.verify(_call("eos", tokens, base=r.cached_len, max_tokens=2))
        return [again.extra_token, *again.more]

    assert asyncio.run(run()) == want[end + 1:end + 3]
    assert engine.stats.accepted_tokens >= end, "the tokens came from accepted drafts"


def test_logprobs_of_locally_drafted_tokens_are_those_of_one_token_passes(
        tiny_pair, target_model):
    """Each returned token's log-probability and top alternatives come from the pass that
    verified it: the same as a pass per token gives (float tolerance)."""
    model, _ = target_model
    prompt = _prompts(model.config.vocab_size)[3]
    drafting = _engine(tiny_pair[0], tiny_pair[1])
    _always(drafting.local)
    plain = _engine(tiny_pair[0], tiny_pair[1])
    _always(plain.local, on=False)
    a = asyncio.run(drafting.verify(_call("lp", prompt, max_tokens=8, logprobs=2)))
    b = asyncio.run(plain.verify(_call("lp", prompt, max_tokens=8, logprobs=2)))
    assert drafting.local.drafted > 0 and plain.local.drafted == 0
    # what the call reports for the verifier's metrics: its own drafts, and the accepted
    assert (a.local_drafted, a.local_accepted) == (drafting.local.drafted,
                                                   drafting.stats.accepted_tokens)
    assert (b.local_drafted, b.local_accepted) == (0, 0)
    assert [a.extra_token, *a.more] == [b.extra_token, *b.more]
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.token_id == y.token_id and x.top_ids == y.top_ids
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_sampled_local_drafts_keep_the_targets_distribution(tiny_pair, target_model,
                                                           draft_model):
    """Sampled plain rounds of 2 tokens from one prompt, 1,200 seeds: the first token's
    frequencies match the target's warped distribution (its draw went through the local
    draft and the acceptance rule), and the draft model's own distribution is far from it,
    so a rule that kept the drafts would fail."""
    model, _ = target_model
    engine = _engine(tiny_pair[0], tiny_pair[1], k=1)
    _always(engine.local)
    params = SamplingParams(temperature=1.0, top_k=6)
    prompt = _prompts(model.config.vocab_size)[0]
    with torch.inference_mode():
        p = warp_logits(model(torch.tensor([prompt])).logits[0, -1:].float(), params)[0]
        q = warp_logits(draft_model(torch.tensor([prompt])).logits[0, -1:].float(), params)[0]
    n = 1200

    async def run():
        out = []
        for start in range(0, n, 48):
            calls = [_call(f"x{i}", prompt, max_tokens=2, params=params, seed=1000 + i)
                     for i in range(start, min(n, start + 48))]
            out += [r.extra_token for r in await engine.verify_many(calls)]
            for i in range(start, min(n, start + 48)):
                await engine.release(f"x{i}")
        return out

    firsts = asyncio.run(run())
    freq = torch.bincount(torch.tensor(firsts), minlength=p.numel()).float() / n
    tv = 0.5 * (freq - p).abs().sum().item()
    assert engine.local.drafted >= n, "every call's first pass carried a local draft"
    assert 0 < engine.stats.accepted_tokens < engine.stats.draft_tokens
    assert tv < 0.07, f"first tokens' distance from the target's distribution {tv:.3f}"
    assert 0.5 * (q - p).abs().sum().item() > 0.15, "the draft must differ to mean anything"


def test_draft_caches_are_bounded_and_released_and_refed_when_needed(tiny_pair, target_model):
    """At most --max-sessions draft caches (the least recently drafted dropped first); a
    released session's goes at the next step; a session whose draft cache went is fed again
    from its start, and its tokens stay HF greedy's."""
    model, _ = target_model
    engine = _engine(tiny_pair[0], tiny_pair[1], sessions=2)
    _always(engine.local)
    prompts = _prompts(model.config.vocab_size)
    want = [hf_greedy(model, p, 16) for p in prompts[:3]]

    async def run():
        got = [await _decode(engine, f"s{i}", p, 8) for i, p in enumerate(prompts[:3])]
        assert list(engine.local.caches) == ["s1", "s2"], "s0 was dropped: least recent"
        await engine.release("s2")
        more = list(prompts[0]) + got[0]  # s0 goes on: its verifier cache holds all but one
        r = await engine.verify(_call("s0", more, base=len(more) - 1, max_tokens=8))
        assert "s2" not in engine.local.caches and "s0" in engine.local.caches
        return got, [r.extra_token, *r.more]

    got, s0_more = asyncio.run(run())
    assert got == [w[:8] for w in want]
    assert s0_more == want[0][8:16]


def test_a_new_level_starts_from_what_the_others_keep():
    """Drafting lost at a smaller batch: a larger one starts without drafting and does not
    explore at once; drafting won at a larger batch: a smaller one starts drafting; with no
    evidence either way (or both ways) a level explores first."""
    local = LocalDrafter(model=None, device=torch.device("cpu"), new_cache=lambda: None,
                         k=3, max_sessions=8)
    first = local.switch(1)  # nothing known: it explores, its first step drafting
    assert first._exploring and first.mode(0.0)
    lost = local.switches[1] = PairedSwitch(_kept=False, _exploring=False)
    lost.rate = {True: 400.0, False: 500.0}
    up = local.switch(4)
    assert not up.incumbent and not up._exploring and not up.mode(0.0)
    won = local.switches[6] = PairedSwitch(_kept=True, _exploring=False)
    won.rate = {True: 900.0, False: 500.0}
    between = local.switch(3)  # lost below it, won above it: no evidence, it explores
    assert between._exploring
    local.switches[1].rate, local.switches[1]._kept = {True: 600.0, False: 500.0}, True
    down = local.switch(2)
    assert down.incumbent and not down._exploring and down.mode(0.0)


@pytest.mark.parametrize("fed_first", [False, True], ids=["short-prompt", "context-fed-first"])
def test_a_step_feeding_the_draft_model_counts_and_a_prompt_to_the_target_does_not(
        tiny_pair, target_model, fed_first):
    """The level's switch explores (its first step drafts). A session's prompt fed to the
    target (its first call) is left out of the rates: both modes pay it. A drafting step
    that feeds the draft model 24 tokens of context (an earlier call decoded without local
    drafts) is counted, with its feed's time: what drafting costs a session (behind long
    prompts, what loses)."""
    model, _ = target_model
    engine = _engine(tiny_pair[0], tiny_pair[1])
    prompt = _prompts(model.config.vocab_size, (20 if fed_first else 5,))[0]

    async def run():
        tokens, base = list(prompt), 0
        if fed_first:
            r = await engine.verify(_call("c", tokens, max_tokens=4, local=False))
            tokens += [r.extra_token, *r.more]
            base = r.cached_len
        assert engine.local.steps == {True: 0, False: 0}
        await engine.verify(_call("c", tokens, base=base, max_tokens=8))

    asyncio.run(run())
    switch, steps = engine.local.switches[1], sum(engine.local.steps.values())
    assert switch._exploring and engine.local.steps[True] > 0
    counted = sum(switch._count.values())
    # a fed prompt (20 tokens to the target in the second call: none, it was fed before;
    # 5 in the first: under a prompt's size) is the only kind of step left out
    assert engine.local.uncounted == 0
    assert switch._count[True] >= 1 and switch._busy_s[True] > 0
    # every step's unit is observed once the next step starts (the last one: maybe not yet)
    assert steps - 1 <= counted <= steps


def test_a_step_that_feeds_a_prompt_to_the_target_is_not_counted():
    """A step carrying a job that feeds the target a prompt (``feeding`` of a prompt's size,
    PREFILL_ROW tokens or more) is left out of the switch's rates, in either mode."""
    local = LocalDrafter(model=None, device=torch.device("cpu"), new_cache=list, k=3,
                         max_sessions=8)
    switch = local.switches[1] = PairedSwitch(epoch_s=10.0, min_rounds=2)
    switch.mode(-0.001)  # (the exploration's next two units do not draft)
    prompt, decoding = _Job(feeding=PREFILL_ROW), _Job()
    local.prepare([prompt], 0.0)
    prompt.produced += 1
    local.prepare([decoding], 0.01)  # observes the prompt's step: not counted
    assert local.uncounted == 1 and sum(switch._count.values()) == 0
    decoding.produced += 1
    local._observe(0.02)  # the decoding step: counted
    assert local.uncounted == 1 and switch._count == {True: 0, False: 1}


@pytest.mark.parametrize("a, b, n", [([], [1, 2], 0), ([1, 2, 3], [1, 2, 3, 4], 3),
                                     ([1, 2, 9, 4], [1, 2, 3, 4], 2), ([5], [1], 0),
                                     ([1, 2, 3], [1, 2, 3], 3)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n == common_prefix(b, a)


def test_the_gateway_allows_local_drafts_only_where_the_draws_may_differ(redis_url, tiny_pair):
    """Through the gateway's scheduler (tests/engine_harness.py), one request at a time: a
    greedy request that speculates, and a sampled one without a seed, let their plain rounds
    draft locally; target-only requests (speculation disabled) and seeded samples (whose
    rounds are of one token) do not, so their tokens are drawn as without a local drafter."""
    from services.model_info import load_tokenizer
    from tests.engine_harness import EngineHarness, spec
    from tests.round_harness import tables

    target, draft = tables(vocab=512, seed=5, noise=1.0)
    sampled = SamplingParams(temperature=1.0)
    requests = {"greedy": (spec([5, 6, 7, 8], 40), {True}),
                "unseeded": (spec([5, 6, 7, 9], 40, params=sampled), {True}),
                "target-only": (spec([5, 6, 7, 10], 40, speculate=False), {False}),
                "seeded target-only": (spec([5, 6, 7, 11], 40, params=sampled, seed=7,
                                            speculate=False), {False}),
                "seeded, no drafter tier": (spec([5, 6, 7, 12], 40, params=sampled, seed=7),
                                            {False})}
    seen: list[tuple[bool, bool]] = []  # per call without drafts: local, asks several

    async def main():
        h = EngineHarness(target, draft, redis_url, load_tokenizer(tiny_pair[0]))
        verify_many = h.verifier.verify_many

        async def recording(calls):  # (a spy: the calls go on as they came)
            seen.extend((c.local, c.max_tokens > 1) for c in calls if not c.draft_ids)
            return await verify_many(calls)

        h.verifier.verify_many = recording
        flags = {}
        try:
            for name, (request, _) in requests.items():
                if name == "seeded, no drafter tier":
                    h.pools["drafter"].replicas.clear()  # its rounds are all plain ones
                seen.clear()
                await h.complete(request)
                # (a 1-token call, a lead round's say, cannot draft: what it says is moot)
                several = {local for local, many in seen if many}
                flags[name] = several or {local for local, _ in seen}
        finally:
            await h.close()
        return flags

    flags = asyncio.run(main())
    assert flags == {name: want for name, (_, want) in requests.items()}


@dataclasses.dataclass
class _Job:
    """What ``LocalDrafter.prepare`` reads of a job that may draft, where no draft is made."""

    produced: int = 0
    feeding: int = 1
    session_id: str = "s"

    def wants_drafts(self) -> int:
        return 3


def test_steps_of_more_sessions_than_the_limit_do_not_draft_nor_count():
    """``--local-draft-sessions``: a step of more sessions drafts nothing and its switch
    sees nothing of it (no level's switch is even made); a step within the limit goes to
    its level's switch."""
    local = LocalDrafter(model=None, device=torch.device("cpu"), new_cache=list, k=3,
                         max_sessions=8, step_sessions=2)
    _always(local, on=False)
    made = set(local.switches)
    local.switches.pop(3)  # (a switch for 4-7 sessions a step would be made on first use)
    local.prepare([_Job(), _Job(), _Job()], 0.0)
    assert local.steps == {True: 0, False: 0} and set(local.switches) == made - {3}
    local.prepare([_Job(), _Job()], 0.01)
    assert local.steps == {True: 0, False: 1}


def test_a_step_on_threads_its_kind_does_not_keep_is_not_counted():
    """While the verifier's thread switch explores, a step it runs on the threads it does not
    keep (``other_threads``, called by run_step) is left out of the local switch's rates, as
    a step that feeds a context is: it measures neither mode as it runs when kept."""
    local = LocalDrafter(model=None, device=torch.device("cpu"), new_cache=list, k=3,
                         max_sessions=8)
    switch = local.switches[1] = PairedSwitch(epoch_s=10.0, min_rounds=2)
    assert switch.mode(-0.001)  # an exploration's first unit drafts; the next two do not
    job = _Job()
    local.prepare([job], 0.0)
    local.other_threads()
    job.produced += 1
    local.prepare([job], 0.01)  # observes the first step: not counted
    assert local.uncounted == 1 and sum(switch._count.values()) == 0
    job.produced += 1
    local._observe(0.02)  # the second: counted
    assert local.uncounted == 1 and switch._count == {True: 0, False: 1}


def test_a_step_is_rated_by_its_own_time_not_by_the_wait_for_the_next_calls():
    """A step's rate is its tokens over its own time, from its drafting to its pass's end
    (``finish``, called by run_step): the model thread's wait for the next calls after it
    (a round that probes the drafter tier has no decode-ahead) is not charged to it. A step
    whose pass failed is not counted."""
    local = LocalDrafter(model=None, device=torch.device("cpu"), new_cache=list, k=3,
                         max_sessions=8)
    switch = local.switches[1] = PairedSwitch(epoch_s=10.0, min_rounds=2)
    assert switch.mode(-0.001)  # (the exploration's next two units do not draft)
    job = _Job()
    local.prepare([job], 0.0)
    job.produced += 2
    local.finish(0.004)
    local.prepare([job], 0.5)  # half a second later: the next call came
    local.finish(0.504, failed=True)
    assert switch._busy_s[False] == pytest.approx(0.004) and switch._tokens[False] == 2
    assert switch._count == {True: 0, False: 1} and local.uncounted == 1


def test_the_kv_budget_covers_the_draft_models_caches_too(tiny_pair):
    """``--kv-budget-mb`` bounds the target's caches and the local draft model's together:
    both to the budget over the two models' bytes a token, and each pool to the full slots
    that holds; a budget too small for one full-context session in both is refused."""
    from services.errors import StartupError
    from services.model_service import build_parts
    from services.models import kv_bytes_per_token
    from verifier_svc.local_drafts import share_budget

    def parts(budget_mb: int, pair=tiny_pair):
        config = ModelServiceConfig(server=ServerConfig(port=1), model=pair[0],
                                    local_drafter=pair[1], kv_budget_mb=budget_mb)
        runner, caches = build_parts(config)
        return config, runner, caches, build_local_drafter(config, runner.meta)

    config, runner, caches, local = parts(4)
    alone = caches.max_tokens  # (the target's alone: the whole budget)
    share_budget(config, runner, caches, local)
    per_token = kv_bytes_per_token(runner.model) + kv_bytes_per_token(local.model)
    assert caches.max_tokens == local.max_tokens == 4 * 1024 * 1024 // per_token < alone
    for model in (runner.model, local.model):
        assert model.pool.max_slots <= local.max_tokens // model.pool.slot_len
    runner.close()
    # (the demo pair: whole megabytes that hold one full context of the target's alone but
    # not of both's; the tiny pair's contexts are a fraction of a megabyte)
    config, runner, caches, local = parts(64, ("models/demo-target", "models/demo-drafter"))
    target, draft = kv_bytes_per_token(runner.model), kv_bytes_per_token(local.model)
    context = runner.meta.max_context
    smallest = -(-context * target // (1024 * 1024))
    assert smallest * 1024 * 1024 < context * (target + draft)
    runner.close()
    config, runner, caches, local = parts(smallest, ("models/demo-target",
                                                     "models/demo-drafter"))
    with pytest.raises(StartupError, match="--kv-budget-mb .* less than one full-context"):
        share_budget(config, runner, caches, local)
    runner.close()


def test_draft_caches_past_the_token_budget_go_least_recently_drafted_first(tiny_pair,
                                                                            target_model):
    """With a token budget (``max_tokens``) the draft caches at rest past it go, the least
    recently drafted first, never one the step drafts for; the tokens stay HF greedy's."""
    model, _ = target_model
    engine = _engine(tiny_pair[0], tiny_pair[1])
    _always(engine.local)
    engine.local.max_tokens = 40
    prompts = _prompts(model.config.vocab_size)
    for i, p in enumerate(prompts[:3]):
        assert asyncio.run(_decode(engine, f"s{i}", p, 16)) == hf_greedy(model, p, 16)
        held = {s: len(e.tokens) for s, e in engine.local.caches.items()}
        assert f"s{i}" in held  # (the one drafting now stays, whatever it holds)
        assert sum(held.values()) <= 40 or list(held) == [f"s{i}"]
    assert list(engine.local.caches) == ["s2"]  # each session's ~28 tokens: one fits


def test_draws_become_the_acceptance_rules_sparse_drafts():
    """Local draws as the acceptance rule takes them: ids [k], supports [k, S] zero-padded,
    q over them; greedy draws (one token each, q = 1) and sampled ones of several tokens."""
    from verifier_svc.local_drafts import _sparse

    greedy = _sparse([(5, [5], [1.0]), (7, [7], [1.0]), (9, [9], [1.0])])
    assert greedy.token_ids.tolist() == [5, 7, 9] and greedy.token_ids.dtype == torch.long
    assert greedy.q_ids.tolist() == [[5], [7], [9]] and greedy.q_ids.dtype == torch.long
    assert greedy.q_probs.tolist() == [[1.0], [1.0], [1.0]]
    assert greedy.q_probs.dtype == torch.float32
    sampled = _sparse([(6, [5, 6], [0.75, 0.25]), (7, [7], [1.0])])
    assert sampled.token_ids.tolist() == [6, 7]
    assert sampled.q_ids.tolist() == [[5, 6], [7, 0]]
    assert sampled.q_probs.tolist() == [[0.75, 0.25], [1.0, 0.0]]


def test_the_gate_holds_back_a_session_whose_drafts_do_not_pay_and_learns_from_steps(
        tiny_pair, target_model):
    """Steps of a level that keeps drafting (not exploring) draft only for sessions the gate
    allows (verifier_svc/draft_gate.py). Told that a drafting step costs three plain ones
    and that this level's drafts are all rejected, the gate holds a session back: its call
    decodes one pass a token, none drafted, and still gives HF greedy's tokens. A session
    the gate knows nothing against drafts, and its steps teach the gate both step times
    and the level's acceptance."""
    model, _ = target_model
    prompt = _prompts(model.config.vocab_size, (9,))[0]
    want = hf_greedy(model, prompt, 8)

    def decode(engine, session: str) -> list[int]:
        return asyncio.run(_decode(engine, session, prompt, 8))

    held = _engine(tiny_pair[0], tiny_pair[1])
    _always(held.local)
    gate = held.local.gate
    gate.observe_step(1, False, 0.002)
    gate.observe_step(1, True, 0.006)
    for _ in range(20):
        gate.observe_drafts("earlier", 1, 3, 0)
    assert decode(held, "s") == want
    assert held.local.drafted == 0 and held.local.held_back > 0
    assert held.stats.forward_passes >= 8

    free = _engine(tiny_pair[0], tiny_pair[1])
    _always(free.local)
    assert decode(free, "s") == want
    gate = free.local.gate
    assert free.local.drafted > 0 and free.local.held_back == 0
    assert (1, True) in gate._step_s and gate._levels[1].successes + gate._levels[1].failures > 0
