"""The blocking Client is the AsyncClient on a private event loop thread, not a second client."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagoda.client import Client
from pagoda.client.errors import RequestCancelledError


def client_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "pagoda client"]


def test_the_blocking_client_opens_no_channel_of_its_own(fake_server, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the blocking client opened a grpc (sync) channel")

    monkeypatch.setattr(grpc, "insecure_channel", refuse)
    monkeypatch.setattr(grpc, "secure_channel", refuse)
    with Client(fake_server.target) as client:
        assert client.complete("hi", max_new_tokens=2).text == " t0 t1"
        assert [chunk.text for chunk in client.generate("hi", max_new_tokens=1)] == [" t0", ""]


def test_close_stops_the_loop_thread(fake_server):
    before = len(client_threads())
    client = Client(fake_server.target)
    assert len(client_threads()) == before + 1
    client.tokenize("a")
    client.close()
    client.close()  # idempotent
    assert len(client_threads()) == before


def test_a_dropped_client_stops_its_thread(fake_server):
    before = len(client_threads())
    client = Client(fake_server.target)
    assert client.tokenize("a") == [97]
    del client
    gc.collect()
    assert len(client_threads()) == before


def test_calls_from_several_threads_at_once(fake_server):
    def work(index: int) -> tuple[str, list[str]]:
        completion = client.complete([index], max_new_tokens=3, request_id=f"many-{index}")
        streamed = [chunk.text for chunk in client.generate("x y", max_new_tokens=2)]
        return completion.text, streamed

    with Client(fake_server.target) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(32)))
    assert results == [(" t0 t1 t2", [" t0", " t1", ""])] * 32


def test_closing_under_a_running_stream_cancels_it(fake_server):
    client = Client(fake_server.target)
    stream = client.generate("hang", request_id="closed-under")
    next(stream)
    threading.Timer(0.05, client.close).start()
    with pytest.raises(RequestCancelledError):
        list(stream)
    assert list(stream) == []
    assert fake_server.servicer.wait_cancelled("closed-under", timeout_s=10)
    with pytest.raises(ValueError):
        client.model_info()


def test_a_finalizer_that_runs_inside_run_does_not_deadlock(monkeypatch):
    """A collection inside `run`'s guarded region may finalize a dropped stream on the same
    thread, and its `__del__` calls `call_soon`: seen as a hang of the test above."""
    from pagoda.client import loop_thread as module

    loop = module.LoopThread("pagoda client")
    schedule = module.asyncio.run_coroutine_threadsafe

    def schedule_after_a_finalizer(coroutine, event_loop):
        loop.call_soon(lambda: None)  # what ChunkStream.__del__ does
        return schedule(coroutine, event_loop)

    monkeypatch.setattr(module.asyncio, "run_coroutine_threadsafe", schedule_after_a_finalizer)

    async def answer() -> int:
        return 42

    results: list[int] = []
    caller = threading.Thread(target=lambda: results.append(loop.run(answer())), daemon=True)
    caller.start()
    caller.join(timeout=30)
    monkeypatch.undo()
    deadlocked = caller.is_alive()
    if not deadlocked:
        loop.stop()
    assert not deadlocked and results == [42]
