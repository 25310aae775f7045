from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("cache", "draft_token_ids", "draft_dists", "warp", "logprobs", "top_logprobs", "max_tokens", "ahead", "ahead_seed", "drafting_beside", "local_drafts")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTS_FIELD_NUMBER: _ClassVar[int]
    WARP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    AHEAD_SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_BESIDE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    cache: _common_pb2.CacheDelta
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_dists: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDist]
    warp: _common_pb2.WarpParams
    logprobs: bool
    top_logprobs: int
    max_tokens: int
    ahead: int
    ahead_seed: int
    drafting_beside: bool
    local_drafts: bool
    def __init__(self, cache: _Optional[_Union[_common_pb2.CacheDelta, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_dists: _Optional[_Iterable[_Union[_common_pb2.SparseDist, _Mapping]]] = ..., warp: _Optional[_Union[_common_pb2.WarpParams, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., max_tokens: _Optional[int] = ..., ahead: _Optional[int] = ..., ahead_seed: _Optional[int] = ..., drafting_beside: _Optional[bool] = ..., local_drafts: _Optional[bool] = ...) -> None: ...

class VerifiedLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs", "token_id")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_id: int
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., token_id: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "extra_token_id", "cached_len", "cache_hit", "compute_ms", "batch_size", "logprobs", "more_token_ids")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EXTRA_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MORE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    extra_token_id: int
    cached_len: int
    cache_hit: bool
    compute_ms: float
    batch_size: int
    logprobs: _containers.RepeatedCompositeFieldContainer[VerifiedLogprob]
    more_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_accepted: _Optional[int] = ..., extra_token_id: _Optional[int] = ..., cached_len: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[VerifiedLogprob, _Mapping]]] = ..., more_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyStreamRequest(_message.Message):
    __slots__ = ("id", "call")
    ID_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    id: int
    call: VerifyRequest
    def __init__(self, id: _Optional[int] = ..., call: _Optional[_Union[VerifyRequest, _Mapping]] = ...) -> None: ...

class VerifyStreamResponse(_message.Message):
    __slots__ = ("id", "result", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    result: VerifyResponse
    error: _common_pb2.CallError
    def __init__(self, id: _Optional[int] = ..., result: _Optional[_Union[VerifyResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.CallError, _Mapping]] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[VerifyStreamRequest]
    def __init__(self, calls: _Optional[_Iterable[_Union[VerifyStreamRequest, _Mapping]]] = ...) -> None: ...

class VerifyBatchResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[VerifyStreamResponse]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[VerifyStreamResponse, _Mapping]]] = ...) -> None: ...
