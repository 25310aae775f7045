"""Errors that say what to fix (issue #12 item 5): bad CLI values are one line and exit code 2,
bytes that are not a request get INVALID_ARGUMENT on every service, help texts are complete,
`python -m` helpers honour --help, and the summary line is right for target-only requests."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import typer.main

from specmesh.bench_prompts import PROMPTS_PATH
from specmesh.cli import app
from specmesh.generate_cli import summary
from specmesh.v1 import gateway_pb2

SPECMESH = [sys.executable, "-m", "specmesh.cli"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args, names", [
    (["generate", "x", "--seed", "-1"], "--seed"),
    (["generate", "x", "--max-new-tokens", "10000000000"], "--max-new-tokens"),
    (["generate", "x", "--top-p", "2"], "--top-p"),
    (["generate", "x", "--drafter", "big"], "--drafter"),
    (["generate", "x", "--tls-ca", "/nonexistent/ca.pem"], "/nonexistent/ca.pem"),
    (["up", "--target", "/nonexistent", "--draft", "/nonexistent"], "/nonexistent"),
    (["up", "--verifiers", "0"], "--verifiers"),
    (["up", "--metrics-port", "65534"], "--metrics-port"),
    (["verifier", "--model", "./no/such/model"], "./no/such/model"),
    # a CUDA device this machine does not have (no CUDA here; no machine has 100 GPUs)
    (["verifier", "--model", str(ROOT / "models/demo-target"), "--device", "cuda:99"],
     "--device"),
    (["drafter", "--model", str(ROOT / "models/demo-drafter"), "--device", "cuda:99"],
     "--device"),
    (["bench", "--drafter-device", "cuda:99", "--no-hf"], "--drafter-device"),
    (["bench", "--verifier-replicas", "0", "--no-hf"], "--verifier-replicas"),
    (["bench", "--shared-prefixes", "2", "--no-hf"], "--shared-prefixes"),
    (["bench", "--shared-prefix", "100", "--shared-prefixes", "0", "--no-hf"],
     "--shared-prefixes"),
    (["bench", "--unshared-every", "2", "--no-hf"], "--unshared-every"),
    (["bench", "--shared-prefix", "100", "--unshared-every", "1", "--no-hf"], "--unshared-every"),
    (["bench", "--addr", "127.0.0.1:1", "--verifier-replicas", "2", "--no-hf"],
     "--verifier-replicas"),
    (["verifier", "--model", str(ROOT / "models/demo-target"), "--local-drafter",
      "./no/such/drafter"], "./no/such/drafter"),
    (["verifier", "--model", str(ROOT / "models/demo-target"), "--local-draft-tokens", "17"],
     "local draft tokens must be in 1..16"),
    (["verifier", "--model", str(ROOT / "models/demo-target"), "--local-draft-sessions", "0"],
     "--local-draft-sessions"),
    (["gateway", "--redis", "redis://x", "--parent-pid", "-1"], "--parent-pid"),
    (["generate", "x", "--no-such-option"], "--no-such-option"),
])
def test_bad_values_are_one_line_and_exit_code_2(args, names):
    result = subprocess.run([*SPECMESH, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "repo id" not in result.stderr
    assert names in lines[0] and lines[0].startswith("error: "), lines[0]


def test_a_missing_model_path_is_named_as_such():
    result = subprocess.run([*SPECMESH, "up", "--target", "/nonexistent", "--draft",
                             "/nonexistent"], capture_output=True, text=True, timeout=120)
    assert "no model directory at /nonexistent" in result.stderr


def test_a_hub_name_that_cannot_be_loaded_is_one_line_before_anything_starts(tmp_path):
    """A relative path that does not exist reads as a hub name: up checks it loads before
    starting anything, instead of a verifier dying later with a traceback in its log."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([*SPECMESH, "up", "--target", "no-such-org/no-such-model",
                             "--draft", "no-such-org/no-such-model"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "no-such-org/no-such-model is not a local model directory" in lines[0], lines[0]
    assert "SERVING" not in result.stderr


def test_a_local_drafter_of_another_vocabulary_is_refused_with_what_to_fix(tiny_pair):
    """The tiny target (512 tokens) with the demo drafter (8,192) beside it: the verifier
    stops at start with one error line that names both, exit code 2, no traceback."""
    result = subprocess.run([*SPECMESH, "verifier", "--model", tiny_pair[0], "--port", "0",
                             "--local-drafter", str(ROOT / "models/demo-drafter")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --local-drafter") and "another vocabulary" in last, last
    assert "8192 tokens against 512" in last, last


@pytest.mark.parametrize("budget, drafter, says", [
    ("1", (), "error: --kv-budget-mb 1 holds 113 tokens, less than one full-context"),
    ("9", ("--local-drafter", str(ROOT / "models/demo-drafter")),
     "error: --kv-budget-mb 9 holds 837 tokens of the target's and --local-drafter's caches"),
], ids=["target", "target-and-local-drafter"])
def test_a_kv_budget_short_of_one_full_context_is_refused_in_one_line(budget, drafter, says):
    """1 MB holds 113 of the demo target's 9,216-byte tokens, short of its 1,024-token
    context; 9 MB hold one full context of the target's alone but not with the demo
    drafter's caches beside it (2,048 bytes a token more). Either way: one error line that
    says what to raise, exit code 2, no traceback."""
    result = subprocess.run([*SPECMESH, "verifier", "--model", str(ROOT / "models/demo-target"),
                             "--port", "0", "--kv-budget-mb", budget, *drafter],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(says) and last.endswith("raise it"), last


def _options():
    for name, command in typer.main.get_command(app).commands.items():
        for param in command.params:
            if param.param_type_name == "option":
                yield name, param


def test_every_option_has_help_and_no_double_negatives():
    missing = [f"{name} {param.opts[0]}" for name, param in _options()
               if not (param.help or "").strip()]
    assert not missing, f"options without help: {missing}"
    doubled = [f"{name} {opt}" for name, param in _options()
               for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--no-no-")]
    assert not doubled, doubled


def test_generate_help_shows_each_flag_once():
    out = subprocess.run([*SPECMESH, "generate", "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "--no-speculation" in out and "--no-no-speculation" not in out
    assert "--no-keep-session" not in out


def test_python_m_bench_prompts_help_prints_help_and_writes_nothing():
    before = (PROMPTS_PATH.read_bytes(), PROMPTS_PATH.stat().st_mtime_ns)
    result = subprocess.run([sys.executable, "-m", "specmesh.bench_prompts", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout and "--out" in result.stdout
    assert "wrote" not in result.stdout
    assert (PROMPTS_PATH.read_bytes(), PROMPTS_PATH.stat().st_mtime_ns) == before


HELPERS = [["-m", "specmesh.bench_prompts"], ["specmesh/protogen.py"],
           ["-m", "services.tiny_models"], ["-m", "training.demo"], ["-m", "training.distill"],
           ["-m", "training.evaluate"], ["-m", "training.card"]]
WRITTEN_BY_HELPERS = [PROMPTS_PATH, *sorted((ROOT / "specmesh" / "v1").glob("*.py")),
                      ROOT / "models" / "README.md"]


@pytest.mark.parametrize("helper", HELPERS, ids=lambda h: h[-1])
def test_helpers_honour_help_and_write_nothing(helper):
    before = {path: path.stat().st_mtime_ns for path in WRITTEN_BY_HELPERS if path.exists()}
    result = subprocess.run([sys.executable, *helper, "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower() and "wrote" not in result.stdout
    assert {path: path.stat().st_mtime_ns for path in before} == before


def test_python_m_bench_prompts_writes_where_told(tmp_path):
    out = tmp_path / "prompts.json"
    result = subprocess.run([sys.executable, "-m", "specmesh.bench_prompts", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert '"prompts"' in out.read_text()


def test_summary_line_of_a_target_only_request():
    usage = gateway_pb2.Usage(prompt_tokens=3, completion_tokens=1, rounds=1)
    line = summary(usage, 0.5, "length", "s1", speculation=False)
    assert line.startswith("[1 token, 1 round, target only,"), line
    assert "acceptance" not in line and "rounds" not in line


def test_summary_line_of_a_speculative_request():
    usage = gateway_pb2.Usage(completion_tokens=24, rounds=8, draft_tokens=24,
                              accepted_draft_tokens=18)
    line = summary(usage, 2.0, "eos", "s2", speculation=True)
    assert line == ("[24 tokens, 8 rounds, acceptance 75% of 24 draft tokens, 12.0 tokens/s, "
                    "finish eos, session s2]")


def test_generate_target_only_end_to_end(mesh):
    result = subprocess.run([*SPECMESH, "generate", "def f(x):", "--addr", mesh.gateway_address,
                             "--max-new-tokens", "1", "--no-speculation"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("[1 token, 1 round, target only,"), line


GARBAGE = b"\x0a\xff\xff"  # field 1, length-delimited, with a truncated length


def _service_methods(mesh):
    return [(mesh.gateway_address, "/specmesh.v1.Gateway/Generate", False),
            (mesh.gateway_address, "/specmesh.v1.Gateway/GenerateStream", True),
            (mesh.gateway_address, "/specmesh.v1.Gateway/CloseSession", False),
            (mesh.drafter_addresses[0], "/specmesh.v1.Drafter/Draft", False),
            (mesh.drafter_addresses[0], "/specmesh.v1.Drafter/GetModelInfo", False),
            (mesh.verifier_addresses[0], "/specmesh.v1.Verifier/Verify", False),
            (mesh.verifier_addresses[0], "/specmesh.v1.Verifier/Release", False)]


def test_unparseable_bytes_get_invalid_argument_on_every_service(mesh):
    def identity(data: bytes) -> bytes:
        return data

    for address, method, streaming in _service_methods(mesh):
        with grpc.insecure_channel(address) as channel:
            if streaming:
                call = channel.unary_stream(method, request_serializer=identity,
                                            response_deserializer=identity)
                with pytest.raises(grpc.RpcError) as err:
                    list(call(GARBAGE, timeout=30))
            else:
                call = channel.unary_unary(method, request_serializer=identity,
                                           response_deserializer=identity)
                with pytest.raises(grpc.RpcError) as err:
                    call(GARBAGE, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value)
        assert "not a valid specmesh.v1." in err.value.details(), err.value.details()
        assert "DecodeError" not in err.value.details()


def test_services_still_serve_after_garbage(mesh):
    from specmesh.client import GatewayClient, build_request

    with GatewayClient(mesh.gateway_address) as client:
        reply = client.generate(build_request("import os", max_new_tokens=2))
    assert reply.usage.completion_tokens >= 1


@pytest.fixture
def taken_port():
    """A port another process (here: this one) listens on, as an operator's clash would be."""
    with socket.create_server(("0.0.0.0", 0)) as held:
        yield held.getsockname()[1]


@pytest.mark.parametrize("args, option", [
    (["verifier", "--host", "127.0.0.1", "--port", "{port}"], "--port"),
    (["verifier", "--port", "0", "--metrics-port", "{port}"], "--metrics-port"),
    (["drafter", "--host", "127.0.0.1", "--port", "{port}"], "--port"),
    (["verifier", "--port", "0", "--health-port", "{port}"], "--health-port"),
    (["gateway", "--redis", "redis://127.0.0.1:1", "--verifiers", "127.0.0.1:1", "--host",
      "127.0.0.1", "--port", "{port}"],
     "--port"),
    (["gateway", "--redis", "redis://127.0.0.1:1", "--verifiers", "127.0.0.1:1", "--port", "0",
      "--http-port", "{port}"],
     "--http-port"),
    (["up", "--port", "{port}"], "--port"),
    (["up", "--http-port", "{port}"], "--http-port"),
    (["up", "--metrics-port", "{port}"], "--metrics-port"),
])
def test_a_taken_port_is_one_line_and_exit_code_2_before_anything_loads(
        args, option, taken_port, tiny_pair):
    """Before this, a verifier on a taken port loaded its model, then died with grpc's
    traceback, and `specmesh up` printed that traceback from its log; a taken metrics port
    was the same from prometheus_client. Now the port is checked first: one line naming the
    port and the option to change, exit code 2, no model loaded and (up) nothing started."""
    target, draft = tiny_pair
    model = ["--model", draft if args[0] == "drafter" else target] if args[0] != "up" else [
        "--target", target, "--draft", draft]
    argv = [a.replace("{port}", str(taken_port)) for a in args] + model
    result = subprocess.run([*SPECMESH, *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f":{taken_port}" in lines[0] or f"port {taken_port}" in lines[0], lines[0]
    assert option in lines[0] and lines[0].startswith("error: "), lines[0]
    assert "loaded" not in result.stderr and "SERVING" not in result.stderr


def test_a_port_taken_after_the_check_still_fails_with_the_option_to_change(taken_port):
    """The check before the model loads can race another process; the server's own bind
    then says the same thing (grpcio raises where it used to return 0)."""
    from services.config import ServerConfig
    from services.errors import StartupError
    from services.server import serve

    config = ServerConfig(host="127.0.0.1", port=taken_port)
    with pytest.raises(StartupError, match=f"127.0.0.1:{taken_port}.*--port"):
        asyncio.run(serve(config, lambda server: None, []))
