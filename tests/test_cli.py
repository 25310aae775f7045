"""The commands a new user runs: `specmesh up`, then `specmesh generate`, then Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from services.local_mesh import free_port
from services.tiny_models import build_tiny_pair

SPECMESH = [sys.executable, "-m", "specmesh.cli"]


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} never appeared; output:\n{''.join(seen)}")


def test_up_generate_and_ctrl_c_leave_nothing_behind(tmp_path):
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    up = subprocess.Popen([*SPECMESH, "up", "--port", str(port), "--log-dir", str(tmp_path)],
                          stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        banner = _wait_for_line(up, "SpecMesh is up", 240)
        for tier in ("redis", "verifier-0", "drafter-0", "gateway"):
            assert tier in banner
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) == 4  # redis, verifier, drafter, gateway: one process each

        gen = subprocess.run([*SPECMESH, "generate", "def fib(n):", "--addr",
                              f"127.0.0.1:{port}", "--max-new-tokens", "24"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert gen.returncode == 0, gen.stderr
        summary = gen.stderr.strip().splitlines()[-1]
        assert "24 tokens" in summary or "finish eos" in summary, summary
        assert "rounds" in summary and "acceptance" in summary and "tokens/s" in summary
        assert gen.stdout.strip(), "no text was streamed"

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        time.sleep(0.5)
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
    finally:
        if up.poll() is None:
            up.kill()


def test_up_refuses_a_pair_that_does_not_share_a_vocabulary(tmp_path):
    target, _ = build_tiny_pair(tmp_path / "a", vocab_size=512)
    _, other_draft = build_tiny_pair(tmp_path / "b", vocab_size=384)
    result = subprocess.run([*SPECMESH, "up", "--target", str(target), "--draft",
                             str(other_draft), "--port", str(free_port())],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "vocabulary" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["drafter", "--model", "x", "--max-draft-tokens", "0"], "max draft tokens"),
    (["gateway", "--redis", "http://x", "--verifiers", "h:1"], "redis URL"),
    (["gateway", "--redis", "redis://x", "--verifiers", "nohostport"], "HOST:PORT"),
])
def test_service_commands_reject_bad_configuration(args, message):
    result = subprocess.run([*SPECMESH, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
