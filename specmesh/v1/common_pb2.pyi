from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CacheDelta(_message.Message):
    __slots__ = ("session_id", "base_len", "base_hash", "new_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    BASE_HASH_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_len: int
    base_hash: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., base_len: _Optional[int] = ..., base_hash: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class WarpParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SparseDist(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "fingerprint", "vocab_hash", "vocab_size", "max_context", "eos_token_ids", "kind", "max_draft_tokens", "prefix_block_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: str
    vocab_hash: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kind: str
    max_draft_tokens: int
    prefix_block_size: int
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., vocab_hash: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., kind: _Optional[str] = ..., max_draft_tokens: _Optional[int] = ..., prefix_block_size: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("sessions", "calls", "fresh_prefills", "resyncs_requested", "fed_tokens", "draft_tokens", "accepted_tokens", "evictions", "queue_depth", "kv_tokens", "kv_token_budget", "forward_ms", "forward_passes", "batched_calls", "prefix_lookups", "prefix_hits", "prefix_lookup_tokens", "prefix_hit_tokens", "prefix_blocks", "prefix_block_budget", "prefix_evicted_blocks", "prefix_block_size", "ahead_started", "ahead_taken")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    FRESH_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    FED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_CALLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    AHEAD_STARTED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_TAKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    calls: int
    fresh_prefills: int
    resyncs_requested: int
    fed_tokens: int
    draft_tokens: int
    accepted_tokens: int
    evictions: int
    queue_depth: int
    kv_tokens: int
    kv_token_budget: int
    forward_ms: float
    forward_passes: int
    batched_calls: int
    prefix_lookups: int
    prefix_hits: int
    prefix_lookup_tokens: int
    prefix_hit_tokens: int
    prefix_blocks: int
    prefix_block_budget: int
    prefix_evicted_blocks: int
    prefix_block_size: int
    ahead_started: int
    ahead_taken: int
    def __init__(self, sessions: _Optional[int] = ..., calls: _Optional[int] = ..., fresh_prefills: _Optional[int] = ..., resyncs_requested: _Optional[int] = ..., fed_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., queue_depth: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., kv_token_budget: _Optional[int] = ..., forward_ms: _Optional[float] = ..., forward_passes: _Optional[int] = ..., batched_calls: _Optional[int] = ..., prefix_lookups: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., prefix_lookup_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_blocks: _Optional[int] = ..., prefix_block_budget: _Optional[int] = ..., prefix_evicted_blocks: _Optional[int] = ..., prefix_block_size: _Optional[int] = ..., ahead_started: _Optional[int] = ..., ahead_taken: _Optional[int] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message", "resync")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    resync: bool
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., resync: _Optional[bool] = ...) -> None: ...
