"""Build the demo TARGET: a byte-level BPE tokenizer + a Llama model trained from scratch on the
training split of the standard library's ``.py`` sources (see ``training.corpus``).

    python -m training.demo --out models/demo-target            # ~2 h on a 2-core CPU
    python -m training.demo --out models/demo-target --resume   # continue an interrupted run

Layout of ``--out``: the model (``save_pretrained``, safetensors), the tokenizer, a
``generation_config.json`` with bos/eos, and ``training_report.json`` (sizes, steps, tokens,
losses, time, sha256 of the weights). Checkpoints and the cached token streams live in
``--work-dir`` (default ``<out>.work``), not next to the weights.

Determinism: the tokenizer is trained on the sorted training files; the model is initialised
from ``seed``; batch ``step`` is a pure function of ``(seed, step)``; a resumed run restores
model, optimizer, step and RNG state.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from training import corpus
from training.loop import sha256_file, train

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [BOS, EOS, UNK]


@dataclass
class TargetConfig:
    """Defaults: ~30M parameters, sized for ~2 h of bf16 training on a 2-core CPU
    (see docs/models.md for the measured throughput behind the estimate)."""
    vocab_size: int = 8192
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1408
    max_positions: int = 1024
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 2400
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16: str = "auto"  # on | off | auto (on only where bf16 is faster than fp32)
    seed: int = 0
    eval_every: int = 200
    eval_windows: int = 32
    ckpt_every: int = 100


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int = 1024):
    """Byte-level BPE (``<s>``, ``</s>``, ``<unk>``), ``<s>`` prepended, ByteLevel decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be > {256 + len(SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=EOS,
        clean_up_tokenization_spaces=False, model_max_length=model_max_length,
        padding_side="left")


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------
def llama_config(cfg: TargetConfig, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_positions,
        rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def generation_config(tokenizer):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, do_sample=False)


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


@torch.inference_mode()
def mean_loss(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    total, n = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids = windows[i:i + batch_size]
        total += float(lm_loss(model, ids)) * len(ids)
        n += len(ids)
    return total / max(1, n)


def save_model(model, tokenizer, out_dir: Path, dtype: str = "float32") -> list[str]:
    """save_pretrained (safetensors) + tokenizer; returns the weight files' names."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("model*.safetensors"):
        old.unlink()
    to_save = model
    if dtype != "float32":
        import copy

        to_save = copy.deepcopy(model).to(getattr(torch, dtype))
    to_save.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return sorted(p.name for p in out_dir.glob("model*.safetensors"))


def weights_sha256(out_dir: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(Path(out_dir).glob("model*.safetensors"))}


# --------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------
def prepare_data(tokenizer, work_dir: Path, train_list, held_list, seq_len: int):
    """Token streams of both splits, cached as .npy in ``work_dir`` (keyed by file list)."""
    import hashlib

    out = []
    for name, files in (("train", train_list), ("held_out", held_list)):
        key = hashlib.sha256(("\n".join(map(str, files)) + str(len(tokenizer))).encode())
        cache = Path(work_dir) / f"{name}-{key.hexdigest()[:12]}.npy"
        if cache.exists():
            stream = np.load(cache)
        else:
            stream = corpus.token_stream(tokenizer, files)
            np.save(cache, stream)
        out.append(stream)
    return out[0], out[1]


def build_target(out_dir: Path, cfg: TargetConfig | None = None, *, work_dir: Path | None = None,
                 train_list=None, held_list=None, resume: bool = False,
                 max_minutes: float | None = None, stop_after: int | None = None,
                 save_dtype: str = "float32", show_progress: bool = True,
                 include_tests: bool = False, log=print) -> dict:
    """Train tokenizer + target and save them to ``out_dir``; returns the training report.

    ``train_list``/``held_list`` default to the stdlib split (tests pass small subsets).
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    cfg = cfg or TargetConfig()
    out_dir = Path(out_dir)
    work_dir = Path(work_dir) if work_dir is not None else out_dir.with_name(out_dir.name + ".work")
    work_dir.mkdir(parents=True, exist_ok=True)
    train_list = corpus.train_files(include_tests=include_tests) if train_list is None else train_list
    held_list = corpus.held_out_files(include_tests=include_tests) if held_list is None else held_list
    overlap = set(map(str, train_list)) & set(map(str, held_list))
    if overlap:
        raise ValueError(f"train and held-out files overlap: {sorted(overlap)[:3]}")
    t_start = time.perf_counter()

    tok_dir = work_dir / "tokenizer"
    if resume and (tok_dir / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    else:
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(corpus.read_texts(train_list), cfg.vocab_size,
                                    cfg.max_positions)
        tokenizer.save_pretrained(str(tok_dir))
        log(f"tokenizer: {len(tokenizer)} tokens, trained in {time.perf_counter() - t0:.1f}s")
    train_stream, held_stream = prepare_data(tokenizer, work_dir, train_list, held_list,
                                             cfg.seq_len)
    sampler = corpus.WindowSampler(corpus.make_windows(train_stream, cfg.seq_len),
                                   cfg.batch_size, cfg.seed)
    held = torch.from_numpy(corpus.make_windows(held_stream, cfg.seq_len)[:cfg.eval_windows]
                            .astype(np.int64))

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(llama_config(cfg, tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.1f}M params; train {len(train_stream):,} tokens "
        f"({len(train_list)} files), held-out {len(held_stream):,} tokens ({len(held_list)} "
        f"files); {cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} = "
        f"{sampler.epochs(cfg.steps):.2f} epochs")
    initial_held = mean_loss(model, held)

    res = train(model, lambda step: lm_loss(model, sampler.batch(step)), steps=cfg.steps,
                lr=cfg.lr, warmup=cfg.warmup, weight_decay=cfg.weight_decay,
                grad_clip=cfg.grad_clip, bf16=cfg.bf16, ckpt_dir=work_dir,
                ckpt_every=cfg.ckpt_every, resume=resume, seed=cfg.seed,
                eval_fn=lambda: mean_loss(model, held), eval_every=cfg.eval_every,
                max_minutes=max_minutes, stop_after=stop_after,
                tokens_per_step=cfg.batch_size * cfg.seq_len, desc="target",
                show_progress=show_progress, log=log)
    final_held = mean_loss(model, held)
    model.generation_config = generation_config(tokenizer)
    files = save_model(model, tokenizer, out_dir, save_dtype)
    last = [res.losses[s] for s in sorted(res.losses)[-20:]]
    report = {
        "config": asdict(cfg), "params": n_params, "save_dtype": save_dtype,
        "bf16": res.bf16, "steps_done": res.step, "finished": res.step >= cfg.steps,
        "tokens_seen": res.step * cfg.batch_size * cfg.seq_len,
        "epochs": sampler.epochs(res.step), "train_tokens": int(len(train_stream)),
        "held_out_tokens": int(len(held_stream)), "train_files": len(train_list),
        "held_out_files": len(held_list), "split_rule": "blake2b-64(relpath) % 20 == 0",
        "initial_held_out_loss": initial_held, "final_held_out_loss": final_held,
        "first_train_loss": res.losses[min(res.losses)] if res.losses else None,
        "final_train_loss": float(np.mean(last)) if last else None,
        "held_out_curve": res.evals,
        "train_seconds_this_run": res.seconds,
        "tokens_per_second_this_run": (res.step - res.start_step) * cfg.batch_size
        * cfg.seq_len / max(res.seconds, 1e-9),
        "wall_seconds_this_run": time.perf_counter() - t_start,
        "torch_threads": torch.get_num_threads(), "weights": files,
        "sha256": weights_sha256(out_dir),
    }
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"held-out loss {initial_held:.3f} -> {final_held:.3f}; saved to {out_dir}")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Train the SpecMesh demo target on the stdlib.")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work-dir", type=Path, default=None)
    d = TargetConfig()
    for name, value in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            ap.add_argument(flag, type=type(value), default=value)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop after this many steps (the schedule still spans --steps)")
    ap.add_argument("--save-dtype", default="float32",
                    choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--include-tests", action="store_true",
                    help="also train on the stdlib test suites (~2.6x more data)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TargetConfig(**{k: getattr(args, k) for k in asdict(d)})
    build_target(args.out, cfg, work_dir=args.work_dir, resume=args.resume,
                 max_minutes=args.max_minutes, stop_after=args.stop_after,
                 save_dtype=args.save_dtype, show_progress=not args.no_progress,
                 include_tests=args.include_tests)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
