"""`specmesh bench`'s baselines and targets on hand-built rows: which row the speedups are over,
the serving path's overhead, each target's value and pass/fail, and "n/a" for gateway series a
gateway does not export. Every expected number is worked out by hand here."""

from __future__ import annotations

import pytest

from specmesh.bench_baselines import (
    baselines,
    compare,
    passes,
    serving_path_overhead,
    speedup_base,
    targets,
)
from specmesh.bench_costs import cache_hit, gateway_figures
from specmesh.bench_modes import (
    DEFAULT_MODE_KEYS,
    MODE_KEYS,
    hf_threads,
    hf_threads_note,
    make_modes,
)
from specmesh.bench_report import row_cells, run_notes, target_cells


def _row(mode: str, c: int, tps: float | None, **extra) -> dict:
    return {"mode": mode, "label": mode, "concurrency": c, "tokens_per_s": tps, **extra}


def _out(ids: list[int]) -> list[dict]:
    return [{"prompt_index": 0, "token_ids": ids, "error": ""}]


def test_the_speedup_base_is_plain_hf_when_it_ran():
    rows = [_row("target", 1, 50.0), _row("target", 8, 200.0), _row("model", 1, 100.0),
            _row("model", 8, 300.0), _row("hf-plain", 1, 80.0)]
    outputs = {(r["mode"], r["concurrency"]): _out([1, 2]) for r in rows}
    assert speedup_base(rows) == "hf-plain"
    assert compare(rows, outputs) == "hf-plain"
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    assert by[("model", 1)]["speedup"] == pytest.approx(1.25)  # 100 / 80
    assert by[("model", 8)]["speedup"] == pytest.approx(3.75)  # 300 / 80: one plain stream
    assert by[("target", 1)]["speedup"] == pytest.approx(0.625)  # 50 / 80
    assert by[("hf-plain", 1)]["speedup"] == 1.0
    assert by[("model", 1)]["vs_target"] == pytest.approx(2.0)  # 100 / 50
    assert by[("model", 8)]["vs_target"] == pytest.approx(1.5)  # 300 / 200
    assert by[("hf-plain", 1)]["vs_target"] == pytest.approx(1.6)  # 80 / 50
    assert serving_path_overhead(rows) == pytest.approx(1.6)
    assert all(r["outputs_match"] is True for r in rows)


def test_the_speedup_base_falls_back_to_target_only():
    rows = [_row("target", 1, 50.0), _row("target", 8, 200.0), _row("model", 1, 100.0),
            _row("model", 8, 300.0)]
    outputs = {(r["mode"], r["concurrency"]): _out([1, 2]) for r in rows}
    outputs[("model", 8)] = _out([1, 3])  # differs from target-only's
    assert compare(rows, outputs) == "target"
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    assert by[("model", 1)]["speedup"] == pytest.approx(2.0)  # same concurrency
    assert by[("model", 8)]["speedup"] == pytest.approx(1.5)
    assert by[("model", 8)]["outputs_match"] is False
    assert by[("model", 8)]["mismatched_prompts"] == [0]
    assert serving_path_overhead(rows) is None
    assert baselines(rows, "target", {"target": "T"}) == {
        "speedup_base": "target", "speedup_base_label": "T, same concurrency",
        "serving_path_overhead": None}
    # an hf-plain row whose every request failed (no tokens/s) is no base either
    assert speedup_base(rows + [_row("hf-plain", 1, None)]) == "target"


def test_peer_rows_are_not_compared_with_target_only():
    """A peer's outputs are text from another engine: no token ids to compare, so neither a
    match nor a mismatch, while its speed is still set against target-only's."""
    rows = [_row("target", 8, 100.0), _row("peer:vllm", 8, 300.0)]
    compare(rows, {("target", 8): _out([1, 2]), ("peer:vllm", 8): [
        {"prompt_index": 0, "token_ids": [], "text": "x", "error": ""}]})
    assert rows[1]["outputs_match"] is None and rows[1]["vs_target"] == pytest.approx(3.0)


def test_sampled_runs_compare_no_outputs_but_still_their_speed():
    """--temperature > 0: every mode draws other samples of the same distribution, so a
    different output is no mismatch (nor is an equal one a match); the speeds are still set
    against target-only's, and the notes say that the run sampled and how."""
    rows = [_row("target", 1, 50.0), _row("default", 1, 60.0)]
    outputs = {("target", 1): _out([1, 2]), ("default", 1): _out([1, 3])}
    compare(rows, outputs, sampled=True)
    assert [r["outputs_match"] for r in rows] == [None, None]
    assert rows[1]["vs_target"] == pytest.approx(1.2)
    compare(rows, outputs)  # greedy: the same records are a mismatch
    assert rows[1]["outputs_match"] is False
    report = {"rows": rows, "baselines": {"speedup_base": "target"},
              "settings": {"temperature": 0.8, "seed": None},
              "machine": {"load_average_start": [0.5], "load_average_end": [0.7], "cores": 2}}
    assert any(n.startswith("Sampled at temperature 0.8 (no seed): outputs are not compared")
               for n in run_notes(report))
    report["settings"] = {"temperature": 0.0, "seed": 3}
    assert not any(n.startswith("Sampled") for n in run_notes(report))


def test_scaling_16_and_the_lowest_ratio_over_target_only():
    rows = [_row("target", 1, 50.0), _row("target", 16, 400.0), _row("model", 1, 100.0),
            _row("model", 16, 380.0)]
    got = {(t["mode"], t["key"]): t["value"] for t in targets(rows)}
    assert got[("model", "scaling_16")] == pytest.approx(3.8)
    assert got[("model", "vs_target_all")] == pytest.approx(0.95)  # 16 streams: slower


def test_without_target_only_nothing_is_compared():
    rows = [_row("model", 1, 100.0), _row("hf-plain", 1, 50.0)]
    compare(rows, {("model", 1): _out([1]), ("hf-plain", 1): _out([1])})
    assert rows[0]["speedup"] == pytest.approx(2.0) and rows[0]["vs_target"] is None
    assert rows[0]["outputs_match"] is None


def _measured_rows() -> list[dict]:
    """model passes everything; default fails (a), (b), (d) and (f)."""
    return [
        _row("target", 1, 40.0, outputs_match=True),
        _row("target", 8, 200.0, outputs_match=True),
        _row("hf-plain", 1, 80.0, outputs_match=True),
        _row("hf", 1, 70.0, outputs_match=True),
        _row("hf-default", 1, 75.0, outputs_match=True),
        # 130 / 80 = 1.625; 130 / 75 = 1.733; 8 streams: 390 / 130 = 3.0; 390 / 200 = 1.95
        _row("model", 1, 130.0, outputs_match=True, cache_hit=0.9, gateway_ms_per_round=0.4),
        _row("model", 8, 390.0, outputs_match=True),
        # 96 / 80 = 1.2; 96 / 75 = 1.28; 8 streams: 190 / 96 = 1.979; 190 / 200 = 0.95
        _row("default", 1, 96.0, outputs_match=True, cache_hit=0.8, gateway_ms_per_round=1.5),
        _row("default", 8, 190.0, outputs_match=False),
        _row("peer:vllm", 8, 300.0, outputs_match=None),  # a peer: never compared
        _row("peer:llamacpp", 8, 250.0, outputs_match=None),
        _row("peer:llamacpp", 1, 110.0, outputs_match=None),  # one stream: beats default
    ]


def test_targets_by_hand():
    got = {(t["mode"], t["key"]): (t["value"], t["passed"]) for t in targets(_measured_rows())}
    expected = {
        ("model", "vs_hf_plain"): (1.625, True), ("model", "vs_hf_assisted"): (130 / 75, True),
        ("model", "cache_hit"): (0.9, True), ("model", "gateway_ms"): (0.4, True),
        ("model", "scaling"): (3.0, True), ("model", "vs_target_8"): (1.95, True),
        ("model", "scaling_16"): (None, None),  # no 16-stream row
        ("model", "vs_target_all"): (1.95, True),  # min(130 / 40, 390 / 200)
        ("model", "vs_peer_1"): (130 / 110, True),  # the only peer at one stream
        ("model", "vs_peer_8"): (1.3, True),  # 390 / the better peer's 300
        ("model", "vs_peer_16"): (None, None),
        ("default", "scaling_16"): (None, None), ("default", "vs_target_all"): (0.95, False),
        ("default", "vs_peer_1"): (96 / 110, False),
        ("default", "vs_peer_8"): (190 / 300, False), ("default", "vs_peer_16"): (None, None),
        ("default", "vs_hf_plain"): (1.2, False), ("default", "vs_hf_assisted"): (1.28, False),
        ("default", "cache_hit"): (0.8, True),  # the threshold itself passes
        ("default", "gateway_ms"): (1.5, False),
        ("default", "scaling"): (190 / 96, False), ("default", "vs_target_8"): (0.95, False),
        ("model", "cpu_ms_16"): (None, None), ("default", "cpu_ms_16"): (None, None),
        ("all", "lossless"): (8 / 9, False),  # 8 of 9 rows match
    }
    assert set(got) == set(expected)
    for key, (value, passed) in expected.items():
        assert got[key][0] == (pytest.approx(value) if value is not None else None), key
        assert got[key][1] is passed, key


def test_cpu_per_token_at_16_streams_passes_at_2_ms_or_less():
    rows = [_row("model", 16, 500.0, cpu_ms_per_token=1.5),
            _row("default", 16, 500.0, cpu_ms_per_token=2.5),
            _row("model", 8, 400.0, cpu_ms_per_token=9.0),  # another level: not the target's
            _row("target", 16, 450.0, cpu_ms_per_token=2.0)]  # not a SpecMesh mode's target
    got = {(t["mode"], t["key"]): (t["value"], t["passed"]) for t in targets(rows)}
    assert got[("model", "cpu_ms_16")] == (1.5, True)
    assert got[("default", "cpu_ms_16")] == (2.5, False)
    rows[1]["cpu_ms_per_token"] = 2.0  # the threshold itself passes
    assert next(t for t in targets(rows) if (t["mode"], t["key"]) == ("default", "cpu_ms_16")
                )["passed"] is True


def test_targets_are_na_when_not_measured():
    rows = [_row("model", 1, 130.0, outputs_match=None)]  # no baselines, no gateway figures
    result = targets(rows)
    assert all(t["value"] is None and t["passed"] is None for t in result)
    # one assisted row is enough for (b): the better of those that ran
    rows = [_row("model", 1, 130.0), _row("hf", 1, 100.0)]
    vs = next(t for t in targets(rows) if (t["mode"], t["key"]) == ("model", "vs_hf_assisted"))
    assert vs["value"] == pytest.approx(1.3) and vs["passed"] is True


def test_passes():
    assert passes(1.0, "<=", 1.0) is True and passes(1.01, "<=", 1.0) is False
    assert passes(2.5, ">=", 2.5) is True and passes(2.49, ">=", 2.5) is False
    assert passes(None, ">=", 1.0) is None


def test_gateway_figures_are_na_for_missing_series():
    # the gateway today: the cache counters, neither new histogram
    today = {"pipeline_used": 8.0, "pipeline_dropped": 1.0, "pipeline_none": None,
             "gateway_s": None, "gateway_count": None, "fanout_sum": None, "fanout_count": None}
    g = gateway_figures(today)
    assert g == {"cache_hit": pytest.approx(8 / 9), "cache_rounds": 9.0, "fanout": None,
                 "gateway_ms_per_round": None}
    assert gateway_figures(None) == {"cache_hit": None, "cache_rounds": None, "fanout": None,
                                     "gateway_ms_per_round": None}
    # exported but nothing recorded in the cell (deltas of 0)
    assert gateway_figures({"fanout_sum": 0.0, "fanout_count": 0.0, "gateway_s": 0.0,
                            "gateway_count": 0.0})["fanout"] is None
    later = {**today, "gateway_s": 0.03, "gateway_count": 40.0, "fanout_sum": 9.0,
             "fanout_count": 6.0}
    g = gateway_figures(later)
    assert g["fanout"] == pytest.approx(1.5) and g["gateway_ms_per_round"] == pytest.approx(0.75)
    assert cache_hit(None, None, None) is None
    assert cache_hit(None, 2.0, 2.0) == 0.0  # "used" not recorded yet: none used
    assert cache_hit(0.0, 0.0, 0.0) is None  # nothing counted


def test_a_row_shows_na_for_missing_gateway_figures():
    row = {"label": "SpecMesh model k=3", "concurrency": 1, "tokens_per_s": 10.0,
           "per_request_tokens_per_s": 10.0, "speedup": 1.5, "vs_target": 2.0,
           "tokens_per_round": 2.0, "acceptance": 0.5, "alpha": None, "ttft_p50_ms": 5.0,
           "cache_hit": 0.85, "fanout": None, "gateway_ms_per_round": None,
           "outputs_match": True, "errors": 0}
    cells = row_cells(row)
    assert cells[11:14] == ["85%", "n/a", "n/a"]
    assert cells[5:7] == ["1.50x", "2.00x"]
    assert cells[3] == ""  # one run: no spread
    row["runs_tokens_per_s"] = [9.5, 10.0, 12.25]
    assert row_cells(row)[3] == "9.5-12.2 (3)"


def test_a_repeated_cell_reports_its_median_run_and_every_runs_errors():
    """--repeat: the row is the run with the median tokens/s (the lower middle one for an even
    count: a run that happened, with its own figures), every run's tokens/s in run order,
    and the errors of all runs, so a failure in any run still fails the bench."""
    from specmesh.bench_report import median_run

    def run(tps, errors=0, detail=()):
        return {"tokens_per_s": tps, "ttft_p50_ms": tps / 10, "errors": errors,
                "error_details": list(detail)}

    row = median_run([run(30.0), run(10.0, 1, ["UNAVAILABLE: x"]), run(20.0)])
    assert row["tokens_per_s"] == 20.0 and row["ttft_p50_ms"] == 2.0  # the median run's own
    assert row["runs_tokens_per_s"] == [30.0, 10.0, 20.0]
    assert row["errors"] == 1 and row["error_details"] == ["UNAVAILABLE: x"]
    assert median_run([run(40.0), run(10.0)])["tokens_per_s"] == 10.0  # the lower middle
    assert median_run([run(7.0)])["runs_tokens_per_s"] == [7.0]


def test_hf_threads():
    assert hf_threads(1, 16) == 2  # the verifier's and the model drafter's
    assert hf_threads(4, 6) == 6  # never more than the cores
    assert hf_threads(1, 1) == 1
    assert hf_threads(0, 8) == 0  # torch's default, like the mesh's processes
    assert "capped at os.cpu_count() = 6" in hf_threads_note(4, 6, 6, remote=False)
    assert "capped" not in hf_threads_note(1, 2, 2, remote=False)
    assert "--threads 1 × 2" in hf_threads_note(1, 2, 2, remote=False)


def test_the_modes():
    modes = {m.key: m for m in make_modes(list(MODE_KEYS), 4)}
    assert "adaptive" not in modes  # the same request as `default`
    assert modes["default"].k == 0 and modes["default"].drafter == "model"
    assert modes["default"].label == "SpecMesh (gateway defaults)"
    assert modes["model"].k == 4 and modes["hf"].k == 4 and modes["hf"].assistant
    assert modes["hf-default"].assistant and modes["hf-default"].k == 0
    assert not modes["hf-plain"].assistant and not modes["hf-plain"].static_cache
    assert modes["hf-static"].static_cache and not modes["hf-static"].assistant
    assert [m.key for m in modes.values() if m.in_process] == ["hf-plain", "hf-static", "hf",
                                                                "hf-default"]
    # --modes by default: every mode but the static cache's (as fast as plain on a CPU)
    assert DEFAULT_MODE_KEYS == tuple(k for k in MODE_KEYS if k != "hf-static")
    assert "serving-path overhead" in modes["target"].label and modes["target"].disable


def test_the_notes_say_what_is_na_and_why():
    gateway = {"verify_compute_s": 1.0}
    rows = [_row("target", 1, 50.0, services={"gateway": gateway}, cache_hit=None),
            _row("model", 1, 60.0, services={"gateway": gateway}, cache_hit=0.5, fanout=None,
                 gateway_ms_per_round=None)]
    report = {"rows": rows, "baselines": {"speedup_base": "target"},
              "machine": {"load_average_start": [0.5], "load_average_end": [0.7], "cores": 2}}
    notes = run_notes(report)
    assert any(n.startswith("No plain HF generate row") for n in notes)
    assert any(n.startswith("No specmesh_spec_cache_fanout") for n in notes)
    assert any(n.startswith("No specmesh_round_gateway_seconds") for n in notes)
    assert not any("specmesh_pipeline_drafts_total" in n for n in notes)  # measured
    report["baselines"]["speedup_base"] = "hf-plain"
    assert not any(n.startswith("No plain HF generate row") for n in run_notes(report))
    assert any(n.startswith("CPU ms/token is measured over the local mesh") for n in notes)
    rows[0]["cpu_ms_per_token"] = 3.0  # measured for a row: the note says how, not n/a
    notes = run_notes(report)
    assert not any(n.startswith("CPU ms/token is measured over") for n in notes)
    assert any(n.startswith("CPU ms/token: CPU seconds (user + system)") for n in notes)


def test_the_cache_hit_target_says_how_many_rounds_it_stands_on():
    """The speculation cache's hit rate at one stream is a rate over the drafter tier's
    drafting rounds, which under the defaults are the gateway's few probes among hundreds
    of plain rounds: the target's row says how many of how many (console and bench.md), so
    a fail over 8 rounds reads as what it is."""
    rows = [_row("target", 1, 40.0, outputs_match=True),
            _row("default", 1, 60.0, outputs_match=True, cache_hit=0.5, cache_rounds=8.0,
                 rounds=281),
            _row("model", 1, 50.0, outputs_match=True, cache_hit=None, cache_rounds=None,
                 rounds=120)]
    got = {(t["mode"], t["key"]): t for t in targets(rows)}
    hit = got[("default", "cache_hit")]
    assert (hit["value"], hit["passed"], hit["basis"]) == (0.5, False, "8 drafting rounds of 281")
    assert got[("model", "cache_hit")]["basis"] == ""  # nothing counted: nothing to say
    assert got[("default", "scaling")]["basis"] == ""  # only the cache's rate has one
    cells = target_cells(hit, {"default": "SpecMesh (gateway defaults)"})
    assert cells[3] == "0.500 (8 drafting rounds of 281)" and cells[4] == "**fail**"
    assert target_cells(got[("model", "cache_hit")], {})[3] == "n/a"
