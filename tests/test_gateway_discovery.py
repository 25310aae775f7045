"""The gateway follows Kubernetes EndpointSlices: scale-up, scale-down, readiness.

No Kubernetes API server can run here (see tests/test_discovery.py), so the gateway's real
``kubernetes`` client talks to that test's FakeApiServer through a kubeconfig file, while the
drafter and verifiers are real processes on distinct loopback addresses (127.0.0.2, .3), as
pods of one headless Service share a port on different IPs.
"""

from __future__ import annotations

import grpc
import pytest

from services.local_mesh import Proc, _cli, _spawn, _wait, free_port
from specmesh.client import GatewayClient, build_request
from specmesh.v1 import common_pb2, verifier_pb2_grpc
from tests.conftest import hf_greedy
from tests.test_discovery import NS, FakeApiServer

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: test, user: {{}}}}]
contexts: [{{name: test, context: {{cluster: fake, user: test, namespace: {ns}}}}}]
current-context: test
"""


def _calls(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).GetStats(common_pb2.StatsRequest()).calls


@pytest.fixture(scope="module")
def k8s_mesh(tiny_pair, redis_url, tmp_path_factory):
    target, draft = tiny_pair
    logs = tmp_path_factory.mktemp("k8s-logs")
    api = FakeApiServer()
    kubeconfig = logs / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG.format(port=api.port, ns=NS))
    vport, dport, gport = free_port(), free_port(), free_port()
    procs: list[Proc] = []
    try:
        for name, kind, host, port, model in (("verifier-a", "verifier", "127.0.0.2", vport, target),
                                              ("verifier-b", "verifier", "127.0.0.3", vport, target),
                                              ("drafter", "drafter", "127.0.0.2", dport, draft)):
            proc = _spawn(name, _cli(kind, "--host", host, "--port", str(port), "--model", model),
                          logs)
            proc.address = f"{host}:{port}"
            procs.append(proc)
        for proc in procs:
            _wait(proc, 120)
        api.put("verifiers-1", [("127.0.0.2", True, False)], service="verifiers")
        api.put("drafters-1", [("127.0.0.2", True, False)], service="drafters")
        gateway = _spawn("gateway", _cli(
            "gateway", "--host", "127.0.0.1", "--port", str(gport), "--redis", redis_url,
            "--model", target, "--discovery", "kubernetes", "--namespace", NS,
            "--verifier-service", "verifiers", "--drafter-service", "drafters",
            "--verifier-port", str(vport), "--drafter-port", str(dport)), logs,
            {"KUBECONFIG": str(kubeconfig)})
        gateway.address = f"127.0.0.1:{gport}"
        procs.append(gateway)
        _wait(gateway, 120)
        yield api, {p.name: p for p in procs}
    finally:
        for proc in procs:
            proc.popen.kill()
            proc.popen.wait()
        api.close()


def _generate(gateway: str, prompt: str) -> list[int]:
    with GatewayClient(gateway) as client:
        return list(client.generate(build_request(prompt, max_new_tokens=12,
                                                  num_draft_tokens=2)).token_ids)


def _eventually(check, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the gateway did not follow the EndpointSlices"
        time.sleep(0.2)


def test_gateway_follows_scale_up_readiness_and_scale_down(k8s_mesh, target_model):
    api, procs = k8s_mesh
    model, tokenizer = target_model
    gateway, a, b = procs["gateway"].address, procs["verifier-a"].address, procs[
        "verifier-b"].address
    prompts = ["import os", "def f(x):", "class A:", "while True:", "for i in", "x = ["]

    def expected(p):
        return hf_greedy(model, tokenizer(p)["input_ids"], 12)

    # Only verifier A is listed: B gets nothing.
    b_before = _calls(b)
    assert _generate(gateway, prompts[0]) == expected(prompts[0])
    assert _calls(b) == b_before

    # Scale-up, but B not ready yet: still only A.
    api.put("verifiers-1", [("127.0.0.2", True, False), ("127.0.0.3", False, False)],
            service="verifiers")
    for p in prompts[:2]:
        assert _generate(gateway, p) == expected(p)
    assert _calls(b) == b_before

    # B becomes ready and A goes away (scale-down): new requests reach B only.
    api.put("verifiers-1", [("127.0.0.3", True, False)], service="verifiers")

    def served_by_b() -> bool:
        before = _calls(b)
        _generate(gateway, prompts[2])
        return _calls(b) > before

    _eventually(served_by_b)
    a_before = _calls(a)
    for p in prompts[3:]:
        assert _generate(gateway, p) == expected(p)
    assert _calls(a) == a_before


def test_gateway_follows_the_redis_registry(tiny_pair, own_redis, tmp_path, target_model):
    """Replicas started with --redis register with a heartbeat; a gateway with --discovery
    redis finds them, drops one that died (its key expires) and picks up a new one."""
    target, draft = tiny_pair
    model, tokenizer = target_model
    procs: dict[str, Proc] = {}

    def start(name, *argv, env=None):
        port = free_port()
        proc = _spawn(name, _cli(*argv, "--host", "127.0.0.1", "--port", str(port)), tmp_path,
                      env)
        proc.address = f"127.0.0.1:{port}"
        procs[name] = proc
        return proc

    def model_service(name, kind, model_path):
        port = free_port()
        proc = _spawn(name, _cli(kind, "--host", "127.0.0.1", "--port", str(port), "--model",
                                 model_path, "--redis", own_redis), tmp_path)
        proc.address = f"127.0.0.1:{port}"
        procs[name] = proc
        return proc

    try:
        for proc in (model_service("verifier-a", "verifier", target),
                     model_service("drafter", "drafter", draft)):
            _wait(proc, 120)
        gateway = start("gateway", "gateway", "--redis", own_redis, "--model", target,
                        "--discovery", "redis")
        _wait(gateway, 120)

        def expected(p):
            return hf_greedy(model, tokenizer(p)["input_ids"], 12)

        assert _generate(gateway.address, "import os") == expected("import os")
        assert _calls(procs["verifier-a"].address) > 0

        procs["verifier-a"].popen.kill()  # no goodbye: its registry key must expire
        b = model_service("verifier-b", "verifier", target)
        _wait(b, 120)

        def served_by_b() -> bool:
            try:
                return _generate(gateway.address, "def f(x):") == expected("def f(x):") and (
                    _calls(b.address) > 0)
            except grpc.RpcError:
                return False

        _eventually(served_by_b, timeout=20)
    finally:
        for proc in procs.values():
            proc.popen.kill()
            proc.popen.wait()
