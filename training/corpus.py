"""The demo corpus: the Python standard library's ``.py`` sources, with a fixed held-out split.

Data
----
Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, recursively, except

* test suites: any file inside a directory named ``test``, ``tests`` or ``idle_test``
  (``test/``, ``idlelib/idle_test``, ``lib2to3/tests``, ``unittest/test``, ...),
* ``site-packages`` (third-party code, differs between installations),
* ``config-*`` build directories and the machine-specific ``_sysconfigdata*`` modules,
* ``__pycache__``.

On CPython 3.11 this is ~730 files, ~12 MB (``include_tests=True`` keeps the test suites too:
~1,790 files, ~31 MB).  Files are listed sorted by their POSIX path relative to the stdlib root.

Split rule (fixed, documented, never changes)
---------------------------------------------
A file is **held out** when ``int(blake2b(relpath, digest_size=8).hexdigest(), 16) % 20 == 0``,
where ``relpath`` is the UTF-8 POSIX path relative to the stdlib root (e.g.
``"asyncio/tasks.py"``).  That is ~5% of the files.  Held-out files are never used to train the
tokenizer, the target or a drafter; they are only used to measure loss and acceptance.

Token streams
-------------
Each file is encoded without special tokens and wrapped as ``<s> file </s>``; the files are
concatenated in sorted order into one stream, which is cut into non-overlapping windows of
``seq_len`` tokens.  :class:`WindowSampler` serves batches whose content is a pure function of
``(seed, step)`` so that a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "HELD_OUT_MODULUS",
    "stdlib_root",
    "is_held_out",
    "all_files",
    "train_files",
    "held_out_files",
    "read_texts",
    "split_paths",
    "expand_paths",
    "token_stream",
    "make_windows",
    "WindowSampler",
]

HELD_OUT_MODULUS = 20  # 1 in 20 files (~5%) is held out
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SKIP_DIRS = frozenset({"site-packages", "__pycache__"})
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".jsonl")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str | Path) -> bool:
    """The fixed split rule: blake2b-64 of the POSIX relative path, modulo 20, equals 0."""
    rel = Path(relpath).as_posix()
    digest = hashlib.blake2b(rel.encode("utf-8"), digest_size=8).hexdigest()
    return int(digest, 16) % HELD_OUT_MODULUS == 0


def _keep(rel: Path, include_tests: bool) -> bool:
    dirs = rel.parts[:-1]
    if any(d in _SKIP_DIRS for d in dirs):
        return False
    if dirs and dirs[0].startswith("config-"):
        return False
    if rel.name.startswith("_sysconfigdata"):
        return False
    if not include_tests and any(d in _TEST_DIRS for d in dirs):
        return False
    return True


def all_files(root: Path | None = None, include_tests: bool = False) -> list[Path]:
    """Every corpus file (absolute paths), sorted by relative POSIX path."""
    root = Path(root) if root is not None else stdlib_root()
    rels = sorted(
        (p.relative_to(root) for p in root.rglob("*.py") if p.is_file()),
        key=lambda r: r.as_posix(),
    )
    return [root / r for r in rels if _keep(r, include_tests)]


def train_files(root: Path | None = None, include_tests: bool = False,
                limit: int | None = None) -> list[Path]:
    """The training split (sorted); ``limit`` keeps only the first ``limit`` files."""
    root = Path(root) if root is not None else stdlib_root()
    files = [p for p in all_files(root, include_tests) if not is_held_out(p.relative_to(root))]
    return files[:limit] if limit is not None else files


def held_out_files(root: Path | None = None, include_tests: bool = False,
                   limit: int | None = None) -> list[Path]:
    """The held-out split (sorted); never trained on."""
    root = Path(root) if root is not None else stdlib_root()
    files = [p for p in all_files(root, include_tests) if is_held_out(p.relative_to(root))]
    return files[:limit] if limit is not None else files


def expand_paths(paths: Iterable[str | Path],
                 suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[tuple[Path, str]]:
    """Files given directly, or found recursively in directories (by suffix).

    Returns ``(absolute path, split key)`` pairs, sorted; the split key is the path relative to
    the directory it was found in (or the file name for a file given directly), so that the
    held-out rule gives the same answer wherever the corpus lies.
    """
    out: list[tuple[Path, str]] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                rel = f.relative_to(p)
                if f.is_file() and f.suffix in suffixes and _keep(rel, include_tests=True):
                    out.append((f.resolve(), rel.as_posix()))
        elif p.is_file():
            out.append((p.resolve(), p.name))
        else:
            raise FileNotFoundError(f"corpus path not found: {p}")
    out.sort(key=lambda t: (t[1], str(t[0])))
    return out


def split_paths(paths: Iterable[str | Path]) -> tuple[list[Path], list[Path]]:
    """(train, held_out) files of a user corpus by the same rule as the demo corpus."""
    train, held = [], []
    for f, key in expand_paths(paths):
        (held if is_held_out(key) else train).append(f)
    return train, held


def read_texts(files: Iterable[Path]) -> list[str]:
    return [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]


def token_stream(tokenizer, files: Iterable[Path] | None = None, *,
                 texts: Iterable[str] | None = None) -> np.ndarray:
    """``<s> file_1 </s> <s> file_2 </s> ...`` as one int32 array."""
    if texts is None:
        texts = read_texts(files or [])
    texts = list(texts)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if not texts:
        return np.zeros(0, dtype=np.int32)
    enc = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    parts = []
    for ids in enc:
        head = [bos] if bos is not None else []
        tail = [eos] if eos is not None else []
        parts.append(np.asarray(head + list(ids) + tail, dtype=np.int32))
    return np.concatenate(parts)


def make_windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping ``[n, seq_len]`` windows (the tail shorter than a window is dropped)."""
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"token stream of {len(stream)} tokens is shorter than seq_len={seq_len}")
    return np.ascontiguousarray(stream[: n * seq_len].reshape(n, seq_len))


class WindowSampler:
    """Batches of training windows; batch ``step`` is a pure function of ``(seed, step)``.

    Windows are visited in a seeded random order, epoch after epoch (each epoch a fresh
    permutation derived from ``(seed, epoch)``), so resuming at any step reproduces the data an
    uninterrupted run would have seen, without any sampler state in the checkpoint.
    """

    def __init__(self, windows: np.ndarray, batch_size: int, seed: int):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.windows = windows
        self.batch_size = batch_size
        self.seed = int(seed)
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            if len(self._perm_cache) > 4:
                self._perm_cache.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_cache[epoch] = rng.permutation(len(self.windows))
        return self._perm_cache[epoch]

    def indices(self, step: int) -> list[int]:
        n = len(self.windows)
        start = step * self.batch_size
        out = []
        for k in range(start, start + self.batch_size):
            epoch, pos = divmod(k, n)
            out.append(int(self._perm(epoch)[pos]))
        return out

    def batch(self, step: int):
        import torch

        return torch.from_numpy(self.windows[self.indices(step)].astype(np.int64))

    def epochs(self, steps: int) -> float:
        return steps * self.batch_size / len(self.windows)
