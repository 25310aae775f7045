from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("cache", "num_tokens", "warp", "max_support")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARP_FIELD_NUMBER: _ClassVar[int]
    MAX_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    cache: _common_pb2.CacheDelta
    num_tokens: int
    warp: _common_pb2.WarpParams
    max_support: int
    def __init__(self, cache: _Optional[_Union[_common_pb2.CacheDelta, _Mapping]] = ..., num_tokens: _Optional[int] = ..., warp: _Optional[_Union[_common_pb2.WarpParams, _Mapping]] = ..., max_support: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("token_ids", "dists", "cached_len", "cache_hit", "compute_ms", "batch_size")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    dists: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDist]
    cached_len: int
    cache_hit: bool
    compute_ms: float
    batch_size: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., dists: _Optional[_Iterable[_Union[_common_pb2.SparseDist, _Mapping]]] = ..., cached_len: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("cache", "num_drafts", "num_tokens", "warp", "max_support", "max_branches", "acceptance", "coverage")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARP_FIELD_NUMBER: _ClassVar[int]
    MAX_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    MAX_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    cache: _common_pb2.CacheDelta
    num_drafts: int
    num_tokens: int
    warp: _common_pb2.WarpParams
    max_support: int
    max_branches: int
    acceptance: float
    coverage: float
    def __init__(self, cache: _Optional[_Union[_common_pb2.CacheDelta, _Mapping]] = ..., num_drafts: _Optional[int] = ..., num_tokens: _Optional[int] = ..., warp: _Optional[_Union[_common_pb2.WarpParams, _Mapping]] = ..., max_support: _Optional[int] = ..., max_branches: _Optional[int] = ..., acceptance: _Optional[float] = ..., coverage: _Optional[float] = ...) -> None: ...

class SpeculationBranch(_message.Message):
    __slots__ = ("accepted", "token", "token_ids", "dists", "probability")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTS_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    token: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    dists: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDist]
    probability: float
    def __init__(self, accepted: _Optional[int] = ..., token: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., dists: _Optional[_Iterable[_Union[_common_pb2.SparseDist, _Mapping]]] = ..., probability: _Optional[float] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("branches", "cached_len", "cache_hit", "compute_ms", "batch_size")
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    branches: _containers.RepeatedCompositeFieldContainer[SpeculationBranch]
    cached_len: int
    cache_hit: bool
    compute_ms: float
    batch_size: int
    def __init__(self, branches: _Optional[_Iterable[_Union[SpeculationBranch, _Mapping]]] = ..., cached_len: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...

class DraftStreamRequest(_message.Message):
    __slots__ = ("id", "draft", "speculate")
    ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    id: int
    draft: DraftRequest
    speculate: SpeculateRequest
    def __init__(self, id: _Optional[int] = ..., draft: _Optional[_Union[DraftRequest, _Mapping]] = ..., speculate: _Optional[_Union[SpeculateRequest, _Mapping]] = ...) -> None: ...

class DraftStreamResponse(_message.Message):
    __slots__ = ("id", "draft", "speculate", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    draft: DraftResponse
    speculate: SpeculateResponse
    error: _common_pb2.CallError
    def __init__(self, id: _Optional[int] = ..., draft: _Optional[_Union[DraftResponse, _Mapping]] = ..., speculate: _Optional[_Union[SpeculateResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.CallError, _Mapping]] = ...) -> None: ...

class DraftBatchRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[DraftStreamRequest]
    def __init__(self, calls: _Optional[_Iterable[_Union[DraftStreamRequest, _Mapping]]] = ...) -> None: ...

class DraftBatchResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[DraftStreamResponse]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[DraftStreamResponse, _Mapping]]] = ...) -> None: ...
