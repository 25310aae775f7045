"""`specmesh bench`: target-only decoding, SpecMesh with each drafter, and HF assisted generation
on the same model pair and prompts, side by side, at several concurrency levels (issue #4; see
docs/performance.md for what is measured and how).

Modes (``--modes``):

* ``target``: target-only decoding through the same gateway (``speculation.disable``), the
  baseline every speedup is relative to;
* ``model``: the model drafter with a fixed k (``num_draft_tokens=k``);
* ``adaptive``: the model drafter, k chosen by the gateway per round (``num_draft_tokens=0``);
* ``ngram``: the prompt-lookup drafter with a fixed k;
* ``hf``: transformers' assisted generation in this process (specmesh.bench_hf), concurrency 1.

A level of concurrency N runs max(P, N) requests for P prompts: N workers, worker i takes
requests i, i+N, i+2N, ... and request j uses prompt j mod P, so every prompt runs at every
level. The level's wall time runs from the moment every worker is connected until the last
request ends. All decoding is greedy, so every output must equal target-only's (the lossless
guarantee, reported as ``outputs match``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from specmesh import bench_report
from specmesh.bench_costs import ServiceProbe, cost_figures, model_info

MODE_KEYS = ("target", "model", "adaptive", "ngram", "hf")
HF_NOTE = ("HF assisted generation supports batch size 1 only: it runs at concurrency 1 only, "
           "one prompt after another, in the bench process.")


@dataclass(frozen=True)
class Mode:
    key: str
    label: str
    disable: bool = False  # speculation.disable: target-only
    drafter: str = ""  # speculation.drafter
    k: int = 0  # speculation.num_draft_tokens; 0 = the gateway's adaptive choice


def make_modes(keys: list[str], k: int) -> list[Mode]:
    table = {"target": Mode("target", "target-only", disable=True),
             "model": Mode("model", f"SpecMesh model k={k}", drafter="model", k=k),
             "adaptive": Mode("adaptive", "SpecMesh model adaptive k", drafter="model"),
             "ngram": Mode("ngram", f"SpecMesh ngram k={k}", drafter="ngram", k=k),
             "hf": Mode("hf", f"HF assisted k={k}", k=k)}
    return [table[key] for key in MODE_KEYS if key in keys]


@dataclass
class BenchOptions:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8])
    k: int = 3
    max_new_tokens: int = 128
    threads: int = 1
    device: str = "cpu"
    seed: int = 0
    timeout_s: float = 600.0


def stream_one(client, prompt_index: int, prompt: str, mode: Mode, opts: BenchOptions) -> dict:
    """One GenerateStream request: its token ids, usage, TTFT and latency; errors recorded."""
    import grpc

    from specmesh.client import build_request

    request = build_request(prompt, max_new_tokens=opts.max_new_tokens, temperature=0.0,
                            seed=opts.seed, num_draft_tokens=mode.k,
                            disable_speculation=mode.disable, drafter=mode.drafter)
    rec = {"prompt_index": prompt_index, "token_ids": [], "completion_tokens": 0, "rounds": 0,
           "draft_tokens": 0, "accepted_draft_tokens": 0, "ttft_s": None, "latency_s": 0.0,
           "error": "", "chunks": []}
    final = None
    start = time.perf_counter()
    try:
        for chunk in client.stream(request, timeout=opts.timeout_s):
            if chunk.token_ids:
                if rec["ttft_s"] is None:
                    rec["ttft_s"] = time.perf_counter() - start
                rec["token_ids"].extend(chunk.token_ids)
                # one chunk per round: (tokens, was it the last) for the per-token α
                rec["chunks"].append((len(chunk.token_ids), bool(chunk.finish_reason)))
            if chunk.finish_reason:
                final = chunk
    except grpc.RpcError as err:
        rec["error"] = f"{err.code().name}: {err.details()}"
    rec["latency_s"] = time.perf_counter() - start
    if not rec["error"]:
        if final is None:
            rec["error"] = "INCOMPLETE: the stream ended without a finish reason"
        else:
            u = final.usage
            rec.update(completion_tokens=u.completion_tokens, rounds=u.rounds,
                       draft_tokens=u.draft_tokens, accepted_draft_tokens=u.accepted_draft_tokens)
            if u.completion_tokens != len(rec["token_ids"]):
                rec["error"] = (f"USAGE_MISMATCH: {len(rec['token_ids'])} tokens streamed, "
                                f"usage says {u.completion_tokens}")
    return rec


def run_level(address: str, mode: Mode, prompts: list[str], concurrency: int,
              opts: BenchOptions, advance=None) -> tuple[list[dict], float]:
    """One cell: ``concurrency`` workers over max(P, concurrency) requests (see the module
    docstring). Returns the records (sorted by prompt) and the wall time."""
    import grpc

    from specmesh.client import GatewayClient

    n = max(len(prompts), concurrency)
    records: list[dict] = []
    lock = threading.Lock()
    ready = threading.Barrier(concurrency + 1)

    def worker(i: int) -> None:
        with GatewayClient(address) as client:
            try:
                grpc.channel_ready_future(client.channel).result(timeout=30)
            finally:
                ready.wait()
            for j in range(i, n, concurrency):
                rec = stream_one(client, j % len(prompts), prompts[j % len(prompts)], mode, opts)
                with lock:
                    records.append(rec)
                if advance:
                    advance()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True, name=f"bench-{i}")
               for i in range(concurrency)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return sorted(records, key=lambda r: r["prompt_index"]), wall


def run_bench(address: str, prompts: list[dict], modes: list[Mode], opts: BenchOptions,
              probe: ServiceProbe, hf_pair: tuple[str, str] | None, progress) -> dict:
    """Every (mode, concurrency) cell, concurrency by concurrency (so the rows compared with
    each other run close together in time). ``progress(label, total)`` returns an advance()."""
    texts = [p["prompt"] for p in prompts]
    rows: list[dict] = []
    outputs: dict[tuple[str, int], list[dict]] = {}
    gateway_modes = [m for m in modes if m.key != "hf"]
    hf = next((m for m in modes if m.key == "hf"), None)
    warm = dataclasses.replace(opts, max_new_tokens=min(16, opts.max_new_tokens))
    for mode in gateway_modes:  # first calls load caches, open channels: not measured
        stream_one_client(address, texts[0], mode, warm)
    for level, c in enumerate(opts.concurrency):
        for mode in gateway_modes:
            advance = progress(f"{mode.label} @ {c}", max(len(texts), c))
            before = probe.snapshot()
            records, wall = run_level(address, mode, texts, c, opts, advance)
            services = probe.delta(before, probe.snapshot())
            outputs[(mode.key, c)] = records
            alpha = (bench_report.per_token_alpha(records, mode.k, opts.max_new_tokens)
                     if mode.k and not mode.disable else None)
            rows.append({"mode": mode.key, "label": mode.label, "concurrency": c,
                         **bench_report.summarize(records, wall), "alpha": alpha,
                         "services": services})
        if level == 0 and hf is not None and hf_pair is not None:
            from specmesh.bench_hf import run_assisted

            advance = progress(f"{hf.label} @ 1", len(texts))
            records, wall, forward = run_assisted(
                *hf_pair, texts, k=opts.k, max_new_tokens=opts.max_new_tokens,
                threads=opts.threads, device=opts.device, seed=opts.seed, progress=advance)
            outputs[("hf", 1)] = records
            rows.append({"mode": "hf", "label": hf.label, "concurrency": 1,
                         **bench_report.summarize(records, wall), "alpha": None,
                         "services": None,
                         "hf_forward": forward})
    bench_report.compare(rows, outputs)
    target_1 = next((r for r in rows if r["mode"] == "target" and r["concurrency"] == 1), None)
    costs = [cost_figures(target_1, r, opts.k, r["mode"]) for r in rows
             if target_1 and r["concurrency"] == 1 and r["mode"] in ("model", "ngram")]
    reference = {prompts[r["prompt_index"]]["id"]: r["token_ids"]
                 for r in outputs.get(("target", opts.concurrency[0]), []) if not r["error"]}
    return {"rows": rows, "costs": costs, "reference_outputs": reference}


def stream_one_client(address: str, prompt: str, mode: Mode, opts: BenchOptions) -> dict:
    from specmesh.client import GatewayClient

    with GatewayClient(address) as client:
        return stream_one(client, 0, prompt, mode, opts)


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


def _split(csv: str) -> list[str]:
    return [x.strip() for x in csv.split(",") if x.strip()]


def bench(
    target: Annotated[str, typer.Option(help="Target model (default: the demo pair in models/, "
                                             "else the tiny pair `specmesh up` uses).")] = "",
    drafter: Annotated[str, typer.Option("--drafter", "--draft",
                                         help="Draft model (with --target).")] = "",
    addr: Annotated[str, typer.Option(help="Benchmark this gateway instead of starting a local "
                                           "mesh (the HF mode then needs --target/--drafter, "
                                           "the cost figures --verifiers/--drafters/"
                                           "--metrics-url).")] = "",
    verifiers: Annotated[str, typer.Option(help="With --addr: verifier HOST:PORT,... to read "
                                                "GetStats from.")] = "",
    drafters: Annotated[str, typer.Option(help="With --addr: drafter HOST:PORT,... (model and "
                                               "ngram) to read GetStats from.")] = "",
    metrics_url: Annotated[str, typer.Option(help="With --addr: the gateway's Prometheus URL, "
                                                  "e.g. http://HOST:9464/metrics.")] = "",
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma-separated.")
                           ] = "1,4,8",
    k: Annotated[int, typer.Option(min=1, max=16, help="Fixed draft tokens per round.")] = 3,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Per request.")] = 128,
    prompts: Annotated[int | None, typer.Option(min=1, help="Use only N of the shipped prompts "
                                                          "(code and prose mixed).")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Another prompt set, in the format "
                                                          "of specmesh/bench_prompts.json.")
                           ] = None,
    modes: Annotated[str, typer.Option(help="Comma-separated, of: " + ", ".join(MODE_KEYS)
                                            + ".")] = ",".join(MODE_KEYS),
    no_hf: Annotated[bool, typer.Option("--no-hf", help="Skip HF assisted generation.")] = False,
    threads: Annotated[int, typer.Option(min=0, help="torch threads of each drafter and verifier "
                                                     "process of the local mesh, and of the HF "
                                                     "baseline (0 = torch's default).")] = 1,
    device: Annotated[str, typer.Option(help="Device of the local mesh's models and of the HF "
                                             "baseline.")] = "cpu",
    out: Annotated[Path, typer.Option(help="Where bench.json, bench.md and the PNG plots go.")
                   ] = Path("bench-results"),
    seed: Annotated[int, typer.Option(help="Sampling seed sent with every request (greedy "
                                           "output does not depend on it).")] = 0,
    timeout: Annotated[float, typer.Option(help="Deadline of one request, seconds.")] = 600.0,
) -> None:
    """Compare target-only decoding, SpecMesh (model drafter with fixed and adaptive k, n-gram
    drafter) and HF assisted generation on one model pair and prompt set, at several
    concurrency levels; write bench.json, bench.md and plots. Exits 1 when a request failed or
    an output differs from target-only's."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from services.local_mesh import MeshSpec, free_port
    from specmesh.bench_prompts import PROMPTS_PATH, load_prompts
    from specmesh.command_mesh import command_mesh

    err, console = Console(stderr=True), Console()
    if not console.is_terminal:  # a file or a pipe: room for the whole table
        console = Console(width=200)
    machine = machine_info()
    keys = _split(modes)
    if not keys or set(keys) - set(MODE_KEYS):
        raise typer.BadParameter(f"--modes takes {', '.join(MODE_KEYS)}; got {modes!r}")
    try:
        levels = [int(x) for x in _split(concurrency)]
    except ValueError as exc:
        raise typer.BadParameter(f"--concurrency: {exc}") from exc
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise typer.BadParameter("--concurrency takes distinct positive integers, e.g. 1,4,8")
    if bool(target) != bool(drafter):
        raise typer.BadParameter("give both --target and --drafter, or neither")
    keys = [x for x in keys if not (no_hf and x == "hf")]
    opts = BenchOptions(concurrency=levels, k=k, max_new_tokens=max_new_tokens, threads=threads,
                        device=device, seed=seed, timeout_s=timeout)
    chosen = load_prompts(prompt_file or PROMPTS_PATH, prompts)
    mode_list = make_modes(keys, k)
    notes = []
    if not addr and not target:
        from specmesh.cli import _default_pair

        with err.status("finding the demo model pair"):
            target, drafter = _default_pair()
    hf_pair = (target, drafter) if target else None
    if "hf" in keys:
        notes.append(HF_NOTE if hf_pair else "HF assisted generation skipped: with --addr it "
                                             "needs --target and --drafter.")
    address = addr or "local mesh"  # as the report names it
    with command_mesh(err) as start_mesh:
        if addr:
            probe = ServiceProbe(_split(verifiers), _split(drafters), metrics_url)
        else:
            metrics_port = free_port()
            service_args = ("--threads", str(threads), "--device", device)
            mesh = start_mesh(MeshSpec(
                target=target, draft=drafter, port=free_port(), drafters=1,
                ngram_drafters=int("ngram" in keys), log_dir=out / "logs",
                extra_gateway_args=("--metrics-port", str(metrics_port)),
                extra_verifier_args=service_args, extra_drafter_args=service_args))
            addr = mesh.gateway_address
            probe = ServiceProbe(mesh.verifier_addresses, mesh.drafter_addresses,
                                 f"http://127.0.0.1:{metrics_port}/metrics")
        names = {"target": target, "draft": drafter}
        for role, kind, addresses in (("target", "verifier", probe.verifiers),
                                      ("draft", "drafter", probe.drafters["model"])):
            try:  # what the mesh says it serves (the figures stand without it)
                names[role] = model_info(addresses[0], kind).model if addresses else names[role]
            except Exception:
                pass
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                      transient=False) as bar:
            def progress(label: str, total: int):
                task = bar.add_task(label, total=total)
                return lambda: bar.advance(task)
            results = run_bench(addr, chosen, mode_list, opts, probe, hf_pair, progress)
    report = {
        "machine": {**machine, "load_average_end": list(os.getloadavg())},
        "settings": {"concurrency": levels, "k": k, "max_new_tokens": max_new_tokens,
                     "modes": keys, "threads": threads, "device": device, "seed": seed,
                     "address": address,
                     "prompts": [{x: p[x] for x in ("id", "kind", "source")} for p in chosen]},
        "models": {role: {"name": name, "params": count_params(name) if name else None}
                   for role, name in names.items()},
        "notes": notes, **results,
    }
    report["targets"] = bench_report.targets(report["rows"], report["costs"])
    _cost_notes(report)
    files = bench_report.write_outputs(report, out)
    bench_report.render(report, console)
    err.print("wrote " + ", ".join(str(f) for f in files))
    if any(r["errors"] for r in report["rows"]) or any(r["outputs_match"] is False
                                                       for r in report["rows"]):
        raise typer.Exit(1)


def _cost_notes(report: dict) -> None:
    notes = report["notes"]
    rows = [r for r in report["rows"] if r.get("services")]
    if rows and not any((r["services"].get("verifier") or {}).get("forward_passes")
                        for r in rows):
        notes.append("No forward_ms/forward_passes from the services' GetStats (with --addr: "
                     "give --verifiers and --drafters): c, c_v, the bound and the efficiency "
                     "are n/a.")
    if rows and not any((r["services"].get("gateway") or {}).get("verify_compute_s") is not None
                        for r in rows):
        notes.append("No specmesh_round_draft_compute_seconds / "
                     "specmesh_round_verify_compute_seconds from the gateway (with --addr: give "
                     "--metrics-url): the overhead is n/a.")
    if any(r["mode"] == "adaptive" for r in report["rows"]):
        notes.append("Adaptive k: the gateway picks k per round, so it has no single bound.")
    la = report["machine"]["load_average_start"]
    notes.append(f"Load average (1 min) at start {la[0]:.2f}, at end "
                 f"{report['machine']['load_average_end'][0]:.2f}, on "
                 f"{report['machine']['cores']} cores.")
