"""What `specmesh bench` compares its rows with, and its targets (issues #14 and #19, "done
when").

* The speedup base (``speedup_base``): plain HF ``generate`` of the target (``hf-plain``, in
  the bench process, concurrency 1) when that row ran with a tokens/s, else SpecMesh
  target-only through the same gateway (``target``). A row's ``speedup`` is its tokens/s over
  the base's: over hf-plain's at concurrency 1 for every row (plain generate serves one stream
  at a time, so at higher concurrency it is the aggregate over one plain stream); over
  target-only's at the same concurrency when target-only is the base.
* ``vs_target``: a row's tokens/s over SpecMesh target-only's at the same concurrency, whatever
  the base (the cost figures' bound is relative to it too).
* The serving path's overhead (``serving_path_overhead``): plain HF tokens/s / SpecMesh
  target-only tokens/s at concurrency 1: what the gateway, gRPC and the services cost a stream
  that does not speculate.
* ``outputs_match``: every output equals target-only's for the same prompt (greedy: the
  lossless guarantee). Peer rows (``--peer``, specmesh.bench_peers) are not compared: None.
* ``vs_peer_N``: a SpecMesh row's aggregate tokens/s at N streams over the best peer's at N
  (N = 1 as well as #19's 8 and 16: at one stream llama.cpp with the demo drafter, in one
  process, served 1.57x the mesh's defaults on a Zen 4 EPYC, where from 8 streams up the mesh
  led every peer; docs/performance.md, "Beside llama.cpp as well as vLLM").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specmesh.bench_costs import ratio
from specmesh.bench_modes import ASSISTED_KEYS, PLAIN_KEY, SPEC_KEYS, TARGET_KEY
from specmesh.bench_peers import PEER_PREFIX


def _row(rows: list[dict], mode: str, concurrency: int) -> dict:
    return next((r for r in rows if r["mode"] == mode and r["concurrency"] == concurrency), {})


def speedup_base(rows: list[dict]) -> str:
    """``hf-plain`` when its concurrency-1 row has a tokens/s, else ``target``."""
    return PLAIN_KEY if _row(rows, PLAIN_KEY, 1).get("tokens_per_s") else TARGET_KEY


def serving_path_overhead(rows: list[dict]) -> float | None:
    """Plain HF generate's tokens/s / SpecMesh target-only's, concurrency 1 (None without
    either)."""
    return ratio(_row(rows, PLAIN_KEY, 1).get("tokens_per_s"),
                 _row(rows, TARGET_KEY, 1).get("tokens_per_s"))


def baselines(rows: list[dict], base: str, labels: dict[str, str]) -> dict:
    """The report's "baselines": the speedup base (key and words) and the serving path's
    overhead."""
    where = "concurrency 1" if base == PLAIN_KEY else "same concurrency"
    return {"speedup_base": base, "speedup_base_label": f"{labels.get(base, base)}, {where}",
            "serving_path_overhead": serving_path_overhead(rows)}


def compare(rows: list[dict], outputs: dict[tuple[str, int], list[dict]],
            sampled: bool = False) -> str:
    """Fills each row's ``speedup`` (over the base, see the module docstring), ``vs_target`` and
    ``outputs_match`` (None without a target-only row, and for ``sampled`` runs, whose modes
    draw other samples of the same distribution; else compared with target-only's outputs at
    the first concurrency measured). Returns the base's mode key."""
    base = speedup_base(rows)
    targets = {r["concurrency"]: r for r in rows if r["mode"] == TARGET_KEY}
    first = next((r["concurrency"] for r in rows if r["mode"] == TARGET_KEY), None)
    reference = {rec["prompt_index"]: rec["token_ids"]
                 for rec in outputs.get((TARGET_KEY, first), []) if not rec["error"]}
    for row in rows:
        t = targets.get(row["concurrency"], {})
        b = _row(rows, base, 1) if base == PLAIN_KEY else t
        row["speedup"] = ratio(row["tokens_per_s"], b.get("tokens_per_s"))
        row["vs_target"] = ratio(row["tokens_per_s"], t.get("tokens_per_s"))
        if first is None or sampled or row["mode"].startswith(PEER_PREFIX):
            row["outputs_match"], row["mismatched_prompts"] = None, []
            continue
        bad = sorted({rec["prompt_index"] for rec in outputs[(row["mode"], row["concurrency"])]
                      if not rec["error"] and rec["prompt_index"] in reference
                      and rec["token_ids"] != reference[rec["prompt_index"]]})
        row["outputs_match"], row["mismatched_prompts"] = not bad, bad
    return base


@dataclass(frozen=True)
class Target:
    key: str
    what: str
    comparison: str  # ">=" or "<="
    threshold: float


MODE_TARGETS = (  # for each of SPEC_KEYS
    Target("vs_hf_plain", "tokens/s / plain HF generate's, concurrency 1", ">=", 1.25),
    Target("vs_hf_assisted", "tokens/s / the better HF assisted row's (fixed k, HF defaults), "
                             "concurrency 1", ">=", 1.3),
    Target("cache_hit", "speculation-cache hit rate, concurrency 1", ">=", 0.8),
    Target("gateway_ms", "gateway orchestration ms per round, concurrency 1", "<=", 1.0),
    Target("scaling", "aggregate tokens/s at 8 streams / at 1", ">=", 2.5),
    Target("vs_target_8", "tokens/s / SpecMesh target-only's, concurrency 8 (never slower)",
           ">=", 1.0),
    Target("scaling_16", "aggregate tokens/s at 16 streams / at 1", ">=", 5.0),
    Target("vs_target_all", "the lowest tokens/s / SpecMesh target-only's over every level "
                            "(never slower)", ">=", 1.0),
    Target("vs_peer_1", "tokens/s / the best peer's (--peer), concurrency 1", ">=", 1.0),
    Target("vs_peer_8", "aggregate tokens/s / the best peer's (--peer), 8 streams", ">=", 1.0),
    Target("vs_peer_16", "aggregate tokens/s / the best peer's (--peer), 16 streams", ">=",
           1.0),
    Target("cpu_ms_16", "CPU ms per generated token, all mesh processes, 16 streams", "<=",
           2.0),
)
LOSSLESS = Target("lossless", "fraction of rows whose every output equals target-only's",
                  ">=", 1.0)


def passes(value: float | None, comparison: str, threshold: float) -> bool | None:
    """value compared with threshold; None when the value is missing."""
    if value is None:
        return None
    return value <= threshold if comparison == "<=" else value >= threshold


def mode_values(rows: list[dict], mode: str) -> dict[str, float | None]:
    """MODE_TARGETS' measured values for one SpecMesh mode."""
    one, eight, sixteen = _row(rows, mode, 1), _row(rows, mode, 8), _row(rows, mode, 16)
    vs_target = [ratio(r.get("tokens_per_s"), _row(rows, TARGET_KEY, r["concurrency"])
                       .get("tokens_per_s")) for r in rows if r["mode"] == mode]
    assisted = [_row(rows, key, 1).get("tokens_per_s") for key in ASSISTED_KEYS]
    best = max((x for x in assisted if x is not None), default=None)
    return {
        "vs_hf_plain": ratio(one.get("tokens_per_s"), _row(rows, PLAIN_KEY, 1).get("tokens_per_s")),
        "vs_hf_assisted": ratio(one.get("tokens_per_s"), best),
        "cache_hit": one.get("cache_hit"),
        "gateway_ms": one.get("gateway_ms_per_round"),
        "scaling": ratio(eight.get("tokens_per_s"), one.get("tokens_per_s")),
        "vs_target_8": ratio(eight.get("tokens_per_s"),
                             _row(rows, TARGET_KEY, 8).get("tokens_per_s")),
        "scaling_16": ratio(sixteen.get("tokens_per_s"), one.get("tokens_per_s")),
        "vs_target_all": min((x for x in vs_target if x is not None), default=None),
        "vs_peer_1": ratio(one.get("tokens_per_s"), best_peer(rows, 1)),
        "vs_peer_8": ratio(eight.get("tokens_per_s"), best_peer(rows, 8)),
        "vs_peer_16": ratio(sixteen.get("tokens_per_s"), best_peer(rows, 16)),
        "cpu_ms_16": sixteen.get("cpu_ms_per_token"),
    }


def best_peer(rows: list[dict], concurrency: int) -> float | None:
    """The highest aggregate tokens/s of any peer row at ``concurrency`` (None: no peer)."""
    return max((r["tokens_per_s"] for r in rows if r["mode"].startswith(PEER_PREFIX)
                and r["concurrency"] == concurrency and r["tokens_per_s"] is not None),
               default=None)


def lossless_value(rows: list[dict]) -> float | None:
    """Rows whose outputs all match target-only's / rows compared (None: none compared)."""
    compared = [r["outputs_match"] for r in rows if r.get("outputs_match") is not None]
    return ratio(sum(compared), len(compared))


def _cache_basis(row: dict) -> str:
    """What a cell's cache-hit rate stands on: its drafter-tier drafting rounds among all of
    its rounds. Under the defaults most one-stream rounds are plain calls (the verifier's
    own drafts, or none) and the drafter tier drafts only the gateway's probes, whose first
    round has no prepared tree by construction: a rate over 8 such rounds of 280 says little
    of the cache (docs/performance.md)."""
    counted = row.get("cache_rounds")
    if counted is None:
        return ""
    total = row.get("rounds")
    return f"{counted:.0f} drafting rounds" + (f" of {total}" if total else "")


def targets(rows: list[dict]) -> list[dict]:
    """Every target with its measured value and pass/fail (None: not measured), and what the
    value stands on where that can be few (``basis``): MODE_TARGETS for each of SPEC_KEYS,
    then LOSSLESS over all rows."""
    out = []
    for mode in SPEC_KEYS:
        values = mode_values(rows, mode)
        for t in MODE_TARGETS:
            v = values[t.key]
            out.append({**asdict(t), "mode": mode, "value": v,
                        "passed": passes(v, t.comparison, t.threshold),
                        "basis": _cache_basis(_row(rows, mode, 1)) if t.key == "cache_hit" else ""})
    v = lossless_value(rows)
    out.append({**asdict(LOSSLESS), "mode": "all", "value": v,
                "passed": passes(v, LOSSLESS.comparison, LOSSLESS.threshold), "basis": ""})
    return out
