"""Security settings are validated when the config is built, with messages that say what
to fix; a gateway that cannot authenticate to Redis exits with a clear error, not a trace."""

from __future__ import annotations

import json
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

from services import local_mesh
from services.certs import make_ca, make_cert
from services.config import TlsConfig, load_api_keys, redact_url
from services.local_mesh import free_port

DIGEST = "ab" * 32


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    make_ca(out)
    return make_cert(out, "svc", ["127.0.0.1"])


def test_tls_config_rejects_incomplete_or_unreadable_settings(certs, tmp_path):
    not_pem = tmp_path / "x.pem"
    not_pem.write_text("hello")
    cases = [
        (dict(cert=str(certs.cert)), "go together"),
        (dict(key=str(certs.key)), "go together"),
        (dict(ca=str(certs.ca)), "needs --tls-cert"),
        (dict(cert=str(tmp_path / "missing.pem"), key=str(certs.key)), "cannot be read"),
        (dict(cert=str(not_pem), key=str(certs.key)), "not a PEM file"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(ValueError, match=fragment):
            TlsConfig(**kwargs)
    tls = TlsConfig(cert=str(certs.cert), key=str(certs.key), ca=str(certs.ca))
    assert tls.enabled and tls.mutual


@pytest.mark.parametrize("content, fragment", [
    ("not json", "not valid JSON"),
    (json.dumps({"keys": []}), "at least one key"),
    (json.dumps([{"name": "a", "sha256": DIGEST}]), "at least one key"),
    (json.dumps({"keys": [{"name": "a", "sha256": "abc"}]}), "64 lowercase hex"),
    (json.dumps({"keys": [{"name": "a", "sha256": DIGEST, "rate": 1}]}), "unknown fields"),
    (json.dumps({"keys": [{"name": "a", "sha256": DIGEST, "rate_per_s": -1}]}), ">= 0"),
    (json.dumps({"keys": [{"name": "a", "sha256": DIGEST}, {"name": "a", "sha256": "cd" * 32}]}),
     "unique"),
    (json.dumps({"keys": [{"name": "a", "sha256": DIGEST}, {"name": "b", "sha256": DIGEST}]}),
     "duplicate key"),
    (json.dumps({"keys": [{"name": "", "sha256": DIGEST}]}), "name must be"),
])
def test_api_keys_file_errors_name_the_problem(tmp_path, content, fragment):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=fragment):
        load_api_keys(str(path))


def test_redact_url_hides_only_the_password():
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:pw@h:1/0?ssl_ca_certs=/x") == \
        "rediss://user:***@h:1/0?ssl_ca_certs=/x"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


def test_gateway_with_a_wrong_redis_password_exits_with_a_clear_error(tmp_path):
    redis, url = local_mesh.start_redis(tmp_path, password="right")
    port = urlsplit(url).port
    try:
        out = subprocess.run(
            [sys.executable, "-m", "specmesh.cli", "gateway", "--port", str(free_port()),
             "--redis", f"redis://:wrong@127.0.0.1:{port}/0", "--verifiers", "127.0.0.1:1"],
            capture_output=True, text=True, timeout=60)
    finally:
        redis.popen.terminate()
        redis.popen.wait(10)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "cannot use Redis at redis://:***@127.0.0.1" in out.stderr
    assert "invalid username-password" in out.stderr  # Redis answered and refused the password
    assert "wrong" not in out.stderr.split("error:", 1)[1]
    assert "Traceback" not in out.stderr
