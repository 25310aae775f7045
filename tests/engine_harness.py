"""The gateway's whole scheduler in process: the real GenerationEngine (k per round, the load
switch, step batching across sessions, the speculation cache, commits to Redis, streaming)
over the round harness's in-process replicas (tests/round_harness.py: the real drafter and
verifier engines and servicers on table models), a real Redis server and a real tokenizer.

What it leaves out is the network: the gateway's servicer and the replicas' sockets, which
the process-level tests (test_mesh.py, test_sessions.py, ...) cover with the same engine.
"""

from __future__ import annotations

from gateway.chunks import Chunk, TargetLimits
from gateway.engine import GenerationEngine
from gateway.requests import GenerationSpec
from services.config import GatewayConfig, ServerConfig
from services.params import SamplingParams
from services.session_store import SessionStore
from tests.round_harness import Harness, TableLM


def spec(prompt: list[int], max_new_tokens: int, **fields) -> GenerationSpec:
    """A greedy request for ``prompt``'s ids; ``fields`` override any other field."""
    base = dict(prompt="", prompt_ids=tuple(prompt), params=SamplingParams(),
                max_new_tokens=max_new_tokens, stop=(), seed=None, num_draft_tokens=0,
                speculate=True, drafter_kind="", session_id="", keep_session=False)
    return GenerationSpec(**{**base, **fields})


class EngineHarness(Harness):
    """One verifier and one model drafter in process behind a real GenerationEngine, which
    batches their calls in steps as a gateway does."""

    def __init__(self, target: TableLM, draft: TableLM, redis_url: str, tokenizer,
                 **config) -> None:
        super().__init__(target, draft)
        for kind, pool in self.pools.items():
            pool.replicas[kind].batch_steps(kind, lambda p=pool: p.merge_plain())
        self.config = GatewayConfig(server=ServerConfig(port=1), redis_url=redis_url,
                                    verifiers=("verifier",), drafters=("drafter",), **config)
        self.store = SessionStore.from_url(redis_url, self.config.session_ttl_s,
                                           self.config.lease_s)
        limits = TargetLimits(vocab_size=target.config.vocab_size, max_context=4096,
                              eos_token_ids=frozenset(), fingerprint="target",
                              max_draft_tokens=16)
        self.engine = GenerationEngine(self.config, tokenizer, limits, self.pools["drafter"],
                                       self.pools["verifier"], self.store)

    async def complete(self, request: GenerationSpec) -> list[Chunk]:
        """Every chunk of one request's stream."""
        return [chunk async for chunk in self.engine.generate(request)]

    async def close(self) -> None:
        await self.store.client.aclose()


def token_ids(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]
