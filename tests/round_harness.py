"""An in-process harness for the gateway's round loop (issue #14 item 6).

The real RoundRunner drives the real drafter and verifier engines and servicers (their
protobuf conversion, validation, KV caches, micro-batching, speculation tree and acceptance
rule), with two substitutions that make a round cost microseconds instead of processes:

* ``TableLM``: a "model" whose logits come from fixed tables,
  ``logits(t_i | history) = A[t_i] + B[t_{i-1}]``, so a wrong cache (a missing or extra
  token) changes the logits; its KV cache stores the token ids themselves;
* ``InProcessStub``: calls a servicer's method directly instead of over a socket, with the
  per-call context of a call stream; a status the servicer aborts with comes back as the
  ``grpc.aio.AioRpcError`` a channel would raise.

The reference outputs come from the tables alone (``greedy_chain``), never from the code
under test. Tests of the round loop's decisions use this; the process-level tests
(test_mesh.py, test_speculation.py, ...) keep testing the same code over real sockets.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from opentelemetry import metrics

from drafter_svc.engine import DrafterEngine
from drafter_svc.server import DrafterServicer
from gateway.replicas import Replica, ReplicaPool
from gateway.rounds import RoundPlan, RoundRunner
from gateway.session_rounds import SessionRounds
from gateway.streams import rpc_error
from services.call_stream import CallAborted, CallContext
from services.config import GatewayConfig, ServerConfig
from services.convert import meta_to_pb
from services.kv_cache import SessionCaches
from services.kv_slab import SlabCache
from services.metrics import ModelServiceMetrics
from services.model_info import ModelMeta
from services.model_runner import ModelRunner
from services.session_store import SessionHandle
from verifier_svc.engine import VerifierEngine
from verifier_svc.server import VerifierServicer


class TableLM(torch.nn.Module):
    """Next-token logits from two [V, V] tables: A by the current token, B by the one before
    it (0 before the first). Called like an HF causal LM by the engines."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.a, self.b = a, b
        self.config = SimpleNamespace(num_hidden_layers=1, vocab_size=a.shape[0])
        self.calls = 0

    def new_cache(self) -> SlabCache:
        return SlabCache(num_layers=1)

    def forward(self, input_ids, position_ids=None, past_key_values=None, attention_mask=None,
                use_cache=True, logits_to_keep=0, **_):
        self.calls += 1
        batch, m = input_ids.shape
        past = past_key_values.get_seq_length()
        prev = (past_key_values.layers[0].keys[:, 0, -1, 0].long() if past
                else torch.zeros(batch, dtype=torch.long))  # [B] last cached token
        before = torch.cat([prev[:, None], input_ids[:, :-1]], dim=1)  # [B, m]
        ids = input_ids[:, None, :, None].float()  # [B, 1, m, 1]: the cache holds the ids
        keys, _ = past_key_values.update(ids, ids, 0)
        if attention_mask is not None and attention_mask.dim() == 4:  # the drafter's tree
            before = self._visible_before(keys[:, 0, :, 0].long(), attention_mask, past)
        logits = self.a[input_ids] + self.b[before]  # [B, m, V]
        keep = logits_to_keep or m
        return SimpleNamespace(logits=logits[:, -keep:])

    @staticmethod
    def _visible_before(keys: torch.Tensor, mask: torch.Tensor, past: int) -> torch.Tensor:
        """[B, m]: for each query, the token of the last key it may see before its own
        position (0 if none); ``mask`` [B, 1, m, keys] is bool or additive (0 = may see)."""
        allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # [B, m, keys]
        batch, m, _ = allowed.shape
        out = torch.zeros(batch, m, dtype=torch.long)
        for b in range(batch):
            for i in range(m):
                seen = allowed[b, i, : past + i].nonzero()
                if len(seen):
                    out[b, i] = keys[b, seen[-1, 0]]
        return out


def tables(vocab: int, seed: int, noise: float) -> tuple[TableLM, TableLM]:
    """A target and a drafter that agrees with it often (``noise`` scales their difference)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(vocab, vocab, generator=g) * 3, torch.randn(vocab, vocab, generator=g)
    da = a + noise * torch.randn(vocab, vocab, generator=g)
    db = b + noise * torch.randn(vocab, vocab, generator=g)
    return TableLM(a, b), TableLM(da, db)


def greedy_chain(lm: TableLM, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation, straight from its tables."""
    out = list(prompt)
    for _ in range(n):
        prev = out[-2] if len(out) > 1 else 0
        out.append(int((lm.a[out[-1]] + lm.b[prev]).argmax()))
    return out[len(prompt):]


class InProcessStub:
    """A stub whose RPCs call ``servicer``'s methods in this process."""

    def __init__(self, servicer, events: list | None = None) -> None:
        self._servicer = servicer
        self.calls: dict[str, int] = {}
        self.events = [] if events is None else events  # (method, "start" | "end"), in order

    def __getattr__(self, method: str):
        handler = getattr(self._servicer, method)

        async def call(request, timeout=None):
            self.calls[method] = self.calls.get(method, 0) + 1
            self.events.append((method, "start"))
            try:  # a call's own context, as on a call stream (services/call_stream.py)
                return await handler(request, CallContext(None))
            except CallAborted as aborted:  # raised as a channel would raise it
                error = aborted.to_pb()
                raise rpc_error(aborted.code, aborted.details, error.resync) from None
            finally:
                self.events.append((method, "end"))

        return call


def _meta(lm: TableLM, name: str) -> ModelMeta:
    return ModelMeta(model=name, fingerprint=name, vocab_hash="tables",
                     vocab_size=lm.config.vocab_size, max_context=4096, eos_token_ids=())


def _metrics(kind: str, engine) -> ModelServiceMetrics:
    return ModelServiceMetrics(metrics.get_meter("harness"), kind, queue_depth=lambda: 0,
                               sessions=lambda: len(engine.caches), kv_bytes=lambda: 0,
                               kv_capacity_bytes=lambda: 0)


def _engine(cls, lm: TableLM, name: str):
    runner = ModelRunner(lm, _meta(lm, name), torch.device("cpu"), max_queue=64, max_batch=16)
    return cls(runner, SessionCaches(64, runner.new_kv), max_draft_tokens=16)


class Harness:
    """One verifier and one model drafter, in process, behind a real RoundRunner."""

    def __init__(self, target: TableLM, draft: TableLM, *, pipeline: bool = True,
                 fanout: int = 4) -> None:
        self.verifier = _engine(VerifierEngine, target, "target")
        self.drafter = _engine(DrafterEngine, draft, "draft")
        self.config = GatewayConfig(server=ServerConfig(port=1), redis_url="redis://unused",
                                    verifiers=("verifier",), drafters=("drafter",),
                                    pipeline=pipeline, spec_fanout=fanout,
                                    tree_switch=False)  # (trees as asked; tests set a switch)
        pools = {}
        self.events: list[tuple[str, str]] = []  # both replicas' calls, in order
        for kind, engine, servicer in (
                ("verifier", self.verifier, VerifierServicer),
                ("drafter", self.drafter, DrafterServicer)):
            pool = ReplicaPool(kind, (), retry_s=1.0, channel_options=[])
            stub = InProcessStub(servicer(engine, _metrics(kind, engine)), self.events)
            pool.replicas[kind] = Replica(kind, None, stub,
                                          info=meta_to_pb(engine.meta, "model", 16))
            pools[kind] = pool
        self.pools = pools
        self.runner = RoundRunner(self.config, pools["drafter"], pools["verifier"])

    def stub(self, kind: str) -> InProcessStub:
        return self.pools[kind].replicas[kind].stub

    async def generate(self, prompt: list[int], n: int, params, k: int = 3, seed: int = 7,
                       on_round=None, tokens: int = 1) -> tuple[SessionHandle, list]:
        """Runs rounds until ``n`` tokens are committed (the last round may overshoot; the
        caller compares the first n), as the engine does; returns the handle and rounds.
        ``tokens``: what a round without drafts asks for."""
        s = SessionRounds(SessionHandle(session_id="s1", version=1, tokens=list(prompt)))
        rounds = []
        while len(s.tokens) - len(prompt) < n:
            before = s.prefetch
            r = await self.runner.run(
                s, RoundPlan(params, k, "model", seed, acceptance=0.8, tokens=tokens),
                lambda: None)
            committed_before = list(s.tokens)
            s.advance(r, r.proposed, 0.0)
            if on_round is not None:
                on_round(before, committed_before, r, s.handle)
            rounds.append(r)
        return s.handle, rounds
