"""`specmesh up` as a supervisor (issue #12 item 3): SIGINT or SIGTERM while the mesh is still
starting stops every process already started (none is left running under PID 1) and removes
the temporary folder `up` made; a SIGKILLed `up` leaves no service running (they watch their
parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from services.local_mesh import free_port
from services.tiny_models import build_tiny_pair

SPECMESH = [sys.executable, "-m", "specmesh.cli"]


def _wait_for_children(up: subprocess.Popen, names: tuple[str, ...], timeout: float) -> list:
    """The children of ``up`` once one runs each of ``names`` (on its command line)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert up.poll() is None, up.stderr.read()
        children = psutil.Process(up.pid).children(recursive=True)
        lines = [_cmdline(c) for c in children]
        if all(any(name in line for line in lines) for name in names):
            return children
        time.sleep(0.05)
    raise AssertionError(f"{names} never all started")


def _cmdline(child: psutil.Process) -> str:
    """A child's command line, "" once it has exited: a short-lived one (the kernel
    library's compiler on a fresh cache) may end, or be a zombie, between the listing and
    the read (a full suite once failed on psutil.ZombieProcess there)."""
    try:
        return " ".join(child.cmdline())
    except psutil.NoSuchProcess:  # (ZombieProcess is one)
        return ""


def _alive(children) -> list:
    alive = []
    for child in children:
        try:
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = build_tiny_pair(tmp_path_factory.mktemp("models") / "tiny")
    return str(target), str(draft)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_stops_everything_started(tmp_path, pair, sig):
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    up = subprocess.Popen([*SPECMESH, "up", "--target", pair[0], "--draft", pair[1],
                           "--port", str(free_port())],
                          stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        children = _wait_for_children(up, ("redis-server", " verifier ", " drafter "), 120)
        assert list(temp.glob("specmesh-*")), "no temporary folder while starting"
        up.send_signal(sig)
        _, err = up.communicate(timeout=60)  # drains stderr while waiting
        code = up.returncode
        assert "SpecMesh is up" not in err, "the signal came too late to test the start-up"
        assert code == 128 + sig, err
        assert "during start-up" in err, err
        time.sleep(0.2)
        assert not _alive(children), [c.cmdline() for c in _alive(children)]
        assert not list(temp.glob("specmesh-*")), "temporary folder left behind"
    finally:
        if up.poll() is None:
            up.kill()
        for child in _alive(locals().get("children", [])):
            child.kill()


@pytest.mark.parametrize("phase", ["start-up", "running"])
def test_sigterm_on_load_stops_the_mesh_it_started(tmp_path, phase):
    """`specmesh load` without --addr starts its own mesh: SIGTERM, while it starts or while
    the streams run, stops it like Ctrl-C does (exit 130), with nothing left behind."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    load = subprocess.Popen([*SPECMESH, "load", "--streams", "1", "--duration", "120"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env)
    children = []
    try:
        names = ("redis-server", " verifier ", " drafter ")
        children = _wait_for_children(load, (*names, " gateway ") if phase == "running"
                                      else names, 240)
        if phase == "running":
            _wait_serving_gateway(children)
        load.send_signal(signal.SIGTERM)
        # communicate drains stderr while waiting: a progress bar filling the pipe would
        # otherwise block the process and look like a hang
        _, err = load.communicate(timeout=60)
        code = load.returncode
        assert code == 130, err
        assert "interrupted" in err and "Traceback" not in err, err
        time.sleep(0.2)
        assert not _alive(children), [c.cmdline() for c in _alive(children)]
        assert not list(temp.glob("specmesh-*")), "temporary folder left behind"
    finally:
        if load.poll() is None:
            load.kill()
        for child in _alive(children):
            child.kill()


def _wait_serving_gateway(children, timeout: float = 120) -> None:
    from services.health import wait_serving

    gateway = next(c for c in children if " gateway " in " ".join(c.cmdline()))
    argv = gateway.cmdline()
    address = f"{argv[argv.index('--host') + 1]}:{argv[argv.index('--port') + 1]}"
    assert wait_serving(address, timeout)


def test_services_stop_by_themselves_when_up_is_killed(tmp_path, pair):
    """SIGKILL gives `up` no chance to stop its children: the gateway, the verifier and the
    drafter see that their parent is gone (--parent-pid, which the local mesh sets) and stop
    as on SIGTERM, instead of serving on unseen beside whatever runs next. Redis, a binary
    of its own, is the one left; the test stops it."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    up = subprocess.Popen([*SPECMESH, "up", "--target", pair[0], "--draft", pair[1],
                           "--port", str(free_port())],
                          stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
    children = []
    try:
        names = (" verifier ", " drafter ", " gateway ")
        children = _wait_for_children(up, ("redis-server", *names), 120)
        _wait_serving_gateway(children)
        services = [c for c in children if any(n in " ".join(c.cmdline()) for n in names)]
        assert len(services) == 3, [c.cmdline() for c in children]
        up.kill()
        up.wait(10)
        deadline = time.monotonic() + 30
        while _alive(services) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(services), [c.cmdline() for c in _alive(services)]
        logs = {p.stem: p.read_text(errors="replace") for p in temp.glob("specmesh-*/*.log")}
        for name in ("gateway", "verifier-0", "drafter-0"):
            assert f"parent process {up.pid} is gone" in logs[name], (name, logs[name][-2000:])
    finally:
        if up.poll() is None:
            up.kill()
        for child in _alive(children):
            child.kill()
