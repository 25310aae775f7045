"""Plain dataclasses of the internal drafter and verifier calls.

Servicers and clients convert protobuf to and from these (services/convert.py);
nothing deeper sees a proto.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.errors import InvalidArgument
from services.params import SamplingParams


def check_token_ids(tokens, vocab_size: int, what: str) -> None:
    """INVALID_ARGUMENT naming ``what`` when a token id lies outside [0, vocab_size)."""
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{what} contains token ids outside the vocabulary "
                              f"[0, {vocab_size}): {bad[:5]}")


@dataclass(frozen=True)
class CacheDelta:
    session_id: str
    base_len: int
    base_hash: int
    new_tokens: tuple[int, ...]


@dataclass(frozen=True)
class DraftCall:
    cache: CacheDelta
    num_tokens: int
    params: SamplingParams
    seed: int
    max_support: int


@dataclass(frozen=True)
class DraftResult:
    token_ids: tuple[int, ...]
    q_ids: tuple[tuple[int, ...], ...]
    q_probs: tuple[tuple[float, ...], ...]
    cached_len: int
    cache_hit: bool
    compute_ms: float
    batch_size: int = 1  # the largest batch of calls its forward passes ran in


@dataclass(frozen=True)
class SpeculateCall:
    """Drafts for the next round's likely outcomes (drafter.proto SpeculateRequest)."""

    cache: CacheDelta  # committed prefix + this round's drafts (the last num_drafts tokens)
    num_drafts: int
    num_tokens: int
    params: SamplingParams
    seed: int
    max_support: int
    max_branches: int
    acceptance: float
    coverage: float = 0.95


@dataclass(frozen=True)
class Branch:
    """One outcome of a verify (``accepted`` drafts, then ``token``) and the next round's
    drafts after it."""

    accepted: int
    token: int
    draft: DraftResult
    probability: float


@dataclass(frozen=True)
class SpeculateResult:
    branches: tuple[Branch, ...]  # most likely first
    cached_len: int
    cache_hit: bool
    compute_ms: float
    batch_size: int = 1


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probability of one token (log_softmax of its raw logits) and the
    most likely tokens at that position, most likely first."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class VerifyCall:
    cache: CacheDelta
    draft_ids: tuple[int, ...]
    q_ids: tuple[tuple[int, ...], ...]
    q_probs: tuple[tuple[float, ...], ...]
    params: SamplingParams
    seed: int
    logprobs: int = -1  # -1: none; n >= 0: each returned token's logprob and the top n
    max_tokens: int = 1  # without drafts: tokens to decode at most, one pass each
    ahead: int = 0  # without drafts: the next round's tokens to decode once answered (0: none)
    ahead_seed: int = 0  # the next round's seed (verifier_svc/decode_ahead.py)
    beside: bool = False  # with drafts: a drafter drafts the next round meanwhile (a tree)
    local: bool = False  # without drafts: may draft with the verifier's own draft model


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    extra_token: int
    cached_len: int
    cache_hit: bool
    compute_ms: float
    batch_size: int = 1  # the largest batch of calls its forward pass ran in
    logprobs: tuple[TokenLogprobs, ...] = ()  # with VerifyCall.logprobs: one per token returned
    more: tuple[int, ...] = ()  # tokens decoded after extra_token (VerifyCall.max_tokens > 1)
    # the verifier's own drafts among them (VerifyCall.local): proposed, accepted (its
    # metrics only: not sent to the gateway)
    local_drafted: int = 0
    local_accepted: int = 0


@dataclass
class ReplicaStats:
    """Counters of a drafter or verifier (see common.proto ReplicaStats)."""

    calls: int = 0
    fed_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    forward_ms: float = 0.0  # model compute, summed over forward passes
    forward_passes: int = 0  # one per (batched) forward pass
    batched_calls: int = 0  # calls that shared their pass with another call
    ahead_started: int = 0  # verifier: decode-ahead runs started
    ahead_taken: int = 0  # verifier: of them, the ones a call took over
