"""What `specmesh bench` records about the machine and the models: CPU, cores, versions, the
commit, the load average, and the parameter count of a local model directory; and
``wait_quiet``, which lets the CPUs settle between cells."""

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
