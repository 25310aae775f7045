"""Replica discovery: which drafter / verifier addresses the gateway may route to.

Two backends with one surface (``start()``, ``stop()``, ``addresses``, ``wait_for()`` and an
``on_change`` callback receiving the new ``frozenset`` of ``"host:port"`` strings):

- :class:`StaticDiscovery`: a fixed list (``--drafters`` / ``--verifiers``).
- :class:`KubernetesDiscovery`: list-and-watch of the EndpointSlices of one Service
  (label ``kubernetes.io/service-name=<service>``) with the official ``kubernetes`` client. It
  keeps the READY endpoints only and follows scale-up, scale-down and readiness changes without
  a restart.

Threading: ``KubernetesDiscovery.start()`` runs the list-and-watch loop on one daemon thread;
``on_change`` is called from that thread (an asyncio user should hand it over with
``loop.call_soon_threadsafe``). ``addresses`` may be read from any thread.

This module is pure: it imports nothing from the gateway.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

OnChange = Callable[[frozenset[str]], None]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def require_kubernetes() -> None:
    """The kubernetes client is an extra (``pip install 'specmesh[kubernetes]'``), imported
    only when Kubernetes discovery is used; ImportError naming the extra when it is missing."""
    try:
        import kubernetes  # noqa: F401
    except ImportError as exc:
        raise ImportError("kubernetes discovery needs the kubernetes client: pip install "
                          "'specmesh[kubernetes]'") from exc


def format_address(ip: str, port: int) -> str:
    """``ip:port``; IPv6 addresses are bracketed (``[fd00::1]:50071``) as gRPC expects."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def endpoint_is_ready(endpoint: Mapping[str, Any]) -> bool:
    """EndpointSlice semantics: ``conditions.ready`` unset means ready ("unknown state should
    be interpreted as ready"); a terminating endpoint is never routed to."""
    conditions = endpoint.get("conditions") or {}
    if conditions.get("terminating") is True:
        return False
    return conditions.get("ready") is not False


def ready_addresses(slice_obj: Mapping[str, Any], port: int | None) -> frozenset[str]:
    """The ready ``ip:port`` addresses of one EndpointSlice (a raw API dict).

    ``port`` None takes the slice's first port (the Service's only one for our Services).
    """
    if port is None:
        ports = [p.get("port") for p in slice_obj.get("ports") or [] if p.get("port")]
        if not ports:
            return frozenset()
        port = int(ports[0])
    out = set()
    for endpoint in slice_obj.get("endpoints") or []:
        if endpoint_is_ready(endpoint):
            out.update(format_address(ip, port) for ip in endpoint.get("addresses") or [])
    return frozenset(out)


class _Observable:
    """The shared part: current addresses, change notification, ``wait_for``."""

    def __init__(self, on_change: OnChange | None) -> None:
        self._on_change = on_change
        self._addresses: frozenset[str] = frozenset()
        self._cond = threading.Condition()

    @property
    def addresses(self) -> frozenset[str]:
        with self._cond:
            return self._addresses

    def _publish(self, addresses: frozenset[str]) -> None:
        with self._cond:
            if addresses == self._addresses:
                return
            self._addresses = addresses
            self._cond.notify_all()
        log.info("discovery: %d address(es): %s", len(addresses), ", ".join(sorted(addresses)))
        if self._on_change is not None:
            try:
                self._on_change(addresses)
            except Exception:  # a faulty callback must not kill the watch
                log.exception("discovery on_change callback failed")

    def wait_for(self, predicate: Callable[[frozenset[str]], bool], timeout: float) -> bool:
        """Blocks until ``predicate(addresses)`` holds; False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self._addresses), timeout)


class StaticDiscovery(_Observable):
    """A fixed set of addresses; ``start()`` publishes it once."""

    def __init__(self, addresses: Iterable[str], on_change: OnChange | None = None) -> None:
        super().__init__(on_change)
        self._static = frozenset(addresses)

    def start(self) -> None:
        self._publish(self._static)

    def stop(self) -> None:
        pass


class KubernetesDiscovery(_Observable):
    """Ready endpoints of one Service, from list-and-watch on its EndpointSlices.

    The loop: LIST the slices (their ready endpoints replace the whole state; the list's
    ``metadata.resourceVersion`` is kept), then WATCH from that version, applying ADDED /
    MODIFIED (the slice's ready endpoints replace that slice's) and DELETED (the slice's go
    away) and remembering each event's resourceVersion (BOOKMARKs included). A watch that ends
    normally (server timeout) is re-opened from the last version; a ``410 Gone`` (as an HTTP
    status or an ERROR event: the version was compacted) or any other error leads to a
    re-LIST after a short, jittered, growing backoff. ``on_change`` fires only when the union of
    ready addresses changes.
    """

    def __init__(self, api_client: Any, namespace: str, service: str, port: int | None,
                 on_change: OnChange | None = None, *, watch_timeout_s: int = 240,
                 backoff_s: float = 0.5, max_backoff_s: float = 10.0) -> None:
        super().__init__(on_change)
        require_kubernetes()
        from kubernetes import client

        self._api = client.DiscoveryV1Api(api_client)
        self.namespace = namespace
        self.service = service
        self.port = port
        self.label_selector = f"{SERVICE_NAME_LABEL}={service}"
        self._watch_timeout_s = watch_timeout_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._slices: dict[str, frozenset[str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None
        self.synced = threading.Event()  # set after the first successful LIST
        self.lists = 0  # LIST calls made (initial + relists), for tests and metrics

    def start(self) -> None:
        """Starts the list-and-watch thread (returns at once; see ``synced``/``wait_for``)."""
        if self._thread is not None:
            raise RuntimeError("already started")
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"discovery-{self.service}")
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the loop and closes an open watch. ``Watch.stop`` unblocks a read by shutting
        the response's socket, but only once the response exists: a stop that lands while the
        watch request is still being answered would leave the thread reading until the watch
        times out, so it is repeated until the thread ends (or ``timeout``)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self._thread is not None and self._thread.is_alive():
            watch = self._watch
            if watch is not None:
                watch.stop()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._thread.join(min(0.1, left))

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                version = self._list()
                failures = 0
                while not self._stop.is_set():
                    version = self._watch_once(version)
            except _Relist:
                log.info("discovery %s: watch expired (410 Gone), relisting", self.service)
                failures = 0
            except Exception as exc:  # noqa: BLE001 -- API down, reset, bad response: relist
                if self._stop.is_set():
                    return
                failures += 1
                log.warning("discovery %s: %s; relisting", self.service, exc)
            delay = min(self._max_backoff_s, self._backoff_s * 2 ** min(failures, 6))
            self._stop.wait(delay * random.uniform(0.5, 1.0) if failures else 0.0)

    def _list(self) -> str:
        from kubernetes.client.rest import ApiException

        try:
            resp = self._api.list_namespaced_endpoint_slice(
                self.namespace, label_selector=self.label_selector, _preload_content=False,
                _request_timeout=30)
        except ApiException as exc:
            raise (_Relist() if exc.status == 410 else exc) from exc
        import json

        body = json.loads(resp.data)
        self.lists += 1
        self._slices = {item["metadata"]["name"]: ready_addresses(item, self.port)
                        for item in body.get("items") or []}
        self._publish(frozenset().union(*self._slices.values()))
        self.synced.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch_once(self, version: str) -> str:
        """One WATCH from ``version``; returns the last version seen when it ends normally."""
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        self._watch = watch.Watch()
        try:
            # timeout_seconds makes the client neither retry on its own nor hide 410s from us.
            for event in self._watch.stream(
                    self._api.list_namespaced_endpoint_slice, self.namespace,
                    label_selector=self.label_selector, resource_version=version,
                    allow_watch_bookmarks=True, timeout_seconds=self._watch_timeout_s,
                    _request_timeout=self._watch_timeout_s + 30):
                if self._stop.is_set():
                    break
                version = self._apply(event["type"], event["raw_object"]) or version
        except ApiException as exc:
            if exc.status == 410:
                raise _Relist() from exc
            raise
        finally:
            self._watch = None
        return version

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> str | None:
        metadata = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            self._slices[metadata["name"]] = ready_addresses(obj, self.port)
        elif kind == "DELETED":
            self._slices.pop(metadata["name"], None)
        elif kind != "BOOKMARK":
            log.debug("discovery %s: ignoring %s event", self.service, kind)
            return None
        if kind != "BOOKMARK":
            self._publish(frozenset().union(*self._slices.values()))
        return metadata.get("resourceVersion")


class _Relist(Exception):
    """The watch's resourceVersion is gone (410): list again."""
