"""One run of one `specmesh bench` cell, as a row: a gateway mode's (``mode_row``) or a
peer's (``peer_row``), with the CPU its processes used meanwhile (specmesh.bench runs them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specmesh import bench_report
from specmesh.bench_costs import ServiceProbe, gateway_figures
from specmesh.bench_gateway import run_level
from specmesh.bench_machine import ProcessCpu
from specmesh.bench_peers import Peer, run_peer_level
from specmesh.bench_workers import cell_requests

if TYPE_CHECKING:
    from specmesh.bench import BenchOptions
    from specmesh.bench_modes import Mode


def _cpu_during(cpu: ProcessCpu | None, work):
    """(what ``work()`` returns, the CPU seconds each of ``cpu``'s processes used meanwhile,
    by name; None without processes to measure)."""
    if cpu is None:
        return work(), None
    before = cpu.by_name()
    result = work()
    return result, {name: s - before.get(name, 0.0) for name, s in cpu.by_name().items()}


def mode_row(address: str, mode: Mode, texts: list[str], c: int, opts: BenchOptions,
              probe: ServiceProbe, cpu: ProcessCpu | None, progress, outputs: dict,
              tag: str = "") -> dict:
    """One run of a gateway mode's cell; its records join ``outputs``."""
    advance = progress(f"{mode.label} @ {c}{tag}",
                       cell_requests(len(texts), c, opts.per_stream))
    before = probe.snapshot()
    (records, wall), by_process = _cpu_during(
        cpu, lambda: run_level(address, mode, texts, c, opts, advance))
    services = probe.delta(before, probe.snapshot())
    outputs.setdefault((mode.key, c), []).extend(records)
    alpha = (bench_report.per_token_alpha(records, mode.k, opts.max_new_tokens)
             if mode.k and not mode.disable else None)
    summary = bench_report.summarize(records, wall)
    return {"mode": mode.key, "label": mode.label, "concurrency": c, **summary, "alpha": alpha,
            **bench_report.cpu_figures(by_process, summary["tokens"]),
            **gateway_figures(services.get("gateway")), "services": services}


def peer_row(peer: Peer, model: str, texts: list[str], c: int, opts: BenchOptions, progress,
              outputs: dict, tag: str = "") -> dict:
    advance = progress(f"{peer.name} @ {c}{tag}",
                       cell_requests(len(texts), c, opts.per_stream))
    cpu = ProcessCpu.serving(peer.url)  # found per cell: a peer may be restarted in between
    (records, wall), by_process = _cpu_during(cpu, lambda: run_peer_level(
        peer, model, texts, c, opts.max_new_tokens, opts.timeout_s, advance, opts.per_stream,
        opts.temperature, opts.seed))
    outputs.setdefault((peer.key, c), []).extend(records)
    summary = bench_report.summarize(records, wall)
    return {"mode": peer.key, "label": f"{peer.name} ({peer.url}, {model})", "concurrency": c,
            **summary, "alpha": None, **bench_report.cpu_figures(by_process, summary["tokens"]),
            **gateway_figures(None), "services": None}
