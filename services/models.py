"""Loading HF causal LMs and describing them (fingerprints, vocabulary, limits)."""

from __future__ import annotations

import hashlib
import logging

import torch

from services.model_info import ModelMeta, load_tokenizer, vocab_hash  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def device_problem(name: str) -> str:
    """Why the device ``name`` (auto, cpu or cuda[:N]) cannot hold a model on this machine,
    "" when it can: a service or bench asked for CUDA where PyTorch has none would otherwise
    die with a traceback while loading its model."""
    if not name.startswith("cuda"):
        return ""
    try:
        index = torch.device(name).index
    except RuntimeError:
        return f"{name!r} is not a device: use auto, cpu or cuda[:N]"
    if not torch.cuda.is_available():
        return f"{name}: this PyTorch sees no CUDA device; use auto or cpu"
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        return f"{name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
    return ""


def load_causal_lm(path: str, device: torch.device, dtype: str = "float32") -> torch.nn.Module:
    """Loads a causal LM by hub name or local path, in eval mode without gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def eos_token_ids(generation_config, config) -> tuple[int, ...]:
    """EOS ids as HF generate uses them: generation_config first, then config."""
    for source in (generation_config, config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


def max_context(config) -> int:
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def fingerprint(model) -> str:
    """Hash of the config and every parameter's name, shape, dtype and sum."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, param in model.state_dict().items():
            h.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
            h.update(f"{float(param.double().sum()):.6e}".encode())
    return h.hexdigest()[:16]


def describe(name: str, model, tokenizer) -> ModelMeta:
    return ModelMeta(
        model=name,
        fingerprint=fingerprint(model),
        vocab_hash=vocab_hash(tokenizer),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        max_context=max_context(model.config),
        eos_token_ids=eos_token_ids(getattr(model, "generation_config", None), model.config),
    )


def load_for_serving(path: str, device_name: str, dtype: str, threads: int,
                     forward: str = "auto"):
    """Loads model and tokenizer, runs one warm-up forward; returns (model, meta, device).
    ``forward`` "auto" runs supported models with the lean forward (services/lean_llama.py)
    and, on a CPU, 16-bit copies of exactly 16-bit weights and the others prepacked;
    "packed" every weight prepacked; "lean" none; "hf" with transformers'."""
    from services.lean_llama import lean_forward, packing_unavailable

    if threads > 0:
        torch.set_num_threads(threads)
    device = resolve_device(device_name)
    model = load_causal_lm(path, device, dtype)
    tokenizer = load_tokenizer(path)
    meta = describe(path, model, tokenizer)
    model, why_not = lean_forward(model, forward)
    if why_not:
        how = f"transformers' forward ({why_not})"
    elif model.packed:
        how = (f"the lean forward; 16-bit weight copies: {model.half_weights}; "
               "the other weights prepacked")
    elif forward == "lean":
        how = "the lean forward (--forward lean: PyTorch's matmuls)"
    else:
        how = f"the lean forward, weights not prepacked ({packing_unavailable(model.hf.lm_head.weight)})"
    if not why_not and model.graphs is not None:
        how += "; decode and verify passes as CUDA graphs"
    log.info("%s runs with %s", path, how)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=device))
    log.info("loaded %s on %s: vocab %d, context %d, fingerprint %s", path, device,
             meta.vocab_size, meta.max_context, meta.fingerprint)
    return model, meta, device


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token occupies in the KV cache, over all layers."""
    c = model.config
    heads = getattr(c, "num_attention_heads", 1)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    dtype_bytes = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def describe_without_weights(path: str) -> ModelMeta:
    """A model's vocabulary and limits from its config and tokenizer, without its weights
    (for drafters that need no model, such as the n-gram drafter)."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    tokenizer = load_tokenizer(path)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = None
    return ModelMeta(
        model=path,
        fingerprint=hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        vocab_hash=vocab_hash(tokenizer),
        vocab_size=int(config.vocab_size),
        max_context=max_context(config),
        eos_token_ids=eos_token_ids(generation_config, config))
