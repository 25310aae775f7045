"""Several choices in one OpenAI request: ``n`` samples of a prompt, and /v1/completions'
list of prompts (each ``n`` times). A choice is a generation of its own through the same
engine, with a session of its own, run concurrently with the request's other choices (the
verifier's passes batch them as they batch any concurrent requests). The body's ``choices``
are in order, prompt by prompt and ``n`` each; a stream's chunks carry each choice's
``index`` and come as each choice's rounds do. Choice j of a prompt samples with the
request's seed + j: distinct samples, the same ones for the same request again; without a
seed each draws its own. docs/api.md documents the fields."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import replace

from gateway.chunks import Chunk, Usage, collect
from gateway.http.errors import bad_request
from gateway.requests import GenerationSpec

MAX_N = 128  # OpenAI's own bound on n
SEEDS = 2**64  # a seed's range (gateway/requests.py checks it)


def choice_specs(prompts: Sequence[GenerationSpec], n: int | None,
                 max_inflight: int) -> list[GenerationSpec]:
    """Each prompt's request ``n`` times, choice j of a prompt seeded with seed + j. A
    request of several choices keeps no session and continues none (which choice's would it
    be?); its choices must fit the gateway's limit of concurrent requests."""
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be in 1..{MAX_N}, got {n}", "n")
    total = n * len(prompts)
    if total > 1 and (prompts[0].session_id or prompts[0].keep_session):
        field = "n" if n > 1 else "prompt"
        raise bad_request("session_id and keep_session take one choice: send n 1 and one "
                          f"prompt, got {total} choices", field)
    if total > max_inflight:
        many = f"{len(prompts)} prompts" if len(prompts) > 1 else "one prompt"
        raise bad_request(f"n ({n}) × {many} asks {total} choices; this gateway runs at "
                          f"most {max_inflight} at once (--max-inflight)",
                          "n" if n > 1 else "prompt")
    return [spec if spec.seed is None else replace(spec, seed=(spec.seed + j) % SEEDS)
            for spec in prompts for j in range(n)]


def total_usage(usages: Sequence[Usage], n: int) -> Usage:
    """The request's usage: the choices' completions and speculation summed, each prompt's
    tokens counted once (its ``n`` choices share it), as OpenAI counts them."""
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages[::n]),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 rounds=sum(u.rounds for u in usages),
                 draft_tokens=sum(u.draft_tokens for u in usages),
                 accepted_draft_tokens=sum(u.accepted_draft_tokens for u in usages))


async def all_of(awaitables: Sequence[Awaitable]) -> list:
    """Each awaitable's result, run concurrently; the first failure cancels the rest and is
    raised (one awaitable: awaited as it is)."""
    if len(awaitables) == 1:
        return [await awaitables[0]]
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _first(stream: AsyncIterator[Chunk]) -> Chunk:
    return await anext(stream)


async def first_chunks(streams: Sequence[AsyncIterator[Chunk]]) -> list[Chunk]:
    """Every choice's first chunk: a choice that fails before its first token fails the
    request with that error's status, before anything is sent."""
    return await all_of([_first(s) for s in streams])


async def wholes(streams: Sequence[AsyncIterator[Chunk]], firsts: Sequence[Chunk]) -> list[Chunk]:
    """Every choice collected into one chunk (gateway/chunks.py ``collect``)."""
    return await all_of([collect(s, f) for s, f in zip(streams, firsts, strict=True)])


async def merged(streams: Sequence[AsyncIterator[Chunk]],
                 firsts: Sequence[Chunk]) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) for every chunk of every choice as it comes, each choice's
    first chunk first, until every choice has finished; a choice's failure is raised. Closed
    early, it stops reading the choices (their streams are the caller's to close)."""
    if len(streams) == 1:
        chunk = firsts[0]
        yield 0, chunk
        while chunk.finish is None:
            chunk = await anext(streams[0])
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, Chunk | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        chunk = firsts[i]
        try:
            await queue.put((i, chunk, None))
            while chunk.finish is None:
                chunk = await anext(streams[i])
                await queue.put((i, chunk, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, None, exc))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        left = len(streams)
        while left:
            i, chunk, error = await queue.get()
            if error is not None:
                raise error
            yield i, chunk
            left -= chunk.finish is not None
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
