"""Figures and output files of `specmesh bench`: one row per (mode, concurrency), the notes on
what a run measured, the tables (console and bench.md), bench.json and the PNG plots. The
comparisons and the targets are specmesh.bench_baselines'."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from specmesh.bench_costs import ratio
from specmesh.bench_modes import HF_KEYS, PLAIN_KEY, TARGET_KEY, hf_threads, hf_threads_note
from specmesh.loadtest import percentiles

HF_NOTE = ("HF rows run at concurrency 1 only (assisted generation supports batch size 1), one "
           "prompt after another, in the bench process, while the mesh is idle.")


def _prefix_note(settings: dict) -> str:
    n, contexts = settings.get("shared_prefix_tokens", 0), settings.get("shared_prefixes", 1)
    if not n:
        return ""
    every = settings.get("unshared_every", 0)
    alone = f", one prompt in {every} without a context (--unshared-every)" if every else ""
    if contexts > 1:
        return (f" behind {contexts} shared contexts of {n} tokens or more, prompt i behind "
                f"context i mod {contexts} (--shared-prefix, --shared-prefixes){alone}")
    return f" behind one shared {n}-token context (--shared-prefix){alone}"


def per_token_alpha(records: list[dict], k: int, max_new_tokens: int) -> float | None:
    """The per-token acceptance rate α of Leviathan et al. from the rounds of fixed-k
    requests: a round drafting k' = min(k, tokens left − 1) that yields n tokens accepted
    n − 1 drafts and, when n − 1 < k', rejected the next one; the maximum-likelihood α is
    Σ accepted / (Σ accepted + Σ rejections). A request's last round is left out (EOS or the
    budget may have cut it). (Σ accepted / Σ drafted, the ``acceptance`` column, counts the
    drafts after a rejection as failures too and so understates α.)"""
    accepted = rejected = 0
    if k <= 0:
        return None
    for rec in records:
        if rec["error"]:
            continue
        done = 0
        for n, last in rec.get("chunks", []):
            k_round = min(k, max_new_tokens - done - 1)
            done += n
            if last or k_round <= 0:
                continue
            accepted += n - 1
            rejected += 1 if n - 1 < k_round else 0
    return ratio(accepted, accepted + rejected)


def cpu_figures(by_process: dict[str, float] | None, tokens: int) -> dict:
    """A cell's CPU seconds (every process of the engine it measured, psutil, by name and in
    all) and CPU milliseconds per generated token; None where the processes were not known."""
    cpu_s = sum(by_process.values()) if by_process is not None else None
    return {"cpu_s": cpu_s, "cpu_s_by_process": by_process,
            "cpu_ms_per_token": ratio(None if cpu_s is None else cpu_s * 1000.0, tokens)}


def median_run(runs: list[dict]) -> dict:
    """A cell's row from its runs (``--repeat``): the run with the median aggregate tokens/s
    (the lower of the two middle ones for an even count, so the row is a run that happened),
    with ``runs_tokens_per_s`` (every run's, in run order) and the errors of every run."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"] or 0.0)
    row = dict(ranked[(len(ranked) - 1) // 2])
    row["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    row["errors"] = sum(r["errors"] for r in runs)
    row["error_details"] = sorted({d for r in runs for d in r["error_details"]})[:5]
    return row


def summarize(records: list[dict], wall_s: float) -> dict:
    """The figures of one cell from its request records (errored requests count nowhere but in
    ``errors``): aggregate tokens/s = completion tokens of all requests / wall time of the
    cell; per-request tokens/s = mean of completion tokens / latency; TTFT p50; tokens per
    round = Σ completion tokens / Σ rounds; acceptance = Σ accepted draft tokens / Σ draft
    tokens (the per-token α is ``per_token_alpha``, filled in by the caller for fixed k)."""
    ok = [r for r in records if not r["error"]]
    tokens = sum(r["completion_tokens"] for r in ok)
    rounds = sum(r["rounds"] for r in ok)
    drafts = sum(r["draft_tokens"] for r in ok)
    ttft = percentiles([r["ttft_s"] * 1000 for r in ok if r["ttft_s"] is not None])
    per_request = [r["completion_tokens"] / r["latency_s"] for r in ok if r["latency_s"] > 0]
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "error_details": sorted({r["error"] for r in records if r["error"]})[:5],
        "tokens": tokens, "rounds": rounds, "draft_tokens": drafts,
        "accepted_draft_tokens": sum(r["accepted_draft_tokens"] for r in ok),
        "wall_s": wall_s, "tokens_per_s": ratio(tokens, wall_s),
        "per_request_tokens_per_s": statistics.fmean(per_request) if per_request else None,
        "ttft_p50_ms": ttft["p50"] if ttft else None,
        "tokens_per_round": ratio(tokens, rounds),
        "acceptance": ratio(sum(r["accepted_draft_tokens"] for r in ok), drafts),
    }


def hf_notes(keys: list[str], have_pair: bool, threads: int, cpus: int | None,
             remote: bool) -> list[str]:
    """Notes on the HF rows: how they run, their threads, or why they did not."""
    if not set(keys) & set(HF_KEYS):
        return []
    if not have_pair:
        return ["HF rows skipped: with --addr they need --target and --drafter."]
    return [HF_NOTE, hf_threads_note(threads, hf_threads(threads, cpus), cpus, remote)]


GATEWAY_FIGURES = (  # row key, what, the series it needs
    ("cache_hit", "cache hit", "specmesh_pipeline_drafts_total"),
    ("fanout", "fan-out", "specmesh_spec_cache_fanout"),
    ("gateway_ms_per_round", "gateway ms/round", "specmesh_round_gateway_seconds"),
)


def run_notes(report: dict) -> list[str]:
    """Notes on what the run measured: the speedup base, figures that are n/a and why, the
    HF assistant's settings, the load."""
    notes, rows = [], report["rows"]
    settings = report.get("settings") or {}
    if settings.get("temperature"):
        seed = settings.get("seed")
        notes.append(f"Sampled at temperature {settings['temperature']:g} "
                     f"({'seed ' + str(seed) if seed is not None else 'no seed'}): outputs are "
                     "not compared (each mode draws other samples of the same distribution), "
                     "and a completion may end early at an end-of-sequence token.")
    if report["baselines"]["speedup_base"] != PLAIN_KEY:
        notes.append("No plain HF generate row (hf-plain not run): speedups are over SpecMesh "
                     "target-only at the same concurrency, serving-path overhead included.")
    for r in rows:
        if r.get("hf_assistant") and r["mode"] == "hf-default":
            notes.append(f"{r['label']}: the draft's generation_config as saved; transformers "
                         "reads these from the assistant's config: " + ", ".join(
                             f"{k}={v}" for k, v in r["hf_assistant"].items()) + ".")
    spec = [r for r in rows if r.get("services") and r["mode"] != TARGET_KEY]
    for key, what, series in GATEWAY_FIGURES:
        if spec and all(r.get(key) is None for r in spec):
            notes.append(f"No {series} counts from the gateway (a gateway that does not "
                         f"export it, none recorded, or with --addr no --metrics-url): {what} "
                         "is n/a.")
    served = [r for r in rows if r.get("services")]
    if served and not any((r["services"].get("verifier") or {}).get("forward_passes")
                          for r in served):
        notes.append("No forward_ms/forward_passes from the services' GetStats (with --addr: "
                     "give --verifiers and --drafters): c, c_v, the bound and the efficiency "
                     "are n/a.")
    if served and not any((r["services"].get("gateway") or {}).get("verify_compute_s")
                          is not None for r in served):
        notes.append("No specmesh_round_draft_compute_seconds / "
                     "specmesh_round_verify_compute_seconds from the gateway (with --addr: give "
                     "--metrics-url): the overhead is n/a.")
    if served and all(r.get("cpu_ms_per_token") is None for r in served):
        notes.append("CPU ms/token is measured over the local mesh's processes (psutil): with "
                     "--addr the mesh's processes are not known, so it is n/a.")
    elif served:
        notes.append("CPU ms/token: CPU seconds (user + system) of every mesh process (Redis, "
                     "verifiers, drafters, gateway) during the cell over the tokens generated; "
                     "a peer's, of whatever listens on its port on this machine and its "
                     "children (n/a for a peer on another host).")
    if any(r["mode"] == "default" for r in rows):
        notes.append("SpecMesh (gateway defaults) leaves k to the gateway, so the bench knows "
                     "no k for it: no α and no bound.")
    notes += steal_notes(rows)
    m = report["machine"]
    notes.append(f"Load average (1 min) at start {m['load_average_start'][0]:.2f}, at end "
                 f"{m['load_average_end'][0]:.2f}, on {m['cores']} cores.")
    return notes


STEAL_WARN = 0.05  # a cell whose CPUs were stolen this much is named in the notes


def steal_notes(rows: list[dict]) -> list[str]:
    """What the steal column means, and the cells slowed by more than ``STEAL_WARN`` of it."""
    if all(r.get("steal") is None for r in rows):
        return ["Steal: not counted on this system (n/a)."]
    notes = ["Steal: the share of the time the CPUs had work for during the cell that a "
             "virtual machine's host gave to other guests instead (/proc/stat; the HF rows: "
             "over all of them, run together); a cell is slowed by about that share, by load "
             "the machine itself cannot see."]
    rerun = [f"{r['label']} @ {r['concurrency']} ({r['steal_reruns']})" for r in rows
             if r.get("steal_reruns")]
    if rerun:
        notes.append("Cells run again because the host stole more than --max-steal of the "
                     "CPUs' time, the least stolen run kept (times run again): "
                     + ", ".join(rerun) + ".")
    hit = [f"{r['label']} @ {r['concurrency']} ({r['steal'] * 100:.0f}%)" for r in rows
           if (r.get("steal") or 0.0) > STEAL_WARN]
    if hit:
        notes.append(f"**Cells run with more than {STEAL_WARN:.0%} of the CPUs stolen**, whose "
                     "ratios to the others say less (rerun them, or use --repeat): "
                     + ", ".join(hit) + ".")
    return notes


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    return f"{value:{spec}}{suffix}"


def _pct(value: float | None) -> float | None:
    return None if value is None else value * 100


ROW_COLUMNS = (("mode", None), ("concurrency", "d"), ("tokens/s", ".1f"), ("runs", None),
               ("per-request tokens/s", ".1f"), ("speedup", ".2f"), ("vs target-only", ".2f"),
               ("tokens/round", ".2f"), ("acceptance", ".3f"), ("α", ".3f"),
               ("TTFT p50 (ms)", ".1f"), ("cache hit", ".0f"), ("fan-out", ".2f"),
               ("gateway ms/round", ".3f"), ("prefix hit", ".0f"), ("CPU ms/token", ".2f"),
               ("steal", ".0f"), ("outputs match", None),
               ("errors", "d"))


def row_cells(r: dict) -> list[str]:
    return [r["label"], str(r["concurrency"]), fmt(r["tokens_per_s"], ".1f"), _runs(r),
            fmt(r["per_request_tokens_per_s"], ".1f"), fmt(r["speedup"], ".2f", "x"),
            fmt(r.get("vs_target"), ".2f", "x"), fmt(r["tokens_per_round"]),
            fmt(r["acceptance"], ".3f"), fmt(r.get("alpha"), ".3f"),
            fmt(r["ttft_p50_ms"], ".1f"), fmt(_pct(r.get("cache_hit")), ".0f", "%"),
            fmt(r.get("fanout")), fmt(r.get("gateway_ms_per_round"), ".3f"),
            fmt(_pct(prefix_hit(r)), ".0f", "%"), fmt(r.get("cpu_ms_per_token"), ".2f"),
            fmt(_pct(r.get("steal")), ".0f", "%"), fmt(r["outputs_match"]), str(r["errors"])]


def _runs(row: dict) -> str:
    """The spread of a cell's runs' tokens/s (``--repeat``): "min-max (N)"; "" for one run."""
    runs = [x for x in row.get("runs_tokens_per_s") or () if x is not None]
    return f"{min(runs):.1f}-{max(runs):.1f} ({len(runs)})" if len(runs) > 1 else ""


def prefix_hit(row: dict) -> float | None:
    """The verifiers' prefix hit rate in a cell: prompt tokens restored from their prefix
    caches over prompt tokens looked up (None: no lookups, or not a mesh row)."""
    v = (row.get("services") or {}).get("verifier")
    if not v or not v.get("prefix_lookup_tokens"):
        return None
    return v["prefix_hit_tokens"] / v["prefix_lookup_tokens"]


COST_COLUMNS = ("mode", "α", "k", "c", "c_v", "E(α,k)", "tokens/round", "bound",
                "vs target-only", "efficiency", "overhead ms/round", "overhead %", "cache hit")


def cost_cells(x: dict) -> list[str]:
    return [x["label"], fmt(x["alpha"], ".3f"), str(x["k"]) if x["k"] else "gateway",
            fmt(x["c"], ".3f"), fmt(x["c_v"], ".3f"), fmt(x["expected_tokens_per_round"]),
            fmt(x["observed_tokens_per_round"]), fmt(x["bound"], ".2f", "x"),
            fmt(x["vs_target"], ".2f", "x"), fmt(x["efficiency"]),
            fmt(x["overhead_ms_per_round"], ".2f"), fmt(_pct(x["overhead_fraction"]), ".1f", "%"),
            fmt(_pct(x["cache_hit"]), ".0f", "%")]


REPLICA_COLUMNS = ("mode", "concurrency", "verifier passes", "verifier ms/pass",
                   "verifier busy", "drafter passes", "drafter ms/pass", "drafter busy")
REPLICA_NOTE = ("Per cell, from the replicas' GetStats deltas: a tier's forward passes, its "
                "model compute per pass (the step's jobs included), and busy = model compute "
                "/ the cell's wall time: a tier near 100% is what limits the cell.")


def replica_figures(row: dict) -> dict | None:
    """What each model tier did in a mesh row's cell (None for HF and peer rows): passes, ms
    per pass and busy share (model compute over the wall time)."""
    services = row.get("services") or {}
    if not services.get("verifier") or not row.get("wall_s"):
        return None
    out = {}
    for tier, key in (("verifier", "verifier"), ("drafter", "drafter_model")):
        stats = services.get(key) or {}
        passes, ms = stats.get("forward_passes") or 0, stats.get("forward_ms") or 0.0
        out[tier] = {"passes": passes, "ms_per_pass": ratio(ms, passes),
                     "busy": ratio(ms / 1000, row["wall_s"])}
    return out


def replica_cells(row: dict, figures: dict) -> list[str]:
    v, d = figures["verifier"], figures["drafter"]
    return [row["label"], str(row["concurrency"]), str(v["passes"]), fmt(v["ms_per_pass"]),
            fmt(_pct(v["busy"]), ".0f", "%"), str(d["passes"]),
            fmt(d["ms_per_pass"]), fmt(_pct(d["busy"]), ".0f", "%")]


def baseline_lines(report: dict) -> list[str]:
    """The speedup base and the serving path's overhead, in words."""
    b = report["baselines"]
    return [f"Speedup base: {b['speedup_base_label']}.",
            "Serving-path overhead (plain HF generate tokens/s / SpecMesh target-only tokens/s, "
            f"concurrency 1): {fmt(b['serving_path_overhead'], '.2f', 'x')}."]


def target_cells(t: dict, labels: dict[str, str]) -> list[str]:
    mark = {True: "pass", False: "**fail**", None: "n/a"}[t["passed"]]
    value = fmt(t["value"], ".3f")
    if t.get("basis") and t["value"] is not None:
        value += f" ({t['basis']})"
    return [labels.get(t["mode"], t["mode"]), t["what"], f"{t['comparison']} {t['threshold']:g}",
            value, mark]


def _md_table(header, rows: list[list[str]], left: int = 1) -> list[str]:
    """A markdown table, its first ``left`` columns left-aligned, the others right-aligned."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def device_note(settings: dict) -> str:
    """Where the models ran, for the report's first line ("" for an all-CPU run with one
    verifier)."""
    device = settings.get("device", "cpu")
    drafter = settings.get("drafter_device", device)
    replicas = settings.get("verifier_replicas") or 1
    where = "" if device == drafter == "cpu" else (
        f"models on {device}" + (f", the model drafter on {drafter}" if drafter != device
                                 else "") + "; ")
    return where + (f"{replicas} verifier replicas; " if replicas > 1 else "")


def markdown(report: dict) -> str:
    s, m = report["settings"], report["machine"]
    labels = {r["mode"]: r["label"] for r in report["rows"]}
    lines = [f"# specmesh bench, {m['date']}", "",
             f"Target {report['models']['target']['name']} "
             f"({fmt(report['models']['target']['params'], ',')} params), draft "
             f"{report['models']['draft']['name']} "
             f"({fmt(report['models']['draft']['params'], ',')} params); {len(s['prompts'])} "
             f"prompts{_prefix_note(s)}, greedy, max_new_tokens {s['max_new_tokens']}, "
             f"k {s['k']}, torch threads {s['threads']} per mesh process, {s['hf_threads']} "
             f"in process (HF rows); {device_note(s)}"
             f"{m['cpu']} ({m['cores']} cores), torch {m['torch']}.", "",
             *baseline_lines(report), "",
             *_md_table([c for c, _ in ROW_COLUMNS], [row_cells(r) for r in report["rows"]]),
             ""]
    lines += [f"- {note}" for note in report["notes"]] + [""]
    lines += ["## Costs (concurrency 1)", "",
              "t = verifier ms per forward pass, target-only; c = drafter ms per drafted token / t; "
              "c_v = verifier ms per pass when speculating / t; α = per-token acceptance rate "
              "(maximum likelihood from the rounds: accepted / (accepted + first rejections)); "
              "bound = E(α,k) / (k·c + c_v), "
              "E(α,k) = (1 − α^(k+1)) / (1 − α); efficiency = (tokens/s over target-only) / "
              "bound; overhead = round time − draft compute − verify compute; cache hit = "
              "rounds whose draft was ready and used / rounds.", ""]
    lines += _md_table(COST_COLUMNS, [cost_cells(x) for x in report["costs"]]) + [""]
    tiers = [(r, f) for r in report["rows"] if (f := replica_figures(r)) is not None]
    if tiers:
        lines += ["## Replicas (every cell)", "", REPLICA_NOTE, "",
                  *_md_table(REPLICA_COLUMNS, [replica_cells(r, f) for r, f in tiers]), ""]
    lines += ["## Targets (issue #14)", "",
              *_md_table(["mode", "target", "threshold", "measured", "pass"],
                         [target_cells(t, labels) for t in report["targets"]], left=2)]
    return "\n".join(lines) + "\n"


def plots(report: dict, out: Path) -> list[Path]:
    """tokens_per_s.png (aggregate tokens/s vs concurrency, one line per mode) and speedup.png
    (speedup over the speedup base vs concurrency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["label"] for r in report["rows"]))
    base = report["baselines"]["speedup_base_label"]
    paths = []
    for key, ylabel, name in (("tokens_per_s", "aggregate tokens/s", "tokens_per_s.png"),
                              ("speedup", f"speedup over {base}", "speedup.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        for label in modes:
            pts = [(r["concurrency"], r[key]) for r in report["rows"]
                   if r["label"] == label and r[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set_xlabel("concurrency (streams)")
        ax.set_ylabel(ylabel, fontsize="small")
        ax.set_xticks(report["settings"]["concurrency"])
        ax.grid(alpha=0.3)
        if ax.lines:  # nothing to label when every request of a mode failed
            ax.legend(fontsize="small")
        ax.set_title(f"specmesh bench: {key.replace('_', ' ')}")
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        paths.append(out / name)
    return paths


def write_outputs(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    (out / "bench.md").write_text(markdown(report))
    return [out / "bench.json", out / "bench.md", *plots(report, out)]


def render(report: dict, console) -> None:
    from rich.table import Table

    table = Table(title="specmesh bench")
    for name, spec in ROW_COLUMNS:
        table.add_column(name, justify="left" if spec is None and name == "mode" else "right")
    for r in report["rows"]:
        table.add_row(*[c.replace("**", "") for c in row_cells(r)])
    console.print(table)
    for r in report["rows"]:
        for detail in r["error_details"]:
            console.print(f"[red]error[/] {r['label']} @ {r['concurrency']}: {detail}",
                          markup=True, highlight=False)
    for line in baseline_lines(report) + [f"note: {n}" for n in report["notes"]]:
        console.print(line, markup=False, highlight=False)
    costs = Table(title="costs at concurrency 1")
    for name in COST_COLUMNS:
        costs.add_column(name, justify="left" if name == "mode" else "right")
    for x in report["costs"]:
        costs.add_row(*cost_cells(x))
    console.print(costs)
    labels = {r["mode"]: r["label"] for r in report["rows"]}
    for t in report["targets"]:
        mode, what, threshold, value, mark = target_cells(t, labels)
        mark = {"pass": "[green]pass[/]", "**fail**": "[red]fail[/]"}.get(mark, mark)
        console.print(f"{mark}  {mode}: {what} {threshold}: {value}", highlight=False)
