"""Where a drafter's or verifier's start-up time goes (docs/performance.md, "Start-up time").

    python -m specmesh.startup_profile --role drafter --model models/demo-drafter

1. **Time to SERVING**: the real command (`specmesh drafter|verifier --model M`) is started
   ``--runs`` times, one after the other; each run is timed from the spawn to the first
   grpc.health.v1 answer SERVING, polled every 20 ms (faster than any launcher, so the figure
   is the replica's own time), with the CPU seconds the process used until then (on a busy
   machine the wall time is about this CPU time over the process's share of the cores).
2. **Phases** (median of ``--runs``): a fresh interpreter runs the replica's start-up steps
   in their order, each timed: the interpreter itself, ``import torch``, the service's own modules (gRPC,
   OpenTelemetry, protobuf, Redis), transformers with the model's class, then
   ``load_for_serving`` (weights, tokenizer, fingerprint, warm-up forward). What the time to
   SERVING has beyond their sum is the engine, the gRPC server's start and the process spawn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

_PHASES = r"""
import json, sys, time
clock = lambda: (time.perf_counter(), time.process_time())
t = [clock()]
import torch
t.append(clock())
import importlib
importlib.import_module(sys.argv[2] + "_svc.server")
t.append(clock())
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(sys.argv[1]))]
t.append(clock())
from services.models import load_for_serving
load_for_serving(sys.argv[1], "cpu", "float32", int(sys.argv[3]))
t.append(clock())
names = ["import torch", "service modules (gRPC, OpenTelemetry, protobuf, Redis)",
         "transformers + the model class", "load_for_serving (weights, tokenizer, "
         "fingerprint, warm-up)"]
print(json.dumps({n: [t[i + 1][0] - t[i][0], t[i + 1][1] - t[i][1]]
                  for i, n in enumerate(names)}))
"""


def time_to_serving(role: str, model: str, threads: int,
                    timeout: float = 300.0) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process) from the spawn to SERVING."""
    import psutil

    from services.health import is_serving
    from services.local_mesh import free_port

    port = free_port()
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "specmesh.cli", role, "--host", "127.0.0.1",
                             "--port", str(port), "--model", model, "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not is_serving(f"127.0.0.1:{port}", timeout=0.5):
            if proc.poll() is not None or time.monotonic() - start > timeout:
                raise RuntimeError(f"{role} --model {model} did not become SERVING")
            time.sleep(0.02)
        wall = time.monotonic() - start
        cpu = psutil.Process(proc.pid).cpu_times()
        return wall, cpu.user + cpu.system
    finally:
        proc.terminate()
        proc.wait(30)


def phases(role: str, model: str, threads: int) -> dict[str, list[float]]:
    """Each phase's [wall, CPU] seconds (the interpreter's start: wall only, CPU as wall)."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    interpreter = time.monotonic() - start
    out = subprocess.run([sys.executable, "-c", _PHASES, model, role, str(threads)],
                         check=True, capture_output=True, text=True).stdout
    return {"interpreter start": [interpreter, interpreter],
            **json.loads(out.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specmesh.startup_profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("drafter", "verifier"), required=True)
    parser.add_argument("--model", required=True, help="The model directory to serve.")
    parser.add_argument("--threads", type=int, default=1, help="--threads of the replica.")
    parser.add_argument("--runs", type=int, default=3,
                        help="Timed starts and phase runs (medians shown).")
    args = parser.parse_args(argv)
    runs = [time_to_serving(args.role, args.model, args.threads) for _ in range(args.runs)]
    samples = [phases(args.role, args.model, args.threads) for _ in range(args.runs)]
    steps = {name: [statistics.median(s[name][j] for s in samples) for j in (0, 1)]
             for name in samples[0]}
    wall = statistics.median(w for w, _ in runs)
    cpu = statistics.median(c for _, c in runs)
    print(f"{args.role} {args.model}: SERVING after {wall:.2f} s, {cpu:.2f} CPU s (medians "
          f"of {', '.join(f'{w:.2f}' for w, _ in runs)} s; CPU "
          f"{', '.join(f'{c:.2f}' for _, c in runs)} s)")
    print("    wall     CPU  phase")
    for name, (w, c) in steps.items():
        print(f"  {w:6.2f}  {c:6.2f}  {name}")
    print(f"  {wall - sum(w for w, _ in steps.values()):6.2f}  "
          f"{cpu - sum(c for _, c in steps.values()):6.2f}  the rest: engine, gRPC server "
          "start, spawn (time to SERVING minus the phases)")


if __name__ == "__main__":
    main()
