"""What the gateway needs to know of a model without loading it, and without torch: its
description (ModelMeta), its tokenizer and the hash of its vocabulary. services.models
(torch) re-exports these for the drafter and verifier."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelMeta:
    model: str
    fingerprint: str
    vocab_hash: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]


def load_tokenizer(path: str):
    """The model's tokenizer, or None when the path has none (a bare model)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer at %s (%s)", path, exc)
        return None


def vocab_hash(tokenizer) -> str:
    if tokenizer is None:
        return ""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]
