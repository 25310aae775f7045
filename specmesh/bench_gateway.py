"""How `specmesh bench` talks to the gateway: one GenerateStream request as a bench record
(``stream_one``; the peers' and the HF rows' records have its shape) and one cell of them
(``run_level``)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

from specmesh.bench_workers import cell_requests, run_workers

if TYPE_CHECKING:
    from specmesh.bench import BenchOptions
    from specmesh.bench_modes import Mode


def stream_one(client, prompt_index: int, prompt: str, mode: Mode, opts: BenchOptions) -> dict:
    """One GenerateStream request: its token ids, usage, TTFT and latency; errors recorded."""
    import grpc

    from specmesh.client import build_request

    request = build_request(prompt, max_new_tokens=opts.max_new_tokens,
                            temperature=opts.temperature,
                            seed=opts.seed, num_draft_tokens=mode.k,
                            disable_speculation=mode.disable, drafter=mode.drafter)
    rec = {"prompt_index": prompt_index, "token_ids": [], "completion_tokens": 0, "rounds": 0,
           "draft_tokens": 0, "accepted_draft_tokens": 0, "ttft_s": None, "latency_s": 0.0,
           "error": "", "chunks": []}
    final = None
    start = time.perf_counter()
    try:
        for chunk in client.stream(request, timeout=opts.timeout_s):
            if chunk.token_ids:
                if rec["ttft_s"] is None:
                    rec["ttft_s"] = time.perf_counter() - start
                rec["token_ids"].extend(chunk.token_ids)
                # one chunk per round: (tokens, was it the last) for the per-token α
                rec["chunks"].append((len(chunk.token_ids), bool(chunk.finish_reason)))
            if chunk.finish_reason:
                final = chunk
    except grpc.RpcError as err:
        rec["error"] = f"{err.code().name}: {err.details()}"
    rec["latency_s"] = time.perf_counter() - start
    if not rec["error"]:
        if final is None:
            rec["error"] = "INCOMPLETE: the stream ended without a finish reason"
        else:
            u = final.usage
            rec.update(completion_tokens=u.completion_tokens, rounds=u.rounds,
                       draft_tokens=u.draft_tokens, accepted_draft_tokens=u.accepted_draft_tokens)
            if u.completion_tokens != len(rec["token_ids"]):
                rec["error"] = (f"USAGE_MISMATCH: {len(rec['token_ids'])} tokens streamed, "
                                f"usage says {u.completion_tokens}")
    return rec


def run_level(address: str, mode: Mode, prompts: list[str], concurrency: int,
              opts: BenchOptions, advance=None) -> tuple[list[dict], float]:
    """One cell: ``concurrency`` workers over ``cell_requests`` requests (specmesh.bench's
    docstring). Returns the records (sorted by prompt) and the wall time."""
    n = cell_requests(len(prompts), concurrency, opts.per_stream)
    return run_workers(
        concurrency, n, lambda client, j: stream_one(client, j % len(prompts),
                                                     prompts[j % len(prompts)], mode, opts),
        connect=lambda: _ready_client(address), advance=advance)


@contextmanager
def _ready_client(address: str):
    """A gateway client whose channel is connected (a worker's start is not timed)."""
    import grpc

    from specmesh.client import GatewayClient

    with GatewayClient(address) as client:
        grpc.channel_ready_future(client.channel).result(timeout=30)
        yield client


def stream_one_client(address: str, prompt: str, mode: Mode, opts: BenchOptions) -> dict:
    from specmesh.client import GatewayClient

    with GatewayClient(address) as client:
        return stream_one(client, 0, prompt, mode, opts)
