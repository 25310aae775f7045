"""Several groups of sessions, each behind its own shared prompt, or groups beside sessions
that share no prompt, run a pass as one operator (services/cascade_attention.py
``joint_plan``, ``specmesh_cpu::dense_layers`` with a prefix a group and the rows sharing none
attending their own slots from position 0): the demo target's logits and caches against the
layer loop that attends each group's prefix from Python, and the operator's checks on the
row-to-group map."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from services.batching import Row, shared_prefixes
from services.lean_llama import LeanLlama
from tests.test_lean_forward import DEMO_TARGET, _fed, _same_caches

TOL = {"rtol": 1e-4, "atol": 1e-4}  # the same attention split at another position


@pytest.fixture(scope="module")
def lean():
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    if not (lean.kernel_prefix and lean.kernel_layer):
        pytest.skip("prefix_attention needs AVX-512 or AVX2; this CPU has neither")
    return lean


def _sessions(lean, lengths: tuple[int, int], gap: bool, alternate: bool = False,
              groups: list[int] | None = None) -> list[list]:
    """17 sessions: 9 behind a prompt of lengths[0] tokens, 8 behind another of lengths[1]
    (the first nine, or with ``alternate`` every other one, as arrivals leave them), each
    with a few tokens of its own ([cache, length, group] each); with ``gap`` the fifth is
    left out, its slot held between the others'. ``groups``: each session's prompt instead
    (-1: a prompt of its own, lengths[0] + 40 tokens)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 8000, (n,), generator=g).tolist() for n in lengths]
    if groups is None:
        groups = [b % 2 for b in range(17)] if alternate else [0] * 9 + [1] * 8
    own = [torch.randint(0, 8000, (lengths[0] + 40,), generator=g).tolist() for _ in groups]
    fed = _fed(lean, [(prompts[grp] if grp >= 0 else own[b])
                      + torch.randint(0, 8000, (4 + 3 * b,), generator=g).tolist()
                      for b, grp in enumerate(groups)])
    return [[*c, grp] for i, (c, grp) in enumerate(zip(fed, groups, strict=True))
            if not (gap and i == 4)]


def _pass(lean, caches: list[list], step: int, lengths: tuple[int, int], one_op: bool,
          own, width: int = 1, groups: int = 2) -> tuple[list[torch.Tensor], dict[str, int]]:
    """One pass of ``width`` tokens a session (decode, or verify), as one operator or layer
    by layer: the logits and the operators it ran (``groups``: the groups of the pass)."""
    lean._uniform = own if one_op else lambda tokens: False
    rows = [Row(tokens=list(range(3 + step + b, 3 + step + b + width)), kv=kv, start=s,
                keep=width,
                chain=list(range(1000 * (grp + 1), 1000 * (grp + 1) + lengths[grp] // 16))
                if grp >= 0 else (), chain_tokens=lengths[grp] // 16 * 16 if grp >= 0 else 0)
            for b, (kv, s, grp) in enumerate(caches)]
    shared = shared_prefixes(rows)
    assert len(shared) == groups
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = lean.forward_ragged(rows, shared)
    for c in caches:
        c[1] += width
    return logits, {e.key: e.count for e in prof.key_averages()}


@pytest.mark.parametrize("threads, gap, width, alternate", [
    (1, False, 1, False), (2, False, 1, False), (2, True, 1, False), (2, True, 2, False),
    (1, False, 1, True), (2, False, 1, True), (2, True, 2, True)],
    ids=["one-thread", "two-threads", "two-threads-and-a-gap", "two-token-rows",
         "alternate-slots-one-thread", "alternate-slots-two-threads",
         "alternate-slots-two-token-rows-and-a-gap"])
def test_two_groups_behind_their_own_prompts_run_as_one_operator_with_the_same_floats(
        lean, threads, gap, width, alternate):
    """Two groups of 8-9 sessions behind two 400-token prompts: over three decode steps one
    ``dense_layers`` call a pass (no ``prefix_attention`` from Python), the very logits and
    cache contents of the layer loop, which attends each group's prefix in a call of its
    own, on one thread and on two (each thread then takes one group's rows, wherever their
    slots lie), with the groups' sessions in alternate slots, with a session at rest holding
    a slot between the rows, and with rows of two tokens (verify rows; 16 of them, the 32
    tokens a one-operator pass takes)."""
    _as_the_layer_loop(lean, threads, gap, width, alternate=alternate)


def _as_the_layer_loop(lean, threads: int, gap: bool, width: int, alternate: bool = False,
                       layout: list[int] | None = None) -> None:
    """Three passes of the sessions (``_sessions``, behind 400-token prompts) as one
    operator and layer by layer on ``threads`` threads: one ``dense_layers`` call a pass
    against each group's ``prefix_attention`` a layer, the very logits and caches."""
    own, count = lean._uniform, torch.get_num_threads()
    lengths = (400, 400)
    groups = 2 if layout is None else len({grp for grp in layout if grp >= 0})
    one = _sessions(lean, lengths, gap, alternate, groups=layout)
    layered = _sessions(lean, lengths, gap, alternate, groups=layout)
    try:
        torch.set_num_threads(threads)
        for step in range(3):
            got, ran = _pass(lean, one, step, lengths, True, own, width, groups)
            want, ran_layered = _pass(lean, layered, step, lengths, False, own, width, groups)
            assert ran.get("specmesh_cpu::dense_layers", 0) == 1
            assert ran.get("specmesh_cpu::prefix_attention", 0) == 0
            assert ran_layered.get("specmesh_cpu::prefix_attention", 0) == (
                groups * len(lean.layers))
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
    finally:
        lean._uniform = own
        torch.set_num_threads(count)
    _same_caches([c[:2] for c in one], [c[:2] for c in layered])


LONE = -1  # a session behind a prompt of its own


@pytest.mark.parametrize("threads, layout, gap, width", [
    (1, [0] * 8 + [LONE] * 8, False, 1), (2, [0] * 8 + [LONE] * 8, False, 1),
    (2, [LONE, 0] * 8, True, 1), (2, [0, LONE] * 8, False, 2),
    (2, [0] * 8 + [LONE] * 2, False, 1), (1, [0, 1, LONE] * 4 + [0, 1] * 4, False, 1),
    (2, [0, 1, 0, 1] + [LONE, 0, 1] * 4 + [0, 1, 0, 1], True, 1)],
    ids=["eight-beside-eight-one-thread", "eight-beside-eight-two-threads",
         "alternate-slots-and-a-gap", "alternate-slots-two-token-rows", "eight-beside-two",
         "two-groups-beside-four-one-thread", "two-groups-beside-four-two-threads-and-a-gap"])
def test_groups_beside_sessions_sharing_no_prompt_run_as_one_operator_with_the_same_floats(
        lean, threads, layout, gap, width):
    """Groups of 8 sessions behind 400-token prompts beside sessions behind prompts of their
    own (440 tokens and more): over three decode steps one ``dense_layers`` call a pass, the
    very logits and cache contents of the layer loop (the groups' prefixes attended in calls
    of their own, the other sessions over their whole slots), on one thread and on two (the
    rows sharing none then go to the claims that cost least), in alternate slots, with a
    session at rest between the rows (the fifth session, one sharing none) and with rows of
    two tokens. Left as it was before, the pass (70-350 positions saved a token) dropped its
    groups."""
    _as_the_layer_loop(lean, threads, gap, width, layout=layout)


def test_groups_behind_prompts_of_different_lengths_attend_from_the_shorter_one(lean):
    """Prompts of 400 and 448 tokens: the one operator reads both groups' first 400
    positions as their prefixes and the rest in each row's own pass (the layer loop splits
    the second group at 448), the same attention to float rounding, the same next tokens."""
    own = lean._uniform
    lengths = (400, 448)
    one, layered = _sessions(lean, lengths, False), _sessions(lean, lengths, False)
    try:
        for step in range(2):
            got, ran = _pass(lean, one, step, lengths, True, own)
            want, _ = _pass(lean, layered, step, lengths, False, own)
            assert ran.get("specmesh_cpu::dense_layers", 0) == 1
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, **TOL)
                assert torch.equal(a.argmax(-1), b.argmax(-1))
    finally:
        lean._uniform = own


def test_the_operator_rejects_a_row_to_group_map_that_does_not_fit(lean):
    """``dense_layers`` with two prefixes a layer needs each row's group, 0 or 1, or -1 for a
    row that shares none: a map of the wrong length, naming a third group or below -1 is
    refused with what to fix."""
    own = lean._uniform
    caches = _sessions(lean, (400, 400), False)
    run = lean.uniform_pass.run
    seen = []

    def checked(x, p, segment, cos, sin, prefix=(), prefix_of=None):
        seen.append(prefix_of.tolist())
        for bad in (prefix_of[:-1], torch.full_like(prefix_of, 2), torch.full_like(prefix_of, -2)):
            with pytest.raises(RuntimeError, match="prefix_of must be empty for one prefix"):
                run(x, p, segment, cos, sin, prefix, bad)
        return run(x, p, segment, cos, sin, prefix, prefix_of)

    try:
        lean.uniform_pass.run = checked
        _pass(lean, caches, 0, (400, 400), True, own)
    finally:
        lean.uniform_pass.run = run
        lean._uniform = own
    assert seen == [[0] * 9 + [1] * 8]
