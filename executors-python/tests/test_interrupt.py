"""Executor(interrupt_on_cancel=True): a cancel wakes a handler blocked in a system call."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from _harness import ByteCollector, FrameStream, PipeSession, cancel_frame, job_frame, which

import durable_executor
from durable_executor import Executor

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import os, select, signal, sys, time
    from durable_executor import Cancelled, Executor, Job

    ex = Executor("python", interrupt_on_cancel=True, stop_grace=0.5)

    @ex.handler("sleep")
    def sleep(job: Job) -> str:
        job.progress("sleeping")
        time.sleep(60)
        return "not reached"

    @ex.handler("select")
    def wait_select(job: Job) -> str:
        r, w = os.pipe()
        job.progress("selecting")
        select.select([r], [], [], 60)
        return "not reached"

    @ex.handler("read")
    def read(job: Job) -> str:
        r, w = os.pipe()
        job.progress("reading")
        os.read(r, 1)
        return "not reached"

    @ex.handler("catch")
    def catch(job: Job) -> str:
        job.progress("sleeping")
        try:
            time.sleep(60)
        except Cancelled as e:
            return f"caught: {e.reason}"
        return "not reached"

    @ex.handler("chatty")
    def chatty(job: Job) -> str:
        i = 0
        while True:  # frames in a tight loop: the interrupt must never cut one
            job.progress(f"event {i} " + "x" * (i % 5000))
            i += 1

    @ex.handler("quick")
    def quick(job: Job) -> str:
        return "quick"

    sys.exit(ex.run())
    """
)


@pytest.fixture
def executor_process(tmp_path):
    script = tmp_path / "interruptible.py"
    script.write_text(SCRIPT)
    procs = []

    def spawn(script_path=script):
        proc = subprocess.Popen(
            [sys.executable, str(script_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=PKG_ROOT),
            start_new_session=True,
        )
        procs.append(proc)
        frames = FrameStream(ByteCollector(proc.stdout))
        stderr = ByteCollector(proc.stderr)
        assert which(frames.next()) == "hello"
        return proc, frames, stderr

    yield spawn
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def send(proc, *frames) -> None:
    proc.stdin.write(b"".join(durable_executor.encode_frame(f.SerializeToString()) for f in frames))
    proc.stdin.flush()


@pytest.mark.parametrize("kind", ["sleep", "select", "read"])
def test_a_cancel_interrupts_a_handler_blocked_in_a_system_call(executor_process, kind):
    proc, frames, _ = executor_process()
    send(proc, job_frame(kind))
    assert [frames.next().event.kind for _ in range(3)] == [1, 2, 3]  # ACCEPTED, RUNNING, PROGRESS
    time.sleep(0.05)  # into the blocking call
    t0 = time.monotonic()
    send(proc, cancel_frame(message="stop now"))
    err = frames.next(timeout=5).error
    assert time.monotonic() - t0 < 1.0
    assert err.code == "CANCELLED" and not err.retryable
    assert json.loads(err.details) == {"reason": "REQUESTED"}
    assert "stop now" in err.message and "then raised" not in err.message
    # The executor serves the next job normally (persistent mode).
    send(proc, job_frame("quick", job_id="job-2"))
    assert frames.until_terminal()[-1].result.output == b'"quick"'
    proc.stdin.close()
    assert proc.wait(10) == 0


def test_a_handler_may_catch_the_interrupt_and_return(executor_process):
    proc, frames, _ = executor_process()
    send(proc, job_frame("catch"))
    frames.next(), frames.next(), frames.next()
    time.sleep(0.05)
    send(proc, cancel_frame())
    frame = frames.next(timeout=5)
    assert which(frame) == "result" and frame.result.output == b'"caught: REQUESTED"'


def test_the_interrupt_never_cuts_a_frame(executor_process):
    proc, frames, _ = executor_process()
    for n in range(5):
        send(proc, job_frame("chatty", job_id=f"job-{n}"))
        frames.next(), frames.next()
        first = frames.next()
        assert first.event.message.startswith("event 0")
        time.sleep(0.02 * n)
        send(proc, cancel_frame(job_id=f"job-{n}"))
        rest = frames.until_terminal(timeout=10)  # every frame parses
        assert rest[-1].error.code == "CANCELLED"
        seqs = [f.event.sequence for f in rest[:-1]]
        assert seqs == list(range(4, 4 + len(seqs)))
        assert rest[-1].error.sequence == 4 + len(seqs)
    proc.stdin.close()
    assert proc.wait(10) == 0
    frames.collector.wait_eof(5)
    assert frames.rest() == b""


def test_without_interrupt_a_blocked_handler_stays_blocked(executor_process, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT.replace("interrupt_on_cancel=True", "interrupt_on_cancel=False"))
    proc, frames, _ = executor_process(script)
    send(proc, job_frame("sleep"))
    frames.next(), frames.next(), frames.next()
    send(proc, cancel_frame())
    frames.expect_no_frame(0.5)
    proc.stdin.close()  # stdin ends: stop_grace (0.5 s), then the process exits 1
    assert proc.wait(10) == 1


def test_interrupt_needs_the_main_thread():
    ex = Executor("python", interrupt_on_cancel=True)
    s = PipeSession(ex)  # serve() on another thread
    try:
        with pytest.raises(RuntimeError, match="main thread"):
            s.wait()
    finally:
        s.close()
    assert threading.current_thread() is threading.main_thread()


STRAY_THREAD_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from durable_executor import Executor, Job

    ex = Executor("python")

    @ex.handler("linger")
    def linger(job: Job) -> str:
        threading.Thread(target=time.sleep, args=(30,), name="lingering").start()
        return "started"

    sys.exit(ex.run())
    """
)


def test_a_thread_a_handler_left_running_does_not_hold_an_idle_executor(executor_process, tmp_path):
    """EOF on stdin while idle ends the process at once, with exit 0, even with a
    non-daemon thread a handler started still running: Python's exit waited for it
    (30 s here; SDK audit 89: 20 s, and the supervisor signalled the group)."""
    script = tmp_path / "stray_thread.py"
    script.write_text(STRAY_THREAD_SCRIPT)
    proc, frames, stderr = executor_process(script)
    send(proc, job_frame("linger"))
    assert frames.until_terminal()[-1].result.output == b'"started"'
    t0 = time.monotonic()
    proc.stdin.close()
    assert proc.wait(10) == 0
    assert time.monotonic() - t0 < 5.0
    stderr.wait_eof(5)
    assert b"1 thread(s) still run ('lingering')" in stderr.data
