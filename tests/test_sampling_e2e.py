"""The sampling path through the real services is lossless: the first generated token of a
request is distributed as the target's warped distribution, although it came from a
drafter whose distribution is very different (so rejections and residual draws happen).

The test's mesh runs its gateway with --no-lead-round: by default a new session's first
token comes from the verifier alone (the drafter computes the prompt beside it), which
would leave no draft to accept or reject at the first position."""

from __future__ import annotations

import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.sampling import SamplingParams, warp_logits
from specmesh.client import GatewayClient, build_request
from tests.conftest import launch

CANDIDATES = ["def f(x):", "import os", "class A:", "# The", "return", "for i in", "x = ",
              "while", "print(", "if not", "self.", "try:", "with open(", "\"\"\"", "from"]
PARAMS = SamplingParams(temperature=1.0, top_k=4, top_p=1.0)
N = 800
DELTA = 1e-4


def first_token_dist(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    return warp_logits(logits, PARAMS)  # [V]


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.fixture(scope="module")
def drafting_mesh(tiny_pair, redis_url, tmp_path_factory):
    """A mesh whose first round drafts, like every later one (see the module docstring)."""
    m = launch(tiny_pair, redis_url, tmp_path_factory.mktemp("sampling-mesh-logs"),
               extra_gateway_args=("--no-lead-round",))
    yield m
    m.stop()


def test_first_token_follows_the_target_distribution_through_the_mesh(
        drafting_mesh, target_model, draft_model):
    mesh = drafting_mesh
    model, tokenizer = target_model
    # A prompt where draft and target disagree a lot, yet not completely (the acceptance
    # probability of a draft is 1 - TV(p, q)), so both accepted drafts and residual draws occur.
    scored = []
    for prompt in CANDIDATES:
        ids = tokenizer(prompt)["input_ids"]
        p, q = first_token_dist(model, ids), first_token_dist(draft_model, ids)
        if tv(p, q) < 0.8:
            scored.append((tv(p, q), prompt, p, q))
    tv_pq, prompt, p, q = max(scored, key=lambda s: s[0])
    support = int((p > 0).sum())
    # Distribution-free bound on the empirical TV distance for a correct sampler (prob. >= 1-DELTA).
    bound = 0.5 * math.sqrt((support - 1) / N) + math.sqrt(math.log(1 / DELTA) / (2 * N))
    assert tv_pq > 2 * bound, "the test has no power: draft and target agree too well"

    def one(seed: int) -> int:
        with GatewayClient(mesh.gateway_address) as client:
            reply = client.generate(build_request(
                prompt, max_new_tokens=2, temperature=PARAMS.temperature, top_k=PARAMS.top_k,
                seed=seed, num_draft_tokens=1))
        return reply.token_ids[0], reply.usage.accepted_draft_tokens

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(N)))
    counts = Counter(token for token, _ in results)
    empirical = torch.zeros_like(p)
    for token, n in counts.items():
        empirical[token] = n / N
    assert tv(empirical, p) < bound, (tv(empirical, p), bound)
    assert tv(empirical, q) > bound  # and it is not the draft's distribution
    rejected = sum(1 for _, accepted in results if accepted == 0)
    assert 0.1 * N < rejected < 0.95 * N  # drafts were both accepted and rejected

    # Seeded requests are reproducible through the services.
    assert [one(s) for s in range(5)] == results[:5]


def test_seeded_sampling_is_reproducible_without_a_fixed_k(mesh):
    """With the draft length left to the gateway (adaptive), a seed still reproduces."""
    with GatewayClient(mesh.gateway_address) as client:
        runs = [list(client.generate(build_request("class A:", max_new_tokens=24,
                                                   temperature=0.9, seed=11)).token_ids)
                for _ in range(3)]
        other = list(client.generate(build_request("class A:", max_new_tokens=24,
                                                   temperature=0.9, seed=12)).token_ids)
    assert runs[0] == runs[1] == runs[2]
    assert other != runs[0]


def test_seeded_target_only_sampling_keeps_one_token_rounds_and_reproduces(mesh):
    """A seeded sample without speculation draws one token a round, each with its round's
    seed: plain rounds of several tokens (--plain-tokens) would make its draws depend on
    how many tokens each round got, which other requests in the same step decide. An
    unseeded one takes the plain rounds."""
    def run(**kw):
        return client.generate(build_request("class A:", max_new_tokens=24, temperature=0.9,
                                             disable_speculation=True, **kw))

    with GatewayClient(mesh.gateway_address) as client:
        runs = [run(seed=11) for _ in range(2)]
        unseeded = run()
    assert list(runs[0].token_ids) == list(runs[1].token_ids)
    assert runs[0].usage.rounds == runs[0].usage.completion_tokens
    assert unseeded.usage.rounds < unseeded.usage.completion_tokens
