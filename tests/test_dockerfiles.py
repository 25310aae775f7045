"""docker/Dockerfile and .dockerignore, checked by parsing (no Docker engine runs here).

A small parser of Dockerfile instructions (line continuations, comments, JSON-form
ENTRYPOINT) follows each target's chain of ``FROM <stage>`` so inherited settings count.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer.main

from specmesh.cli import app

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
TIERS = ("gateway", "drafter", "verifier")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages in order) of a Dockerfile."""
    logical, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comments inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    assert not buf, "dangling line continuation"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, f"bad FROM: {line}"
            stages.append(Stage(name=(m.group(2) or str(len(stages))).lower(), base=m.group(1)))
        elif not stages:
            assert op == "ARG", f"only ARG may precede FROM: {line}"
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            stages[-1].instructions.append((op, rest))
    return args, stages


def expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


@pytest.fixture(scope="module")
def dockerfile():
    args, stages = parse(DOCKERFILE.read_text())
    return args, {s.name: s for s in stages}


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    out = [stages[name]]
    while out[-1].base.lower() in stages:
        out.append(stages[out[-1].base.lower()])
    return out


def last(stages: dict[str, Stage], name: str, op: str) -> str | None:
    for stage in chain(stages, name):
        for o, rest in reversed(stage.instructions):
            if o == op:
                return rest
    return None


def root_image(stages, name, args) -> str:
    return expand(chain(stages, name)[-1].base, args)


def test_parser_reads_continuations_and_stages():
    args, stages = parse("ARG A=x:1\nFROM ${A} AS one\nRUN a \\\n  # c\n  && b\n"
                         "FROM one AS two\nUSER 5\n")
    assert args == {"A": "x:1"}
    assert [(s.name, s.base) for s in stages] == [("one", "${A}"), ("two", "one")]
    assert stages[0].instructions == [("RUN", "a  && b")]


def test_every_tier_target_exists(dockerfile):
    _, stages = dockerfile
    assert set(TIERS) <= set(stages)


@pytest.mark.parametrize("tier", TIERS)
def test_target_runs_as_non_root(dockerfile, tier):
    _, stages = dockerfile
    user = last(stages, tier, "USER")
    assert user is not None, f"{tier}: no USER (would run as root)"
    name = user.split(":")[0]
    assert name not in ("root", "0"), f"{tier}: USER {user}"
    # The chart's podSecurityContext runs as 10001; a numeric USER lets runAsNonRoot verify it.
    assert name == "10001"


@pytest.mark.parametrize("tier", TIERS)
def test_entrypoint_is_a_real_specmesh_subcommand(dockerfile, tier):
    _, stages = dockerfile
    entrypoint = last(stages, tier, "ENTRYPOINT")
    assert entrypoint and entrypoint.startswith("["), f"{tier}: ENTRYPOINT must be JSON (exec)"
    argv = json.loads(entrypoint)
    commands = typer.main.get_command(app).commands
    assert argv[0] == "specmesh" and argv[1] in commands, argv
    assert argv == ["specmesh", tier]


def test_only_the_verifier_is_built_on_cuda(dockerfile):
    args, stages = dockerfile
    assert "nvidia/cuda" in root_image(stages, "verifier", args)
    assert "runtime" in root_image(stages, "verifier", args)
    for tier in ("gateway", "drafter"):
        assert "cuda" not in root_image(stages, tier, args).lower(), tier


def _copied_venv_builder(stages, tier) -> Stage:
    for stage in chain(stages, tier):
        for op, rest in stage.instructions:
            if op == "COPY" and "/opt/venv" in rest:
                src = re.search(r"--from=(\S+)", rest).group(1)
                return stages[src]
    raise AssertionError(f"{tier}: no venv copied from a builder")


def test_builds_install_with_constraints_and_regenerate_stubs(dockerfile):
    args, stages = dockerfile
    builders = {t: _copied_venv_builder(stages, t) for t in TIERS}
    torch_index = {t: "" for t in TIERS}
    for tier, builder in builders.items():
        runs = [expand(rest, args) for stage in chain(stages, builder.name)
                for op, rest in stage.instructions if op == "RUN"]
        assert any("python specmesh/protogen.py" in r and "diff" in r for r in runs), tier
        installs = [r for r in runs if re.search(r"pip install .*-c constraints.txt '?\.", r)]
        assert installs, f"{tier}: no `pip install -c constraints.txt .`"
        torch_index[tier] = installs[0]
    assert "whl/cpu" in torch_index["drafter"]
    # The gateway never runs a model: its image has no torch (issue #13).
    assert "whl/" not in torch_index["gateway"] and "--no-deps" in torch_index["gateway"]
    assert "whl/cu" in torch_index["verifier"] and "whl/cpu" not in torch_index["verifier"]


def test_no_latest_base_images(dockerfile):
    args, stages = dockerfile
    for stage in stages.values():
        base = expand(stage.base, args)
        if base.lower() in stages:
            continue
        assert ":" in base and not base.endswith(":latest"), base


def _ignored(patterns: list[str], path: str) -> bool:
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        pat = pat.removeprefix("**/")
        if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path.split("/")[-1], pat) \
                or path.startswith(pat + "/"):
            result = not negate
    return result


def test_dockerignore_excludes_venv_git_and_caches():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in (".venv", ".venv/bin/python", ".git", ".git/HEAD", ".pytest_cache",
                 ".hypothesis", "specmesh/__pycache__", ".cache/specmesh/tiny-pair"):
        assert _ignored(patterns, path), path
    # ... but never what the build COPYs.
    for path in ("pyproject.toml", "constraints.txt", "README.md", "proto/specmesh/v1",
                 "specmesh/cli.py", "services", "gateway", "drafter_svc", "verifier_svc"):
        assert not _ignored(patterns, path), path
    copied = re.findall(r"^COPY (?!--from)(.+?) \S+$", DOCKERFILE.read_text(), re.MULTILINE)
    for sources in copied:
        for src in shlex.split(sources):
            assert (ROOT / src).exists(), src
            assert not _ignored(patterns, src.rstrip("/")), src
