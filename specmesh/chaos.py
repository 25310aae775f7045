"""Chaos under load (`specmesh load --chaos`, tests/test_chaos.py): a mesh with two of every
tier and a Redis of its own, concurrent greedy (or seeded sampled) streams, and replicas of
every tier and Redis SIGKILLed and started again in turn while the streams run.

A client here does what the README tells a client to do: a stream cut after some chunks is
resumed on the other gateway with ``session_id`` + ``resume_from`` (the offset after the last
token received, prompt empty); a request that fails before its first chunk, or whose session
cannot be resumed (NOT_FOUND, or INVALID_ARGUMENT for a position the session never committed),
is sent again from the start. Every completed output is compared with the intact mesh's (or a
reference the caller gives); a request that does not complete within its deadline is lost.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services import local_mesh
from services.local_mesh import Mesh, MeshSpec, Proc, add_gateway, free_port, start_mesh

# Each tier's replicas in turn; Redis once per cycle.
KILL_ORDER = ("gateway", "drafter-0", "verifier-0", "redis", "gateway-1", "drafter-1",
              "verifier-1")
BACKOFF_S = 0.2  # after a failed attempt, before the next one
REDIS_DOWN_S = 2.0  # Redis stays down this long before it is started again
CUT_WAIT_S = 10.0  # a gateway is killed once a stream on it has chunks, waiting at most this
GATEWAYS = ("gateway", "gateway-1")


def tier(name: str) -> str:
    return name.split("-")[0]


@dataclass
class ChaosOptions:
    streams: int = 4
    duration_s: float = 600.0  # the kills go on this long; then the streams drain
    cycles: int = 0  # stop after this many full rounds of KILL_ORDER (0 = only the duration)
    max_new_tokens: int = 32
    pause_s: float = 3.0  # between a restarted process being back and the next kill
    request_timeout_s: float = 180.0  # one request, its resumes and retries included
    restart_timeout_s: float = 180.0
    seed: int = 0
    temperature: float = 0.0  # > 0: each prompt sampled with a seed of its own (sample_seed)


def sample_seed(opts: ChaosOptions, prompt_index: int) -> int | None:
    """The seed of a prompt's requests: a seeded sample must draw the same tokens however
    its stream is cut, resumed or sent again (None: greedy)."""
    return (opts.seed << 16) + prompt_index if opts.temperature > 0 else None


@dataclass
class ChaosRecord:
    """One request as the client saw it, over every attempt it needed."""

    prompt_index: int
    session_id: str = ""
    tokens: list[int] = field(default_factory=list)
    finish: int = 0
    completion_tokens: int = 0  # the final chunk's usage
    resumes: int = 0  # attempts that continued the session with resume_from
    retries: int = 0  # attempts that sent the request again from the start
    transient: Counter = field(default_factory=Counter)  # status codes that were retried
    error: str = ""  # why it did not complete (lost), or a broken stream
    latency_s: float = 0.0
    gateway: int = -1  # the gateway of the attempt under way (-1: none)

    @property
    def completed(self) -> bool:
        return not self.error and self.finish != 0


@dataclass
class KillRecord:
    name: str
    at_s: float  # since the chaos began
    back_after_s: float  # from the SIGKILL to SERVING (Redis: answering PING) again


@dataclass
class ChaosMesh:
    """Two gateways, two model drafters, two verifiers and a Redis (append-only file, so a
    restart on the same port and directory reloads every session handle)."""

    mesh: Mesh
    redis: Proc
    redis_dir: Path
    redis_port: int

    @property
    def gateways(self) -> list[str]:
        return [self.mesh.proc(n).address for n in GATEWAYS]

    def pids(self) -> dict[str, int]:
        return {"redis": self.redis.popen.pid, **{p.name: p.popen.pid for p in self.mesh.procs}}

    def kill(self, name: str) -> None:
        if name == "redis":
            self.redis.popen.kill()
            self.redis.popen.wait()
        else:
            self.mesh.kill(name)

    def restart(self, name: str, timeout: float) -> None:
        if name == "redis":
            self.redis, _ = local_mesh.start_redis(self.redis_dir, self.redis_port)
        else:
            self.mesh.restart(name, timeout)

    def stop(self) -> None:
        self.mesh.stop()
        if self.redis.popen.poll() is None:
            self.redis.popen.terminate()
            self.redis.popen.wait(10)


def start_chaos_mesh(target: str, draft: str, log_dir: Path,
                     extra_gateway_args: tuple[str, ...] = ()) -> ChaosMesh:
    redis_dir = log_dir / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    redis, url = local_mesh.start_redis(redis_dir)
    try:
        spec = MeshSpec(target=target, draft=draft, port=free_port(), drafters=2, verifiers=2,
                        redis_url=url, log_dir=log_dir, extra_gateway_args=extra_gateway_args)
        mesh = start_mesh(spec)
        try:
            add_gateway(mesh, spec, free_port(), spec.extra_gateway_args, log_dir, "gateway-1")
        except BaseException:
            mesh.stop()
            raise
    except BaseException:
        redis.popen.kill()
        redis.popen.wait()
        raise
    return ChaosMesh(mesh, redis, redis_dir, int(url.rsplit(":", 1)[1].split("/")[0]))


def _attempt(client, request, rec: ChaosRecord, expect_offset: int | None, timeout: float,
             base: list[int]) -> None:
    """One GenerateStream call; appends what it streams to ``rec``. ``base[0]`` is the session
    position of the request's first token (the first chunk's offset of a fresh attempt).
    Raises grpc.RpcError as the stream does; a chunk at the wrong position is a broken
    stream (rec.error)."""
    for chunk in client.stream(request, timeout=timeout):
        if expect_offset is None:  # a fresh attempt: its first chunk says where tokens start
            base[0] = expect_offset = chunk.offset
        if chunk.offset != base[0] + len(rec.tokens):
            rec.error = (f"OFFSET: a chunk at {chunk.offset}, expected "
                         f"{base[0] + len(rec.tokens)}")
            return
        rec.tokens.extend(chunk.token_ids)
        rec.session_id = chunk.session_id
        if chunk.finish_reason:
            rec.finish = chunk.finish_reason
            rec.completion_tokens = chunk.usage.completion_tokens
            if rec.completion_tokens != len(rec.tokens):
                rec.error = (f"USAGE_MISMATCH: {len(rec.tokens)} tokens received, usage says "
                             f"{rec.completion_tokens}")
            return


def chaos_request(clients: list, first: int, prompt_index: int, prompt: str,
                  opts: ChaosOptions, abort: threading.Event | None = None,
                  on_start: Callable[[ChaosRecord], None] = lambda rec: None) -> ChaosRecord:
    """One greedy (or seeded sampled) request that resumes or retries as documented until it
    completes or its deadline passes. ``clients``: a GatewayClient per gateway; ``first``:
    which to try first; ``abort`` set: give up at once (Ctrl-C); ``on_start`` gets the record
    as it begins."""
    import grpc

    from specmesh.client import build_request

    rec = ChaosRecord(prompt_index)
    on_start(rec)
    start = time.monotonic()
    deadline = start + opts.request_timeout_s
    gateway, base = first, [0]
    abort = abort or threading.Event()
    while not rec.completed and not rec.error:
        if abort.is_set():
            rec.error = "INTERRUPTED"
            break
        left = deadline - time.monotonic()
        if left <= 0:
            rec.error = f"LOST: not completed within {opts.request_timeout_s:g} s"
            break
        resuming = bool(rec.session_id and rec.tokens)
        if resuming:
            request = build_request(session_id=rec.session_id,
                                    resume_from=base[0] + len(rec.tokens))
        else:
            rec.tokens, rec.session_id = [], ""
            request = build_request(prompt, max_new_tokens=opts.max_new_tokens,
                                    temperature=opts.temperature,
                                    seed=sample_seed(opts, prompt_index))
        rec.gateway = gateway
        try:
            _attempt(clients[gateway], request, rec,
                     base[0] + len(rec.tokens) if resuming else None, left, base)
            if not rec.completed and not rec.error:
                rec.error = "INCOMPLETE: the stream ended without a finish reason"
        except grpc.RpcError as err:
            code = err.code().name
            rec.transient[code] += 1
            if resuming and code in ("NOT_FOUND", "INVALID_ARGUMENT"):
                # the session is gone, or never committed what this client received: start over
                rec.session_id = ""
            if rec.session_id and rec.tokens:
                rec.resumes += 1
            else:
                rec.retries += 1
            gateway = 1 - gateway  # the other gateway: this one may be the one killed
            abort.wait(BACKOFF_S)
    rec.latency_s = time.monotonic() - start
    rec.gateway = -1
    return rec


Reference = dict[int, tuple[list[int], int]]  # prompt index -> (token ids, finish reason)


def reference_outputs(address: str, prompts: tuple[str, ...], opts: ChaosOptions) -> Reference:
    """Each prompt once on the intact mesh, before any kill (sampled: with its seed)."""
    from specmesh.client import GatewayClient, build_request

    out: Reference = {}
    with GatewayClient(address) as client:
        for i, prompt in enumerate(prompts):
            reply = client.generate(build_request(prompt, max_new_tokens=opts.max_new_tokens,
                                                  temperature=opts.temperature,
                                                  seed=sample_seed(opts, i)))
            out[i] = (list(reply.token_ids), reply.finish_reason)
    return out


def kill_in_turn(cmesh: ChaosMesh, opts: ChaosOptions, until: float, kills: list[KillRecord],
                 stop: threading.Event, t0: float,
                 ready: Callable[[str], bool] = lambda name: True) -> None:
    """SIGKILLs the processes of KILL_ORDER one at a time, each started again (and SERVING)
    before the next, until ``until`` or ``opts.cycles`` full rounds. A kill waits (up to
    CUT_WAIT_S) until ``ready(name)``: a gateway is killed while it streams to a client."""
    for n, name in enumerate(itertools.cycle(KILL_ORDER)):
        if opts.cycles and n >= opts.cycles * len(KILL_ORDER):
            break
        if stop.wait(opts.pause_s) or time.monotonic() >= until:
            break
        give_up = time.monotonic() + CUT_WAIT_S
        while not ready(name) and time.monotonic() < give_up and not stop.is_set():
            time.sleep(0.005)
        at = time.monotonic()
        cmesh.kill(name)
        if name == "redis":
            time.sleep(REDIS_DOWN_S)
        cmesh.restart(name, opts.restart_timeout_s)
        kills.append(KillRecord(name, at - t0, time.monotonic() - at))


def run_chaos(cmesh: ChaosMesh, prompts: tuple[str, ...], opts: ChaosOptions,
              progress: Callable[[float, int, int, int], None] | None = None
              ) -> tuple[list[ChaosRecord], list[KillRecord], float]:
    """Streams back to back while kill_in_turn runs; when it ends the streams start no new
    request and the ones in flight complete. Returns (records, kills, wall seconds). On
    Ctrl-C the calls in flight are cancelled and the restart under way, if any, is waited for
    (so that stopping the mesh leaves no process behind)."""
    from specmesh.client import GatewayClient

    records: list[ChaosRecord] = []
    kills: list[KillRecord] = []
    lock, stop, abort = threading.Lock(), threading.Event(), threading.Event()
    channels: list = []
    current: dict[int, ChaosRecord] = {}  # stream -> its request under way

    def streaming(name: str) -> bool:
        """Whether a stream on gateway ``name`` has received chunks and is not done."""
        if name not in GATEWAYS:
            return True
        g = GATEWAYS.index(name)
        return any(r.gateway == g and r.tokens and not r.completed and not r.error
                   for r in list(current.values()))
    t0 = time.monotonic()
    addresses = cmesh.gateways

    def worker(i: int) -> None:
        rng = random.Random(f"chaos/{opts.seed}/{i}")
        clients = [GatewayClient(a) for a in addresses]
        with lock:
            channels.extend(c.channel for c in clients)
        try:
            while not stop.is_set():
                index = rng.randrange(len(prompts))
                rec = chaos_request(clients, i % 2, index, prompts[index], opts, abort,
                                    lambda r: current.__setitem__(i, r))
                with lock:
                    records.append(rec)
        finally:
            for c in clients:
                c.channel.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True, name=f"chaos-{i}")
               for i in range(opts.streams)]
    for t in threads:
        t.start()
    failure: BaseException | None = None
    failures: list[BaseException] = []
    killer = threading.Thread(target=_guard, daemon=True, name="chaos-kills", args=(
        lambda: kill_in_turn(cmesh, opts, t0 + opts.duration_s, kills, stop, t0, streaming),
        failures.append))
    killer.start()
    try:
        while killer.is_alive() or any(t.is_alive() for t in threads):
            if not killer.is_alive():
                stop.set()
            time.sleep(0.25)
            if progress:
                with lock:
                    done = len(records)
                    lost = sum(not r.completed for r in records)
                    tokens = sum(len(r.tokens) for r in records if r.completed)
                progress(time.monotonic() - t0, done, lost, tokens)
    except BaseException as exc:
        failure = exc
        abort.set()
        stop.set()
        with lock:
            for channel in channels:
                channel.close()  # cancels the calls in flight
        killer.join(opts.restart_timeout_s)
    stop.set()
    for t in threads:
        t.join(opts.request_timeout_s + 5)
    if failure is not None:
        raise failure
    if failures:
        raise failures[0]
    return records, kills, time.monotonic() - t0


def _guard(fn: Callable[[], None], on_error: Callable[[BaseException], None]) -> None:
    try:
        fn()
    except BaseException as exc:  # reported by run_chaos in the main thread
        on_error(exc)

