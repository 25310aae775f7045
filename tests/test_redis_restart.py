"""Redis restarted (issue #7 item 4): in-flight requests finish, new requests get UNAVAILABLE
at once while Redis is down and work again when it is back, and no session handle is corrupted.

Everything is real: this module's own redis-server (append-only file on) is SIGKILLed or
SIGTERMed and started again on the same port and directory; the mesh is separate processes.
"""

from __future__ import annotations

import asyncio
import copy
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest
import redis

from services import local_mesh
from services.config import GatewayConfig, ServerConfig
from services.errors import Busy
from services.session_store import SessionHandle, SessionStore
from specmesh.client import GatewayClient, build_request
from tests.conftest import hf_greedy, launch

OUTAGE_S = 5.0  # the test gateway's --store-outage-s


class RedisBox:
    """A redis-server of this module's own that a test can kill and start again on the same
    port and directory (so the gateway's URL stays valid and the append-only file reloads)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.proc, self.url = local_mesh.start_redis(directory)
        self.port = urlsplit(self.url).port

    @property
    def up(self) -> bool:
        return self.proc.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.popen.send_signal(sig)
        self.proc.popen.wait(20)

    def start(self) -> None:
        self.proc, url = local_mesh.start_redis(self.directory, self.port)
        assert url == self.url

    def stop(self) -> None:
        if self.up:
            self.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def redis_box(tmp_path_factory):
    box = RedisBox(tmp_path_factory.mktemp("redis-restart"))
    yield box
    box.stop()


@pytest.fixture
def box(redis_box):
    """The module's Redis, running again after each test whatever the test did to it."""
    yield redis_box
    if not redis_box.up:
        redis_box.start()


@pytest.fixture(scope="module")
def outage_mesh(tiny_pair, redis_box, tmp_path_factory):
    m = launch(tiny_pair, redis_box.url, tmp_path_factory.mktemp("redis-restart-logs"),
               extra_gateway_args=("--store-outage-s", str(OUTAGE_S)))
    yield m
    m.stop()


def _run(coro_fn, url: str):
    async def main():
        store = SessionStore.from_url(url, ttl_s=600, lease_s=5)
        try:
            return await coro_fn(store)
        finally:
            await store.close()
    return asyncio.run(main())


def _handle(url: str, session_id: str) -> SessionHandle:
    return _run(lambda store: store.load(session_id), url)


def _exists(url: str, session_id: str) -> bool:
    return bool(redis.Redis.from_url(url).exists(f"specmesh:session:{session_id}"))


def test_store_outage_s_must_be_positive_in_config_flag_and_env():
    """--store-outage-s / SPECMESH_STORE_OUTAGE_S reach GatewayConfig, which refuses 0."""
    with pytest.raises(ValueError, match="store outage"):
        GatewayConfig(server=ServerConfig(port=1), redis_url="redis://x", verifiers=("h:1",),
                      store_outage_s=0)
    base = [sys.executable, "-m", "specmesh.cli", "gateway", "--redis", "redis://x",
            "--verifiers", "h:1"]
    for args, env in (([*base, "--store-outage-s", "0"], {}),
                      (base, {"SPECMESH_STORE_OUTAGE_S": "-1"})):
        result = subprocess.run(args, capture_output=True, text=True, timeout=60,
                                env={**os.environ, **env})
        assert result.returncode == 2 and "store outage" in result.stderr, result.stderr


def test_start_redis_reloads_session_handles_after_a_sigkill(tmp_path):
    """start_redis keeps an append-only file: a SIGKILLed server started again on the same
    port and directory has every handle, tokens and version as committed before the kill."""
    proc, url = local_mesh.start_redis(tmp_path)
    port = urlsplit(url).port
    h = SessionHandle(session_id="aof", version=1, tokens=[5, 6, 7], keep=True)

    async def write(store):
        await store.create(h)
        h.tokens += [8, 9]
        await store.commit(h, [8, 9], "owner")

    try:
        _run(write, url)
        proc.popen.kill()
        proc.popen.wait(10)
        proc, url2 = local_mesh.start_redis(tmp_path, port)
        assert url2 == url
        loaded = _handle(url, "aof")
        assert loaded.tokens == [5, 6, 7, 8, 9] and loaded.version == 2 and loaded.keep
    finally:
        proc.popen.terminate()
        proc.popen.wait(10)


def test_commit_repeated_after_a_lost_reply_is_applied_once(box):
    """Redis may apply a commit and die before replying; the gateway then sends the same
    tokens again (plus later rounds') with the old version. That repeat must append only what
    is missing, never twice, and anything else with a stale version must still be refused."""

    def view(h: SessionHandle, *more: int) -> SessionHandle:
        out = copy.deepcopy(h)
        out.tokens += list(more)
        return out

    async def scenario(store):
        results = {}
        for name, repeat in (("exact", [4, 5]), ("more", [4, 5, 6, 7])):
            h = SessionHandle(session_id=f"lost-reply-{name}", version=1, tokens=[1, 2, 3])
            await store.create(h)
            before = copy.deepcopy(h)  # the gateway's view: it never saw the reply below
            await store.commit(view(h, 4, 5), [4, 5], "owner-a")  # applied, reply "lost"
            again = view(before, *repeat)
            await store.commit(again, repeat, "owner-a")
            results[name] = (await store.load(h.session_id), again.version)
        refused = []
        h = SessionHandle(session_id="lost-reply-refused", version=1, tokens=[1, 2, 3])
        await store.create(h)
        before = copy.deepcopy(h)
        await store.commit(view(h, 4, 5), [4, 5], "owner-a")
        for owner, stale in (("owner-b", view(before, 4, 5, 6)),  # another request's
                             ("owner-a", view(before, 4, 8)),  # not what was committed
                             ("owner-a", view(before, 4))):  # shorter than what was
            try:
                await store.commit(stale, stale.tokens[3:], owner)
            except Busy:
                refused.append(owner)
        current = await store.load(h.session_id)
        await store.commit(view(current, 6), [6], "owner-a")
        try:
            await store.commit(view(before, 4, 5, 6, 7), [4, 5, 6, 7], "owner-a")
        except Busy:
            refused.append("two behind")
        results["refused"] = (await store.load(h.session_id), refused)
        return results

    results = _run(scenario, box.url)
    assert results["exact"][0].tokens == [1, 2, 3, 4, 5]
    assert results["exact"][0].version == results["exact"][1] == 3
    assert results["more"][0].tokens == [1, 2, 3, 4, 5, 6, 7]
    assert results["more"][0].version == results["more"][1] == 3
    handle, refused = results["refused"]
    assert refused == ["owner-b", "owner-a", "owner-a", "two behind"]
    assert handle.tokens == [1, 2, 3, 4, 5, 6] and handle.version == 3


def test_new_requests_fail_fast_while_redis_is_down_and_work_after_restart(
        outage_mesh, box, target_model):
    """With Redis down, a new request, a continued session and CloseSession each get
    UNAVAILABLE in under 2 s, naming Redis and saying to retry; once Redis is back
    the very same requests succeed (the gateway's pooled connections are reconnected)."""
    model, tokenizer = target_model
    prompt = "def area(r):"
    with GatewayClient(outage_mesh.gateway_address) as client:
        kept = client.generate(build_request("import math\n", max_new_tokens=6,
                                             keep_session=True))
        box.kill()
        calls = {
            "new": lambda: client.generate(build_request(prompt, max_new_tokens=16)),
            "continue": lambda: client.generate(build_request("x", session_id=kept.session_id,
                                                              max_new_tokens=4)),
            "close": lambda: client.close_session(kept.session_id),
        }
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                call()
            elapsed = time.monotonic() - start
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
            assert "Redis" in err.value.details() and "retry" in err.value.details(), name
            assert elapsed < 2.0, f"{name} took {elapsed:.2f} s to fail"
        box.start()
        reply = client.generate(build_request(prompt, max_new_tokens=16))
        closed = client.close_session(kept.session_id)
    assert list(reply.token_ids) == hf_greedy(model, tokenizer(prompt)["input_ids"], 16)
    assert closed == len(tokenizer("import math\n")["input_ids"]) + len(kept.token_ids)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "ephemeral"])
def test_stream_goes_on_through_a_redis_restart_and_the_handle_is_exact(
        outage_mesh, box, target_model, keep):
    """Redis SIGKILLed after the first chunks of a long greedy stream, started again a second
    later: the stream completes with exactly the HF greedy tokens (the rounds during the
    outage kept their tokens pending and committed them all once Redis was back). A kept
    session's handle then holds exactly prompt + output and continues correctly; an
    ephemeral one is gone or, if Redis was still down at the end, a consistent prefix."""
    model, tokenizer = target_model
    prompt = "def tokenize(text):\n"
    prompt_ids = tokenizer(prompt)["input_ids"]
    with GatewayClient(outage_mesh.gateway_address) as client:
        stream = client.stream(build_request(prompt, max_new_tokens=200, num_draft_tokens=2,
                                             keep_session=keep))
        chunks = [next(stream), next(stream)]
        sid = chunks[0].session_id
        box.kill()
        restarter = threading.Timer(1.0, box.start)
        restarter.start()
        try:
            chunks += list(stream)
        finally:
            restarter.join(30)
        assert box.up
        tokens = [t for c in chunks for t in c.token_ids]
        ref = hf_greedy(model, prompt_ids, 200)
        assert tokens == ref
        # Offsets stay exact: every chunk starts where the previous one ended.
        offsets = [c.offset for c in chunks]
        assert offsets == [len(prompt_ids) + sum(len(c.token_ids) for c in chunks[:i])
                           for i in range(len(chunks))]
        # The outage did hit this stream: the gateway kept its tokens pending.
        log = outage_mesh.proc("gateway").log_path.read_text(errors="replace")
        assert any(sid in line and "stay pending" in line for line in log.splitlines())
        if keep:
            handle = _handle(box.url, sid)
            assert handle.tokens == prompt_ids + ref
            follow = "\n# test"
            turn2 = client.generate(build_request(follow, session_id=sid, max_new_tokens=12))
            client.close_session(sid)
            history = (prompt_ids + ref
                       + tokenizer(follow, add_special_tokens=False)["input_ids"])
            assert list(turn2.token_ids) == hf_greedy(model, history, 12)
        elif _exists(box.url, sid):  # deleted best-effort; if Redis was down, the TTL's job
            handle = _handle(box.url, sid)
            full = prompt_ids + ref
            assert handle.tokens == full[:len(handle.tokens)]


def test_kept_session_from_before_a_sigterm_continues_after_restart(
        outage_mesh, box, target_model):
    """A kept session created before Redis is stopped (SIGTERM) and started again continues
    exactly like one request on its whole history, and its handle holds exactly that."""
    model, tokenizer = target_model
    first, second = "class Stack:\n    def __init__(self):\n", "    def push(self, x):"
    with GatewayClient(outage_mesh.gateway_address) as client:
        turn1 = client.generate(build_request(first, max_new_tokens=30, keep_session=True,
                                              num_draft_tokens=3))
        box.kill(signal.SIGTERM)
        box.start()
        turn2 = client.generate(build_request(second, session_id=turn1.session_id,
                                              max_new_tokens=24, num_draft_tokens=3))
        history = (tokenizer(first)["input_ids"] + list(turn1.token_ids)
                   + tokenizer(second, add_special_tokens=False)["input_ids"])
        single = client.generate(build_request(prompt_token_ids=history, max_new_tokens=24))
        handle = _handle(box.url, turn1.session_id)
        closed = client.close_session(turn1.session_id)
    assert turn2.session_id == turn1.session_id
    assert list(turn2.token_ids) == list(single.token_ids) == hf_greedy(model, history, 24)
    assert handle.tokens == history + list(turn2.token_ids)
    assert closed == len(handle.tokens)


def test_kept_session_whose_redis_stays_down_fails_clearly_and_stays_consistent(
        outage_mesh, box, target_model):
    """If Redis is still down when a kept session's generation finishes, the gateway waits
    --store-outage-s, then answers UNAVAILABLE saying how many final tokens were not saved.
    After Redis is back the handle holds exactly the output minus those tokens, a prefix of
    the greedy output, and the session continues from there."""
    model, tokenizer = target_model
    prompt = "import os\nimport sys\n"
    prompt_ids = tokenizer(prompt)["input_ids"]
    ref = hf_greedy(model, prompt_ids, 200)
    with GatewayClient(outage_mesh.gateway_address) as client:
        stream = client.stream(build_request(prompt, max_new_tokens=200, num_draft_tokens=2,
                                             keep_session=True))
        chunks = [next(stream)]
        sid = chunks[0].session_id
        box.kill()
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for chunk in stream:
                chunks.append(chunk)
        waited = time.monotonic() - killed
        box.start()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        details = err.value.details()
        assert "could not be saved" in details and "Redis" in details
        assert OUTAGE_S - 0.5 < waited < OUTAGE_S + 20
        unsaved = int(re.search(r"last (\d+) tokens", details).group(1))
        received = [t for c in chunks for t in c.token_ids]
        assert received == ref[:len(received)] and len(received) < len(ref)  # no final chunk
        handle = _handle(box.url, sid)
        assert len(handle.tokens) + unsaved == len(prompt_ids) + len(ref)
        assert handle.tokens == (prompt_ids + ref)[:len(handle.tokens)]
        follow = "\nimport re"
        deadline = time.monotonic() + 15
        while True:  # the failed request's lease runs out at most lease_s after its last commit
            try:
                turn2 = client.generate(build_request(follow, session_id=sid,
                                                      max_new_tokens=12))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.ABORTED
                assert time.monotonic() < deadline
                time.sleep(0.2)
        client.close_session(sid)
    history = handle.tokens + tokenizer(follow, add_special_tokens=False)["input_ids"]
    assert list(turn2.token_ids) == hf_greedy(model, history, 12)
