"""Peers in `specmesh bench` (``--peer NAME=URL``): any OpenAI-compatible server (vLLM,
llama.cpp's llama-server, another SpecMesh gateway's HTTP API) run on the same prompts, at the
same concurrency levels and in the same run as the mesh's rows, so that the mesh is measured
next to what a user would deploy instead.

Each request is a streamed ``/completions`` call (greedy: temperature 0, the bench's
max_new_tokens, ``stream_options.include_usage``), timed like the mesh's gRPC requests: TTFT
to the first chunk with text, latency to the end of the stream, and the completion tokens
the server reports in ``usage`` (never counted from the text). A peer's row is a mode keyed
``peer:NAME``; its outputs are text, not token ids, so the bench does not compare them with
target-only's (the peers' own decoding is not SpecMesh's guarantee to keep).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from specmesh.bench_workers import cell_requests, run_workers

PEER_PREFIX = "peer:"


@dataclass(frozen=True)
class Peer:
    name: str
    url: str  # the OpenAI base URL, e.g. http://127.0.0.1:8101/v1

    @property
    def key(self) -> str:
        return PEER_PREFIX + self.name


def parse_peers(values: list[str]) -> list[Peer]:
    """``NAME=URL`` items (each value may hold several, comma-separated). Raises ValueError
    with what to fix."""
    peers: list[Peer] = []
    for item in (x.strip() for v in values for x in v.split(",")):
        if not item:
            continue
        name, sep, url = item.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--peer takes NAME=URL with an http(s) OpenAI base URL, e.g. "
                             f"vllm=http://127.0.0.1:8101/v1; got {item!r}")
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--peer: the name {name!r} may hold only letters, digits, - and _")
        if any(p.name == name for p in peers):
            raise ValueError(f"--peer: the name {name!r} is given twice")
        peers.append(Peer(name, url))
    return peers


def served_model(peer: Peer, timeout_s: float = 10.0) -> str:
    """The first model the peer lists at ``/models``. Raises OSError (URLError) when it does
    not answer, ValueError when it answers with no model."""
    with urllib.request.urlopen(peer.url + "/models", timeout=timeout_s) as resp:
        data = json.loads(resp.read()).get("data") or []
    if not data:
        raise ValueError(f"{peer.url}/models lists no model")
    return data[0]["id"]


def complete_one(peer: Peer, model: str, prompt_index: int, prompt: str, max_new_tokens: int,
                 timeout_s: float, temperature: float = 0.0, seed: int | None = None) -> dict:
    """One streamed completion, as a bench record (specmesh.bench_gateway.stream_one's shape):
    greedy, or sampled at ``temperature`` (with ``seed`` when given)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    rec = {"prompt_index": prompt_index, "token_ids": [], "text": "", "completion_tokens": 0,
           "rounds": 0, "draft_tokens": 0, "accepted_draft_tokens": 0, "ttft_s": None,
           "latency_s": 0.0, "error": "", "chunks": []}
    request = urllib.request.Request(peer.url + "/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    usage = None
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices") or ():
                    if choice.get("text"):
                        if rec["ttft_s"] is None:
                            rec["ttft_s"] = time.perf_counter() - start
                        rec["text"] += choice["text"]
                usage = event.get("usage") or usage
    except (OSError, ValueError) as exc:  # URLError/HTTPError are OSErrors; bad JSON
        rec["error"] = f"PEER: {exc}"[:200]
    rec["latency_s"] = time.perf_counter() - start
    if not rec["error"]:
        if usage is None:
            rec["error"] = "PEER: the stream carried no usage (stream_options.include_usage)"
        else:
            rec["completion_tokens"] = int(usage.get("completion_tokens", 0))
    return rec


def run_peer_level(peer: Peer, model: str, prompts: list[str], concurrency: int,
                   max_new_tokens: int, timeout_s: float, advance=None, per_stream: int = 1,
                   temperature: float = 0.0, seed: int | None = None
                   ) -> tuple[list[dict], float]:
    """One cell, as the mesh's rows run theirs (specmesh.bench_workers.run_workers, over
    ``cell_requests``): the records (sorted by prompt) and the wall time."""
    n = cell_requests(len(prompts), concurrency, per_stream)
    return run_workers(
        concurrency, n, lambda _, j: complete_one(peer, model, j % len(prompts),
                                                  prompts[j % len(prompts)], max_new_tokens,
                                                  timeout_s, temperature, seed),
        advance=advance)
