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

On a CPU a cache can live in a slot of a ``KVPool``: per layer, the slots' keys (and values)
are rows of one buffer [slots, KV, slot_len, D], so a pass over many sessions reads and
writes all of their caches with one call per layer (services/ragged_attention.py) instead
of one per session. A pooled cache behaves as any other; one that outgrows its slot moves to
a buffer of its own (the slot is then no longer read), and the slot returns to the pool when
the cache is garbage (``weakref.finalize``: a slot is never handed out while a cache that
may still write it lives) or moves out of it (``leave_pool``: a session at rest makes room
for a new one, services/kv_cache.py).
"""

from __future__ import annotations

import heapq
import threading
import weakref
from collections import deque

import torch

CHUNK = 256  # positions a full buffer grows by
AHEAD = 64  # positions of a pool slot made to hold numbers at a time (KVPool.ready)
POOL_SEGMENT = 16  # slots allocated together on an accelerator (its memory taken at once)
# On a CPU (address space, not memory, until written), 64: the slots a pass reads in one call
# per layer. Sessions that end give their slots back a little after the next ones began (the
# gateway frees caches after the response), so at 16 streams 17-27 slots were in use at times
# and, with segments of 16, half of a verifier's passes straddled two segments: a call per
# segment each, the layer loop where one operator would do (demo target, 16 sessions behind
# 800 shared positions: 8.1-8.7 ms a pass over two segments of 16, 6.4 over slots 0-26 of
# one of 64; docs/performance.md, 2026-11-29)
POOL_SEGMENT_CPU = 64
POOL_MAX_SLOTS = 256  # a replica lowers it to its --max-sessions and --kv-budget-mb
POOL_MEMORY_SHARE = 0.5  # of an accelerator's memory free after the weights, at most


def pool_slots(device: torch.device, slot_bytes: int, free_bytes: int | None) -> int:
    """How many KV pool slots a model on ``device`` may hold. On a CPU ``POOL_MAX_SLOTS``:
    ``torch.empty`` takes address space there and a page is backed once a cache writes it.
    On an accelerator a segment's memory is taken at once, whatever its sessions hold: as
    many slots as ``POOL_MEMORY_SHARE`` of the memory free after the weights (``free_bytes``)
    holds, so that sessions beyond them, prefills and activations still fit (a session
    without a slot has a cache of its own, as before pools). 0 (no pool) where the free
    memory is not known."""
    if device.type == "cpu":
        return POOL_MAX_SLOTS
    if not free_bytes or slot_bytes <= 0:
        return 0
    return min(POOL_MAX_SLOTS, int(free_bytes * POOL_MEMORY_SHARE) // slot_bytes)


def pool_segment(device: torch.device, slots: int) -> int:
    """The slots of a pool segment on ``device`` (``POOL_SEGMENT_CPU`` on a CPU,
    ``POOL_SEGMENT`` elsewhere), at most ``slots``."""
    return min(POOL_SEGMENT_CPU if device.type == "cpu" else POOL_SEGMENT, slots)


def free_memory(device: torch.device) -> int | None:
    """Bytes free on a CUDA device (None elsewhere: the CPU's pages are taken as written)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


class KVPool:
    """Slots of ``slot_len`` KV positions for every layer, allocated ``segment`` slots at a
    time up to ``max_slots``: segment s holds, per layer, keys and values [segment, KV,
    slot_len, D]. ``torch.empty`` on the CPU takes address space, not memory: a page is
    backed once a cache writes it, so slots cost what their sessions actually held at most.
    The lowest free slot goes first, which keeps the slots of the running sessions close
    together (a pass reads the span between its lowest and highest slot)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, slot_len: int,
                 segment: int = 16, max_slots: int = 256, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", scratch: bool = False) -> None:
        if slot_len < 1 or segment < 1 or max_slots < 1:
            raise ValueError("slot_len, segment and max_slots must be >= 1")
        self.num_layers, self.slot_len, self.segment = num_layers, slot_len, segment
        # ``scratch``: each segment's buffers get one more row, ``segment``, never handed out,
        # where a pass of fixed shape (services/cuda_graphs.py) writes its padding's keys
        self._scratch = scratch
        self._row = (kv_heads, slot_len, head_dim)
        self.dtype, self._device = dtype, torch.device(device)
        self.max_slots = max_slots  # a replica lowers it to fit its KV budget
        self.segments: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # [seg][layer]
        self._free: list[int] = []  # a heap of released slots, reused before a new one
        self._clean: list[int] = []  # per slot: positions that hold numbers (written or 0)
        self._made = 0
        self._lock = threading.Lock()  # acquire() and bound(), on whichever thread calls them
        self._returned: deque[int] = deque()  # slots given back, not yet in the heap (release)

    @property
    def in_use(self) -> int:
        return self._made - len(self._free) - len(self._returned)

    @property
    def scratch(self) -> int | None:
        """The scratch row of each segment's buffers, or None (made without)."""
        return self.segment if self._scratch else None

    def bound(self, max_slots: int) -> None:
        """Lowers ``max_slots`` (a replica's --max-sessions and --kv-budget-mb); a segment
        larger than that shrinks to it while no slot is in use (the warm-up's is back)."""
        with self._lock:
            self._take_returned()
            self.max_slots = min(self.max_slots, max_slots)
            if self.segment > self.max_slots and self._made == len(self._free):
                self.segment = self.max_slots
                self.segments, self._free, self._clean, self._made = [], [], [], 0
                if self._device.type == "cuda":  # the warm-up's segment back to the device
                    torch.cuda.empty_cache()

    def acquire(self) -> int | None:
        """A free slot, or None when all ``max_slots`` are in use."""
        with self._lock:
            self._take_returned()
            if self._free:
                return heapq.heappop(self._free)
            if self._made >= self.max_slots:
                return None
            if self._made == len(self.segments) * self.segment:
                # normal tensors even when a slot is first taken inside inference mode: a
                # prefix-cache restore writes them outside it
                shape = (self.segment + self._scratch, *self._row)
                with torch.inference_mode(False):
                    self.segments.append([
                        (torch.empty(shape, dtype=self.dtype, device=self._device),
                         torch.empty(shape, dtype=self.dtype, device=self._device))
                        for _ in range(self.num_layers)])
                    if self.scratch is not None:  # numbers, though no kept output reads it
                        for keys, values in self.segments[-1]:
                            keys[self.scratch].zero_()
                            values[self.scratch].zero_()
            self._made += 1
            self._clean.append(0)
            return self._made - 1

    def release(self, slot: int) -> None:
        """Gives ``slot`` back, taking no lock: it runs as a cache's finalizer, which the
        cyclic garbage collector calls at whatever allocation starts a collection, on that
        thread, also inside ``acquire`` while it holds the lock to allocate a segment: a
        lock here would wait there for its own thread, for good (a cache in a reference
        cycle, e.g. with a failed call's traceback, is freed that way).
        ``deque.append`` is atomic; the next ``acquire`` moves the slot to the heap."""
        self._returned.append(slot)

    def _take_returned(self) -> None:
        """(Under the lock.) The slots given back since, into the heap of free ones."""
        while self._returned:
            heapq.heappush(self._free, self._returned.popleft())

    def ready(self, slot: int, live: int, length: int) -> None:
        """Makes positions [0, length) of ``slot``, whose cache holds ``live`` positions
        when the pass attends, hold numbers in every layer: a padded pass masks the positions
        past a row's own length, but a masked NaN (memory never written) would still turn its
        row's softmax into NaN. Zeroes each position past the live ones once, ``AHEAD`` at a
        time: a row shorter than the pass's longest would otherwise zero one position per
        layer in every pass (two small operators each, 192 a pass over 16 such rows of the
        demo target, about a tenth of the pass's operators)."""
        clean = max(self._clean[slot], live)
        if clean < length:
            end = min(self.slot_len, max(length, clean + AHEAD))
            for layer in range(self.num_layers):
                keys, values = self.buffers(slot, layer)
                keys[:, :, clean:end] = 0
                values[:, :, clean:end] = 0
            clean = end
        self._clean[slot] = clean

    def buffers(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's keys and values for ``layer``: views [1, KV, slot_len, D]."""
        keys, values = self.segments[slot // self.segment][layer]
        i = slot % self.segment
        return keys[i:i + 1], values[i:i + 1]


class SlabLayer:
    def __init__(self, chunk: int = CHUNK,
                 slot: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``slot``: a pool slot's keys and values ([1, KV, slot_len, D] views) to write in
        place until they are full; None: a buffer of its own from the first write on."""
        self._chunk = chunk
        self._keys: torch.Tensor | None = None if slot is None else slot[0]  # [B, KV, cap, D]
        self._values: torch.Tensor | None = None if slot is None else slot[1]
        self.pooled = slot is not None  # still writing the pool's slot
        self.length = 0

    def own(self) -> None:
        """Copies the live positions into a buffer of its own (off a pool slot)."""
        if self.pooled:
            self._move(self.length, self._keys)

    def _move(self, end: int, like: torch.Tensor) -> None:
        """A buffer of its own shaped like ``like`` [B, KV, *, D] with room for ``end``
        positions (whole chunks, at least one), holding the live ones."""
        size = max(1, -(-end // self._chunk)) * self._chunk
        shape = (*like.shape[:2], size, like.shape[3])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if self._keys is not None and self.length:
            keys[:, :, :self.length] = self._keys[:, :, :self.length]
            values[:, :, :self.length] = self._values[:, :, :self.length]
        self._keys, self._values, self.pooled = keys, values, False

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
            self._move(end, keys)
        self._keys[:, :, self.length:end] = keys
        self._values[:, :, self.length:end] = values
        self.length = end
        return self.keys, self.values


class SlabCache:
    """One ``SlabLayer`` per decoder layer; the interface the lean forward and the batching
    code use, with ``DynamicCache``'s meaning of ``crop``. With a ``pool`` that has a free
    slot, the layers write that slot."""

    def __init__(self, num_layers: int, chunk: int = CHUNK, pool: KVPool | None = None) -> None:
        self.pool = pool
        self._slot = None if pool is None else pool.acquire()
        self.missed_slot = pool is not None and self._slot is None  # the pool was full
        self._release = None
        if self._slot is None:
            self.pool = None
            self.layers = [SlabLayer(chunk) for _ in range(num_layers)]
        else:
            self.layers = [SlabLayer(chunk, pool.buffers(self._slot, i))
                           for i in range(num_layers)]
            self._release = weakref.finalize(self, pool.release, self._slot)

    def leave_pool(self) -> bool:
        """Moves the live positions out of the pool slot into buffers of their own and
        gives the slot back (a resting session's, for a new one); False when it has none."""
        if self._slot is None:
            return False
        for layer in self.layers:
            layer.own()
        self._release()  # (once: the finalizer is then dead)
        self._slot, self.pool = None, None
        return True

    @property
    def slot(self) -> int | None:
        """The pool slot every layer still writes, or None (no pool, or outgrown)."""
        if self._slot is None or not all(layer.pooled for layer in self.layers):
            return None
        return self._slot

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
