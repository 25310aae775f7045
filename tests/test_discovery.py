"""KubernetesDiscovery against a local server speaking the EndpointSlice list-and-watch API.

No real API server runs here: our machines have no Kubernetes cluster, container runtime or
etcd, and a kube-apiserver binary cannot be downloaded. So this test runs a small HTTP server
(``http.server`` on 127.0.0.1, a free port) that answers exactly the requests the official
``kubernetes`` client makes, with the JSON shapes of the discovery.k8s.io/v1 API:

- ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=...``: an
  ``EndpointSliceList`` with ``metadata.resourceVersion``;
- the same with ``watch=true&resourceVersion=RV``: a chunked stream of newline-delimited
  ``{"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR", "object": ...}`` events after RV,
  ending at ``timeoutSeconds``, when the test closes the watches, or with an ``ERROR`` event
  carrying a ``Status`` with ``code: 410`` (``Expired``) when RV is older than the compaction
  point, as the real server does.

A real ``kubernetes.client.ApiClient`` (``Configuration(host="http://127.0.0.1:PORT")``) talks to
it, so the client's own request building, streaming and event decoding are exercised.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import kubernetes  # noqa: E402
import pytest

from gateway.discovery import (
    KubernetesDiscovery,
    StaticDiscovery,
    endpoint_is_ready,
    ready_addresses,
)

NS = "specmesh"
SVC = "rel-specmesh-verifier"
PORT = 50071
WAIT = 5.0


def endpoint_slice(name: str, service: str, endpoints: list[tuple[str, bool | None, bool]],
                   rv: int, port: int = PORT) -> dict:
    """A discovery.k8s.io/v1 EndpointSlice as the API server serialises it."""
    eps = []
    for ip, ready, terminating in endpoints:
        conditions: dict = {}
        if ready is not None:  # ready unset must be read as ready
            conditions["ready"] = ready
            conditions["serving"] = ready or terminating
            conditions["terminating"] = terminating
        eps.append({"addresses": [ip], "conditions": conditions,
                    "targetRef": {"kind": "Pod", "namespace": NS, "name": f"pod-{ip}"},
                    "nodeName": "node-1", "zone": "zone-a"})
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}",
                     "resourceVersion": str(rv), "generation": 1,
                     "creationTimestamp": "2025-01-01T00:00:00Z",
                     "labels": {"kubernetes.io/service-name": service,
                                "endpointslice.kubernetes.io/managed-by":
                                    "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "endpoints": eps,
        "ports": [{"name": "grpc", "protocol": "TCP", "port": port, "appProtocol": "grpc"}],
    }


class FakeApiServer:
    """State and event log of EndpointSlices; see the module docstring."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.rv = 100
        self.slices: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.compacted_before = 0  # watches from an older RV get 410 Gone
        self.watch_generation = 0  # bumping it ends every open watch
        self.requests: list[tuple[str, dict]] = []
        self.fail_next_lists = 0  # answer that many LISTs with 500
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output quiet
                pass

            def do_GET(self):
                server.handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.end_watches()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- mutations by the test -----------------------------------------------------------------
    def put(self, name: str, endpoints, service: str = SVC) -> None:
        with self.lock:
            self.rv += 1
            kind = "MODIFIED" if name in self.slices else "ADDED"
            obj = endpoint_slice(name, service, endpoints, self.rv)
            self.slices[name] = obj
            self.events.append((self.rv, kind, obj))
            self.lock.notify_all()

    def delete(self, name: str) -> None:
        with self.lock:
            self.rv += 1
            obj = dict(self.slices.pop(name))
            obj["metadata"] = dict(obj["metadata"], resourceVersion=str(self.rv))
            self.events.append((self.rv, "DELETED", obj))
            self.lock.notify_all()

    def end_watches(self) -> None:
        with self.lock:
            self.watch_generation += 1
            self.lock.notify_all()

    def compact(self) -> None:
        """Forget every event so far: a watch resuming from an older RV gets 410 Gone."""
        with self.lock:
            self.compacted_before = self.rv + 1
            self.events.clear()

    def watches(self) -> list[dict]:
        return [q for _, q in self.requests if q.get("watch") == ["true"]]

    # -- HTTP ----------------------------------------------------------------------------------
    def handle(self, h: BaseHTTPRequestHandler) -> None:
        url = urlparse(h.path)
        query = parse_qs(url.query)
        with self.lock:
            self.requests.append((url.path, query))
        if url.path != f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices":
            return self.send_json(h, 404, status_obj(404, "NotFound", f"no route {url.path}"))
        selector = query.get("labelSelector", [""])[0]
        key, _, value = selector.partition("=")

        def selected(obj):
            return obj["metadata"]["labels"].get(key) == value

        if query.get("watch") != ["true"]:
            with self.lock:
                if self.fail_next_lists:
                    self.fail_next_lists -= 1
                    return self.send_json(h, 500, status_obj(500, "InternalError", "etcd"))
                body = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                        "metadata": {"resourceVersion": str(self.rv)},
                        "items": [o for o in self.slices.values() if selected(o)]}
            return self.send_json(h, 200, body)
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        timeout = float(query.get("timeoutSeconds", ["30"])[0])
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        try:
            with self.lock:
                if since < self.compacted_before - 1:
                    gone = status_obj(410, "Expired",
                                      f"too old resource version: {since} "
                                      f"({self.compacted_before - 1})")
                    self.write_chunk(h, {"type": "ERROR", "object": gone})
                    return self.end_chunks(h)
                generation = self.watch_generation
                deadline = time.monotonic() + timeout
                sent = since
                while True:
                    for rv, kind, obj in self.events:
                        if rv > sent:
                            if selected(obj):
                                self.write_chunk(h, {"type": kind, "object": obj})
                            sent = rv
                    left = deadline - time.monotonic()
                    if generation != self.watch_generation or left <= 0:
                        break
                    self.lock.wait(min(left, 0.2))
            self.end_chunks(h)
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def write_chunk(h, event: dict) -> None:
        data = (json.dumps(event) + "\n").encode()
        h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        h.wfile.flush()

    @staticmethod
    def end_chunks(h) -> None:
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()
        h.close_connection = True

    @staticmethod
    def send_json(h, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


def status_obj(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


@pytest.fixture()
def server():
    srv = FakeApiServer()
    yield srv
    srv.close()


@pytest.fixture()
def make_discovery(server):
    started = []

    def make(port=PORT, **kwargs):
        config = kubernetes.client.Configuration(host=f"http://127.0.0.1:{server.port}")
        api_client = kubernetes.client.ApiClient(config)
        changes: list[frozenset[str]] = []
        kwargs.setdefault("backoff_s", 0.05)
        d = KubernetesDiscovery(api_client, NS, SVC, port, changes.append, **kwargs)
        d.changes = changes
        d.start()
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()


def addrs(*ips: str) -> frozenset[str]:
    return frozenset(f"{ip}:{PORT}" for ip in ips)


def test_readiness_rules_follow_the_endpointslice_spec():
    assert endpoint_is_ready({"addresses": ["10.0.0.1"]})  # conditions unset: ready
    assert endpoint_is_ready({"conditions": {}})
    assert endpoint_is_ready({"conditions": {"ready": True}})
    assert not endpoint_is_ready({"conditions": {"ready": False}})
    assert not endpoint_is_ready({"conditions": {"ready": True, "terminating": True}})
    obj = endpoint_slice("s", SVC, [("10.0.0.1", True, False), ("fd00::2", None, False)], 1)
    assert ready_addresses(obj, None) == {"10.0.0.1:50071", "[fd00::2]:50071"}
    assert ready_addresses(obj, 9) == {"10.0.0.1:9", "[fd00::2]:9"}


def test_static_discovery_has_the_same_surface():
    seen = []
    d = StaticDiscovery(["a:1", "b:2"], seen.append)
    assert d.addresses == frozenset()
    d.start()
    assert d.wait_for(lambda a: a == {"a:1", "b:2"}, 1)
    assert seen == [frozenset({"a:1", "b:2"})]
    d.stop()


def test_initial_list_keeps_only_ready_endpoints_of_its_own_service(server, make_discovery):
    server.put("verifier-abc", [("10.0.0.1", True, False), ("10.0.0.2", None, False),
                                ("10.0.0.3", False, False), ("10.0.0.4", False, True)])
    server.put("drafter-xyz", [("10.9.9.9", True, False)], service="rel-specmesh-drafter")
    d = make_discovery()
    assert d.synced.wait(WAIT)
    assert d.wait_for(lambda a: a == addrs("10.0.0.1", "10.0.0.2"), WAIT), d.addresses
    list_query = server.requests[0][1]
    assert list_query["labelSelector"] == [f"kubernetes.io/service-name={SVC}"]
    # The watch resumes from the list's resourceVersion, not from "now" or from 0.
    assert _eventually(lambda: server.watches() and
                       server.watches()[0]["resourceVersion"] == [str(server.rv)])


def test_follows_scale_up_scale_down_and_readiness(server, make_discovery):
    server.put("verifier-abc", [("10.0.0.1", True, False)])
    d = make_discovery()
    assert d.wait_for(lambda a: a == addrs("10.0.0.1"), WAIT)
    assert _eventually(lambda: server.watches())

    # Scale-up: a new pod appears not ready (loading its model), then becomes ready.
    server.put("verifier-abc", [("10.0.0.1", True, False), ("10.0.0.2", False, False)])
    time.sleep(0.3)
    assert d.addresses == addrs("10.0.0.1")
    server.put("verifier-abc", [("10.0.0.1", True, False), ("10.0.0.2", True, False)])
    assert d.wait_for(lambda a: a == addrs("10.0.0.1", "10.0.0.2"), WAIT), d.addresses

    # More replicas spill into a second slice (ADDED).
    server.put("verifier-def", [("10.0.0.3", True, False)])
    assert d.wait_for(lambda a: a == addrs("10.0.0.1", "10.0.0.2", "10.0.0.3"), WAIT)

    # Scale-down: a pod terminates (MODIFIED), a slice goes away (DELETED).
    server.put("verifier-abc", [("10.0.0.1", True, False), ("10.0.0.2", False, True)])
    assert d.wait_for(lambda a: a == addrs("10.0.0.1", "10.0.0.3"), WAIT), d.addresses
    server.delete("verifier-def")
    assert d.wait_for(lambda a: a == addrs("10.0.0.1"), WAIT), d.addresses

    # A drafter slice changing does not touch the verifier's set or fire on_change.
    n = len(d.changes)
    server.put("drafter-xyz", [("10.9.9.9", True, False)], service="rel-specmesh-drafter")
    time.sleep(0.3)
    assert len(d.changes) == n and d.addresses == addrs("10.0.0.1")
    assert d.changes == [addrs("10.0.0.1"), addrs("10.0.0.1", "10.0.0.2"),
                         addrs("10.0.0.1", "10.0.0.2", "10.0.0.3"),
                         addrs("10.0.0.1", "10.0.0.3"), addrs("10.0.0.1")]


def test_watch_that_ends_is_resumed_from_the_last_version(server, make_discovery):
    server.put("verifier-abc", [("10.0.0.1", True, False)])
    d = make_discovery()
    assert d.wait_for(lambda a: a == addrs("10.0.0.1"), WAIT)
    assert _eventually(lambda: len(server.watches()) == 1)
    server.put("verifier-abc", [("10.0.0.1", True, False), ("10.0.0.2", True, False)])
    assert d.wait_for(lambda a: a == addrs("10.0.0.1", "10.0.0.2"), WAIT)
    rv_seen = server.rv
    server.end_watches()  # the API server closes the stream (its timeout, a restart, ...)
    assert _eventually(lambda: len(server.watches()) == 2)
    assert server.watches()[1]["resourceVersion"] == [str(rv_seen)]
    assert d.lists == 1  # resumed without a relist
    server.put("verifier-abc", [("10.0.0.2", True, False)])
    assert d.wait_for(lambda a: a == addrs("10.0.0.2"), WAIT), d.addresses


def test_410_gone_leads_to_a_relist_that_sees_missed_changes(server, make_discovery):
    server.put("verifier-abc", [("10.0.0.1", True, False)])
    d = make_discovery()
    assert d.wait_for(lambda a: a == addrs("10.0.0.1"), WAIT)
    assert _eventually(lambda: len(server.watches()) == 1)
    # The watch drops; meanwhile the cluster changes and etcd compacts past our version.
    with server.lock:
        server.watch_generation += 1
        server.rv += 1
        server.slices["verifier-abc"] = endpoint_slice(
            "verifier-abc", SVC, [("10.0.0.5", True, False)], server.rv)
        server.compacted_before = server.rv + 1
        server.events.clear()
        server.lock.notify_all()
    # The resumed watch gets an ERROR 410 event; discovery relists and sees the missed change.
    assert d.wait_for(lambda a: a == addrs("10.0.0.5"), WAIT), d.addresses
    assert d.lists >= 2
    # ... and keeps following changes after the relist.
    assert _eventually(lambda: server.watches()[-1]["resourceVersion"] == [str(server.rv)])
    server.put("verifier-abc", [("10.0.0.5", True, False), ("10.0.0.6", True, False)])
    assert d.wait_for(lambda a: a == addrs("10.0.0.5", "10.0.0.6"), WAIT), d.addresses


def test_api_errors_are_retried_with_a_relist(server, make_discovery):
    server.fail_next_lists = 2  # the API server answers 500 twice, then recovers
    server.put("verifier-abc", [("10.0.0.1", True, False)])
    d = make_discovery()
    assert d.wait_for(lambda a: a == addrs("10.0.0.1"), WAIT), d.addresses
    assert d.lists == 1
    lists = [q for _, q in server.requests if q.get("watch") != ["true"]]
    assert len(lists) == 3
    server.put("verifier-abc", [("10.0.0.1", True, False), ("10.0.0.2", True, False)])
    assert d.wait_for(lambda a: a == addrs("10.0.0.1", "10.0.0.2"), WAIT)


def test_stop_ends_the_watch_thread(server, make_discovery):
    d = make_discovery()
    assert d.synced.wait(WAIT)
    assert _eventually(lambda: server.watches())
    d.stop(timeout=WAIT)
    assert not d._thread.is_alive()


def _eventually(cond, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())
