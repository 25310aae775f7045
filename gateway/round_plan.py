"""What one round of gateway/rounds.py carries: its plan (``RoundPlan``, what the round loop
chose), the seed each of its calls draws from, the share of a speculation tree's branches a
call gets, and the pieces of drafts and cache deltas its calls send."""

from __future__ import annotations

import dataclasses
import hashlib

from services.messages import CacheDelta, DraftResult
from services.params import SamplingParams
from services.session_store import SessionHandle


def round_seed(seed: int, round_index: int, role: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{round_index}:{role}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def part(draft: DraftResult, start: int = 0, stop: int | None = None) -> DraftResult:
    """Drafts start..stop with their q: the first k (k may have shrunk since they were
    prepared), or all but a lead round's first (its guess of the verifier's token)."""
    if start == 0 and (stop is None or len(draft.token_ids) <= stop):
        return draft
    cut = slice(start, stop)
    return dataclasses.replace(draft, token_ids=draft.token_ids[cut], q_ids=draft.q_ids[cut],
                               q_probs=draft.q_probs[cut])


def held(draft: DraftResult, old: int) -> tuple[int, ...]:
    """The drafts a draft call left in its drafter's cache past the ``old`` committed ones."""
    return draft.token_ids[: max(0, draft.cached_len - old)]


def cache_delta(h: SessionHandle, base: int, drafts: tuple[int, ...] = ()) -> CacheDelta:
    """The cache delta of h's committed tokens (then ``drafts``) for a replica holding the
    first ``base`` of them."""
    return CacheDelta(session_id=h.session_id, base_len=base, base_hash=h.prefix_hash(base),
                      new_tokens=(*h.tokens[base:], *drafts))


def fanout_share(fanout: int, busy: int, requests: int = 1, max_requests: int = 1) -> int:
    """The branches one speculation call gets while its drafter serves ``busy`` other calls
    and the gateway runs ``requests`` requests: all of them while the drafter is idle and
    the gateway runs at most ``max_requests``, else none."""
    return fanout if busy == 0 and requests <= max_requests else 0


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """What the round loop chose for one round (gateway/engine.py)."""

    params: SamplingParams
    k: int  # drafts to verify (0: none)
    kind: str  # the drafter kind that drafts them
    seed: int  # the request's seed (each round draws its own from it and the round index)
    acceptance: float = 0.7  # the expected acceptance, which weighs the speculation tree
    logprobs: int = -1  # top log-probabilities per token (-1: none)
    tokens: int = 1  # what a round without drafts asks the verifier for
    ahead: int = 0  # a round without drafts: the next one's tokens, to decode ahead (0: none)
    local: bool = False  # a round without drafts may draft with the verifier's own drafter
