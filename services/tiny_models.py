"""Deterministic tiny target/draft model pair for tests and the local demo.

Everything is built locally (no model hub access is needed):

* :func:`build_tokenizer` trains a small byte-level BPE tokenizer on a fixed,
  sorted subset of the Python standard library sources and saves it as a
  ``transformers`` fast tokenizer.
* :func:`build_tiny_pair` builds a tiny random Llama "target" model and a
  1-layer "draft" model derived from it (shared vocabulary), and saves both so
  that ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``
  can load them back.

Design notes
------------
* Random tiny models have nearly flat logits (std ~0.16 with the default
  init), which makes sampling close to uniform and greedy choices fragile.
  The target's ``lm_head`` is rescaled so that logits have a standard
  deviation of ~4 (see ``_LOGIT_STD``): softmax distributions are peaky and the
  top-1/top-2 logit gap is ~0.9 in the median (~7% of the max |logit|).  fp32
  differences between a batched forward and a token-by-token cached forward
  are ~5e-7 of the max |logit|, so greedy decoding is the same either way
  (tests/test_tiny_models.py checks this, including a chunked speculative
  verifier with KV-cache cropping).
* The draft copies the target's embeddings, first decoder layer, final norm and
  ``lm_head`` and perturbs the ``lm_head`` with seeded noise, so it agrees with
  the target's greedy choice only part of the time (~43% of positions on
  stdlib text for seed 0).
* Builds are deterministic for a given ``seed``/``vocab_size`` (and Python
  stdlib, which provides the tokenizer corpus) and are cached: a directory that
  already holds a complete pair built with the same parameters is reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "UNK_TOKEN",
    "MARKER_NAME",
    "build_tokenizer",
    "build_tiny_pair",
    "corpus_files",
    "load_corpus",
]

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]

MARKER_NAME = "specmesh_tiny.json"
# Bump when the build recipe changes so that stale caches are rebuilt.
_FORMAT_VERSION = 1

_CORPUS_MAX_FILES = 40
_CORPUS_MAX_BYTES = 2 * 1024 * 1024

# Target architecture.
_TARGET_ARCH = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
)
_DRAFT_LAYERS = 1
# Target lm_head is rescaled so that logits have roughly this std (the final
# RMSNorm makes the hidden state ~unit variance per dimension).
_LOGIT_STD = 4.0
# Draft lm_head = target lm_head + noise with this std relative to the
# target lm_head's own std.
_DRAFT_NOISE_REL = 0.2
_DRAFT_SEED_OFFSET = 1_000_003

_REQUIRED_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------
def corpus_files() -> list[Path]:
    """The fixed, sorted subset of stdlib ``.py`` files used as corpus."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(
        p.name
        for p in stdlib.iterdir()
        if p.suffix == ".py"
        and p.is_file()
        # machine-specific build data: not deterministic across installs
        and not p.name.startswith("_sysconfigdata")
    )
    files: list[Path] = []
    total = 0
    for name in names:
        if len(files) >= _CORPUS_MAX_FILES:
            break
        path = stdlib / name
        size = path.stat().st_size
        if total + size > _CORPUS_MAX_BYTES:
            continue
        files.append(path)
        total += size
    if not files:  # pragma: no cover - every CPython install has a stdlib
        raise RuntimeError(f"no stdlib .py sources found under {stdlib}")
    return files


def load_corpus() -> list[str]:
    """Corpus texts (one string per file), decoded as UTF-8."""
    return [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files()]


def _corpus_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------
def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(
            f"vocab_size must be > {256 + len(SPECIAL_TOKENS)} (byte alphabet + special tokens)"
        )
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # add_prefix_space=False keeps decode(encode(s)) == s.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        # no dedicated pad token: padding (if any) uses eos, like Llama
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=_TARGET_ARCH["max_position_embeddings"],
        padding_side="left",
    )


def build_tokenizer(out_dir: Path, vocab_size: int = 512):
    """Train the byte-level BPE tokenizer and ``save_pretrained`` it to *out_dir*.

    Returns the ``PreTrainedTokenizerFast``.  ``tokenizer("text")`` prepends
    ``<s>``; ``decode`` round-trips arbitrary UTF-8.
    """
    out_dir = Path(out_dir)
    tokenizer = _wrap_tokenizer(_train_tokenizer(load_corpus(), vocab_size))
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------
def _make_configs(tokenizer):
    from transformers import LlamaConfig

    common = dict(
        _TARGET_ARCH,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    target_cfg = LlamaConfig(**common)
    draft_cfg = LlamaConfig(**dict(common, num_hidden_layers=_DRAFT_LAYERS))
    return target_cfg, draft_cfg


def _generation_config(tokenizer):
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )


def _build_models(tokenizer, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    target_cfg, draft_cfg = _make_configs(tokenizer)
    # Do not disturb the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = LlamaForCausalLM(target_cfg)
        draft = LlamaForCausalLM(draft_cfg)  # weights overwritten below
    target.eval()
    draft.eval()

    with torch.no_grad():
        # Peaky logits: rescale lm_head so logits have std ~_LOGIT_STD.
        w = target.lm_head.weight
        hidden = w.shape[1]
        w.mul_(_LOGIT_STD / (w.std() * hidden**0.5))

    tsd = target.state_dict()
    dsd = {}
    for name in draft.state_dict():
        if name not in tsd:  # pragma: no cover - same architecture prefix
            raise RuntimeError(f"draft parameter {name} has no target counterpart")
        dsd[name] = tsd[name].detach().clone()
    gen = torch.Generator().manual_seed(seed + _DRAFT_SEED_OFFSET)
    w = dsd["lm_head.weight"]
    noise = torch.randn(w.shape, generator=gen, dtype=w.dtype)
    dsd["lm_head.weight"] = w + noise * (w.std() * _DRAFT_NOISE_REL)
    draft.load_state_dict(dsd, strict=True)

    target.generation_config = _generation_config(tokenizer)
    draft.generation_config = _generation_config(tokenizer)
    return target, draft


def _marker(seed: int, vocab_size: int, corpus_digest: str) -> dict:
    return {
        "format": _FORMAT_VERSION,
        "seed": int(seed),
        "vocab_size": int(vocab_size),
        "corpus_sha256": corpus_digest,
        "target_arch": dict(_TARGET_ARCH),
        "draft_layers": _DRAFT_LAYERS,
        "logit_std": _LOGIT_STD,
        "draft_noise_rel": _DRAFT_NOISE_REL,
    }


def _is_complete(out_dir: Path, marker: dict) -> bool:
    try:
        found = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if found != marker:
        return False
    return all(
        (out_dir / sub / f).is_file() for sub in ("target", "draft") for f in _REQUIRED_MODEL_FILES
    )


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """Inter-process lock so concurrent builders don't clobber each other."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    fd = os.open(out_dir / ".specmesh_tiny.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def build_tiny_pair(out_dir: Path, seed: int = 0, vocab_size: int = 512) -> tuple[Path, Path]:
    """Build (or reuse) the tiny target/draft pair under *out_dir*.

    Returns ``(out_dir / "target", out_dir / "draft")``.  Both directories hold
    a ``LlamaForCausalLM`` (safetensors), its generation config and the same
    tokenizer.  If *out_dir* already holds a complete pair built with the same
    parameters (see ``specmesh_tiny.json``), nothing is rebuilt.
    """
    out_dir = Path(out_dir)
    target_dir, draft_dir = out_dir / "target", out_dir / "draft"
    texts = load_corpus()
    marker = _marker(seed, vocab_size, _corpus_digest(texts))
    if _is_complete(out_dir, marker):
        return target_dir, draft_dir

    out_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        if _is_complete(out_dir, marker):  # built by a concurrent process
            return target_dir, draft_dir
        tokenizer = _wrap_tokenizer(_train_tokenizer(texts, vocab_size))
        target, draft = _build_models(tokenizer, seed)

        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir))
        try:
            for name, model in (("target", target), ("draft", draft)):
                d = staging / name
                model.save_pretrained(str(d), safe_serialization=True)
                tokenizer.save_pretrained(str(d))
            # Invalidate the old marker first, then swap directories in.
            (out_dir / MARKER_NAME).unlink(missing_ok=True)
            for name in ("target", "draft"):
                dest = out_dir / name
                if dest.is_dir() and not dest.is_symlink():
                    shutil.rmtree(dest)
                elif dest.exists() or dest.is_symlink():
                    dest.unlink()
                os.replace(staging / name, dest)
            tmp_marker = staging / MARKER_NAME
            tmp_marker.write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            os.replace(tmp_marker, out_dir / MARKER_NAME)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target_dir, draft_dir


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - CLI helper
    import argparse

    ap = argparse.ArgumentParser(description="Build the SpecMesh tiny target/draft pair.")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=512)
    args = ap.parse_args(argv)
    t, d = build_tiny_pair(args.out_dir, seed=args.seed, vocab_size=args.vocab_size)
    print(f"target: {t}\ndraft:  {d}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
