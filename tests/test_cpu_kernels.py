"""The CPU kernels' build and load (services/cpu_kernels.py) and the row argmax.

The library is compiled with this machine's C++ compiler on first use, as a replica does; on
these machines it must build and run (a CPU with AVX2 at least).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services import cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def kernel_ready():
    assert cpu_kernels.kernel() == ""


def _rows_with_ties_nans_and_infinities() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8192, generator=g)
    x[0, 90] = float("nan")
    x[0, 3] = 50.0  # a NaN after the largest number: the NaN is the answer
    x[1] = float("-inf")  # every value equal: the first
    x[2, 7] = float("inf")
    x[3, 8191] = float("nan")  # the last element
    x[4, 5000] = x[4, 6000] = 1e9  # a tie: the first
    x[5, :] = 1.0
    x[6, 8190:] = 1e9  # in the scalar tail
    x[7, 17] = float("nan")
    x[7, 9] = float("nan")
    return x


@pytest.mark.parametrize("isa", ["", "avx2"])
def test_argmax_is_torch_argmax_on_ties_nans_and_infinities(isa):
    if isa == "avx2" and torch.ops.specmesh_cpu.isa() != "avx512":
        pytest.skip("the CPU's own kernel is the AVX2 one: the default case covers it")
    x = _rows_with_ties_nans_and_infinities()
    assert torch.equal(torch.ops.specmesh_cpu.argmax(x, isa), x.argmax(dim=-1))
    for n in (1, 7, 8, 9, 15, 16, 17, 33):  # rows shorter than a vector, and tails
        y = torch.randn(5, n, generator=torch.Generator().manual_seed(n))
        y[1, n // 2] = float("nan")
        assert torch.equal(torch.ops.specmesh_cpu.argmax(y, isa), y.argmax(dim=-1))


def _calls(op: str, fn) -> int:
    """How many times ``fn()`` ran the operator ``op`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == op)


def test_argmax_helper_falls_back_to_torch_for_what_the_kernel_does_not_take():
    x = _rows_with_ties_nans_and_infinities()
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(dim=-1))
    assert _calls("specmesh_cpu::argmax", lambda: cpu_kernels.argmax(x)) == 1  # the kernel's
    assert _calls("specmesh_cpu::argmax", lambda: cpu_kernels.argmax(x.double())) == 0
    assert torch.equal(cpu_kernels.argmax(x[:3].double()), x[:3].argmax(dim=-1))
    assert torch.equal(cpu_kernels.argmax(x[0]), x[0].argmax(dim=-1))  # one row, 1-D
    assert torch.equal(cpu_kernels.argmax(x[:, ::2]), x[:, ::2].argmax(dim=-1))  # strided
    with pytest.raises(RuntimeError, match="float32 \\[rows, V\\]"):
        torch.ops.specmesh_cpu.argmax(torch.ones(2, 0))


def _load_elsewhere(tmp_path, env: dict[str, str], prebuild: bool = False) -> str:
    """``load()``'s answer in a fresh Python process (a process that loaded the kernel keeps
    it) whose source is a copy in ``tmp_path``: no prebuilt file beside it unless asked."""
    source = tmp_path / "csrc" / cpu_kernels.SOURCE.name
    source.parent.mkdir(exist_ok=True)
    source.write_bytes(cpu_kernels.SOURCE.read_bytes())
    code = ("import sys; from pathlib import Path; from services import cpu_kernels as h; "
            f"h.SOURCE = Path({str(source)!r}); "
            + ("h.prebuild(); " if prebuild else "")
            + "print(repr(h.load()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env},
                          timeout=240, check=True)
    return done.stdout.strip()


def test_a_failed_build_is_reported_not_raised(tmp_path):
    """Without a working compiler the replica keeps float32 weights and says why."""
    reason = _load_elsewhere(tmp_path, {"CXX": "false"})  # a "compiler" that fails
    assert "compiling cpu_kernels.cpp failed" in reason
    assert not list((tmp_path / "cache").rglob("*.so"))  # no half-built file left
    assert "no-such-compiler" in _load_elsewhere(
        tmp_path, {"CXX": str(tmp_path / "no-such-compiler")})


def test_a_prebuilt_kernel_beside_the_source_is_loaded_without_a_compiler(tmp_path):
    """An image compiles the kernel at build time (``prebuild``, docker/Dockerfile) and runs
    without a compiler: ``load`` takes the file beside the source and compiles nothing."""
    assert _load_elsewhere(tmp_path, {}, prebuild=True) == "''"
    assert list((tmp_path / "csrc").glob("cpu_kernels-*.so"))
    assert _load_elsewhere(tmp_path, {"CXX": "false"}) == "''"  # compiling would fail
    assert not list((tmp_path / "cache").rglob("*.so"))
