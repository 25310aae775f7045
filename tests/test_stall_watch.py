"""A replica whose model thread hangs reports NOT_SERVING (services/stall_watch.py).

A real ModelRunner runs a solo job that blocks on an event (a model thread that hangs, as one
did in a deadlock) and a real gRPC health servicer answers Check; only the hang is staged.
The whole replica with a real hung pass is not run: nothing in its own code hangs on purpose.
"""

from __future__ import annotations

import asyncio
import threading

import torch
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from services.model_runner import ModelRunner, SoloJob
from services.models import describe
from services.stall_watch import StallWatch


async def _status(health: HealthServicer, service: str) -> int:
    reply = await health.Check(health_pb2.HealthCheckRequest(service=service), None)
    return reply.status


def test_a_hung_pass_turns_health_not_serving_and_its_end_serving_again(tiny_pair,
                                                                        target_model, caplog):
    model, tokenizer = target_model
    runner = ModelRunner(model, describe(tiny_pair[0], model, tokenizer), torch.device("cpu"),
                         max_queue=8, max_batch=4)
    release = threading.Event()

    async def scenario() -> list[tuple[bool, int, int]]:
        health = HealthServicer()
        for name in ("", "specmesh.v1.Verifier"):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        watch = StallWatch(lambda: runner.pass_started, health, ["specmesh.v1.Verifier"],
                           stall_s=0.3, poll_s=0.05)
        seen = []

        async def look() -> None:
            seen.append((await watch.check(), await _status(health, ""),
                         await _status(health, "specmesh.v1.Verifier")))

        await look()  # idle
        hung = asyncio.ensure_future(runner.submit(SoloJob(lambda m, d: release.wait(30), 1)))
        await asyncio.sleep(0.1)
        await look()  # running, not for long yet
        await asyncio.sleep(0.4)
        await look()  # past stall_s
        release.set()
        await hung
        await look()  # the pass ended
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        release.set()
        runner.close()
    up, down = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert seen == [(False, up, up), (False, up, up), (True, down, down), (False, up, up)]
    assert "has run one pass for" in caplog.text and "SERVING again" in caplog.text


def test_the_model_thread_reports_each_pass_and_none_between(tiny_pair, target_model):
    """``pass_started`` is set while a pass runs (what the watch reads) and None after it."""
    model, tokenizer = target_model
    runner = ModelRunner(model, describe(tiny_pair[0], model, tokenizer), torch.device("cpu"),
                         max_queue=8, max_batch=4)
    during = []

    async def scenario() -> None:
        await runner.submit(SoloJob(lambda m, d: during.append(runner.pass_started), 1))

    try:
        asyncio.run(scenario())
    finally:
        runner.close()
    assert len(during) == 1 and during[0] is not None
    assert runner.pass_started is None
