"""The commands a new user runs: `specmesh up`, then `specmesh generate`, then Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

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


def _free_port_range(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now."""
    while True:
        base = free_port()
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


def test_up_generate_and_ctrl_c_leave_nothing_behind(tmp_path):
    """`SPECMESH_METRICS_PORT=BASE make up` (each service on its own metrics port), a gateway
    option passed through, a generate, an ngram request the mesh cannot serve, then Ctrl-C:
    no process and no temporary folder is left."""
    port, metrics = free_port(), _free_port_range(3)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "SPECMESH_METRICS_PORT": str(metrics), "TMPDIR": str(tmp_path / "tmp")}
    http = free_port()
    up = subprocess.Popen([*SPECMESH, "up", "--port", str(port), "--num-draft-tokens", "2",
                           "--no-pipeline", "--http-port", str(http)],
                          stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        banner = _wait_for_line(up, "SpecMesh is up", 240)
        # The OpenAI-compatible HTTP API's address, printed beside the gRPC one, answers.
        assert f"OpenAI-compatible HTTP API: http://127.0.0.1:{http}/v1" in _wait_for_line(
            up, "OpenAI-compatible HTTP API", 10)
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10) as reply:
            assert json.load(reply)["data"][0]["object"] == "model"
        for tier in ("redis", "verifier-0", "drafter-0", "gateway"):
            assert tier in banner
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) == 4  # redis, verifier, drafter, gateway: one process each
        assert len(list((tmp_path / "tmp").glob("specmesh-*"))) == 1
        for name, metrics_port in (("gateway", metrics), ("verifier-0", metrics + 1),
                                   ("drafter-0", metrics + 2)):
            line = next(line for line in banner.splitlines() if f" {name} " in line + " ")
            assert f":{metrics_port}/metrics" in line, line
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                        timeout=10) as reply:
                assert reply.status == 200
        gateway_cmd = next(" ".join(c.cmdline()) for c in children
                           if " gateway " in " ".join(c.cmdline()))
        assert "--num-draft-tokens 2" in gateway_cmd and "--no-pipeline" in gateway_cmd

        ngram = subprocess.run([*SPECMESH, "generate", "x", "--addr", f"127.0.0.1:{port}",
                                "--drafter", "ngram"],
                               capture_output=True, text=True, timeout=120, env=env)
        assert ngram.returncode == 1
        assert "INVALID_ARGUMENT" in ngram.stderr and "--ngram-drafters 1" in ngram.stderr

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
        assert not list((tmp_path / "tmp").glob("specmesh-*")), "temporary folder left behind"
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
    (["verifier", "--model", "x", "--prefill-threads", "-1"], "--prefill-threads"),
    (["verifier", "--model", "x", "--plain-threads", "-1"], "--plain-threads"),
    (["drafter", "--model", "x", "--plain-threads", "2"], "--plain-threads"),  # verifier's only
    (["verifier", "--model", "x", "--stall-s", "-1"], "stall time must be >= 0 s"),
    (["gateway", "--redis", "http://x", "--verifiers", "h:1"], "redis URL"),
    (["gateway", "--redis", "redis://x", "--verifiers", "nohostport"], "HOST:PORT"),
])
def test_service_commands_reject_bad_configuration(args, message):
    result = subprocess.run([*SPECMESH, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


def test_service_options_default_to_their_config_defaults():
    """Each option of `gateway`, `drafter` and `verifier` that names a config field defaults to
    that field's default, so a default changed in services/config.py cannot silently differ
    on the command line (the drafter's --device cpu is the one deliberate exception)."""
    import dataclasses
    import inspect

    from services.config import GatewayConfig, ModelServiceConfig
    from specmesh import cli

    deliberate = {("drafter", "device")}
    checked = 0
    for command, config in ((cli.gateway, GatewayConfig), (cli.drafter, ModelServiceConfig),
                            (cli.verifier, ModelServiceConfig)):
        defaults = {f.name: f.default for f in dataclasses.fields(config)
                    if f.default is not dataclasses.MISSING and not isinstance(f.default, tuple)}
        for name, param in inspect.signature(command).parameters.items():
            if name in defaults and (command.__name__, name) not in deliberate:
                assert param.default == defaults[name], (command.__name__, name)
                checked += 1
    assert checked >= 25
