"""What `specmesh bench` records about the machine and the models: CPU, cores, versions, the
commit, the load average, and the parameter count of a local model directory; and
``wait_quiet``, which lets the CPUs settle between cells, ``ProcessCpu``, the CPU time a set
of processes (the local mesh's) used."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path


def count_params(path: str) -> int | None:
    """Parameters stored in a local model directory's safetensors files (None elsewhere)."""
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            total += sum(math.prod(h.get_slice(name).get_shape()) for name in h.keys())
    return total


def machine_info() -> dict:
    import grpc
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        root = Path(__file__).resolve().parent.parent
        commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__,
            "torch_default_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "grpcio": grpc.__version__,
            "commit": commit, "load_average_start": list(os.getloadavg()),
            "date": datetime.now(UTC).isoformat(timespec="seconds")}


def wait_quiet(max_s: float = 5.0, busy_cores: float = 0.3, sample_s: float = 0.2) -> float:
    """Waits until the machine's CPUs are quiet: less than ``busy_cores`` cores' worth of
    CPU busy over a ``sample_s`` sample, for at most ``max_s``; returns the seconds waited.
    Between bench cells: an engine that just served a cell can keep a core busy after its
    last answer (vLLM for CPU spun one of two cores for about a second), which the next cell
    would pay for."""
    import psutil

    limit = 100.0 * busy_cores / (os.cpu_count() or 1)  # cpu_percent: all cores = 100
    start = time.monotonic()
    while psutil.cpu_percent(interval=sample_s) >= limit:
        if time.monotonic() - start >= max_s:
            break
    return time.monotonic() - start


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


class ProcessCpu:
    """CPU seconds (user + system, every thread) used by some processes and their descendants:
    the local mesh's Redis, verifiers, drafters and gateway, for the bench's CPU per generated
    token. ``by_name()`` gives what each process alive at the call (with its descendants) has
    used since it started, with what its ended and reaped children used (the kernel adds
    that to the parent's); the difference of two calls is what they used in between. Only a
    root process that ends in between takes its time with it: the bench's mesh lives for the
    whole run."""

    def __init__(self, pids: list[int], names: list[str] | None = None) -> None:
        self.pids = list(pids)
        self.names = list(names) if names is not None else [str(pid) for pid in self.pids]

    @classmethod
    def serving(cls, url: str) -> ProcessCpu | None:
        """The processes behind a peer's ``url`` when it is served on this machine: whichever
        process listens on its port, with its descendants (vLLM's engine core is a child of
        its API server). None for another host, or when the listener cannot be seen."""
        from urllib.parse import urlsplit

        import psutil

        parts = urlsplit(url)
        if parts.hostname not in LOCAL_HOSTS:
            return None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            pids = {c.pid for c in psutil.net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                    and c.pid is not None}
        except psutil.AccessDenied:
            return None
        return cls(sorted(pids)) if pids else None

    def by_name(self) -> dict[str, float]:
        """The seconds of each root process (by its name) with its descendants."""
        import psutil

        seen: set[int] = set()
        out: dict[str, float] = {}
        for pid, name in zip(self.pids, self.names, strict=True):
            out[name] = 0.0
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for proc in procs:
                if proc.pid in seen:
                    continue
                seen.add(proc.pid)
                try:
                    t = proc.cpu_times()
                except psutil.NoSuchProcess:
                    continue
                # children_*: those of its children that ended and were waited for
                out[name] += t.user + t.system + t.children_user + t.children_system
        return out
