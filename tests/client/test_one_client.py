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
    schedule = loop._loop.call_soon_threadsafe
    finalized: list[bool] = []

    def schedule_after_a_finalizer(callback, *args, **kwargs):
        if not finalized:  # inside run's guarded region, on run's thread
            finalized.append(True)
            loop.call_soon(lambda: None)  # what ChunkStream.__del__ does
        return schedule(callback, *args, **kwargs)

    monkeypatch.setattr(loop._loop, "call_soon_threadsafe", schedule_after_a_finalizer)

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
    assert not deadlocked and results == [42] and finalized


def test_an_interrupt_inside_python_level_locking_cannot_hang_stop(monkeypatch):
    """Ctrl-C raises KeyboardInterrupt between two bytecodes of whatever the main thread
    runs. Landing in threading.Condition's `__enter__` just after it took its lock, it
    leaves the lock held: `future.result()` waited on a concurrent.futures.Future's
    Condition here, the loop thread then blocked on that lock as it settled the future,
    and `stop()` (leaving `with Client`) joined it forever (`pagoda generate`'s exit, seen
    once in the suite: test_ctrl_c_cancels_the_stream_and_exits_130). Such an interrupt is
    made to land there at once; `run` must not wait through a Condition on its thread."""
    import asyncio

    from pagoda.client import loop_thread as module

    loop = module.LoopThread("pagoda client")
    caller = threading.current_thread()
    take = threading.Condition.__enter__

    def interrupted_after_taking_the_lock(condition):
        entered = take(condition)
        if threading.current_thread() is caller:
            raise KeyboardInterrupt  # the lock stays held, as it would
        return entered

    async def answer() -> int:
        await asyncio.sleep(0.2)  # long enough to be waited for
        return 42

    monkeypatch.setattr(threading.Condition, "__enter__", interrupted_after_taking_the_lock)
    try:
        result = loop.run(answer())
    except KeyboardInterrupt:
        result = None
    finally:
        monkeypatch.undo()
    assert stops(loop), "stop() hangs: the loop thread waits on a lock run's thread holds"
    assert result == 42


def test_ctrl_c_during_run_cancels_the_coroutine():
    """A SIGINT while `run` waits raises KeyboardInterrupt there and cancels the task (the
    RPC it awaits), and the loop still stops."""
    import asyncio
    import signal

    from pagoda.client import loop_thread as module

    loop = module.LoopThread("pagoda client")
    main = threading.get_ident()
    cancelled = threading.Event()

    async def forever() -> None:
        signal.pthread_kill(main, signal.SIGINT)  # the coroutine runs: interrupt the waiter
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run(forever())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stops(loop) and cancelled.is_set()


def stops(loop) -> bool:
    """Whether `loop.stop()` returns within 30 s (on a daemon thread, so that a hang fails
    the test, not the suite)."""
    stopper = threading.Thread(target=loop.stop, daemon=True)
    stopper.start()
    stopper.join(timeout=30)
    return not stopper.is_alive()
