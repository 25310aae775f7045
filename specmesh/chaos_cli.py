"""`specmesh load --chaos`: the chaos mesh started, the reference taken, the chaos run
(specmesh/chaos.py), and its report: built, printed and written (docs/load.md, "Chaos")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from specmesh.chaos import (
    ChaosOptions,
    ChaosRecord,
    KillRecord,
    Reference,
    reference_outputs,
    run_chaos,
    start_chaos_mesh,
    tier,
)


def build_chaos_report(records: list[ChaosRecord], kills: list[KillRecord], wall_s: float,
                       reference: Reference, opts: ChaosOptions) -> dict:
    from specmesh.loadtest import percentiles

    done = [r for r in records if r.completed]
    differ = [r for r in done if (r.tokens, r.finish) != reference[r.prompt_index]]
    tokens = sum(len(r.tokens) for r in done)
    transient = Counter()
    for r in records:
        transient.update(r.transient)
    return {
        "streams": opts.streams, "duration_s": opts.duration_s, "cycles": opts.cycles,
        "max_new_tokens": opts.max_new_tokens, "wall_s": wall_s,
        "requests": len(records), "completed": len(done),
        "lost": len(records) - len(done),
        "lost_details": sorted({r.error for r in records if not r.completed})[:5],
        "outputs_equal": len(done) - len(differ), "outputs_differ": len(differ),
        "all_equal": not differ and len(done) == len(records),
        "resumes": sum(r.resumes for r in records),
        "retries": sum(r.retries for r in records),
        "requests_resumed": sum(bool(r.resumes) for r in records),
        "requests_retried": sum(bool(r.retries) for r in records),
        "transient_errors": dict(transient),
        "kills": dict(Counter(tier(k.name) for k in kills)),
        "kill_log": [{"name": k.name, "at_s": round(k.at_s, 1),
                      "back_after_s": round(k.back_after_s, 1)} for k in kills],
        "tokens_total": tokens, "tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "latency_ms": percentiles([r.latency_s * 1000 for r in done]),
    }


def render_chaos(report: dict, console) -> None:
    kills = ", ".join(f"{t} {n}" for t, n in report["kills"].items()) or "none"
    console.print(f"specmesh load --chaos: {report['streams']} streams, "
                  f"{report['wall_s']:.1f} s wall, max_new_tokens {report['max_new_tokens']}")
    console.print(f"kills: {kills}")
    for k in report["kill_log"]:
        console.print(f"  {k['at_s']:7.1f} s  {k['name']:<11} back after {k['back_after_s']} s")
    transient = ", ".join(f"{c} {n}" for c, n in report["transient_errors"].items()) or "none"
    console.print(f"requests {report['requests']}: completed {report['completed']}, lost "
                  f"{report['lost']}; outputs equal to the intact mesh's "
                  f"{report['outputs_equal']}, different {report['outputs_differ']}")
    console.print(f"resume attempts {report['resumes']} ({report['requests_resumed']} requests "
                  f"resumed), retries from the start {report['retries']} "
                  f"({report['requests_retried']} requests); errors met: {transient}")
    lat = report["latency_ms"]
    console.print(f"tokens {report['tokens_total']}, {report['tokens_per_s']:.1f} tokens/s"
                  + (f"; latency ms p50 {lat['p50']:.0f} p90 {lat['p90']:.0f} "
                     f"p99 {lat['p99']:.0f}" if lat else ""))
    for line in report["lost_details"]:
        console.print(f"  [red]{line}[/]")
    console.print("[green]all outputs equal, none lost[/]" if report["all_equal"]
                  else "[red]FAILED: outputs lost or different[/]")


def chaos_command(opts: ChaosOptions, json_path: Path | None) -> bool:
    """`specmesh load --chaos`: the bundled tiny pair in a chaos mesh, the reference outputs
    from the intact mesh, the chaos, the report. Returns whether every output was equal."""
    import json
    import tempfile

    from rich.console import Console
    from rich.live import Live

    from services.local_mesh import default_cache_dir
    from services.tiny_models import build_tiny_pair
    from specmesh.loadtest import PROMPTS

    err, out = Console(stderr=True), Console()
    with err.status("building the bundled tiny model pair"):
        target, draft = build_tiny_pair(default_cache_dir() / "tiny-pair")
    log_dir = Path(tempfile.mkdtemp(prefix="specmesh-chaos-"))
    with err.status("starting a mesh of two gateways, drafters and verifiers and a Redis"):
        cmesh = start_chaos_mesh(str(target), str(draft), log_dir)
    err.print(f"chaos mesh up (logs: {log_dir})")
    try:
        reference = reference_outputs(cmesh.gateways[0], PROMPTS, opts)
        with Live(console=err, transient=True, refresh_per_second=4) as live:
            def progress(elapsed: float, requests: int, lost: int, tokens: int) -> None:
                live.update(f"chaos: {elapsed:5.1f} s, {requests} requests, {lost} lost, "
                            f"{tokens / elapsed if elapsed else 0:.1f} tokens/s")
            records, kills, wall_s = run_chaos(cmesh, PROMPTS, opts, progress)
    finally:
        cmesh.stop()
    report = build_chaos_report(records, kills, wall_s, reference, opts)
    report["log_dir"] = str(log_dir)
    render_chaos(report, out)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report["all_equal"]
