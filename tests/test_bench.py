"""`specmesh bench`: the cost formulas against numbers worked out by hand, the figures of a
cell, the shipped prompt set, and one end-to-end run on the tiny pair (its own local mesh)
whose report must be complete and lossless. No timing thresholds."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time

import pytest
import typer.main
from typer.testing import CliRunner

from gateway.adaptive import expected_tokens
from specmesh.bench_costs import (
    cost_figures,
    efficiency,
    overhead_per_round,
    parse_gateway_metrics,
    ratio,
    speedup_bound,
)
from specmesh.bench_machine import ProcessCpu, wait_quiet
from specmesh.bench_prompts import PROMPTS_PATH, first_prompt, load_prompts, make_prompt_set
from specmesh.bench_report import device_note, per_token_alpha, steal_notes, summarize
from specmesh.cli import app

PNG = b"\x89PNG\r\n\x1a\n"


def test_expected_tokens_by_hand():
    # α = 0.5, k = 3: (1 - 0.5^4) / (1 - 0.5) = 0.9375 / 0.5 = 1.875 (= 1 + .5 + .25 + .125)
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    # α = 0.8, k = 3: (1 - 0.4096) / 0.2 = 2.952
    assert expected_tokens(0.8, 3) == pytest.approx(2.952)
    assert expected_tokens(0.0, 3) == 1.0  # every draft rejected: the target's token
    assert expected_tokens(1.0, 3) == 4.0  # every draft accepted, plus the bonus
    assert expected_tokens(1.0, 7) == 8.0


def test_speedup_bound_and_efficiency_by_hand():
    # E = 1.875; k·c + c_v = 3 × 0.1 + 1.2 = 1.5; bound = 1.25
    assert speedup_bound(0.5, 3, 0.1, 1.2) == pytest.approx(1.25)
    # Leviathan et al.'s form (c_v = 1): α = 0.8, k = 3, c = 0.05: 2.952 / 1.15 = 2.566...
    assert speedup_bound(0.8, 3, 0.05, 1.0) == pytest.approx(2.952 / 1.15)
    assert efficiency(1.0, 1.25) == pytest.approx(0.8)
    assert efficiency(None, 1.25) is None and efficiency(1.0, None) is None


def test_overhead_per_round_by_hand():
    # 100 rounds took 2.0 s, of which 0.5 s drafting and 1.2 s verifying: 0.3 s rest
    ms, frac = overhead_per_round(2.0, 0.5, 1.2, 100)
    assert ms == pytest.approx(3.0) and frac == pytest.approx(0.15)
    assert overhead_per_round(2.0, None, 1.2, 100) == (None, None)
    assert overhead_per_round(2.0, 0.5, 1.2, 0) == (None, None)


def test_ratio_is_none_for_missing_or_zero():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(3.0, 0) is None and ratio(None, 2.0) is None and ratio(3.0, None) is None


def _stats(forward_ms=0.0, passes=0, drafted=0):
    return {"forward_ms": forward_ms, "forward_passes": passes, "draft_tokens": drafted}


def test_cost_figures_by_hand():
    target = {"services": {"verifier": _stats(100.0, 50)}}  # t = 2 ms
    spec = {"mode": "model", "label": "m", "concurrency": 1, "alpha": 0.5, "vs_target": 0.5,
            "speedup": 9.0, "tokens_per_round": 1.8,  # speedup (over hf-plain) is not used
            "services": {"verifier": _stats(120.0, 40),  # 3 ms per pass: c_v = 1.5
                         "drafter_model": _stats(30.0, 60, drafted=60),  # 0.5 ms: c = 0.25
                         "gateway": {"round_s": 2.0, "round_count": 100,
                                     "draft_compute_s": 0.5, "verify_compute_s": 1.2,
                                     "pipeline_used": 30.0, "pipeline_dropped": None,
                                     "pipeline_none": 10.0, "gateway_s": 0.05,
                                     "gateway_count": 100, "fanout_sum": 60.0,
                                     "fanout_count": 40.0}}}
    x = cost_figures(target, spec, 3, "model")
    assert x["target_step_ms"] == pytest.approx(2.0)
    assert x["c"] == pytest.approx(0.25) and x["c_v"] == pytest.approx(1.5)
    assert x["expected_tokens_per_round"] == pytest.approx(1.875)
    assert x["bound"] == pytest.approx(1.875 / 2.25)  # 3 × 0.25 + 1.5 = 2.25
    assert x["efficiency"] == pytest.approx(0.5 / (1.875 / 2.25))  # = 0.6
    assert x["overhead_ms_per_round"] == pytest.approx(3.0)
    assert x["overhead_fraction"] == pytest.approx(0.15)
    assert x["cache_hit"] == pytest.approx(0.75)  # 30 of 40
    assert x["fanout"] == pytest.approx(1.5)  # 60 branches / 40 trees
    assert x["gateway_ms_per_round"] == pytest.approx(0.5)  # 50 ms / 100 rounds
    assert x["vs_target"] == 0.5


def test_cost_figures_are_none_when_the_services_report_zeros():
    target = {"services": {"verifier": _stats()}}
    spec = {"mode": "model", "label": "m", "concurrency": 1, "alpha": 0.5, "vs_target": 0.9,
            "services": {"verifier": _stats(), "drafter_model": _stats(drafted=10),
                         "gateway": None}}
    x = cost_figures(target, spec, 3, "model")
    assert x["c"] is None and x["c_v"] is None and x["bound"] is None
    assert x["efficiency"] is None and x["overhead_fraction"] is None
    assert x["cache_hit"] is None and x["fanout"] is None
    assert x["gateway_ms_per_round"] is None
    assert x["expected_tokens_per_round"] == pytest.approx(1.875)
    # k = 0 (the gateway's default): no k, so no E(α, k) and no bound
    assert cost_figures(target, spec, 0, "model")["expected_tokens_per_round"] is None


def test_parse_gateway_metrics():
    text = "\n".join([
        "# TYPE specmesh_rounds_total counter",
        'specmesh_rounds_total{otel_scope_name="specmesh"} 40.0',
        "# TYPE specmesh_round_duration_seconds histogram",
        'specmesh_round_duration_seconds_bucket{le="+Inf"} 40.0',
        "specmesh_round_duration_seconds_count 40.0",
        "specmesh_round_duration_seconds_sum 0.5",
        "# TYPE specmesh_pipeline_drafts_total counter",
        'specmesh_pipeline_drafts_total{outcome="used"} 7.0',
        'specmesh_pipeline_drafts_total{outcome="dropped"} 2.0', ""])
    m = parse_gateway_metrics(text)
    assert m["rounds"] == 40.0 and m["round_count"] == 40.0 and m["round_s"] == 0.5
    assert m["pipeline_used"] == 7.0 and m["pipeline_dropped"] == 2.0
    assert m["pipeline_none"] is None and m["verify_compute_s"] is None  # not exported
    assert m["gateway_s"] is None and m["fanout_sum"] is None and m["fanout_count"] is None
    text += "\n".join([
        "# TYPE specmesh_spec_cache_fanout histogram",
        'specmesh_spec_cache_fanout_bucket{le="+Inf"} 4.0',
        "specmesh_spec_cache_fanout_count 4.0", "specmesh_spec_cache_fanout_sum 10.0",
        "# TYPE specmesh_round_gateway_seconds histogram",
        'specmesh_round_gateway_seconds_bucket{le="+Inf"} 40.0',
        "specmesh_round_gateway_seconds_count 40.0",
        "specmesh_round_gateway_seconds_sum 0.02", ""])
    m = parse_gateway_metrics(text)
    assert (m["fanout_sum"], m["fanout_count"]) == (10.0, 4.0)
    assert (m["gateway_s"], m["gateway_count"]) == (0.02, 40.0)


def test_cells_wait_for_the_cpus_to_settle():
    """Between cells the bench waits until the CPUs are quiet (an engine that just served a
    cell may spin on: vLLM for CPU kept a core busy for about a second): with a process busy
    on one core for 1.5 s, wait_quiet returns only once it has ended; with it gone, at once;
    and never later than its bound. The threshold, 0.8 cores, sits between the hog's one core
    and what else a suite in progress runs meanwhile: at 0.5 a full suite once saw 16 s more
    of such background after the hog had ended."""
    launched = time.monotonic()
    hog = subprocess.Popen([sys.executable, "-c",
                            "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    try:
        time.sleep(0.3)  # (the interpreter has started and spins)
        waited = wait_quiet(max_s=20.0, busy_cores=0.8)
        assert time.monotonic() - launched >= 1.4, "returned while a core was still busy"
        assert waited < 10.0
    finally:
        hog.kill()
        hog.wait()
    assert wait_quiet(max_s=20.0, busy_cores=0.8) < 2.0
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert 1.0 <= wait_quiet(max_s=1.0, busy_cores=0.8) < 2.0  # gives up at the bound
    finally:
        hog.kill()
        hog.wait()


SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_cells_run_with_much_stolen_cpu_are_named_in_the_notes():
    rows = [{"label": "SpecMesh target-only", "concurrency": 8, "steal": 0.14},
            {"label": "SpecMesh (gateway defaults)", "concurrency": 8, "steal": 0.02},
            {"label": "vllm", "concurrency": 16, "steal": 0.051},
            {"label": "HF generate", "concurrency": 1, "steal": None}]
    meaning, warning = steal_notes(rows)
    assert meaning.startswith("Steal: the share of the time the CPUs had work for")
    assert warning.endswith(": SpecMesh target-only @ 8 (14%), vllm @ 16 (5%).")
    assert steal_notes(rows[1:2]) == [meaning]  # 2%: nothing to name
    assert steal_notes([{**r, "steal": None} for r in rows]) == [
        "Steal: not counted on this system (n/a)."]


def test_process_cpu_counts_a_process_and_its_descendants():
    """The bench's CPU per token sums what the mesh's processes and their children (a
    service's workers, vLLM's engine core) used: a child that spins 0.6 s of CPU while its
    own child spins 0.6 s more counts about 1.2 s between two readings; a process that
    sleeps counts about nothing; a pid that is gone counts nothing."""
    grandchild = SPIN.format(s=0.6)
    child = ("import subprocess, sys\n"
             f"g = subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
             + SPIN.format(s=0.6) + "g.wait()\nimport time\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", child])
    idle = subprocess.Popen(
        [sys.executable, "-c", "import time\nprint('asleep', flush=True)\ntime.sleep(30)"],
        stdout=subprocess.PIPE, text=True)
    try:
        # (the sleeper's interpreter start-up is counted before: on a slow 2-core VM, beside
        # the spinner's, it took 0.07 s of CPU after the first reading)
        assert idle.stdout.readline() == "asleep\n"
        cpu = ProcessCpu([proc.pid, idle.pid], ["spinner", "sleeper"])
        before = cpu.by_name()  # the spinner's start-up is counted before, mostly
        time.sleep(3.0)  # two spins of 0.6 s on two cores, or one after the other on one
        after = cpu.by_name()
        used = after["spinner"] - before["spinner"]
        assert 0.9 <= used <= 1.6, used
        assert after["sleeper"] - before["sleeper"] < 0.05
        quiet = ProcessCpu([idle.pid])
        first = quiet.by_name()[str(idle.pid)]
        time.sleep(0.5)
        assert quiet.by_name()[str(idle.pid)] - first < 0.05
    finally:
        for p in (proc, idle):
            for c in __import__("psutil").Process(p.pid).children(recursive=True):
                c.kill()
            p.kill()
            p.wait()
        idle.stdout.close()
    assert ProcessCpu([proc.pid]).by_name() == {str(proc.pid): 0.0}  # gone: nothing counted


def test_a_local_peers_processes_are_found_by_its_port():
    """A peer served on this machine is measured through whatever listens on its URL's port
    (and its children); a peer on another host is not measured."""
    server = subprocess.Popen([sys.executable, "-c",
                               "import socket, sys, time\ns = socket.socket()\n"
                               "s.bind(('127.0.0.1', 0))\ns.listen()\n"
                               "print(s.getsockname()[1], flush=True)\ntime.sleep(30)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        found = ProcessCpu.serving(f"http://127.0.0.1:{port}/v1")
        assert found is not None and found.pids == [server.pid]
        assert ProcessCpu.serving(f"http://localhost:{port}/v1").pids == [server.pid]
    finally:
        server.kill()
        server.wait()
    assert ProcessCpu.serving(f"http://127.0.0.1:{port}/v1") is None  # nobody listens now
    assert ProcessCpu.serving("http://10.1.2.3:8000/v1") is None  # another host


def test_summarize_by_hand():
    def rec(tokens, rounds, drafts, accepted, ttft, latency, error=""):
        return {"prompt_index": 0, "token_ids": [], "completion_tokens": tokens,
                "rounds": rounds, "draft_tokens": drafts, "accepted_draft_tokens": accepted,
                "ttft_s": ttft, "latency_s": latency, "error": error}

    s = summarize([rec(10, 5, 6, 3, 0.1, 1.0), rec(20, 10, 6, 3, 0.3, 4.0),
                   rec(0, 0, 0, 0, None, 0.5, "UNAVAILABLE: down")], wall_s=5.0)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["tokens_per_s"] == pytest.approx(6.0)  # 30 tokens / 5 s
    assert s["per_request_tokens_per_s"] == pytest.approx(7.5)  # (10/1 + 20/4) / 2
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["tokens_per_round"] == pytest.approx(2.0)  # 30 / 15
    assert s["acceptance"] == pytest.approx(0.5)  # 6 / 12


def test_per_token_alpha_by_hand():
    """k = 3, budget 9 tokens: rounds of 4 (all 3 accepted), 2 (1 accepted, then a rejection),
    1 (a rejection at once), then with 2 tokens left k' = min(3, 9 − 7 − 1) = 1 and 1 token
    (a rejection), then the last round (left out). Accepted 3 + 1 + 0 + 0 = 4, rejections 3:
    α = 4/7. A failed request counts for nothing; k = 0 has no α."""
    rec = {"error": "", "chunks": [(4, False), (2, False), (1, False), (1, False), (1, True)]}
    bad = {"error": "UNAVAILABLE", "chunks": [(1, False)] * 5}
    assert per_token_alpha([rec, bad], k=3, max_new_tokens=9) == pytest.approx(4 / 7)
    assert per_token_alpha([rec], k=0, max_new_tokens=9) is None


def test_the_shipped_prompt_set():
    prompts = load_prompts()
    assert [p["kind"] for p in prompts].count("code") == 12
    assert [p["kind"] for p in prompts].count("prose") == 4
    assert len({p["prompt"] for p in prompts}) == 16
    assert [p["kind"] for p in load_prompts(limit=3)] == ["code", "code", "prose"]
    shipped = json.loads(PROMPTS_PATH.read_text())
    if shipped["python"] == platform.python_version():  # the same stdlib: made the same way
        assert make_prompt_set() == shipped


def test_a_code_prompt_is_a_def_line_and_its_docstring():
    source = ("import os\n\nclass A:\n    @staticmethod\n    def f(x):\n"
              '        """Return x, unchanged, whatever it is: a number or a string."""\n'
              "        return x\n")
    prompt, line = first_prompt(source)
    assert line == 5
    assert prompt == ('def f(x):\n    """Return x, unchanged, whatever it is: a number or a '
                      'string."""\n    ')
    assert first_prompt("def g():\n    return 1\n") is None  # no docstring


def test_bench_end_to_end_on_the_tiny_pair(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "--target", target, "--drafter", draft,
                                      "--concurrency", "1,2", "--prompts", "3",
                                      "--per-stream", "2", "--max-new-tokens", "16",
                                      "--out", str(out)])
    report = json.loads((out / "bench.json").read_text())
    assert result.exit_code == 0, (result.output, [(r["label"], r["concurrency"],
                                                    r["error_details"]) for r in report["rows"]])
    rows = {(r["mode"], r["concurrency"]): r for r in report["rows"]}
    gateway_modes = ("target", "model", "default", "ngram")
    hf_modes = ("hf-plain", "hf", "hf-default")
    assert set(rows) == ({(m, c) for m in gateway_modes for c in (1, 2)}
                         | {(m, 1) for m in hf_modes})
    assert report["settings"]["per_stream"] == 2
    plain = rows[("hf-plain", 1)]
    for (mode, c), r in rows.items():
        assert r["errors"] == 0, r["error_details"]
        # max(P, R·N): every prompt at least once, every stream at least R = 2 requests
        # (the HF rows run each prompt once)
        assert r["requests"] == (4 if c == 2 else 3), (mode, c, r["requests"])
        assert r["outputs_match"] is True, (mode, c, r["mismatched_prompts"])  # lossless
        assert r["tokens_per_round"] >= 1.0
        # the speedup base is plain HF generate (concurrency 1) for every row
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        if mode not in hf_modes:
            assert r["vs_target"] == pytest.approx(
                r["tokens_per_s"] / rows[("target", c)]["tokens_per_s"])
            # the mesh's processes worked for the cell: some CPU, at most every core's wall
            assert 0 < r["cpu_s"] <= r["wall_s"] * report["machine"]["cores"] + 0.5
            assert r["cpu_ms_per_token"] == pytest.approx(r["cpu_s"] * 1000 / r["tokens"])
            by = r["cpu_s_by_process"]  # where it went: every process of the mesh, by name
            assert set(by) == {"redis", "verifier-0", "drafter-0", "ngram-0", "gateway"}
            assert sum(by.values()) == pytest.approx(r["cpu_s"])
            assert by["verifier-0"] > 0 and by["gateway"] > 0
        else:
            assert r.get("cpu_ms_per_token") is None
        assert 0.0 <= r["steal"] <= 1.0  # counted for every cell (the HF rows together)
    for c in (1, 2):  # one token in a request's first round, up to 8 (--plain-tokens) after
        assert 1.0 < rows[("target", c)]["tokens_per_round"] <= 8.0
        assert rows[("target", c)]["vs_target"] == 1.0
    assert plain["speedup"] == 1.0 and plain["tokens_per_round"] == 1.0
    assert rows[("hf-default", 1)]["hf_assistant"] == {
        "num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.4}  # the tiny draft's config sets none of them
    assert rows[("hf", 1)]["hf_assistant"]["num_assistant_tokens"] == 3
    assert report["baselines"]["speedup_base"] == "hf-plain"
    assert report["baselines"]["serving_path_overhead"] == pytest.approx(
        plain["tokens_per_s"] / rows[("target", 1)]["tokens_per_s"])
    assert report["settings"]["hf_threads"] == min(2, report["machine"]["cores"])
    assert len(report["reference_outputs"]) == 3
    assert {x["mode"] for x in report["costs"]} == {"model", "default", "ngram"}
    assert {(t["mode"], t["key"]) for t in report["targets"]} == (
        {(m, key) for m in ("model", "default") for key in (
            "vs_hf_plain", "vs_hf_assisted", "cache_hit", "gateway_ms", "scaling",
            "vs_target_8", "scaling_16", "vs_target_all", "vs_peer_1", "vs_peer_8", "vs_peer_16",
            "cpu_ms_16")}
        | {("all", "lossless")})
    lossless = next(t for t in report["targets"] if t["key"] == "lossless")
    assert lossless["value"] == 1.0 and lossless["passed"] is True
    assert report["machine"]["cores"] >= 1 and report["machine"]["torch"]
    assert report["models"]["target"]["params"] > report["models"]["draft"]["params"] > 0

    md = (out / "bench.md").read_text()
    assert "| mode | concurrency | tokens/s |" in md
    # the replicas' table: every mesh cell, its verifier's model compute within the wall time
    replicas = md[md.index("## Replicas (every cell)"):md.index("## Targets")]
    for r in report["rows"]:
        if r["mode"] in hf_modes:
            assert r["label"] + " | " + str(r["concurrency"]) + " |" not in replicas
            continue
        v = r["services"]["verifier"]
        busy = v["forward_ms"] / 1000 / r["wall_s"]
        assert 0 < busy <= 1.0 + 1e-6  # one model thread: its passes fit in the cell
        assert (f"| {r['label']} | {r['concurrency']} | {v['forward_passes']} | "
                f"{v['forward_ms'] / v['forward_passes']:.2f} | {busy * 100:.0f}% |") in replicas
    assert ("| cache hit | fan-out | gateway ms/round | prefix hit | CPU ms/token | steal |"
            in md)
    assert "Speedup base: HF generate (plain, no assistant), concurrency 1." in md
    for r in report["rows"]:
        assert r["label"] in md
    for name in ("tokens_per_s.png", "speedup.png"):
        assert (out / name).read_bytes()[:8] == PNG


def test_a_cell_run_while_the_host_stole_much_runs_again(tiny_pair, tmp_path, monkeypatch):
    """A VM's host that takes half the CPUs' time during a cell's first run (a fake steal
    clock: nothing else can make a host steal on cue): that run is over --max-steal, the cell
    runs again, and the less stolen run is the row, marked in bench.json and the notes.
    Cells under the bound run once; with --steal-reruns 0 none runs again."""
    from specmesh import bench

    def fake_clock(shares):
        ticks, calls = [0, 0], [0]

        def read():  # readings come in pairs around each cell run: stolen, demanded ticks
            calls[0] += 1
            if calls[0] % 2 == 0:
                share = shares.pop(0) if shares else 0.0
                ticks[0] += round(100 * share)
                ticks[1] += 100
            return tuple(ticks)
        return read

    target, draft = tiny_pair
    args = ["bench", "--target", target, "--drafter", draft, "--modes", "target", "--no-hf",
            "--concurrency", "1,2", "--prompts", "2", "--max-new-tokens", "8", "--per-stream",
            "1"]
    monkeypatch.setattr(bench.steal, "read", fake_clock([0.5, 0.01]))
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "a" / "bench.json").read_text())
    assert report["settings"]["max_steal"] == 0.05 and report["settings"]["steal_reruns"] == 1
    rows = {r["concurrency"]: r for r in report["rows"]}
    assert rows[1]["steal_reruns"] == 1 and rows[1]["steal"] == pytest.approx(0.01)
    assert rows[2]["steal_reruns"] == 0 and rows[2]["steal"] == 0.0
    assert rows[1]["requests"] == 2  # the row is one run's, not both runs' together
    md = (tmp_path / "a" / "bench.md").read_text()
    assert ("least stolen run kept (times run again): SpecMesh target-only "
            "(serving-path overhead) @ 1 (1).") in md
    monkeypatch.setattr(bench.steal, "read", fake_clock([0.5]))
    result = CliRunner().invoke(app, [*args, "--steal-reruns", "0", "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    rows = {r["concurrency"]: r for r in json.loads(
        (tmp_path / "b" / "bench.json").read_text())["rows"]}
    assert rows[1]["steal_reruns"] == 0 and rows[1]["steal"] == pytest.approx(0.5)
    assert "SpecMesh target-only (serving-path overhead) @ 1 (50%)" in (
        tmp_path / "b" / "bench.md").read_text()


def test_bench_repeats_each_cell_and_reports_its_median_run(tiny_pair, tmp_path):
    """--repeat 3: every cell runs three times; its row is the run with the median tokens/s,
    every run's tokens/s beside it (bench.json and the table's runs column), and every run's
    outputs are compared with target-only's."""
    target, draft = tiny_pair
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "--target", target, "--drafter", draft,
                                      "--modes", "target,model", "--no-hf", "--concurrency",
                                      "1,2", "--prompts", "2", "--max-new-tokens", "8",
                                      "--per-stream", "1", "--repeat", "3", "--drafter-device", "cpu",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["repeat"] == 3
    assert report["settings"]["device"] == report["settings"]["drafter_device"] == "cpu"
    assert {(r["mode"], r["concurrency"]) for r in report["rows"]} == {
        (m, c) for m in ("target", "model") for c in (1, 2)}
    for r in report["rows"]:
        runs = r["runs_tokens_per_s"]
        assert len(runs) == 3 and r["tokens_per_s"] == sorted(runs)[1]
        assert r["requests"] == 2 and r["errors"] == 0 and r["outputs_match"] is True
    md = (out / "bench.md").read_text()
    assert "| mode | concurrency | tokens/s | runs |" in md and md.count(" (3) |") == 4


def test_the_report_says_where_the_models_ran():
    """bench.md's first line names the device only when a model left the CPU, and the model
    drafter's only when it differs (the design's case: the target on an accelerator, the
    drafter on the CPU)."""
    assert device_note({"device": "cpu", "drafter_device": "cpu"}) == ""
    assert device_note({}) == ""  # a report from before --drafter-device
    assert device_note({"device": "cuda", "drafter_device": "cuda"}) == "models on cuda; "
    assert device_note({"device": "cuda", "drafter_device": "cpu"}) == (
        "models on cuda, the model drafter on cpu; ")
    assert device_note({"device": "cpu", "drafter_device": "cpu", "verifier_replicas": 2}) == (
        "2 verifier replicas; ")
    assert device_note({"device": "cpu", "drafter_device": "cpu", "verifier_replicas": 1}) == ""


def test_the_bench_can_run_its_local_mesh_with_several_verifiers(tiny_pair, tmp_path):
    """--verifier-replicas N starts N verifier processes, as `specmesh up --verifiers N`
    does (the verifier tier scaled on its own): the report says so and the outputs still
    equal target-only's."""
    target, draft = tiny_pair
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "--target", target, "--drafter", draft,
                                      "--modes", "target,model", "--no-hf", "--concurrency",
                                      "4", "--prompts", "4", "--max-new-tokens", "8",
                                      "--per-stream", "1", "--verifier-replicas", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["verifier_replicas"] == 2
    assert all(r["outputs_match"] is True and r["errors"] == 0 for r in report["rows"])
    assert sorted(p.name for p in (out / "logs").glob("verifier-*.log")) == [
        "verifier-0.log", "verifier-1.log"]
    assert "2 verifier replicas; " in (out / "bench.md").read_text().splitlines()[2]


def test_the_drafter_stays_on_the_cpu_unless_the_bench_is_told_otherwise():
    """`--device cuda` alone benchmarks what `specmesh up` runs on a GPU machine: the
    verifier on the GPU, the model drafter on the CPU (not both on the GPU, as before)."""
    bench = typer.main.get_command(app).commands["bench"]
    options = {p.name: p for p in bench.params}
    assert options["drafter_device"].default == "cpu"
    assert options["device"].default == "cpu"  # (so "--device cuda" alone changes the target's)


def test_shared_prefix_prompts_start_with_one_context_of_the_asked_length(tiny_pair):
    from transformers import AutoTokenizer

    from specmesh.bench_prompts import with_shared_prefix

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    prompts = load_prompts(limit=3)
    shared, n = with_shared_prefix(prompts, tokenizer, 300, source=load_prompts())
    context = shared[0]["prompt"][:-len(prompts[0]["prompt"])]
    assert 250 <= n <= 300 and context.endswith("\n")
    assert len(tokenizer(context, add_special_tokens=False)["input_ids"]) == n
    assert [s["prompt"] for s in shared] == [context + p["prompt"] for p in prompts]
    assert [s["id"] for s in shared] == [p["id"] + "+prefix" for p in prompts]
    # the prompts' token ids share the context's blocks: what a prefix cache can reuse
    ids = [tokenizer(s["prompt"])["input_ids"] for s in shared]
    common = min(next((i for i, (a, b) in enumerate(zip(ids[0], x, strict=False)) if a != b), len(x))
                 for x in ids[1:])
    assert common >= n - 2


def test_shared_prefixes_put_every_nth_prompt_behind_its_own_context(tiny_pair):
    """--shared-prefixes 3: three contexts, each of at most the asked length, none beginning
    as another does (no prefix block in common), prompt i behind context i mod 3."""
    from transformers import AutoTokenizer

    from specmesh.bench_prompts import with_shared_prefix

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    prompts = load_prompts(limit=7)
    shared, n = with_shared_prefix(prompts, tokenizer, 200, source=load_prompts(), contexts=3)
    contexts = [s["prompt"][:-len(p["prompt"])] for s, p in zip(shared, prompts, strict=True)]
    assert [s["id"] for s in shared] == [f"{p['id']}+prefix{i % 3}"
                                        for i, p in enumerate(prompts)]
    assert all(contexts[i] == contexts[i % 3] for i in range(len(prompts)))
    firsts = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in contexts[:3]]
    assert n == min(len(ids) for ids in firsts) and all(150 <= len(ids) <= 200 for ids in firsts)
    assert len({tuple(ids[:16]) for ids in firsts}) == 3  # three different first blocks


def test_unshared_every_leaves_every_nth_prompt_without_a_context(tiny_pair):
    """--unshared-every 3 with two contexts: prompts 2 and 5 as they were (their ids too), the
    others behind context i mod 2, as without the option."""
    from transformers import AutoTokenizer

    from specmesh.bench_prompts import with_shared_prefix

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    prompts = load_prompts(limit=7)
    every, n = with_shared_prefix(prompts, tokenizer, 200, source=load_prompts(), contexts=2,
                                  unshared_every=3)
    behind, m = with_shared_prefix(prompts, tokenizer, 200, source=load_prompts(), contexts=2)
    assert n == m
    for i, (e, b, p) in enumerate(zip(every, behind, prompts, strict=True)):
        assert e == (p if i in (2, 5) else b)
    assert behind[2] != prompts[2]


def test_bench_shared_prefix_reuses_the_verifiers_prefix_cache(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "--target", target, "--drafter", draft,
                                      "--concurrency", "1", "--prompts", "2", "--modes",
                                      "target,default", "--no-hf", "--shared-prefix", "200",
                                      "--per-stream", "1",
                                      "--max-new-tokens", "8", "--out", str(out)])
    report = json.loads((out / "bench.json").read_text())
    assert result.exit_code == 0, result.output
    assert 150 <= report["settings"]["shared_prefix_tokens"] <= 200
    for row in report["rows"]:
        assert row["outputs_match"] is True and row["errors"] == 0
        v = row["services"]["verifier"]
        # the warm-up request computed the context: every measured prompt reuses most of it
        assert v["prefix_hit_tokens"] >= 0.8 * v["prefix_lookup_tokens"] > 0
    md = (out / "bench.md").read_text()
    shared = report["settings"]["shared_prefix_tokens"]
    assert f"behind one shared {shared}-token context" in md and "| prefix hit |" in md


def test_the_reports_prefix_note_names_one_context_or_several():
    from specmesh.bench_report import _prefix_note

    assert _prefix_note({"shared_prefix_tokens": 0, "shared_prefixes": 0}) == ""
    assert _prefix_note({"shared_prefix_tokens": 790, "shared_prefixes": 1}) == (
        " behind one shared 790-token context (--shared-prefix)")
    assert "behind 2 shared contexts of 780 tokens or more, prompt i behind context i mod 2" in (
        _prefix_note({"shared_prefix_tokens": 780, "shared_prefixes": 2}))
    assert _prefix_note({"shared_prefix_tokens": 790, "shared_prefixes": 1,
                         "unshared_every": 2}) == (
        " behind one shared 790-token context (--shared-prefix), one prompt in 2 without a "
        "context (--unshared-every)")
