"""Linear layers over 16-bit copies of float32 weights whose values are 16-bit numbers.

A replica's decode and verify passes carry a few rows each, so their linear layers read every
weight once and do little else with it: on a CPU they are bound by memory traffic, not
arithmetic. Checkpoints are usually saved in float16 or bfloat16 (the demo pair in float16)
and loaded as float32 for exact serving, so each float32 weight is a 16-bit number widened.
Stored in those 16 bits and widened again inside the kernel, the weights give the same
products in float32 and sums in float32: the same linear layer, at half the traffic. A weight
is used this way only when it is exactly representable (``exact_dtype``).

The kernel (services/csrc/half_linear.cpp, AVX-512 or AVX2 chosen at run time) sums each
output over the input features in order in one float32 accumulator, so a row's result does not
depend on the batch it is in or the threads that run it; its sums are ordered differently from
oneDNN's, so logits differ from the prepacked float32 path by about as much as that path's
differ from transformers' (~1e-5; the tests bound both). It is compiled on first use with the
machine's C++ compiler against the installed PyTorch and cached (``cache_dir``), unless an
image shipped it prebuilt (``prebuild``); without either, or on a CPU with neither AVX-512 nor
AVX2, the replica keeps its float32 weights and says why in its log (``kernel``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "half_linear.cpp"
ROWS_MAX = 32  # a call over more rows (a prompt's) runs on the float32 weights
BLOCK, PAD = 16, 32  # the layout's output block, and N's padding (csrc/half_linear.cpp)


def cache_dir() -> Path:
    """Where the compiled kernel is kept: ``$XDG_CACHE_HOME/specmesh`` (default ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specmesh" / "kernels"


def _library_name() -> str:
    """The kernel's file name for this source and this PyTorch: a new one when either changes
    (the kernels inside are chosen at run time, so the file suits any x86-64 CPU)."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    return f"half_linear-{key}.so"


def prebuild() -> Path:
    """Compiles the kernel beside its source, where ``load`` looks first: an image built
    with a compiler runs it without one (docker/Dockerfile)."""
    path = SOURCE.parent / _library_name()
    _compile(path)
    return path


def _compile(out: Path) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    lib = Path(torch.__file__).parent / "lib"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        cmd = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{p}" for p in cpp_extension.include_paths()), str(SOURCE), "-o", str(built),
               f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines()
            raise RuntimeError(f"compiling {SOURCE.name} failed: {(lines or ['?'])[0].strip()}")
        os.replace(built, out)  # atomic: a process racing this one loads either copy whole


def _loaded() -> bool:
    try:
        torch.ops.specmesh_half.isa  # noqa: B018 - registered in this process?
    except (AttributeError, RuntimeError):
        return False
    return True


def load() -> str:
    """Compiles the kernel (once per source and PyTorch: the file is kept in ``cache_dir``)
    and loads it: "" when it is ready, else why it cannot run here."""
    if _loaded():
        return ""  # (a second library of the same operators would abort the process)
    try:
        path = SOURCE.parent / _library_name()  # prebuilt (``prebuild``)
        if not path.exists():
            path = cache_dir() / path.name
            if not path.exists():
                _compile(path)
        torch.ops.load_library(str(path))
        isa = torch.ops.specmesh_half.isa()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return "" if isa else "this CPU has neither AVX-512 nor AVX2 with F16C and FMA"


kernel = functools.cache(load)  # load once per process


def exact_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """float16 or bfloat16 when every value of the float32 ``weight`` is exactly one, else
    None (float16 first: more mantissa, so it holds more checkpoints' values)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    for dtype in (torch.float16, torch.bfloat16):
        if torch.equal(weight.to(dtype).to(torch.float32), weight):
            return dtype
    return None


def blocks(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's layout of ``weight`` [N, K]: [NB, K, 16] in ``dtype``, N padded with zeros
    to a multiple of 32."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // PAD) * PAD, k, dtype=dtype)
    padded[:n] = weight.to(dtype)
    return padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, weight_blocks: torch.Tensor, n: int, isa: str = "") -> torch.Tensor:
    """x [..., K] float32 @ W.T for W in ``blocks``' layout: [..., n] float32. ``isa``: "" for
    the best kernel this CPU runs, "avx2" for that one (the tests compare them)."""
    return torch.ops.specmesh_half.linear(x, weight_blocks, n, isa)


if __name__ == "__main__":  # python -m services.half_linear: prebuild (docker/Dockerfile)
    print(prebuild())
