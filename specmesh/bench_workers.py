"""How `specmesh bench` runs one cell: N workers over the cell's requests, timed the same way
for the mesh's rows and the peers' (specmesh.bench, specmesh.bench_peers)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

from services import interrupts


def cell_requests(prompts: int, concurrency: int, per_stream: int) -> int:
    """How many requests a cell of ``concurrency`` streams runs over ``prompts`` prompts: every
    prompt at least once and every stream at least ``per_stream`` requests, max(P, R·N). With
    one request a stream, a cell is one burst whose streams end one by one, and its wall time
    is mostly the start and the tail: at 16 streams such cells lasted 1.4-4 s and their runs
    spread by up to a fifth (docs/performance.md)."""
    return max(prompts, per_stream * concurrency)


def run_workers(concurrency: int, n: int, one: Callable[[Any, int], dict],
                connect: Callable[[], AbstractContextManager] = nullcontext,
                advance: Callable[[], None] | None = None) -> tuple[list[dict], float]:
    """``concurrency`` workers over requests 0..n-1, worker i taking i, i + N, i + 2N, ...;
    each worker first enters ``connect()`` (e.g. a client whose channel is ready) and runs
    ``one(what connect gave, j)`` for each of its requests. The wall time runs from the moment
    every worker has connected until the last request ends. Returns the records (sorted by
    ``prompt_index``) and that wall time."""
    records: list[dict] = []
    lock = threading.Lock()
    ready = threading.Barrier(concurrency + 1)

    def worker(i: int) -> None:
        with ExitStack() as stack:
            try:
                conn = stack.enter_context(connect())
            finally:
                ready.wait()  # also when connecting failed: the cell must not hang
            for j in range(i, n, concurrency):
                rec = one(conn, j)
                with lock:
                    records.append(rec)
                if advance:
                    advance()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True, name=f"bench-{i}")
               for i in range(concurrency)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        interrupts.join(t)  # a Ctrl-C or SIGTERM a finalizer swallowed still stops the bench
    wall = time.perf_counter() - start
    return sorted(records, key=lambda r: r["prompt_index"]), wall
