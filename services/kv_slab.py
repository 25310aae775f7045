"""A KV cache written in place: each layer's keys and values live in a buffer with room to
grow, a step writes its new positions into it and rollback is a length change.

transformers' ``DynamicCache`` appends by concatenation, copying a session's whole cache for
every layer at every step; cropping rejected drafts makes the next append copy it again.
This cache copies only when a buffer is full (it then grows by ``chunk`` positions, so a
session holds at most ``chunk - 1`` unused positions per layer) and crops by moving the
length back. Only the lean forward (services/lean_llama.py) uses it: it calls just
``update`` and ``get_seq_length``; the drafter's tree also ``crop``s its branches off. The
micro-batching code (services/batching.py) and the round-loop tests' table model read
``layers[i].keys`` / ``.values``, which are views of the live positions.
"""

from __future__ import annotations

import torch

CHUNK = 256  # positions a full buffer grows by


class SlabLayer:
    def __init__(self, chunk: int = CHUNK) -> None:
        self._chunk = chunk
        self._keys: torch.Tensor | None = None  # [B, KV, capacity, D]
        self._values: torch.Tensor | None = None
        self.length = 0

    @property
    def is_initialized(self) -> bool:
        return self._keys is not None

    @property
    def keys(self) -> torch.Tensor | None:  # [B, KV, length, D], a view
        return None if self._keys is None else self._keys[:, :, :self.length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, :self.length]

    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[2]

    def update(self, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes [B, KV, n, D] new positions after the live ones; returns all live ones."""
        end = self.length + keys.shape[2]
        if end > self.capacity():
            size = -(-end // self._chunk) * self._chunk
            shape = (keys.shape[0], keys.shape[1], size, keys.shape[3])
            grown_k, grown_v = keys.new_empty(shape), values.new_empty(shape)
            if self._keys is not None and self.length:
                grown_k[:, :, :self.length] = self._keys[:, :, :self.length]
                grown_v[:, :, :self.length] = self._values[:, :, :self.length]
            self._keys, self._values = grown_k, grown_v
        self._keys[:, :, self.length:end] = keys
        self._values[:, :, self.length:end] = values
        self.length = end
        return self.keys, self.values


class SlabCache:
    """One ``SlabLayer`` per decoder layer; the interface the lean forward and the batching
    code use, with ``DynamicCache``'s meaning of ``crop``."""

    def __init__(self, num_layers: int, chunk: int = CHUNK) -> None:
        self.layers = [SlabLayer(chunk) for _ in range(num_layers)]

    def update(self, keys: torch.Tensor, values: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer_idx].update(keys, values)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def crop(self, max_length: int) -> None:
        """Keeps ``max_length`` positions, or drops the last ``-max_length`` when negative."""
        for layer in self.layers:
            keep = layer.length + max_length if max_length < 0 else max_length
            layer.length = max(0, min(layer.length, keep))
