"""`specmesh bench`: SpecMesh with each drafter against honest baselines, on the same model pair
and prompts, side by side, at several concurrency levels (issue #14; see docs/performance.md
for what is measured and how).

Modes (``--modes``; specmesh.bench_modes has them in full): ``target`` (target-only through the
same gateway: the serving path's overhead), ``model`` (fixed k), ``default`` (the gateway's
default policy, ``num_draft_tokens=0``; it replaces the former ``adaptive``, the same request),
``ngram`` (fixed k), and in the bench process at concurrency 1 ``hf-plain`` (the target's own
``generate``: the speedup base), ``hf`` (HF assisted generation, fixed k) and ``hf-default``
(HF assisted generation, its own defaults). The HF rows use the torch threads of the mesh's
verifier and model drafter together (``--threads`` × 2, at most the CPU count).

A level of concurrency N runs max(P, R·N) requests for P prompts and ``--per-stream`` R: N
workers, worker i takes requests i, i+N, i+2N, ... and request j uses prompt j mod P, so every
prompt runs at every level and every stream runs at least R requests. The level's wall time
runs from the moment every worker is connected until the last request ends. All decoding is
greedy, so every output must equal target-only's (the lossless guarantee, reported as ``outputs
match``). Speedups, the targets and the serving path's overhead: specmesh.bench_baselines.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from services import steal
from specmesh import bench_baselines, bench_report
from specmesh.bench_cells import mode_row, peer_row
from specmesh.bench_costs import ServiceProbe, cost_figures, gateway_figures, model_info
from specmesh.bench_gateway import stream_one_client
from specmesh.bench_machine import ProcessCpu, count_params, machine_info, wait_quiet
from specmesh.bench_modes import (
    DEFAULT_MODE_KEYS,
    HF_KEYS,
    MODE_KEYS,
    TARGET_KEY,
    Mode,
    hf_threads,
    make_modes,
)
from specmesh.bench_peers import Peer, parse_peers, run_peer_level, served_model
from specmesh.up_cli import default_pair


@dataclass
class BenchOptions:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8])
    k: int = 3
    max_new_tokens: int = 128
    threads: int = 1
    device: str = "cpu"
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None  # sent with every request when given
    timeout_s: float = 600.0
    repeat: int = 1  # runs of every cell; its row is the median run
    per_stream: int = 4  # a cell runs at least this many requests a stream (cell_requests)
    max_steal: float = 0.05  # a cell run with more of the CPUs' time stolen than this ...
    steal_reruns: int = 1  # ... runs again up to this many times; the least stolen run counts


def run_bench(address: str, prompts: list[dict], modes: list[Mode], opts: BenchOptions,
              probe: ServiceProbe, hf_pair: tuple[str, str] | None, progress,
              peers: list[tuple[Peer, str]] = (), cpu: ProcessCpu | None = None) -> dict:
    """Every (mode, concurrency) cell, concurrency by concurrency (so the rows compared with
    each other run close together in time): the gateway's modes, then each peer (``peers``:
    (peer, its model)), in that order on even levels and reversed on odd ones, each once the
    CPUs are quiet; the HF rows after the first level's. With ``opts.repeat`` N > 1 a level
    passes over its cells N times, each pass in the other order, and a cell's row is its
    run with the median tokens/s (``bench_report.median_run``). A run during which a VM's
    host stole more than ``opts.max_steal`` of the CPUs' demanded time runs again, up to
    ``opts.steal_reruns`` times, and the least stolen one counts (services/steal.py).
    ``progress(label, total)`` returns an advance(). ``cpu``: the mesh's processes (a local
    mesh), for each gateway cell's CPU seconds and CPU milliseconds per generated token (None
    with ``--addr``)."""
    texts = [p["prompt"] for p in prompts]
    rows: list[dict] = []
    outputs: dict[tuple[str, int], list[dict]] = {}
    gateway_modes = [m for m in modes if not m.in_process]
    hf_modes = [m for m in modes if m.in_process]
    warm = dataclasses.replace(opts, max_new_tokens=min(16, opts.max_new_tokens))
    for mode in gateway_modes:  # first calls load caches, open channels: not measured
        stream_one_client(address, texts[0], mode, warm)
    for peer, model in peers:  # first calls open connections, load caches: not measured
        run_peer_level(peer, model, texts[:1], 1, warm.max_new_tokens, opts.timeout_s)
    for level, c in enumerate(opts.concurrency):
        cells = list(enumerate([*gateway_modes, *peers]))
        runs: dict[int, list[dict]] = {i: [] for i, _ in cells}
        for rep in range(opts.repeat):  # each pass over the cells in the other order
            for i, cell in cells if (level + rep) % 2 == 0 else cells[::-1]:
                tag = f" (run {rep + 1}/{opts.repeat})" if opts.repeat > 1 else ""
                tried = []
                for _ in range(1 + opts.steal_reruns):  # (a VM's host took CPU time meanwhile)
                    settle_s = wait_quiet()  # (the previous cell's engine may still spin)
                    clock = steal.read()
                    row = (peer_row(*cell, texts, c, opts, progress, outputs, tag)
                           if isinstance(cell, tuple) else
                           mode_row(address, cell, texts, c, opts, probe, cpu, progress,
                                     outputs, tag))
                    tried.append({**row, "settle_s": settle_s,
                                  "steal": steal.share(clock, steal.read())})
                    if (tried[-1]["steal"] or 0.0) <= opts.max_steal:
                        break
                best = min(tried, key=lambda r: r["steal"] or 0.0)
                runs[i].append({**best, "steal_reruns": len(tried) - 1})
        rows += [bench_report.median_run(runs[i]) for i, _ in cells]
        if level == 0 and hf_modes and hf_pair is not None:
            clock = steal.read()
            hf_rows = run_hf_rows(hf_pair, hf_modes, texts, opts, progress, outputs)
            stolen = steal.share(clock, steal.read())  # (one run loads and runs them all)
            rows += [{**r, "steal": stolen} for r in hf_rows]
    base = bench_baselines.compare(rows, outputs, sampled=opts.temperature > 0)
    target_1 = next((r for r in rows if r["mode"] == TARGET_KEY and r["concurrency"] == 1), None)
    costs = [cost_figures(target_1, r, mode.k, mode.drafter) for mode in gateway_modes
             for r in rows if target_1 and r["concurrency"] == 1 and r["mode"] == mode.key
             and not mode.disable]
    reference = {prompts[r["prompt_index"]]["id"]: r["token_ids"]
                 for r in outputs.get((TARGET_KEY, opts.concurrency[0]), []) if not r["error"]}
    baselines = bench_baselines.baselines(rows, base, {m.key: m.label for m in modes})
    return {"rows": rows, "costs": costs, "baselines": baselines, "reference_outputs": reference}


def run_hf_rows(pair: tuple[str, str], modes: list[Mode], texts: list[str], opts: BenchOptions,
                progress, outputs: dict) -> list[dict]:
    """The HF rows (concurrency 1), the models loaded once for all of them; their records go
    into ``outputs``."""
    from specmesh.bench_hf import HfSetting, run_hf

    labels = {m.key: m.label for m in modes}
    results = run_hf(*pair, texts, [HfSetting(m.key, m.assistant, m.k, m.static_cache)
                                       for m in modes],
                     max_new_tokens=opts.max_new_tokens,
                     threads=hf_threads(opts.threads, os.cpu_count()), device=opts.device,
                     seed=opts.seed, temperature=opts.temperature,
                     progress=lambda s: progress(f"{labels[s.key]} @ 1", len(texts)))
    rows = []
    for m in modes:
        res = results[m.key]
        outputs[(m.key, 1)] = res.records
        rows.append({"mode": m.key, "label": m.label, "concurrency": 1,
                     **bench_report.summarize(res.records, res.wall_s), "alpha": None,
                     **gateway_figures(None), "services": None, "hf_forward": res.forward,
                     "hf_assistant": res.assistant})
    return rows


def _shared_prefix(prompts: list[dict], target: str, tokens: int,
                   contexts: int, unshared_every: int) -> tuple[list[dict], int]:
    """``prompts`` behind ``contexts`` shared contexts of about ``tokens`` tokens of
    ``target``'s tokenizer, every ``unshared_every``th without
    (specmesh.bench_prompts.with_shared_prefix)."""
    from transformers import AutoTokenizer

    from specmesh.bench_prompts import load_prompts, with_shared_prefix

    if not target:
        raise typer.BadParameter("--shared-prefix needs the target's tokenizer: give --target "
                                 "(or --verifiers, whose model it reads)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"--shared-prefix: no tokenizer at {target!r}: {exc}") from exc
    return with_shared_prefix(prompts, tokenizer, tokens, source=load_prompts(),
                              contexts=contexts, unshared_every=unshared_every)


def _split(csv: str) -> list[str]:
    return [x.strip() for x in csv.split(",") if x.strip()]


def bench(
    target: Annotated[str, typer.Option(help="Target model (default: the demo pair in models/, "
                                             "else the tiny pair `specmesh up` uses).")] = "",
    drafter: Annotated[str, typer.Option("--drafter", "--draft",
                                         help="Draft model (with --target).")] = "",
    addr: Annotated[str, typer.Option(help="Benchmark this gateway instead of starting a local "
                                           "mesh (the HF rows then need --target/--drafter, "
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
    k: Annotated[int, typer.Option(min=1, max=16, help="Draft tokens per round of the fixed-k "
                                                   "modes (model, ngram, hf).")] = 3,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Per request.")] = 128,
    prompts: Annotated[int | None, typer.Option(min=1, help="Use only N of the shipped prompts "
                                                          "(code and prose mixed).")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Another prompt set, in the format "
                                                          "of specmesh/bench_prompts.json.")
                           ] = None,
    modes: Annotated[str, typer.Option(help="Comma-separated, of: " + ", ".join(MODE_KEYS)
                                            + " (hf-static: plain generate with a static "
                                            "cache; worth a row on a GPU).")
                     ] = ",".join(DEFAULT_MODE_KEYS),
    no_hf: Annotated[bool, typer.Option("--no-hf", help="Skip the in-process HF rows ("
                                        + ", ".join(HF_KEYS) + ").")] = False,
    threads: Annotated[int, typer.Option(min=0, help="torch threads of each drafter and verifier "
                                                     "process of the local mesh (0 = torch's "
                                                     "default); the in-process HF rows get twice "
                                                     "as many (the verifier's and the model "
                                                     "drafter's together), at most the CPU "
                                                     "count.")] = 1,
    device: Annotated[str, typer.Option(help="Device of the local mesh's models and of the HF "
                                             "rows.")] = "cpu",
    drafter_device: Annotated[str, typer.Option(
        help="Device of the local mesh's model drafter: the CPU by default, where `specmesh "
             "up` and `specmesh drafter` put it whatever --device is (--device cuda: the "
             "target on the accelerator, the drafter on the CPU beside it; --drafter-device "
             "cuda shares the accelerator).")] = "cpu",
    verifier_replicas: Annotated[int, typer.Option(
        min=1, help="Verifier replicas of the local mesh, each its own process (the gateway "
                    "spreads sessions over them), as `specmesh up --verifiers` starts them.")
                         ] = 1,
    out: Annotated[Path, typer.Option(help="Where bench.json, bench.md and the PNG plots go.")
                   ] = Path("bench-results"),
    temperature: Annotated[float, typer.Option(
        min=0.0, max=2.0, help="0 (the default) decodes greedily, and every mode's output "
                               "must equal target-only's; above 0 every row samples at this "
                               "temperature (the OpenAI API's default is 1), and outputs are "
                               "not compared.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="With --temperature: the seed sent with every "
                                                  "request (a seeded sample keeps a fixed k "
                                                  "and one-token plain rounds, so that it "
                                                  "draws the same again); default none, as "
                                                  "most clients send.")] = None,
    timeout: Annotated[float, typer.Option(help="Deadline of one request, seconds.")] = 600.0,
    shared_prefix: Annotated[int, typer.Option(
        min=0, help="The shared-prefix workload: every prompt preceded by the same context of "
                    "about N tokens (a long system prompt or document before a short "
                    "question), so prefix caches are put to the test; 0 = the prompts alone. "
                    "Prompt + --max-new-tokens must fit the target's context.")] = 0,
    shared_prefixes: Annotated[int, typer.Option(
        min=1, help="With --shared-prefix: that many different contexts, prompt i behind "
                    "context i mod N (several tenants' system prompts), so passes carry "
                    "several groups of sessions that share one.")] = 1,
    unshared_every: Annotated[int, typer.Option(
        min=0, help="With --shared-prefix: every Nth prompt (i mod N = N - 1) without a "
                    "context, as requests behind a system prompt mix with ones that have "
                    "none, so passes carry groups beside sessions that share nothing; 0 = "
                    "none, at least 2.")] = 0,
    repeat: Annotated[int, typer.Option(
        min=1, help="Run every (mode, concurrency) cell N times, each pass over a level's "
                    "cells in the other order, and report each cell's run with the median "
                    "tokens/s (every run's tokens/s in the runs column and bench.json).")] = 1,
    per_stream: Annotated[int, typer.Option(
        min=1, help="Requests a stream runs at least in each cell: a level of N streams runs "
                    "max(prompts, N × this) requests, prompts in turn, so that its wall time "
                    "is not mostly its start and its tail.")] = 4,
    peer: Annotated[list[str] | None, typer.Option(
        help="NAME=URL of an OpenAI-compatible server (vLLM, llama.cpp's llama-server, ...) "
             "to run the same prompts against at every concurrency level, in the same run; "
             "repeatable.")] = None,
    max_steal: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="On a virtual machine: a cell run during which the host took "
                               "more than this share of the CPUs' time for other guests "
                               "(steal, /proc/stat) runs again (--steal-reruns).")] = 0.05,
    steal_reruns: Annotated[int, typer.Option(
        min=0, help="How many times a cell run above --max-steal runs again; the least "
                    "stolen run counts (0: never).")] = 1,
) -> None:
    """Compare SpecMesh (model drafter with a fixed k and with the gateway's defaults, n-gram
    drafter) with plain HF generate (the speedup base), HF assisted generation (fixed k and its
    own defaults) and target-only decoding through the same gateway, on one model pair and
    prompt set, at several concurrency levels; write bench.json, bench.md and plots. Exits 1
    when a request failed or an output differs from target-only's."""
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
    if "adaptive" in keys:
        raise typer.BadParameter("--modes: `adaptive` is now `default` (num_draft_tokens=0, "
                                 "the gateway's default policy)")
    if not keys or set(keys) - set(MODE_KEYS):
        raise typer.BadParameter(f"--modes takes {', '.join(MODE_KEYS)}; got {modes!r}")
    try:
        levels = [int(x) for x in _split(concurrency)]
    except ValueError as exc:
        raise typer.BadParameter(f"--concurrency: {exc}") from exc
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise typer.BadParameter("--concurrency takes distinct positive integers, e.g. 1,4,8")
    from services.models import device_problem

    for option, value in (("--device", device), ("--drafter-device", drafter_device)):
        if problem := device_problem(value):
            raise typer.BadParameter(problem, param_hint=f"'{option}'")
    if bool(target) != bool(drafter):
        raise typer.BadParameter("give both --target and --drafter, or neither")
    if addr and verifier_replicas != 1:
        raise typer.BadParameter("--verifier-replicas sizes the local mesh; a gateway given by "
                                 "--addr has its own replicas", param_hint="'--verifier-replicas'")
    if shared_prefixes > 1 and not shared_prefix:
        raise typer.BadParameter("--shared-prefixes sets how many contexts --shared-prefix N "
                                 "puts before the prompts: give --shared-prefix too",
                                 param_hint="'--shared-prefixes'")
    if unshared_every and not shared_prefix:
        raise typer.BadParameter("--unshared-every leaves every Nth prompt without the "
                                 "context --shared-prefix N puts before the others: give "
                                 "--shared-prefix too", param_hint="'--unshared-every'")
    if unshared_every == 1:
        raise typer.BadParameter("--unshared-every 1 would leave every prompt without the "
                                 "context: give 2 or more (0: none)",
                                 param_hint="'--unshared-every'")
    replicas = None if addr else verifier_replicas  # (the report's: a remote mesh's unknown)
    keys = [x for x in keys if not (no_hf and x in HF_KEYS)]
    try:
        peer_list = parse_peers(peer or [])
        peers = [(p, served_model(p)) for p in peer_list]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    except OSError as exc:
        raise typer.BadParameter(f"--peer: a peer does not answer at its /models: {exc}") from exc
    opts = BenchOptions(concurrency=levels, k=k, max_new_tokens=max_new_tokens, threads=threads,
                        device=device, temperature=temperature, seed=seed, timeout_s=timeout,
                        repeat=repeat,
                        per_stream=per_stream, max_steal=max_steal, steal_reruns=steal_reruns)
    chosen = load_prompts(prompt_file or PROMPTS_PATH, prompts)
    mode_list = make_modes(keys, k)
    if not addr and not target:
        with err.status("finding the demo model pair"):
            target, drafter = default_pair()
    hf_pair = (target, drafter) if target else None
    notes = bench_report.hf_notes(keys, hf_pair is not None, threads, os.cpu_count(),
                                  remote=bool(addr))
    address = addr or "local mesh"  # as the report names it
    with command_mesh(err) as start_mesh:
        cpu = None
        if addr:
            probe = ServiceProbe(_split(verifiers), _split(drafters), metrics_url)
        else:
            metrics_port = free_port()
            def service_args(on: str) -> tuple[str, ...]:
                return ("--threads", str(threads), "--device", on)

            mesh = start_mesh(MeshSpec(
                target=target, draft=drafter, port=free_port(), drafters=1,
                verifiers=verifier_replicas,
                ngram_drafters=int("ngram" in keys), log_dir=out / "logs",
                extra_gateway_args=("--metrics-port", str(metrics_port)),
                extra_verifier_args=service_args(device),
                extra_drafter_args=service_args(drafter_device)))
            addr = mesh.gateway_address
            probe = ServiceProbe(mesh.verifier_addresses, mesh.drafter_addresses,
                                 f"http://127.0.0.1:{metrics_port}/metrics")
            cpu = ProcessCpu([p.popen.pid for p in mesh.procs], [p.name for p in mesh.procs])
        names = {"target": target, "draft": drafter}
        for role, kind, addresses in (("target", "verifier", probe.verifiers),
                                      ("draft", "drafter", probe.drafters["model"])):
            try:  # what the mesh says it serves (the figures stand without it)
                names[role] = model_info(addresses[0], kind).model if addresses else names[role]
            except Exception:
                pass
        prefix_tokens = 0
        if shared_prefix:
            chosen, prefix_tokens = _shared_prefix(chosen, names["target"], shared_prefix,
                                                   shared_prefixes, unshared_every)
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                      transient=False) as bar:
            def progress(label: str, total: int):
                task = bar.add_task(label, total=total)
                return lambda: bar.advance(task)
            results = run_bench(addr, chosen, mode_list, opts, probe, hf_pair, progress, peers,
                                cpu)
    report = {
        "machine": {**machine, "load_average_end": list(os.getloadavg())},
        "settings": {"concurrency": levels, "k": k, "max_new_tokens": max_new_tokens,
                     "repeat": repeat, "per_stream": per_stream, "max_steal": max_steal,
                     "steal_reruns": steal_reruns,
                     "modes": keys, "threads": threads,
                     "hf_threads": hf_threads(threads, os.cpu_count()), "device": device,
                     "drafter_device": drafter_device,
                     "verifier_replicas": replicas,
                     "temperature": temperature, "seed": seed,
                     "shared_prefix_tokens": prefix_tokens,
                     "shared_prefixes": shared_prefixes if prefix_tokens else 0,
                     "unshared_every": unshared_every if prefix_tokens else 0,
                     "address": address,
                     "peers": [{"name": p.name, "url": p.url, "model": m} for p, m in peers],
                     "prompts": [{x: p[x] for x in ("id", "kind", "source")} for p in chosen]},
        "models": {role: {"name": name, "params": count_params(name) if name else None}
                   for role, name in names.items()},
        "notes": notes, **results,
    }
    report["targets"] = bench_baselines.targets(report["rows"])
    report["notes"] += bench_report.run_notes(report)
    files = bench_report.write_outputs(report, out)
    bench_report.render(report, console)
    err.print("wrote " + ", ".join(str(f) for f in files))
    if any(r["errors"] for r in report["rows"]) or any(r["outputs_match"] is False
                                                       for r in report["rows"]):
        raise typer.Exit(1)
