"""Chaos under load (issue #12 item 2): two gateways, two drafters, two verifiers and a Redis,
each a real process; concurrent greedy streams while every one of them is SIGKILLed and started
again in turn. The clients resume a cut stream on the other gateway (session_id + resume_from)
or send a request again as the README says; every request must complete, and every output must
equal the target's own HF greedy generate for its prompt. Bounded: one round of kills (seven),
about two minutes on a 2-core machine."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specmesh.chaos import KILL_ORDER, ChaosOptions, run_chaos, start_chaos_mesh
from specmesh.chaos_cli import build_chaos_report
from specmesh.cli import app
from specmesh.loadtest import PROMPTS
from tests.conftest import hf_greedy

MAX_NEW_TOKENS = 24
FINISH_LENGTH, FINISH_EOS = 1, 2
SLOW_S = 20.0  # no request may take this long (see the end of the chaos test)


@pytest.fixture(scope="module")
def hf_reference(target_model) -> dict[int, tuple[list[int], int]]:
    """What an intact mesh must answer: HF generate(do_sample=False) of the target."""
    model, tokenizer = target_model
    out = {}
    for i, prompt in enumerate(PROMPTS):
        tokens = hf_greedy(model, tokenizer(prompt)["input_ids"], MAX_NEW_TOKENS)
        out[i] = (tokens, FINISH_LENGTH if len(tokens) == MAX_NEW_TOKENS else FINISH_EOS)
    return out


@pytest.mark.timeout(600)  # ~2 min alone; each restart is ~4 CPU seconds, slower on a busy machine
def test_streams_survive_every_tier_and_redis_killed_in_turn(tiny_pair, hf_reference,
                                                             tmp_path):
    cmesh = start_chaos_mesh(*tiny_pair, tmp_path / "logs")
    try:
        opts = ChaosOptions(streams=3, cycles=1, duration_s=240, max_new_tokens=MAX_NEW_TOKENS,
                            pause_s=1.5, request_timeout_s=120, restart_timeout_s=120)
        records, kills, wall_s = run_chaos(cmesh, PROMPTS, opts)
        # every process is up again and answers after the chaos
        assert all(p.popen.poll() is None for p in cmesh.mesh.procs)
        assert cmesh.redis.popen.poll() is None
    finally:
        cmesh.stop()
    report = build_chaos_report(records, kills, wall_s, hf_reference, opts)

    assert [k.name for k in kills] == list(KILL_ORDER), report["kill_log"]
    assert report["kills"] == {"gateway": 2, "drafter": 2, "verifier": 2, "redis": 1}
    lost = [(r.error, r.prompt_index, len(r.tokens), r.resumes, r.retries, dict(r.transient),
             round(r.latency_s, 1)) for r in records if not r.completed]
    assert report["lost"] == 0, (lost, report["kill_log"])
    for r in records:
        assert (r.tokens, r.finish) == hf_reference[r.prompt_index], (
            r.prompt_index, r.resumes, r.retries, dict(r.transient))
        assert r.completion_tokens == len(r.tokens)
    assert report["all_equal"] and report["requests"] == report["completed"] >= 2 * len(kills)
    # A gateway is killed while it streams to a client: that stream went on on the other
    # gateway by resume_from, not by sending the request again.
    assert report["requests_resumed"] >= 1, report
    assert report["tokens_total"] == sum(len(r.tokens) for r in records)
    # No request waits for a restart (there is always a second replica): the longest wait a
    # client should see is a resume behind the dead gateway's lease (<= 5 s) or Redis down
    # (2 s). Internal calls time out after 30 s, so a request this slow met a replica call
    # that got no answer instead of failing over.
    slowest = max(records, key=lambda r: r.latency_s)
    assert slowest.latency_s < SLOW_S, (slowest.latency_s, dict(slowest.transient),
                                        report["kill_log"])


def test_load_chaos_starts_its_own_mesh():
    """--chaos kills processes it started itself; it refuses a remote mesh (--addr)."""
    result = CliRunner().invoke(app, ["load", "--chaos", "--addr", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "--chaos" in result.output and "--addr" in result.output


def test_seeded_samples_draw_the_reference_again_so_chaos_can_compare_them(mesh):
    """`specmesh load --chaos --temperature T`: each prompt is sampled with a seed of its own
    (``sample_seed``), so the intact mesh's reference and a chaos client's request draw the
    same tokens; they are not the greedy ones, and another --seed draws others."""
    from specmesh.chaos import chaos_request, reference_outputs
    from specmesh.client import GatewayClient

    prompts = PROMPTS[:3]
    sampled = ChaosOptions(max_new_tokens=16, temperature=1.0, request_timeout_s=60)
    reference = reference_outputs(mesh.gateway_address, prompts, sampled)
    with GatewayClient(mesh.gateway_address) as client:
        for i, prompt in enumerate(prompts):
            rec = chaos_request([client, client], 0, i, prompt, sampled)
            assert rec.completed and (rec.tokens, rec.finish) == reference[i], i
    greedy = reference_outputs(mesh.gateway_address, prompts, ChaosOptions(max_new_tokens=16))
    other = reference_outputs(mesh.gateway_address, prompts,
                              ChaosOptions(max_new_tokens=16, temperature=1.0, seed=1))
    assert reference != greedy and reference != other
