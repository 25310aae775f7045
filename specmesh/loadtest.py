"""`specmesh load`: N concurrent streams through a gateway for a while, then latency
percentiles, tokens/s, and the RSS growth and CPU per token of the mesh processes (see
docs/load.md).

Each stream is a thread with its own gRPC channel that sends GenerateStream requests back to
back (greedy, a prompt drawn from PROMPTS) until the duration is over; requests in flight at
that moment run to their end and are counted. Per request:

- TTFT: from sending the request to the first chunk that carries a token;
- inter-token latency (ITL): the gap between a token-carrying chunk and the previous one,
  divided by the chunk's token count and counted once per token (a round that accepts 4
  tokens gives 4 samples of gap/4); the first chunk's tokens are covered by TTFT;
- latency: from sending the request to the end of its stream.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from services.interrupts import raise_pending

PROMPTS = (
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "for i, line in enumerate(lines):\n",
    "The quick brown fox jumps over",
    "Once upon a time, in a small village by the sea,",
    "Speculative decoding makes inference faster because",
    "Dear team, thank you all for",
)
ERROR_BACKOFF_S = 0.2  # a stream pauses this long after a failed request (no busy loop)
MiB = 1024 * 1024


@dataclass
class LoadOptions:
    streams: int = 8
    duration_s: float = 120.0
    max_new_tokens: int = 64
    drafter: str = ""  # "" = the gateway's default
    seed: int = 0
    temperature: float = 0.0  # 0: greedy; else sampled, unseeded
    timeout_s: float = 120.0  # deadline of one request
    tls_ca: str = ""  # verify a TLS gateway with this CA
    api_key: str = ""  # for a gateway started with --api-keys


@dataclass
class RequestRecord:
    prompt_index: int
    code: str = "OK"  # gRPC status name; INCOMPLETE / USAGE_MISMATCH for broken streams
    detail: str = ""
    ttft_s: float | None = None
    latency_s: float = 0.0
    tokens: int = 0  # token ids received
    itl_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.code == "OK"


def stream_one(client, prompt_index: int, opts: LoadOptions, calls: set) -> RequestRecord:
    """One GenerateStream request, timed; errors are recorded, never raised."""
    import grpc

    from specmesh.client import build_request

    rec = RequestRecord(prompt_index)
    request = build_request(PROMPTS[prompt_index], max_new_tokens=opts.max_new_tokens,
                            temperature=opts.temperature, drafter=opts.drafter)
    start = last = time.perf_counter()
    final = None
    call = client.stream(request, timeout=opts.timeout_s)
    calls.add(call)
    try:
        for chunk in call:
            now = time.perf_counter()
            n = len(chunk.token_ids)
            if n:
                if rec.ttft_s is None:
                    rec.ttft_s = now - start
                else:
                    rec.itl_s.extend([(now - last) / n] * n)
                last = now
                rec.tokens += n
            if chunk.finish_reason:
                final = chunk
    except grpc.RpcError as err:
        rec.code, rec.detail = err.code().name, err.details() or ""
    else:
        if final is None:
            rec.code, rec.detail = "INCOMPLETE", "the stream ended without a finish reason"
        elif final.usage.completion_tokens != rec.tokens:
            rec.code = "USAGE_MISMATCH"
            rec.detail = f"{rec.tokens} tokens streamed, usage says {final.usage.completion_tokens}"
    finally:
        calls.discard(call)
        rec.latency_s = time.perf_counter() - start
    return rec


Progress = Callable[[float, int, int, int], None]  # elapsed, requests, errors, tokens


def run_streams(address: str, opts: LoadOptions, *, duration_s: float | None = None,
                per_stream: int | None = None, progress: Progress | None = None,
                seed_offset: int = 0) -> tuple[list[RequestRecord], float]:
    """Runs opts.streams streams until duration_s is over (or per_stream requests each);
    returns every finished request and the wall time. Ctrl-C cancels the calls in flight."""
    from specmesh.client import GatewayClient

    records: list[RequestRecord] = []
    lock, stop, calls = threading.Lock(), threading.Event(), set()
    start = time.perf_counter()
    until = start + duration_s if duration_s is not None else float("inf")

    def worker(i: int) -> None:
        rng = random.Random(f"{opts.seed}/{seed_offset}/{i}")
        with GatewayClient(address, tls_ca=opts.tls_ca, api_key=opts.api_key) as client:
            done = 0
            while not stop.is_set() and time.perf_counter() < until and (
                    per_stream is None or done < per_stream):
                rec = stream_one(client, rng.randrange(len(PROMPTS)), opts, calls)
                done += 1
                with lock:
                    records.append(rec)
                if not rec.ok:
                    stop.wait(ERROR_BACKOFF_S)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True, name=f"load-{i}")
               for i in range(opts.streams)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            next(t for t in threads if t.is_alive()).join(0.25)
            raise_pending()  # a Ctrl-C or SIGTERM a finalizer swallowed (services/interrupts.py)
            if progress:
                with lock:
                    errors = sum(not r.ok for r in records)
                    tokens = sum(r.tokens for r in records)
                    count = len(records)
                progress(time.perf_counter() - start, count, errors, tokens)
    except BaseException:
        stop.set()
        for call in list(calls):
            call.cancel()
        for t in threads:
            t.join(5)
        raise
    return records, time.perf_counter() - start


def _sample(pids: dict[str, int], read: Callable) -> dict[str, float | None]:
    """``read(process)`` summed over each process and its children; None when it is gone."""
    import psutil

    out: dict[str, float | None] = {}
    for name, pid in pids.items():
        try:
            root = psutil.Process(pid)
            total = read(root)
            for child in root.children(recursive=True):
                try:
                    total += read(child)
                except psutil.NoSuchProcess:
                    pass
            out[name] = total
        except psutil.NoSuchProcess:
            out[name] = None
    return out


def sample_rss(pids: dict[str, int]) -> dict[str, int | None]:
    """RSS in bytes of each process plus its children; None when the process is gone."""
    return _sample(pids, lambda p: p.memory_info().rss)


def sample_cpu(pids: dict[str, int]) -> dict[str, float | None]:
    """CPU seconds (user + system) used so far by each process plus its children."""
    return _sample(pids, lambda p: sum(p.cpu_times()[:2]))


def cpu_report(start: dict, end: dict, tokens: int) -> dict:
    """CPU seconds of each process over the measured phase and per generated token (ms),
    with "all" the sum of the processes still there at the end."""
    used = {name: end[name] - start[name] for name in start
            if start.get(name) is not None and end.get(name) is not None}
    used["all"] = sum(used.values())
    return {name: {"seconds": s, "ms_per_token": 1000 * s / tokens if tokens else None}
            for name, s in used.items()}


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50/p90/p99 with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)

    def q(p: float) -> float:
        pos = (len(s) - 1) * p
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def build_report(address: str, opts: LoadOptions, records: list[RequestRecord], wall_s: float,
                 warmup: list[RequestRecord], rss_start: dict | None, rss_end: dict | None,
                 pids: dict[str, int] | None) -> dict:
    ok = [r for r in records if r.ok]
    tokens = sum(r.tokens for r in records)
    ms = lambda xs: percentiles([x * 1000 for x in xs])  # noqa: E731
    rss = None
    if pids is not None:
        rss = {name: {"pid": pid, "start_bytes": rss_start.get(name),
                      "end_bytes": rss_end.get(name),
                      "growth_bytes": (rss_end[name] - rss_start[name]
                                       if rss_end.get(name) and rss_start.get(name) else None)}
               for name, pid in pids.items()}
    return {
        "address": address, "streams": opts.streams, "duration_s": opts.duration_s,
        "wall_s": wall_s, "max_new_tokens": opts.max_new_tokens,
        "drafter": opts.drafter or "gateway default", "seed": opts.seed,
        "temperature": opts.temperature,
        "requests": len(records), "ok": len(ok),
        "errors": dict(Counter(r.code for r in records if not r.ok)),
        "error_details": sorted({f"{r.code}: {r.detail}" for r in records if not r.ok})[:5],
        "warmup": {"requests": len(warmup),
                   "errors": dict(Counter(r.code for r in warmup if not r.ok))},
        "tokens_total": tokens, "tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "ttft_ms": ms([r.ttft_s for r in ok]),
        "itl_ms": ms([x for r in ok for x in r.itl_s]),
        "latency_ms": ms([r.latency_s for r in ok]),
        "rss": rss,
        "cpu": None,  # measure() fills it in for a mesh whose processes it knows
    }


def measure(address: str, opts: LoadOptions, pids: dict[str, int] | None = None,
            progress: Callable[[str, float, int, int, int], None] | None = None) -> dict:
    """Warm-up (one request per stream), RSS sample, the measured load, RSS sample, report."""
    phase = (lambda name: (lambda *a: progress(name, *a))) if progress else (lambda name: None)
    warmup, _ = run_streams(address, opts, per_stream=1, progress=phase("warm-up"), seed_offset=1)
    rss_start = sample_rss(pids) if pids is not None else None
    cpu_start = sample_cpu(pids) if pids is not None else None
    records, wall_s = run_streams(address, opts, duration_s=opts.duration_s,
                                  progress=phase("load"))
    cpu_end = sample_cpu(pids) if pids is not None else None
    rss_end = sample_rss(pids) if pids is not None else None
    report = build_report(address, opts, records, wall_s, warmup, rss_start, rss_end, pids)
    if pids is not None:
        report["cpu"] = cpu_report(cpu_start, cpu_end, report["tokens_total"])
    return report


def failed(report: dict) -> bool:
    """Any error, in the warm-up or the load, or a mesh process that is gone."""
    gone = any(v["end_bytes"] is None for v in (report["rss"] or {}).values())
    return bool(report["errors"] or report["warmup"]["errors"] or gone)


def render(report: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"specmesh load: {report['streams']} streams, {report['duration_s']:g} s "
                        f"(wall {report['wall_s']:.1f} s), max_new_tokens "
                        f"{report['max_new_tokens']}, drafter {report['drafter']}")
    table.add_column("metric")
    for col in ("p50", "p90", "p99"):
        table.add_column(col, justify="right")
    for key, label in (("ttft_ms", "TTFT (ms)"), ("itl_ms", "inter-token latency (ms)"),
                       ("latency_ms", "request latency (ms)")):
        p = report[key]
        table.add_row(label, *([f"{p[c]:.1f}" for c in ("p50", "p90", "p99")] if p else ["-"] * 3))
    console.print(table)
    errors = ", ".join(f"{k} {v}" for k, v in report["errors"].items()) or "none"
    console.print(f"requests {report['requests']} (ok {report['ok']}), errors: {errors}; "
                  f"tokens {report['tokens_total']}, {report['tokens_per_s']:.1f} tokens/s")
    for line in report["error_details"]:
        console.print(f"  [red]{line}[/]")
    if report["warmup"]["errors"]:
        console.print(f"[red]warm-up errors:[/] {report['warmup']['errors']}")
    if report["rss"] is None:
        console.print("RSS: not measured (remote mesh)")
        return
    rss = Table(title="RSS per mesh process (with children)")
    for col in ("process", "pid", "start MiB", "end MiB", "growth MiB"):
        rss.add_column(col, justify="left" if col == "process" else "right")
    fmt = lambda b: "-" if b is None else f"{b / MiB:.1f}"  # noqa: E731
    for name, v in report["rss"].items():
        rss.add_row(name, str(v["pid"]), fmt(v["start_bytes"]),
                    fmt(v["end_bytes"]) if v["end_bytes"] else "exited", fmt(v["growth_bytes"]))
    console.print(rss)
    if report.get("cpu"):
        cpu = Table(title="CPU per mesh process (with children) over the measured phase")
        for col in ("process", "CPU s", "ms / token"):
            cpu.add_column(col, justify="left" if col == "process" else "right")
        for name, v in report["cpu"].items():
            per = v["ms_per_token"]
            cpu.add_row(name, f"{v['seconds']:.1f}", "-" if per is None else f"{per:.2f}")
        console.print(cpu)


def load(
    addr: Annotated[str, typer.Option(help="Gateway HOST:PORT (default: start a local mesh "
                                           "with the bundled tiny pair).")] = "",
    streams: Annotated[int, typer.Option(min=1, help="Concurrent streams.")] = 8,
    duration: Annotated[float, typer.Option(min=0.0, help="Seconds of measured load, after a "
                                                         "warm-up of one request per stream.")
                        ] = 120.0,
    max_new_tokens: Annotated[int, typer.Option(help="Per request.")] = 64,
    drafter: Annotated[str, typer.Option(help="model or ngram (default: the gateway's).")] = "",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the report here.")
                         ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the streams' prompt choice.")] = 0,
    temperature: Annotated[float, typer.Option(
        min=0.0, max=2.0, help="0 (the default) decodes greedily; above 0 requests sample "
                               "at this temperature (with --chaos each prompt with a seed of "
                               "its own, so every output must still equal the intact "
                               "mesh's).")] = 0.0,
    timeout: Annotated[float, typer.Option(help="Deadline of one request, seconds.")] = 120.0,
    tls_ca: Annotated[str, typer.Option(envvar="SPECMESH_TLS_CA",
                                        help="Verify a TLS gateway with this CA (PEM).")] = "",
    api_key: Annotated[str, typer.Option(envvar="SPECMESH_API_KEY",
                                         help="API key of a gateway started with --api-keys.")
                       ] = "",
    chaos: Annotated[bool, typer.Option(
        "--chaos", help="Start a mesh of two gateways, drafters and verifiers and a Redis, and "
                        "SIGKILL and restart each in turn while the streams run; clients resume "
                        "or retry; every output must equal the intact mesh's (docs/load.md).")
                     ] = False,
    target: Annotated[str, typer.Option(help="Target model of the local mesh (default: the "
                                             "bundled tiny pair); not with --addr.")] = "",
    draft: Annotated[str, typer.Option(help="Drafter model of the local mesh, with --target.")
                     ] = "",
) -> None:
    """Hold N concurrent streams for a while; report latency percentiles, tokens/s and the
    mesh processes' RSS growth and CPU per token. Exits 1 on any error (with --chaos: on any request lost or
    output different)."""
    from rich.console import Console
    from rich.live import Live

    from services.local_mesh import MeshSpec, default_cache_dir, free_port
    from specmesh.command_mesh import command_mesh

    if drafter not in ("", "model", "ngram"):
        raise typer.BadParameter("--drafter must be model or ngram")
    if bool(target) != bool(draft) or (target and (addr or chaos)):
        raise typer.BadParameter("--target and --draft go together, for the local mesh "
                                 "(not with --addr or --chaos)")
    if target:
        from specmesh.model_ref import check_loadable

        check_loadable(target, "--target")
        check_loadable(draft, "--draft")
    if chaos:
        if addr or drafter == "ngram":
            raise typer.BadParameter("--chaos kills and restarts the processes of a mesh it "
                                     "starts itself (model drafters): leave out --addr and "
                                     "--drafter ngram")
        from specmesh.chaos import ChaosOptions
        from specmesh.chaos_cli import chaos_command

        try:
            equal = chaos_command(ChaosOptions(streams=streams, duration_s=duration,
                                               max_new_tokens=max_new_tokens, seed=seed,
                                               temperature=temperature,
                                               request_timeout_s=timeout), json_path)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        if not equal:
            raise typer.Exit(1)
        return
    err, out = Console(stderr=True), Console()
    opts = LoadOptions(streams=streams, duration_s=duration, max_new_tokens=max_new_tokens,
                       drafter=drafter, seed=seed, temperature=temperature, timeout_s=timeout,
                       tls_ca=tls_ca,
                       api_key=api_key)
    pids = None
    with command_mesh(err) as start_mesh:
        if not addr:
            from services.tiny_models import build_tiny_pair

            if not target:
                with err.status("building the bundled tiny model pair"):
                    target, draft = build_tiny_pair(default_cache_dir() / "tiny-pair")
            mesh = start_mesh(MeshSpec(target=str(target), draft=str(draft), port=free_port(),
                                       ngram_drafters=int(drafter == "ngram")))
            addr, pids = mesh.gateway_address, {p.name: p.popen.pid for p in mesh.procs}
        with Live(console=err, transient=True, refresh_per_second=4) as live:
            def progress(phase: str, elapsed: float, requests: int, errors: int, tokens: int):
                live.update(f"{phase}: {elapsed:5.1f} s, {requests} requests, {errors} errors, "
                            f"{tokens / elapsed if elapsed else 0:.1f} tokens/s")
            report = measure(addr, opts, pids, progress)
    render(report, out)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    if failed(report):
        raise typer.Exit(1)
