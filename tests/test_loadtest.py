"""`specmesh load`: concurrent streams against a real mesh, the figures it reports, and that a
failure is counted with its status code and fails the command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from services.local_mesh import free_port
from specmesh import loadtest
from specmesh.cli import app
from specmesh.loadtest import LoadOptions, measure, percentiles, run_streams


def _ordered(p: dict | None) -> None:
    assert p is not None
    assert 0 < p["p50"] <= p["p90"] <= p["p99"], p


def test_percentiles_interpolate_between_ranks():
    assert percentiles([]) is None
    p = percentiles([float(x) for x in range(101, 0, -1)])  # 101..1, unsorted on purpose
    assert p == {"p50": 51.0, "p90": 91.0, "p99": 100.0}
    assert percentiles([2.0, 4.0]) == {"p50": 3.0, "p90": pytest.approx(3.8),
                                       "p99": pytest.approx(3.98)}


def test_load_against_a_real_mesh_counts_every_request_and_token(mesh):
    pids = {p.name: p.popen.pid for p in mesh.procs}
    opts = LoadOptions(streams=3, duration_s=6, max_new_tokens=16, timeout_s=60)
    seen = []
    report = measure(mesh.gateway_address, opts, pids, progress=lambda *a: seen.append(a))

    assert report["errors"] == {} and report["warmup"]["errors"] == {}, report["error_details"]
    assert report["warmup"]["requests"] == 3  # one per stream
    assert report["requests"] == report["ok"] >= 3
    assert report["wall_s"] >= 6
    _ordered(report["ttft_ms"])
    _ordered(report["itl_ms"])
    _ordered(report["latency_ms"])
    assert report["ttft_ms"]["p50"] <= report["latency_ms"]["p99"]
    assert report["tokens_per_s"] == pytest.approx(report["tokens_total"] / report["wall_s"])
    assert {s[0] for s in seen} == {"warm-up", "load"}
    assert seen[-1][2] == report["requests"] and seen[-1][4] == report["tokens_total"]

    assert set(report["rss"]) == set(pids)
    for name, v in report["rss"].items():
        assert v["pid"] == pids[name]
        assert v["start_bytes"] > 0 and v["end_bytes"] > 0, (name, v)
        assert v["growth_bytes"] == v["end_bytes"] - v["start_bytes"]
    # the gateway, the verifier and the model drafter worked while the streams ran (the
    # fixture's n-gram drafter serves none of these requests)
    assert set(report["cpu"]) == set(pids) | {"all"}
    for name in ("gateway", "verifier-0", "drafter-0"):
        assert report["cpu"][name]["seconds"] > 0, report["cpu"]
    assert all(v["seconds"] >= 0 for v in report["cpu"].values()), report["cpu"]
    assert report["cpu"]["all"]["seconds"] == pytest.approx(
        sum(v["seconds"] for k, v in report["cpu"].items() if k != "all"))
    assert report["cpu"]["all"]["ms_per_token"] == pytest.approx(
        1000 * report["cpu"]["all"]["seconds"] / report["tokens_total"])
    assert not loadtest.failed(report)
    json.dumps(report)  # serializable as is


def test_each_request_record_is_consistent(mesh):
    opts = LoadOptions(streams=2, max_new_tokens=12, timeout_s=60)
    records, _ = run_streams(mesh.gateway_address, opts, per_stream=2)
    assert len(records) == 4
    total = 0
    for r in records:
        assert r.ok, (r.code, r.detail)
        assert 0 < r.tokens <= 12
        assert 0 < r.ttft_s <= r.latency_s
        # the first chunk's tokens have no ITL sample; every later token has exactly one
        assert len(r.itl_s) < r.tokens and all(x >= 0 for x in r.itl_s)
        assert sum(r.itl_s) <= r.latency_s - r.ttft_s + 1e-6
        total += r.tokens
    report = loadtest.build_report("x", opts, records, 1.0, [], None, None, None)
    assert report["tokens_total"] == total and report["rss"] is None


def test_nothing_listening_is_counted_as_unavailable():
    dead = f"127.0.0.1:{free_port()}"
    report = measure(dead, LoadOptions(streams=2, duration_s=1, timeout_s=5))
    assert report["ok"] == 0 and report["requests"] >= 2
    assert report["errors"] == {"UNAVAILABLE": report["requests"]}
    assert report["warmup"]["errors"] == {"UNAVAILABLE": 2}
    assert report["tokens_total"] == 0 and report["ttft_ms"] is None
    assert report["rss"] is None and loadtest.failed(report)


def _cli(mesh, tmp_path, streams: int, max_new_tokens: int):
    """`specmesh load --addr` for 1 s: (the CliRunner result, the --json report)."""
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["load", "--addr", mesh.gateway_address, "--streams",
                                      str(streams), "--duration", "1", "--max-new-tokens",
                                      str(max_new_tokens), "--json", str(out)])
    assert out.exists(), result.output
    return result, json.loads(out.read_text())


def test_cli_exits_non_zero_and_reports_the_status_of_rejected_requests(mesh, tmp_path):
    # the mesh fixture caps max_new_tokens at 512: the gateway rejects every request
    result, report = _cli(mesh, tmp_path, streams=2, max_new_tokens=513)
    assert result.exit_code == 1, result.output
    assert set(report["errors"]) == {"INVALID_ARGUMENT"}
    assert report["errors"]["INVALID_ARGUMENT"] == report["requests"] >= 2
    assert "max_new_tokens" in report["error_details"][0]
    assert "INVALID_ARGUMENT" in result.output


def test_cli_succeeds_against_a_healthy_mesh(mesh, tmp_path):
    result, report = _cli(mesh, tmp_path, streams=1, max_new_tokens=8)
    assert result.exit_code == 0, result.output
    assert report["errors"] == {} and report["requests"] >= 1
    assert "TTFT" in result.output and "not measured" in result.output


def test_cpu_report_per_process_and_per_token():
    start = {"verifier-0": 10.0, "drafter-0": 4.0, "gateway": 2.5, "gone": 1.0}
    end = {"verifier-0": 12.0, "drafter-0": 5.0, "gateway": 3.0, "gone": None}
    cpu = loadtest.cpu_report(start, end, tokens=1000)
    assert set(cpu) == {"verifier-0", "drafter-0", "gateway", "all"}  # an exited one is left out
    assert cpu["verifier-0"] == {"seconds": 2.0, "ms_per_token": 2.0}
    assert cpu["gateway"]["ms_per_token"] == pytest.approx(0.5)
    assert cpu["all"]["seconds"] == pytest.approx(3.5)
    assert cpu["all"]["ms_per_token"] == pytest.approx(3.5)
    assert loadtest.cpu_report(start, end, tokens=0)["all"]["ms_per_token"] is None


def test_target_without_draft_is_one_line_and_exit_2():
    result = CliRunner().invoke(app, ["load", "--target", "/nonexistent"])
    assert result.exit_code == 2
    assert "--target and --draft go together" in result.output
    assert "Traceback" not in result.output


def test_temperature_reaches_every_request(mesh, monkeypatch):
    """`specmesh load --temperature`: each stream's requests sample at it, unseeded (the
    requests the real mesh serves are built with it; greedy by default)."""
    import specmesh.client

    built, real = [], specmesh.client.build_request

    def spy(*args, **kwargs):
        built.append((kwargs.get("temperature"), kwargs.get("seed")))
        return real(*args, **kwargs)

    monkeypatch.setattr(specmesh.client, "build_request", spy)
    for temperature in (0.9, 0.0):
        opts = LoadOptions(streams=2, max_new_tokens=8, timeout_s=60, temperature=temperature)
        records, _ = run_streams(mesh.gateway_address, opts, per_stream=1)
        assert all(r.ok for r in records), [(r.code, r.detail) for r in records]
    assert built == [(0.9, None)] * 2 + [(0.0, None)] * 2
