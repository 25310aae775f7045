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
    for path in cpu_kernels.sources():
        (source.parent / path.name).write_bytes(path.read_bytes())
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


@pytest.mark.parametrize("heads, kv_heads, d", [(6, 3, 64), (4, 4, 20), (2, 1, 6)])
def test_rope_store_gives_the_rotary_modules_floats_and_writes_each_token_in_its_slot(
        heads, kv_heads, d):
    """``rope_store`` against services/rotary.py ``rope`` and the two cache writes the lean
    forward made: the queries and the written keys the same floats (head sizes with and
    without whole vectors of 8 in a half), the values copied, every other position of the
    buffers untouched."""
    from services import rotary

    g = torch.Generator().manual_seed(d)
    T, S, L = 5, 7, 40
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(T, d, generator=g), torch.randn(T, d, generator=g)
    ssin = rotary.signed(sin)
    keys, values = torch.randn(S, kv_heads, L, d, generator=g), torch.randn(S, kv_heads, L, d, generator=g)
    want_k, want_v = keys.clone(), values.clone()
    slot, pos = torch.tensor([3, 0, 6, 2, 3]), torch.tensor([0, 39, 7, 11, 1])
    qk = rotary.rope(qkv[:, :(heads + kv_heads) * d].view(T, heads + kv_heads, d),
                     cos[:, None], ssin[:, None])
    want_k[slot, :, pos] = qk[:, heads:]
    want_v[slot, :, pos] = qkv[:, (heads + kv_heads) * d:].view(T, kv_heads, d)
    q = torch.ops.specmesh_cpu.rope_store(qkv, cos, ssin, heads, kv_heads, keys, values,
                                          slot, pos)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


@pytest.mark.parametrize("change, message", [
    ({"pos": torch.tensor([40])}, "out of range"),
    ({"slot": torch.tensor([-1])}, "out of range"),
    ({"qkv": torch.randn(1, 10)}, r"\[T, \(H \+ 2 KV\) D\]"),
    ({"cos": torch.randn(2, 8)}, r"\[T, D\]"),
    ({"keys": torch.randn(2, 1, 40, 8).transpose(0, 1)}, "contiguous"),
])
def test_rope_store_refuses_what_would_write_out_of_its_buffers(change, message):
    args = {"qkv": torch.randn(1, 4 * 8), "cos": torch.randn(1, 8), "ssin": torch.randn(1, 8),
            "keys": torch.zeros(2, 1, 40, 8), "values": torch.zeros(2, 1, 40, 8),
            "slot": torch.tensor([1]), "pos": torch.tensor([3])}
    args.update(change)
    if "keys" in change:
        args["values"] = torch.zeros(change["keys"].shape)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specmesh_cpu.rope_store(args["qkv"], args["cos"], args["ssin"], 2, 1,
                                          args["keys"], args["values"], args["slot"],
                                          args["pos"])
