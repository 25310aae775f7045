"""The project's CPU kernels (services/csrc/cpu_kernels.cpp): built with the machine's C++
compiler on first use and loaded as PyTorch operators.

- ``specmesh_cpu::linear``: a linear layer over 16-bit copies of exactly 16-bit float32 weights
  (services/half_linear.py).
- ``specmesh_cpu::argmax``: each row's argmax, torch.argmax's answer (the first largest value,
  or the first NaN), in vector compares. PyTorch's CPU argmax walks a row element by element:
  about 17 us for the demo pair's 8,192 logits, against about 3 us here with the call. A
  verifier takes one per decoded token, so at 16 streams it was a tenth of the model thread's
  time (py-spy; docs/performance.md).
- ``specmesh_cpu::attention``: the attention of a pass's pooled decode and verify rows, each
  row over its own keys only (services/ragged_attention.py; services/csrc/pooled_attention.h).
- ``specmesh_cpu::prefix_attention``: a cascade's shared prefix attended by all of its
  queries at once and merged with what each attended on its own (services/csrc/
  prefix_attention.h, services/ragged_attention.py ``attend``).
- ``specmesh_cpu::rms_norm``: transformers' LlamaRMSNorm of float32 rows in one operator
  (PyTorch's runs six on a CPU: ~40 us a call inside a pass; services/lean_llama.py ``_rms``).
- ``specmesh_cpu::rope_store``: a layer's rotary embedding of its queries and keys (the
  floats of services/rotary.py ``rope``), the split into heads, and the keys' and values'
  writes into their pool slots, in one operator (services/lean_llama.py ``kernel_rope``).

The linear and argmax kernels are compiled for AVX-512 and for AVX2 with F16C and FMA and
picked at run time; the attention, norm and rotary kernels for AVX2 with FMA (the
attention is bound by reading the caches: a 16-lane build was no faster), the attention's
variant that runs two query heads a key load also for AVX-512VL (its 32 registers); the prefix
attention, mostly multiply-adds, for AVX-512 and for AVX2 (the same floats; 16 or 8 lanes).
So the library
suits any x86-64 CPU with AVX2. It is kept in ``cache_dir`` per source, flags and PyTorch
version, or shipped beside the source by an image built with a compiler (``prebuild``).
Without either, or on another CPU, ``kernel`` says why and the callers keep PyTorch's
operators.
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

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
_NO_ISA = "this CPU has neither AVX-512 nor AVX2 with F16C and FMA"


def cache_dir() -> Path:
    """Where the compiled library is kept: ``$XDG_CACHE_HOME/specmesh`` (default ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specmesh" / "kernels"


# -ffp-contract=off: a product and a sum stay two roundings unless the source asks for a
# fused multiply-add (the rotary embedding must give PyTorch's floats)
FLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp")


def sources() -> list[Path]:
    """The files the library is built from: ``SOURCE`` and the headers beside it, which it
    includes."""
    return [SOURCE, *sorted(SOURCE.parent.glob("*.h"))]


def _library_name() -> str:
    """The kernel's file name for this source, its flags and this PyTorch: a new one when any
    changes (the kernels inside are chosen at run time, so the file suits any x86-64 CPU)."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources()) + " ".join(FLAGS).encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    return f"cpu_kernels-{key}.so"


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
        cmd = [compiler, *FLAGS,
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
        torch.ops.specmesh_cpu.isa  # noqa: B018 - registered in this process?
    except (AttributeError, RuntimeError):
        return False
    return True


_ready = False  # this process loaded the library and its CPU runs it (``argmax`` reads it)


def load() -> str:
    """Compiles the kernel (once per source and PyTorch: the file is kept in ``cache_dir``)
    and loads it: "" when it is ready, else why it cannot run here."""
    global _ready
    if not _loaded():  # (a second library of the same operators would abort the process)
        try:
            path = SOURCE.parent / _library_name()  # prebuilt (``prebuild``)
            if not path.exists():
                path = cache_dir() / path.name
                if not path.exists():
                    _compile(path)
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if not torch.ops.specmesh_cpu.isa():
        return _NO_ISA
    _ready = True
    return ""


kernel = functools.cache(load)  # load once per process


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) for float32 CPU logits [rows, V]: the kernel's when it is loaded in
    this process (a replica loads it with its model), else PyTorch's."""
    if _ready and x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu":
        return torch.ops.specmesh_cpu.argmax(x)
    return x.argmax(dim=-1)


if __name__ == "__main__":  # python -m services.cpu_kernels: prebuild (docker/Dockerfile)
    print(prebuild())
