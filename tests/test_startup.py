"""Start-up time (issue #12 item 4; figures in docs/performance.md, "Start-up time").

A replica's own start-up is bound by importing torch and transformers (measured by
`python -m specmesh.startup_profile`); what the code controls is checked structurally here:
the Kubernetes startup probe polls a model replica every second (at 10 s a replica SERVING
after 4 s took traffic only after 10), a replica's process imports nothing that serving does
not need, and the profile tool that the docs' figures come from runs."""

from __future__ import annotations

import subprocess
import sys

from tests.test_helm_chart import by_component, containers, rendered

# Packages a drafter or verifier must not import just to start: the Kubernetes client and the
# plots belong to the gateway's discovery and the bench; exporters load only when configured.
NOT_AT_START = ("kubernetes", "matplotlib", "helm_python", "prometheus_client",
                "opentelemetry.exporter", "pandas", "scipy", "hypothesis")


def test_model_tiers_startup_probe_checks_every_second():
    docs = by_component(rendered("default"), "Deployment")
    for tier in ("drafter", "verifier"):
        (c,) = containers(docs[tier])
        probe = c["startupProbe"]
        assert probe["periodSeconds"] == 1, tier
        assert probe["timeoutSeconds"] <= 2, tier
        # still minutes for a large model to load before the kubelet restarts the container
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 300, tier


def test_replica_modules_import_only_what_serving_needs():
    code = ("import sys, specmesh.cli, drafter_svc.server, verifier_svc.server, "
            "services.model_service\nprint('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    loaded = sorted(m for m in out if m.startswith(NOT_AT_START))
    assert loaded == [], loaded


def test_startup_profile_reports_every_phase(tiny_pair):
    _, draft = tiny_pair
    result = subprocess.run([sys.executable, "-m", "specmesh.startup_profile", "--role",
                             "drafter", "--model", draft, "--runs", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"drafter {draft}: SERVING after "), lines
    assert lines[1].split() == ["wall", "CPU", "phase"], lines
    rows = [line.split() for line in lines[2:]]
    assert [r[2] for r in rows] == [
        "interpreter", "import", "service", "transformers", "load_for_serving", "the"], rows
    phase_cpu = [float(r[1]) for r in rows[:-1]]
    assert all(c > 0 for c in phase_cpu), rows
