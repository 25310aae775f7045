"""A replica whose model thread hangs reports NOT_SERVING (services/stall_watch.py).

A real ModelRunner runs a solo job that blocks on an event (a model thread that hangs, as one
did in a deadlock) and a real gRPC health servicer answers Check; only the hang is staged, and
the watch reads a clock the test moves, so no decision depends on how fast this machine is.
The whole replica with a real hung pass is not run: nothing in its own code hangs on purpose.
"""

from __future__ import annotations

import asyncio
import threading

import torch
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from services import model_runner
from services.hashing import token_hash
from services.kv_cache import SessionCaches
from services.messages import CacheDelta, VerifyCall
from services.model_runner import ModelRunner, SoloJob
from services.models import describe
from services.params import SamplingParams
from services.stall_watch import StallWatch
from verifier_svc.engine import VerifierEngine

UP, DOWN = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _runner(tiny_pair, target_model) -> ModelRunner:
    model, tokenizer = target_model
    return ModelRunner(model, describe(tiny_pair[0], model, tokenizer), torch.device("cpu"),
                       max_queue=8, max_batch=4)


async def _status(health: HealthServicer, service: str) -> int:
    reply = await health.Check(health_pb2.HealthCheckRequest(service=service), None)
    return reply.status


def test_a_hung_pass_turns_health_not_serving_and_its_end_serving_again(tiny_pair,
                                                                        target_model, caplog):
    runner = _runner(tiny_pair, target_model)
    release, entered = threading.Event(), threading.Event()
    elapsed = [0.0]  # the watch's clock; a running pass began at 0

    def hang(model, device) -> None:
        entered.set()
        release.wait(30)

    async def scenario() -> list[tuple[bool, int, int]]:
        health = HealthServicer()
        for name in ("", "specmesh.v1.Verifier"):
            await health.set(name, UP)
        watch = StallWatch(lambda: None if runner.pass_started is None else 0.0,
                           health, ["specmesh.v1.Verifier"], stall_s=120.0,
                           clock=lambda: elapsed[0])
        seen = []

        async def look(after_s: float) -> None:
            elapsed[0] = after_s
            seen.append((await watch.check(), await _status(health, ""),
                         await _status(health, "specmesh.v1.Verifier")))

        await look(500.0)  # idle, however long: no pass runs
        hung = asyncio.ensure_future(runner.submit(SoloJob(hang, 1)))
        await asyncio.to_thread(entered.wait, 10)
        await look(119.0)  # the pass runs, within --stall-s
        await look(121.0)  # past it
        await look(300.0)  # still: reported once
        release.set()
        await hung
        await look(400.0)  # the pass ended
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        release.set()
        runner.close()
    assert seen == [(False, UP, UP), (False, UP, UP), (True, DOWN, DOWN), (True, DOWN, DOWN),
                    (False, UP, UP)]
    assert caplog.text.count("has run one pass for") == 1 and "SERVING again" in caplog.text


def test_the_model_thread_marks_each_pass_and_clears_the_mark_between(tiny_pair, target_model,
                                                                       monkeypatch):
    """``pass_started`` is set while a pass runs, stepped (a verify call's) or solo, and None
    once the model thread hands back: what the watch reads."""
    runner = _runner(tiny_pair, target_model)
    engine = VerifierEngine(runner, SessionCaches(8, runner.new_kv), max_draft_tokens=4)
    during = []
    run_step = model_runner.run_step

    def marked_step(*args, **kwargs):
        during.append(runner.pass_started)
        return run_step(*args, **kwargs)

    monkeypatch.setattr(model_runner, "run_step", marked_step)
    prompt = (5, 9, 14, 3)
    call = VerifyCall(cache=CacheDelta(session_id="s", base_len=0, base_hash=token_hash([]),
                                       new_tokens=prompt),
                      draft_ids=(), q_ids=(), q_probs=(), params=SamplingParams(), seed=0,
                      max_tokens=3)

    async def scenario() -> None:
        await engine.verify(call)
        assert runner.pass_started is None
        await runner.submit(SoloJob(lambda m, d: during.append(runner.pass_started), 1))

    try:
        asyncio.run(scenario())
    finally:
        runner.close()
    assert len(during) >= 4 and all(t is not None for t in during)  # 3 tokens' passes, a solo
    assert runner.pass_started is None
