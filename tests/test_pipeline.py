"""Pipelined drafting: round r+1's drafts are prepared while round r is verified.

Two real meshes, the same tiny target: one whose drafter IS the target (every draft and
every guess of the verifier's extra token is right, so every prepared draft must be used),
and the tiny pair (guesses often wrong: prepared drafts get dropped). In both, greedy output
must equal HF generate and must not change with --no-pipeline. The gateway's Prometheus
counters say what became of the prepared drafts.
"""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.local_mesh import MeshSpec, add_gateway, free_port, start_mesh
from specmesh.client import GatewayClient, build_request
from tests.conftest import hf_greedy

PROMPTS = ["def fibonacci(n):\n", "import os\n\nclass Config:\n", "for i in range(10):\n"]
TOKENS = 40
K = 3


def _pipeline_counts(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {"used": 0.0, "dropped": 0.0, "none": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "specmesh_pipeline_drafts_total":
                out[sample.labels["outcome"]] += sample.value
    return out


@pytest.fixture(scope="module", params=["self-draft", "tiny-pair"])
def pipelined(request, tiny_pair, redis_url, tmp_path_factory):
    """Two gateways on the same drafter and verifier: --pipeline (trees in every round:
    --no-tree-switch) and --no-pipeline."""
    target, draft = tiny_pair
    drafter = target if request.param == "self-draft" else draft
    metrics, log_dir = free_port(), tmp_path_factory.mktemp("pipe")
    spec = MeshSpec(target=target, draft=drafter, port=free_port(), redis_url=redis_url,
                    log_dir=log_dir, extra_gateway_args=("--metrics-port", str(metrics),
                                                         "--no-tree-switch"))
    mesh = start_mesh(spec)
    try:
        plain = add_gateway(mesh, spec, free_port(), ("--no-pipeline",), log_dir, "plain")
        yield request.param, mesh, plain.address, metrics
    finally:
        mesh.stop()


def test_pipelined_output_is_the_targets_and_drafts_are_used_when_guesses_hold(
        pipelined, target_model):
    kind, mesh, plain_address, metrics = pipelined
    model, tokenizer = target_model
    before = _pipeline_counts(metrics)
    rounds = 0
    with GatewayClient(mesh.gateway_address) as client, \
            GatewayClient(plain_address) as plain:
        for prompt in PROMPTS:
            request = build_request(prompt, max_new_tokens=TOKENS, num_draft_tokens=K)
            reply = client.generate(request, timeout=60)
            want = hf_greedy(model, tokenizer(prompt)["input_ids"], TOKENS)
            assert list(reply.token_ids) == want[:len(reply.token_ids)]
            assert len(reply.token_ids) == TOKENS or reply.token_ids[-1] == tokenizer.eos_token_id
            assert list(plain.generate(request, timeout=60).token_ids) == list(reply.token_ids)
            rounds += reply.usage.rounds
    after = _pipeline_counts(metrics)
    used, dropped, none = (after[o] - before[o] for o in ("used", "dropped", "none"))
    # One outcome per round that drafted: all but, per request, the lead round (the
    # verifier alone while the drafter computes the prompt) and a last round left with a
    # budget of one token (k = 0).
    assert rounds - 2 * len(PROMPTS) <= used + dropped + none <= rounds - len(PROMPTS)
    if kind == "self-draft":
        # The lead round prepares round two's draft (its guess of the verifier's token is
        # right), the verify of every later round the next: all prepared and right.
        assert none == 0
        assert dropped == 0
        assert used == rounds - len(PROMPTS)
    else:
        assert dropped > 0, "a drafter that disagrees with the target must miss some guesses"
