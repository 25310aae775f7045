"""Figures and output files of `specmesh bench`: one row per (mode, concurrency), the comparisons
with target-only decoding, the issue's targets, bench.json, bench.md and the PNG plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from specmesh.bench_costs import ratio
from specmesh.loadtest import percentiles

TARGET_MODE = "target"
TARGETS = (  # (key, what, comparison, threshold): the "done when" figures of issue #4
    ("speedup", "speedup of SpecMesh (model drafter, fixed k) over target-only, concurrency 1",
     ">=", 1.8),
    ("vs_hf", "tokens/s of SpecMesh (model drafter, fixed k) / HF assisted generation, "
              "concurrency 1", ">=", 1.1),
    ("efficiency", "efficiency = observed speedup / bound (model drafter, concurrency 1)",
     ">=", 0.8),
    ("overhead", "orchestration overhead, fraction of round time (model drafter, "
                 "concurrency 1)", "<=", 0.15),
    ("scaling", "aggregate tokens/s at concurrency 8 / at concurrency 1 (model drafter, "
                "fixed k)", ">=", 2.5),
)


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


def compare(rows: list[dict], outputs: dict[tuple[str, int], list[dict]]) -> None:
    """Fills each row's ``speedup`` (its tokens/s over target-only's at the same concurrency)
    and ``outputs_match`` (every output equals target-only's for the same prompt, at the first
    concurrency measured: the lossless guarantee; None without a target-only row)."""
    base = {r["concurrency"]: r for r in rows if r["mode"] == TARGET_MODE}
    first = next((r["concurrency"] for r in rows if r["mode"] == TARGET_MODE), None)
    reference = {rec["prompt_index"]: rec["token_ids"]
                 for rec in outputs.get((TARGET_MODE, first), []) if not rec["error"]}
    for row in rows:
        b = base.get(row["concurrency"])
        row["speedup"] = ratio(row["tokens_per_s"], b["tokens_per_s"]) if b else None
        if first is None:
            row["outputs_match"], row["mismatched_prompts"] = None, []
            continue
        bad = sorted({rec["prompt_index"] for rec in outputs[(row["mode"], row["concurrency"])]
                      if not rec["error"] and rec["prompt_index"] in reference
                      and rec["token_ids"] != reference[rec["prompt_index"]]})
        row["outputs_match"], row["mismatched_prompts"] = not bad, bad


def targets(rows: list[dict], costs: list[dict], model_mode: str = "model",
            hf_mode: str = "hf") -> list[dict]:
    """The issue's targets with their measured value and pass/fail (None: not measured)."""
    def row(mode: str, c: int) -> dict:
        return next((r for r in rows if r["mode"] == mode and r["concurrency"] == c), {})

    cost = next((x for x in costs if x["mode"] == model_mode and x["concurrency"] == 1), {})
    values = {
        "speedup": row(model_mode, 1).get("speedup"),
        "vs_hf": ratio(row(model_mode, 1).get("tokens_per_s"), row(hf_mode, 1).get("tokens_per_s")),
        "efficiency": cost.get("efficiency"),
        "overhead": cost.get("overhead_fraction"),
        "scaling": ratio(row(model_mode, 8).get("tokens_per_s"),
                         row(model_mode, 1).get("tokens_per_s")),
    }
    out = []
    for key, what, op, threshold in TARGETS:
        v = values[key]
        passed = None if v is None else (v <= threshold if op == "<=" else v >= threshold)
        out.append({"key": key, "what": what, "comparison": op, "threshold": threshold,
                    "value": v, "passed": passed})
    return out


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    return f"{value:{spec}}{suffix}"


ROW_COLUMNS = (("mode", None), ("concurrency", "d"), ("tokens/s", ".1f"),
               ("per-request tokens/s", ".1f"), ("speedup", ".2f"), ("tokens/round", ".2f"),
               ("acceptance", ".3f"), ("α", ".3f"), ("TTFT p50 (ms)", ".1f"),
               ("outputs match", None),
               ("errors", "d"))


def row_cells(r: dict) -> list[str]:
    return [r["label"], str(r["concurrency"]), fmt(r["tokens_per_s"], ".1f"),
            fmt(r["per_request_tokens_per_s"], ".1f"), fmt(r["speedup"], ".2f", "x"),
            fmt(r["tokens_per_round"]), fmt(r["acceptance"], ".3f"), fmt(r.get("alpha"), ".3f"),
            fmt(r["ttft_p50_ms"], ".1f"),
            fmt(r["outputs_match"]), str(r["errors"])]


COST_COLUMNS = ("mode", "α", "k", "c", "c_v", "E(α,k)", "tokens/round", "bound", "speedup",
                "efficiency", "overhead ms/round", "overhead %", "pipeline used")


def cost_cells(x: dict) -> list[str]:
    pct = (lambda v: None if v is None else v * 100)  # noqa: E731
    return [x["label"], fmt(x["alpha"], ".3f"), str(x["k"]), fmt(x["c"], ".3f"),
            fmt(x["c_v"], ".3f"), fmt(x["expected_tokens_per_round"]),
            fmt(x["observed_tokens_per_round"]), fmt(x["bound"], ".2f", "x"),
            fmt(x["speedup"], ".2f", "x"), fmt(x["efficiency"]),
            fmt(x["overhead_ms_per_round"], ".2f"), fmt(pct(x["overhead_fraction"]), ".1f", "%"),
            fmt(pct(x["pipeline_used_fraction"]), ".0f", "%")]


def _md_table(header, rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def markdown(report: dict) -> str:
    s, m = report["settings"], report["machine"]
    lines = [f"# specmesh bench, {m['date']}", "",
             f"Target {report['models']['target']['name']} "
             f"({fmt(report['models']['target']['params'], ',')} params), draft "
             f"{report['models']['draft']['name']} "
             f"({fmt(report['models']['draft']['params'], ',')} params); {len(s['prompts'])} "
             f"prompts, greedy, max_new_tokens {s['max_new_tokens']}, k {s['k']}, torch threads "
             f"{s['threads']} per process; {m['cpu']} ({m['cores']} cores), torch {m['torch']}.",
             "", *_md_table([c for c, _ in ROW_COLUMNS], [row_cells(r) for r in report["rows"]]),
             ""]
    lines += [f"- {note}" for note in report["notes"]] + [""]
    lines += ["## Costs (concurrency 1)", "",
              "t = verifier ms per forward pass, target-only; c = drafter ms per drafted token / t; "
              "c_v = verifier ms per pass when speculating / t; α = per-token acceptance rate "
              "(maximum likelihood from the rounds: accepted / (accepted + first rejections)); "
              "bound = E(α,k) / (k·c + c_v), "
              "E(α,k) = (1 − α^(k+1)) / (1 − α); efficiency = speedup / bound; overhead = round "
              "time − draft compute − verify compute.", ""]
    lines += _md_table(COST_COLUMNS, [cost_cells(x) for x in report["costs"]]) + [""]
    lines += ["## Targets (issue #4)", "", "| target | threshold | measured | pass |",
              "|---|---:|---:|---|"]
    for t in report["targets"]:
        mark = {True: "pass", False: "**fail**", None: "n/a"}[t["passed"]]
        lines.append(f"| {t['what']} | {t['comparison']} {t['threshold']:g} | "
                     f"{fmt(t['value'], '.3f')} | {mark} |")
    return "\n".join(lines) + "\n"


def plots(report: dict, out: Path) -> list[Path]:
    """tokens_per_s.png (aggregate tokens/s vs concurrency, one line per mode) and speedup.png
    (speedup over target-only vs concurrency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["label"] for r in report["rows"]))
    paths = []
    for key, ylabel, name in (("tokens_per_s", "aggregate tokens/s", "tokens_per_s.png"),
                              ("speedup", "speedup over target-only", "speedup.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        for label in modes:
            pts = [(r["concurrency"], r[key]) for r in report["rows"]
                   if r["label"] == label and r[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set_xlabel("concurrency (streams)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(report["settings"]["concurrency"])
        ax.grid(alpha=0.3)
        if ax.lines:  # nothing to label when every request of a mode failed
            ax.legend(fontsize="small")
        ax.set_title(f"specmesh bench: {ylabel}")
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
    for note in report["notes"]:
        console.print(f"note: {note}")
    costs = Table(title="costs at concurrency 1")
    for name in COST_COLUMNS:
        costs.add_column(name, justify="left" if name == "mode" else "right")
    for x in report["costs"]:
        costs.add_row(*cost_cells(x))
    console.print(costs)
    for t in report["targets"]:
        mark = {True: "[green]pass[/]", False: "[red]fail[/]", None: "n/a"}[t["passed"]]
        console.print(f"{mark}  {t['what']} {t['comparison']} {t['threshold']:g}: "
                      f"{fmt(t['value'], '.3f')}")
