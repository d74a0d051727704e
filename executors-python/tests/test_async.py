"""``async def`` handlers: run on an event loop, cancelled through it."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from _harness import PipeSession, cancel_frame, job_frame, which

from durable_executor import Cancelled, Executor, ExecutorError, Job
from durable_executor._gen.durable.executor.v1 import executor_pb2 as pb


def start(s: PipeSession, kind: str, **fields) -> None:
    s.hello()
    s.send(job_frame(kind, **fields))
    assert s.frames.next().event.kind == pb.EVENT_KIND_ACCEPTED
    assert s.frames.next().event.kind == pb.EVENT_KIND_RUNNING


def test_an_async_handler_returns_its_result_and_sends_events(session_factory):
    ex = Executor("python")
    loops = []

    @ex.handler("fetch")
    async def fetch(job: Job) -> dict[str, object]:
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0.01)
        job.progress("half", fraction=0.5)
        return {"n": job.input["n"] * 2}

    s = session_factory(ex)
    s.hello()
    for i in range(2):
        s.send(job_frame("fetch", {"n": i + 1}, job_id=f"j{i}"))
        frames = s.frames.until_terminal()
        assert [which(f) for f in frames] == ["event", "event", "event", "result"]
        assert frames[2].event.fraction == 0.5
        assert json.loads(frames[-1].result.output) == {"n": 2 * (i + 1)}
    # A persistent executor's async jobs share one loop (loop-bound clients survive).
    assert loops[0] is loops[1]
    s.close_input()
    assert s.wait() == 0


def test_a_cancel_cancels_the_handlers_task(session_factory):
    ex = Executor("python")
    seen = []
    started = threading.Event()

    @ex.handler("slow")
    async def slow(job: Job) -> str:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError as e:
            seen.append((str(e), job.cancelled, job.cancel_reason))
            raise
        return "not reached"

    s = session_factory(ex)
    start(s, "slow")
    assert started.wait(5)
    t0 = time.monotonic()
    s.send(cancel_frame(message="operator asked"))
    err = s.frames.next(timeout=5).error
    assert time.monotonic() - t0 < 0.5
    assert err.code == "CANCELLED" and not err.retryable
    assert json.loads(err.details) == {"reason": "REQUESTED"}
    assert "operator asked" in err.message
    assert "then raised" not in err.message
    assert seen == [("job cancelled (REQUESTED): operator asked", True, "REQUESTED")]


def test_an_async_handler_that_returns_after_the_cancel_has_its_result_sent(session_factory):
    ex = Executor("python")

    @ex.handler("stubborn")
    async def stubborn(job: Job) -> dict[str, bool]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return {"finished_after_cancel": True}
        return {"finished_after_cancel": False}

    s = session_factory(ex)
    start(s, "stubborn")
    time.sleep(0.05)
    s.send(cancel_frame())
    frame = s.frames.next(timeout=5)
    assert which(frame) == "result", frame
    assert json.loads(frame.result.output) == {"finished_after_cancel": True}


def test_other_errors_after_the_cancel_are_cancelled_and_before_it_are_theirs(session_factory):
    ex = Executor("python")

    @ex.handler("cleanup-fails")
    async def cleanup_fails(job: Job) -> None:
        try:
            await asyncio.sleep(30)
        finally:
            raise ExecutorError("CLEANUP_FAILED", "could not clean up")

    @ex.handler("fails")
    async def fails(job: Job) -> None:
        await asyncio.sleep(0)
        raise ExecutorError("NOPE", "no", retryable=False)

    @ex.handler("gives-up")
    async def gives_up(job: Job) -> None:
        raise asyncio.CancelledError()  # no cancel requested: the handler's own CANCELLED

    s = session_factory(ex)
    start(s, "cleanup-fails")
    time.sleep(0.05)
    s.send(cancel_frame())
    err = s.frames.next(timeout=5).error
    assert err.code == "CANCELLED"
    assert "then raised ExecutorError: CLEANUP_FAILED: could not clean up" in err.message
    # and in the details, for the supervisor to keep beside its own cancel
    handler_error = json.loads(err.details)["handler_error"]
    assert handler_error == "ExecutorError: CLEANUP_FAILED: could not clean up"

    s.send(job_frame("fails", job_id="j2"))
    err = s.frames.until_terminal()[-1].error
    assert (err.code, err.retryable) == ("NOPE", False)

    s.send(job_frame("gives-up", job_id="j3"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "CANCELLED" and "by the handler" in err.message


def test_a_cancel_between_running_and_the_tasks_start_still_cancels_it(
    session_factory, monkeypatch
):
    """The cancel lands after RUNNING but before the task exists: the task is
    cancelled at its first await, and a handler that never awaits keeps its result."""
    import durable_executor.executor as executor_module

    gate = threading.Event()
    original = executor_module._Session.run_coroutine

    def delayed(self, job, coro):
        assert gate.wait(5)
        return original(self, job, coro)

    monkeypatch.setattr(executor_module._Session, "run_coroutine", delayed)
    ex = Executor("python")

    @ex.handler("awaits")
    async def awaits(job: Job) -> str:
        await asyncio.sleep(30)
        return "not reached"

    @ex.handler("no-await")
    async def no_await(job: Job) -> str:
        return f"done, cancelled={job.cancelled}"

    s = session_factory(ex)
    start(s, "awaits")
    s.send(cancel_frame())
    time.sleep(0.1)
    gate.set()
    assert s.frames.next(timeout=5).error.code == "CANCELLED"

    gate.clear()
    s.send(job_frame("no-await", job_id="j2"))
    s.frames.next()
    s.frames.next()
    s.send(cancel_frame(job_id="j2"))
    time.sleep(0.1)
    gate.set()
    frame = s.frames.next(timeout=5)
    assert which(frame) == "result" and frame.result.output == b'"done, cancelled=True"'


def test_cancelled_is_not_swallowed_by_except_exception(session_factory):
    assert issubclass(Cancelled, BaseException) and not issubclass(Cancelled, Exception)
    ex = Executor("python")
    swallowed = []

    @ex.handler("careless")
    def careless(job: Job) -> str:
        while True:
            try:
                job.sleep(30)
            except Exception as e:  # the usual over-broad handler: Cancelled goes through
                swallowed.append(e)

    s = session_factory(ex)
    start(s, "careless")
    time.sleep(0.05)
    s.send(cancel_frame())
    err = s.frames.next(timeout=5).error
    assert err.code == "CANCELLED" and "then raised" not in err.message
    assert swallowed == []
