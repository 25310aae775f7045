"""Drafter and verifier replicas as the gateway sees them: channels, load, health.

Routing: a session stays on the replica that holds its cache while that
replica is up; a new session goes to the up replica with the fewest requests
in flight from this gateway, unless one holds a cached prefix of its prompt
(services/prefix_index.py) and is not much busier: then to the one holding most.
A replica that fails a call is marked down for ``retry_s`` and the session moves
(its cache is rebuilt by a resync).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from gateway.step_batch import StepBatcher
from gateway.streams import CallStream, StreamUnsupported, replica_stream, wrap_draft, wrap_verify
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

# A restarted replica is found again within ~1 s instead of gRPC's default backoff of up to 2 min.
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
              ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: object
    info: common_pb2.ModelInfo | None = None
    inflight: int = 0
    down_until: float = 0.0
    failures: int = field(default=0)
    load: dict = field(default_factory=dict)  # last load the replica reported (redis registry)
    admitted: bool = True  # False while a discovered replica's model is being checked
    stream: CallStream | None = None  # its call stream, when the pool uses them
    steps: dict[str, StepBatcher] = field(default_factory=dict)  # method -> its step batcher

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    async def call(self, method: str, request, timeout: float):
        """``method``'s response; raises AioRpcError as its unary RPC would. Draft and
        Verify go through the method's step batcher when the pool batches steps."""
        batcher = self.steps.get(method)
        if batcher is not None:
            return await batcher.call(request, timeout)
        return await self.send(method, request, timeout)

    async def send(self, method: str, request, timeout: float):
        """One call on its own: over the call stream when there is one, else a unary RPC."""
        if method in _STREAMED and self.stream is not None and self.stream.supported:
            try:
                return await self.stream.call(request, timeout)
            except StreamUnsupported:
                pass  # an older replica: unary calls from now on
        return await getattr(self.stub, method)(request, timeout=timeout)

    def batch_steps(self, kind: str, merging: Callable[[], bool] = lambda: True,
                    lone: Callable[[], bool] = lambda: False) -> None:
        """Sends this replica's Draft or Verify calls a step at a time (gateway/step_batch.py);
        ``merging``: whether cohorts of Verify calls without drafts merge now; ``lone``:
        whether the gateway runs a single request (its calls go at once)."""
        method, rpc, wrap, reply = _BATCHED[kind]

        async def send_batch(requests, timeout: float):
            batch = await getattr(self.stub, rpc)(
                reply(calls=[wrap(i, r) for i, r in enumerate(requests)]), timeout=timeout)
            return batch.outcomes

        verify = method == "Verify"
        self.steps[method] = StepBatcher(
            method, lambda request, timeout: self.send(method, request, timeout), send_batch,
            describe=_describe_verify if verify else lambda request: ("", False),
            merging=merging, fit=fit_verify_step if verify else lambda requests: None,
            express=_feeds_prompt if verify else lambda request: False, lone=lone)


_STREAMED = frozenset({"Draft", "Speculate", "Verify"})  # calls a replica's stream carries
# kind -> (the method batched in steps, its batched RPC, how a call is wrapped, the request)
_BATCHED = {"verifier": ("Verify", "VerifyBatch", wrap_verify, verifier_pb2.VerifyBatchRequest),
            "drafter": ("Draft", "DraftBatch", wrap_draft, drafter_pb2.DraftBatchRequest)}


def _describe_verify(request) -> tuple[str, bool]:
    """A Verify call's session, and whether it verifies no drafts (gateway/step_batch.py)."""
    return request.cache.session_id, not request.draft_token_ids


def _feeds_prompt(request) -> bool:
    """Whether a Verify call feeds a prompt (or resyncs a session): more than one new token
    and no drafts. It goes beside a step rather than in the next (gateway/step_batch.py)."""
    return not request.draft_token_ids and len(request.cache.new_tokens) > 1


def fit_verify_step(requests: list[verifier_pb2.VerifyRequest]) -> None:
    """A Verify step answers once its last call is done. A call that asks for several tokens
    (a round without drafts, ``max_tokens``) takes as many passes, so in a step that feeds a
    prompt (its time to the first token) or verifies drafts (the next draft waits for it)
    every call asks for one: the step is one pass, as it was before plain rounds asked for
    more."""
    if any(r.draft_token_ids or len(r.cache.new_tokens) > 1 for r in requests):
        for r in requests:
            r.max_tokens = 0


def _busy(replica: Replica) -> int:
    """Calls in flight to it from this gateway, and its queue as it last reported."""
    return replica.inflight + replica.load.get("queue_depth", 0)


class ReplicaPool:
    def __init__(self, kind: str, addresses: tuple[str, ...], retry_s: float,
                 channel_options: list[tuple[str, int]], interceptors: list | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 streams: bool = False, steps: bool = False) -> None:
        """``streams``: Draft, Speculate and Verify go over one call stream per replica
        (gateway/streams.py) instead of a unary RPC each. ``steps``: Draft and Verify calls
        made while one is in flight go together, as one batched RPC per replica and step
        (gateway/step_batch.py)."""
        self._stub_cls = {"drafter": drafter_pb2_grpc.DrafterStub,
                          "verifier": verifier_pb2_grpc.VerifierStub}[kind]
        self.kind = kind
        self._retry_s = retry_s
        self._options = [*channel_options, *_RECONNECT]
        self._interceptors = interceptors or None
        self._credentials = credentials  # None: plaintext; else TLS (mTLS with a client cert)
        self._streams = streams
        self._steps = steps
        # whether cohorts of Verify calls without drafts merge (the engine sets it: while no
        # load switch keeps drafting)
        self.merge_plain: Callable[[], bool] = lambda: True
        # whether the gateway runs a single request (the engine sets it)
        self.lone: Callable[[], bool] = lambda: False
        self.replicas: dict[str, Replica] = {}
        self.update(frozenset(addresses))

    def forget(self, session_id: str) -> None:
        """A session's request has ended: no replica's step batcher waits for its next call."""
        for replica in self.replicas.values():
            for batcher in replica.steps.values():
                batcher.forget(session_id)

    def update(self, addresses: frozenset[str]) -> list[Replica]:
        """Follows discovery: adds replicas for new addresses, drops vanished ones (their
        channels close after a grace period); returns the added replicas."""
        added = []
        for address in sorted(addresses - self.replicas.keys()):
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=self._options,
                                                    interceptors=self._interceptors)
            else:
                channel = grpc.aio.secure_channel(address, self._credentials, options=self._options,
                                                  interceptors=self._interceptors)
            stub = self._stub_cls(channel)
            replica = Replica(address, channel, stub, stream=replica_stream(
                self.kind, stub) if self._streams else None)
            if self._steps:
                replica.batch_steps(self.kind, lambda: self.merge_plain(), lambda: self.lone())
            self.replicas[address] = replica
            added.append(replica)
        for address in self.replicas.keys() - addresses:
            replica = self.replicas.pop(address)
            if replica.stream is not None:
                asyncio.get_running_loop().create_task(replica.stream.close())
            asyncio.get_running_loop().create_task(replica.channel.close(grace=10.0))
        return added

    def __len__(self) -> int:
        return len(self.replicas)

    def kinds(self) -> set[str]:
        return {r.info.kind for r in self.replicas.values() if r.info is not None}

    def pick(self, prefer: str = "", exclude: frozenset[str] = frozenset(),
             kind: str = "", cached: dict[str, int] | None = None,
             affinity: int = -1) -> Replica | None:
        """``kind``: only replicas whose ModelInfo reports that kind ("" = any). ``cached``:
        address -> prompt tokens the prefix index says it holds; the one holding most wins
        while it runs at most ``affinity`` more requests than the least busy one (-1: load
        alone)."""
        allowed = [r for r in self.replicas.values() if r.address not in exclude and r.admitted
                   and (not kind or (r.info is not None and r.info.kind == kind))]
        preferred = self.replicas.get(prefer)
        if preferred is not None and preferred.up and preferred in allowed:
            return preferred
        # Replicas marked down are still tried when none is up: better a retry than a failure.
        candidates = [r for r in allowed if r.up] or allowed
        if not candidates:
            return None
        if cached and affinity >= 0:
            least = min(_busy(r) for r in candidates)
            near = [r for r in candidates
                    if cached.get(r.address, 0) > 0 and _busy(r) <= least + affinity]
            if near:
                return max(near, key=lambda r: (cached[r.address], -_busy(r)))
        return min(candidates, key=lambda r: (_busy(r), r.load.get("sessions", 0), r.failures))

    @property
    def admitting(self) -> bool:
        """Whether the pool has replicas and none of them is admitted yet."""
        return bool(self.replicas) and not any(r.admitted for r in self.replicas.values())

    async def admitted(self, wait_s: float, poll_s: float = 0.05) -> None:
        """Returns once a replica is admitted, or none is being admitted, or after ``wait_s``.
        A rollout that replaces every replica at once leaves none admitted until the new
        ones' model checks answer (gateway/server.py, moments on a quiet gateway, longer on
        a loaded one): a verify waits for that instead of failing UNAVAILABLE meanwhile."""
        end = time.monotonic() + wait_s
        while self.admitting and time.monotonic() < end:
            await asyncio.sleep(poll_s)

    def mark_down(self, replica: Replica) -> None:
        replica.failures += 1
        replica.down_until = time.monotonic() + self._retry_s

    def mark_ok(self, replica: Replica) -> None:
        replica.failures = 0

    async def close(self) -> None:
        for replica in self.replicas.values():
            if replica.stream is not None:
                await replica.stream.close()
            await replica.channel.close()
