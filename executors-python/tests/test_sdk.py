"""The SDK's protocol behaviour, driven through os.pipe pairs (serve() on a thread)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from _harness import (
    ByteCollector,
    FrameStream,
    cancel_frame,
    is_terminal,
    job_frame,
    sequence_of,
    shutdown_frame,
    which,
)

import durable_executor
import durable_executor.executor as executor_module
from durable_executor import (
    Artifact,
    Cancelled,
    Executor,
    ExecutorError,
    Job,
    Result,
    wire,
)
from durable_executor._gen.durable.executor.v1 import executor_pb2 as pb

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def events(frames, kind=None):
    out = [f.event for f in frames if which(f) == "event"]
    return [e for e in out if kind is None or e.kind == kind]


def assert_lifecycle(frames):
    """ACCEPTED(1), RUNNING(2), ..., one terminal last; sequences strictly increasing."""
    assert which(frames[0]) == "event"
    assert frames[0].event.kind == pb.EVENT_KIND_ACCEPTED
    assert frames[0].event.sequence == 1
    assert frames[1].event.kind == pb.EVENT_KIND_RUNNING
    assert frames[1].event.sequence == 2
    assert is_terminal(frames[-1])
    assert not any(is_terminal(f) for f in frames[:-1])
    seqs = [sequence_of(f) for f in frames]
    assert seqs == sorted(set(seqs)), f"sequences not strictly increasing: {seqs}"


def test_hello_is_sent_first_with_the_executor_description(session_factory):
    ex = Executor("python", {"zone": "a", "gpu": "none"}, advertise_kinds=["x.only-advertised"])
    ex.handler("b.kind")(lambda job: None)
    ex.handler("a.kind")(lambda job: None)
    s = session_factory(ex)
    hello = s.hello()
    assert hello.protocol_version == pb.PROTOCOL_VERSION_1
    assert hello.executor_kind == "python"
    assert list(hello.kinds) == ["a.kind", "b.kind", "x.only-advertised"]
    assert dict(hello.labels) == {"zone": "a", "gpu": "none"}
    assert hello.sdk_name == "durable-executor-python"
    assert hello.sdk_version == durable_executor.__version__
    assert hello.max_jobs_per_process == -1
    assert hello.pid == os.getpid()
    s.close_input()
    assert s.wait() == 0  # EOF while idle: clean exit


def test_echo_job_gets_every_field_and_returns_its_output(session_factory, tmp_path):
    seen = {}
    ex = Executor("python")

    @ex.handler("demo.echo")
    def echo(job: Job):
        seen.update(
            job_id=job.job_id,
            workflow_run_id=job.workflow_run_id,
            step_run_id=job.step_run_id,
            idempotency_key=job.idempotency_key,
            executor_kind=job.executor_kind,
            kind=job.kind,
            attempt=job.attempt,
            deadline_unix_ms=job.deadline_unix_ms,
            attempt_deadline_unix_ms=job.attempt_deadline_unix_ms,
            heartbeat_timeout_ms=job.heartbeat_timeout_ms,
            input_bytes=job.input_bytes,
            output_dir=job.output_dir,
            secrets=job.secrets,
            labels=job.labels,
            artifacts=[(a.id, a.name, a.path, a.size, a.step_name) for a in job.input_artifacts],
            checkpoint=job.checkpoint,
            remaining=job.time_remaining(),
        )
        return job.input

    s = session_factory(ex)
    s.hello()
    deadline = int(time.time() * 1000) + 60_000
    s.send(
        job_frame(
            "demo.echo",
            {"b": [1, 2.5, None], "a": "é"},
            attempt=4,
            deadline_unix_ms=deadline,
            attempt_deadline_unix_ms=deadline - 30_000,
            heartbeat_timeout_ms=5000,
            output_dir=str(tmp_path),
            secrets={"TOKEN": "s3cr3t"},
            labels={"zone": "a"},
            input_artifacts=[
                pb.ArtifactRef(id="art-1", name="in", path="/tmp/in", size=3, step_name="prev")
            ],
        )
    )
    frames = s.frames.until_terminal()
    assert_lifecycle(frames)
    assert len(frames) == 3
    result = frames[-1].result
    assert result.job_id == "job-1"
    assert json.loads(result.output) == {"b": [1, 2.5, None], "a": "é"}
    assert seen["attempt"] == 4
    assert seen["deadline_unix_ms"] == deadline
    assert seen["attempt_deadline_unix_ms"] == deadline - 30_000
    assert seen["heartbeat_timeout_ms"] == 5000
    assert seen["idempotency_key"] == "idem-1"
    assert seen["workflow_run_id"] == "run-1"
    assert seen["step_run_id"] == "step-1"
    assert seen["executor_kind"] == "python"
    assert seen["kind"] == "demo.echo"
    assert seen["output_dir"] == str(tmp_path)
    assert seen["secrets"] == {"TOKEN": "s3cr3t"}
    assert seen["labels"] == {"zone": "a"}
    assert seen["artifacts"] == [("art-1", "in", "/tmp/in", 3, "prev")]
    assert seen["checkpoint"] is None
    assert 25 < seen["remaining"] <= 30  # the earlier of the two deadlines
    s.close_input()
    assert s.wait() == 0


def test_unknown_kind_is_refused_before_accepted(session_factory):
    ex = Executor("python", advertise_kinds=["demo.ghost"])
    ex.handler("demo.echo")(lambda job: 1)
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("demo.ghost", {}))
    frame = s.frames.next()
    assert which(frame) == "error", "a refusal is a JobError with no ACCEPTED before it"
    err = frame.error
    assert err.code == "UNSUPPORTED_KIND"
    assert err.sequence == 1
    assert err.job_id == "job-1"
    assert not err.retryable
    assert "demo.ghost" in err.message
    assert json.loads(err.details) == {"kind": "demo.ghost", "handled_kinds": ["demo.echo"]}
    # The executor serves the next job normally.
    s.send(job_frame("demo.echo", None, job_id="job-2"))
    frames = s.frames.until_terminal()
    assert_lifecycle(frames)
    assert frames[-1].result.output == b"1"
    s.close_input()
    assert s.wait() == 0


def test_cancel_ends_a_sleeping_handler_quickly(session_factory):
    started = threading.Event()
    ex = Executor("python")

    @ex.handler("slow")
    def slow(job: Job):
        started.set()
        job.sleep(30)
        return "not reached"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("slow"))
    assert s.frames.next().event.kind == pb.EVENT_KIND_ACCEPTED
    assert s.frames.next().event.kind == pb.EVENT_KIND_RUNNING
    assert started.wait(5)
    t0 = time.monotonic()
    s.send(cancel_frame(message="operator asked"))
    frame = s.frames.next(timeout=5)
    elapsed = time.monotonic() - t0
    assert which(frame) == "error"
    assert frame.error.code == "CANCELLED"
    assert not frame.error.retryable
    assert frame.error.sequence == 3
    assert "operator asked" in frame.error.message
    assert json.loads(frame.error.details) == {"reason": "REQUESTED"}
    assert elapsed < 0.5, f"cancel took {elapsed:.3f}s"
    s.close_input()
    assert s.wait() == 0


def test_any_exception_after_cancel_is_reported_as_cancelled(session_factory):
    ex = Executor("python")

    @ex.handler("polling")
    def polling(job: Job):
        while not job.cancelled:
            time.sleep(0.005)
        assert job.cancel_reason == "DEADLINE"
        raise ExecutorError("SOMETHING_ELSE", "cleanup failed")

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("polling"))
    s.frames.next()
    s.frames.next()
    s.send(cancel_frame(reason=pb.CANCEL_REASON_DEADLINE))
    err = s.frames.next().error
    assert err.code == "CANCELLED"
    assert not err.retryable
    # the handler's own error in the details too, for the supervisor to keep
    assert json.loads(err.details) == {
        "reason": "DEADLINE",
        "handler_error": "ExecutorError: SOMETHING_ELSE: cleanup failed",
    }
    assert "then raised ExecutorError: SOMETHING_ELSE: cleanup failed" in err.message


def test_a_result_returned_after_cancel_is_sent(session_factory):
    """The terminal reflects what the handler did: a handler that ignores the cancel and
    returns has finished, and its result goes out (the supervisor keeps it)."""
    ex = Executor("python")
    seen = []

    @ex.handler("stubborn")
    def stubborn(job: Job):
        assert job.cancel_event.wait(5)
        seen.append((job.cancelled, job.cancel_reason, job.cancel_grace_ms))
        return {"finished_after_cancel": True}

    @ex.handler("none")
    def returns_none(job: Job):
        assert job.cancel_event.wait(5)

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("stubborn"))
    s.frames.next()
    s.frames.next()
    s.send(cancel_frame())
    frame = s.frames.next()
    assert which(frame) == "result", frame
    assert frame.result.sequence == 3
    assert json.loads(frame.result.output) == {"finished_after_cancel": True}

    # Returning None is a result too (output null).
    s.send(job_frame("none", job_id="job-2"))
    s.frames.next()
    s.frames.next()
    s.send(cancel_frame(job_id="job-2"))
    frame = s.frames.next()
    assert which(frame) == "result", frame
    assert frame.result.output == b"null"

    # stdin closing mid-job cancels the same way; the result still goes out.
    s.send(job_frame("stubborn", job_id="job-3"))
    s.frames.next()
    s.frames.next()
    s.close_input()
    frame = s.frames.next(timeout=5)
    assert which(frame) == "result", frame
    assert json.loads(frame.result.output) == {"finished_after_cancel": True}
    assert s.wait() == 0
    assert seen == [(True, "REQUESTED", 1000), (True, "STDIN_CLOSED", 0)]


def test_stopping_on_cancel_is_cancelled(session_factory):
    """Raising Cancelled (raise_if_cancelled, job.sleep) after a cancel is CANCELLED."""
    ex = Executor("python")

    @ex.handler("polling")
    def polling(job: Job):
        while not job.cancelled:
            time.sleep(0.005)
        job.raise_if_cancelled()
        return "not reached"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("polling"))
    s.frames.next()
    s.frames.next()
    s.send(cancel_frame(message="operator asked"))
    err = s.frames.next().error
    assert err.code == "CANCELLED" and not err.retryable
    assert err.sequence == 3
    assert json.loads(err.details) == {"reason": "REQUESTED"}
    assert "operator asked" in err.message
    assert "then raised" not in err.message


def test_unexpected_exception_is_handler_error_without_secrets(session_factory, capfd):
    ex = Executor("python")

    @ex.handler("boom")
    def boom(job: Job):
        raise RuntimeError(f"could not log in with {job.secrets['TOKEN']}")

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("boom", secrets={"TOKEN": "hunter2-secret"}))
    frames = s.frames.until_terminal()
    assert_lifecycle(frames)
    err = frames[-1].error
    assert err.code == "HANDLER_ERROR"
    assert err.retryable
    assert err.message == "RuntimeError: could not log in with [REDACTED]"
    assert b"hunter2-secret" not in bytes(s.frames.collector.data)
    s.close_input()
    assert s.wait() == 0
    logged = capfd.readouterr().err
    assert "RuntimeError" in logged  # the traceback is logged to stderr...
    assert "hunter2-secret" not in logged  # ...scrubbed


def test_executor_error_maps_to_job_error(session_factory):
    ex = Executor("python")

    @ex.handler("fails")
    def fails(job: Job):
        raise ExecutorError(
            "RATE_LIMITED",
            "slow down",
            retryable=False,
            details={"limit": 10, "key": job.secrets["K"]},
            next_retry_delay_ms=2500,
        )

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("fails", secrets={"K": "topsecret"}))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "RATE_LIMITED"
    assert err.message == "slow down"
    assert not err.retryable
    assert json.loads(err.details) == {"limit": 10, "key": "[REDACTED]"}
    assert err.HasField("next_retry_delay_ms")
    assert err.next_retry_delay_ms == 2500


def test_sys_exit_in_a_handler_is_its_error_and_serving_goes_on(session_factory):
    """sys.exit() (or a library's) in a handler used to end the process with status 0
    and no terminal; it is the handler's failure (Go: runtime.Goexit is HANDLER_PANIC)."""
    import asyncio

    async def async_exit(job: Job):
        await asyncio.sleep(0)
        sys.exit("bye")

    def exit_after_cancel(job: Job):
        job.progress("waiting")
        job.cancel_event.wait(10)
        sys.exit(0)

    ex = Executor("python")
    ex.handler("exit3")(lambda job: sys.exit(3))
    ex.handler("exit")(lambda job: sys.exit())
    ex.handler("async-exit")(async_exit)
    ex.handler("exit-after-cancel")(exit_after_cancel)
    ex.handler("echo")(lambda job: job.input)
    s = session_factory(ex)
    s.hello()
    for i, (kind, code) in enumerate([("exit3", "3"), ("exit", "None"), ("async-exit", "'bye'")]):
        s.send(job_frame(kind, job_id=f"job-{i}"))
        err = s.frames.until_terminal()[-1].error
        assert err.code == "HANDLER_ERROR" and err.retryable, (kind, err)
        assert "SystemExit" in err.message and f"exit code {code}" in err.message, (kind, err)
    s.send(job_frame("exit-after-cancel", job_id="job-c"))
    assert s.frames.next().event.kind == pb.EVENT_KIND_ACCEPTED
    assert s.frames.next().event.kind == pb.EVENT_KIND_RUNNING
    assert s.frames.next().event.message == "waiting"
    s.send(cancel_frame("job-c"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "CANCELLED" and "SystemExit" in err.message
    s.send(job_frame("echo", "still serving", job_id="job-e"))
    assert s.frames.until_terminal()[-1].result.output == b'"still serving"'
    s.close_input()
    assert s.wait() == 0


def test_executor_error_validates_its_arguments():
    with pytest.raises(ValueError, match="UPPER_SNAKE_CASE"):
        ExecutorError("not-upper")
    with pytest.raises(TypeError, match="JSON object"):
        ExecutorError("X", details=[1])
    # any Mapping, as the annotation says (a read-only view was refused)
    import types

    proxied = ExecutorError("X", details=types.MappingProxyType({"a": 1}))
    assert proxied.details == {"a": 1}
    with pytest.raises(ValueError, match="next_retry_delay_ms"):
        ExecutorError("X", next_retry_delay_ms=-1)
    err = ExecutorError("X_1")
    assert err.retryable and err.details is None and err.next_retry_delay_ms is None


def test_bad_json_input_is_bad_input_and_bad_output_is_output_invalid(session_factory):
    ex = Executor("python")
    ex.handler("reads")(lambda job: job.input)
    ex.handler("bad-output")(lambda job: {"not json": object()})
    ex.handler("bad-raw-output")(lambda job: Result(output_json=b"{nope"))
    ex.handler("nan-output")(lambda job: float("nan"))
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("reads", raw_input=b"{not json"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "BAD_INPUT"
    assert not err.retryable
    assert "not valid JSON" in err.message
    s.send(job_frame("bad-output", job_id="job-2"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "OUTPUT_INVALID"
    assert not err.retryable
    assert "not JSON-serializable" in err.message
    s.send(job_frame("bad-raw-output", job_id="job-3"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "OUTPUT_INVALID"
    assert "not valid JSON (5 bytes)" in err.message
    s.send(job_frame("nan-output", job_id="job-4"))
    assert s.frames.until_terminal()[-1].error.code == "OUTPUT_INVALID"


def test_raw_output_is_checked_as_the_supervisor_checks_it(session_factory):
    """``output_json`` bytes are refused as OUTPUT_INVALID where the supervisor would refuse
    them, never by a crash of the process (audit 94: nesting past Python's recursion limit
    ended the process, EXECUTOR_CRASHED, retried), and kept where it keeps them: empty
    bytes are ``null``, an integer of any length is JSON."""
    ex = Executor("python")
    deep = b"[" * 5000 + b"]" * 5000
    big = b'{"x": 1' + b"0" * 5000 + b"}"
    ex.handler("deep")(lambda job: Result(output_json=deep))
    ex.handler("empty")(lambda job: Result(output_json=b""))
    ex.handler("big")(lambda job: Result(output_json=big))
    ex.handler("nan")(lambda job: Result(output_json=b"[NaN]"))
    ex.handler("reads")(lambda job: job.input)
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("deep", job_id="deep"))
    err = s.frames.until_terminal()[-1].error
    assert (err.code, err.retryable) == ("OUTPUT_INVALID", False), err
    assert "nests deeper" in err.message
    s.send(job_frame("empty", job_id="empty"))
    res = s.frames.until_terminal()[-1]
    assert res.WhichOneof("frame") == "result" and res.result.output == b""
    s.send(job_frame("big", job_id="big"))
    assert s.frames.until_terminal()[-1].result.output == big
    s.send(job_frame("nan", job_id="nan"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "OUTPUT_INVALID" and "NaN is not JSON" in err.message, err
    # valid JSON beyond int()'s digits is not called invalid JSON
    s.send(job_frame("reads", job_id="reads", raw_input=b'{"x": 1' + b"0" * 5000 + b"}"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "BAD_INPUT" and "not valid JSON" not in err.message, err
    assert "sys.set_int_max_str_digits()" in err.message


def test_json_the_interpreter_cannot_read_is_said_to_be_so_not_a_handler_error(session_factory):
    """A checkpoint (or an input) nested past the recursion limit is BAD_CHECKPOINT (or
    BAD_INPUT), not retried: as a RecursionError it was HANDLER_ERROR, retried to fail alike
    (audit 95); one with a long integer names the interpreter's digit limit; a fraction of
    an integer past a float is clamped, not a handler error."""
    ex = Executor("python")
    ex.handler("resume")(lambda job: job.checkpoint_json())
    ex.handler("reads")(lambda job: job.input)

    @ex.handler("huge-fraction")
    def huge(job: Job) -> str:
        job.progress("past", fraction=10**400)
        job.progress("below", fraction=-(10**400))
        return "ok"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("resume", job_id="deep-cp", checkpoint=b"[" * 5000 + b"]" * 5000))
    err = s.frames.until_terminal()[-1].error
    assert (err.code, err.retryable) == ("BAD_CHECKPOINT", False), err
    assert "nests deeper than this interpreter parses" in err.message
    s.send(job_frame("resume", job_id="big-cp", checkpoint=b"[1" + b"0" * 5000 + b"]"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "BAD_CHECKPOINT" and "sys.set_int_max_str_digits()" in err.message, err
    s.send(job_frame("reads", job_id="deep-in", raw_input=b"[" * 5000 + b"]" * 5000))
    err = s.frames.until_terminal()[-1].error
    assert (err.code, err.retryable) == ("BAD_INPUT", False), err
    s.send(job_frame("huge-fraction", job_id="frac"))
    frames = s.frames.until_terminal()
    assert frames[-1].result.output == b'"ok"'
    assert [e.fraction for e in events(frames, pb.EVENT_KIND_PROGRESS)] == [1.0, 0.0]


def test_sequences_strictly_increase_with_events_from_several_threads(session_factory):
    ex = Executor("python")

    @ex.handler("chatty")
    def chatty(job: Job):
        def worker(n):
            for i in range(25):
                job.progress(f"worker {n} step {i}", fraction=i / 25)
                job.heartbeat()

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        job.save_checkpoint(b"cp")
        return "done"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("chatty"))
    frames = s.frames.until_terminal()
    assert_lifecycle(frames)
    assert len(frames) == 2 + 4 * 25 * 2 + 1 + 1
    assert [sequence_of(f) for f in frames] == list(range(1, len(frames) + 1))
    progress = events(frames, pb.EVENT_KIND_PROGRESS)
    assert len(progress) == 100
    assert all(e.HasField("fraction") and not e.HasField("checkpoint") for e in progress)
    heartbeats = events(frames, pb.EVENT_KIND_HEARTBEAT)
    assert heartbeats[-1].checkpoint == b"cp"
    assert all(e.at_unix_ms > 0 for e in events(frames))


def test_checkpoint_absent_empty_and_present_and_reported(session_factory):
    seen = []
    ex = Executor("python")

    @ex.handler("cp")
    def cp(job: Job):
        seen.append(job.checkpoint)
        job.progress("saving", checkpoint=b"state-" + str(job.attempt).encode())
        job.progress("no checkpoint here")
        return None

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("cp", job_id="absent"))
    first = s.frames.until_terminal()
    s.send(job_frame("cp", job_id="empty", checkpoint=b""))
    s.frames.until_terminal()
    s.send(job_frame("cp", job_id="present", checkpoint=b"\x00abc", attempt=2))
    s.frames.until_terminal()
    assert seen == [None, b"", b"\x00abc"]
    progress = events(first, pb.EVENT_KIND_PROGRESS)
    assert progress[0].HasField("checkpoint") and progress[0].checkpoint == b"state-1"
    assert not progress[1].HasField("checkpoint")
    assert first[-1].result.output == b"null"


def test_persistent_mode_restarts_sequences_per_job(session_factory):
    ex = Executor("python")
    ex.handler("n")(lambda job: job.input["n"])
    s = session_factory(ex)
    s.hello()
    for i in range(3):
        s.send(job_frame("n", {"n": i}, job_id=f"job-{i}"))
        frames = s.frames.until_terminal()
        assert_lifecycle(frames)
        assert {f.event.job_id for f in frames[:-1]} == {f"job-{i}"}
        assert frames[-1].result.output == str(i).encode()
    s.close_input()
    assert s.wait() == 0


def test_max_jobs_per_process_one_exits_after_the_first_job(session_factory):
    ex = Executor("python", max_jobs_per_process=1)
    ex.handler("n")(lambda job: 7)
    s = session_factory(ex)
    assert s.hello().max_jobs_per_process == 1
    s.send(job_frame("n"))
    assert s.frames.until_terminal()[-1].result.output == b"7"
    assert s.wait() == 0  # without EOF or Shutdown


def test_shutdown_when_idle_exits_zero(session_factory):
    ex = Executor("python")
    ex.handler("n")(lambda job: 1)
    s = session_factory(ex)
    s.hello()
    s.send(shutdown_frame())
    assert s.wait() == 0  # stdin still open


def test_shutdown_during_a_job_lets_it_finish(session_factory):
    release = threading.Event()
    ex = Executor("python")

    @ex.handler("wait")
    def wait(job: Job):
        assert release.wait(5)
        return {"cancelled": job.cancelled}

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("wait"))
    s.frames.next()
    s.frames.next()
    s.send(shutdown_frame())
    time.sleep(0.05)
    release.set()
    result = s.frames.until_terminal()[-1].result
    assert json.loads(result.output) == {"cancelled": False}
    assert s.wait() == 0


def test_eof_during_a_job_cancels_it_and_still_sends_the_terminal(session_factory):
    ex = Executor("python")
    ex.handler("slow")(lambda job: job.sleep(30))
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("slow"))
    s.frames.next()
    s.frames.next()
    s.close_input()
    err = s.frames.next(timeout=5).error
    assert err.code == "CANCELLED"
    assert json.loads(err.details) == {"reason": "STDIN_CLOSED"}
    assert s.wait() == 0


def test_cancel_before_the_handler_starts_skips_the_handler(session_factory, monkeypatch):
    calls = []
    gate = threading.Event()
    original = executor_module._Session.run_job

    def delayed_run_job(self, job):
        assert gate.wait(5)  # hold the job between its receipt and its start
        original(self, job)

    monkeypatch.setattr(executor_module._Session, "run_job", delayed_run_job)
    ex = Executor("python")
    ex.handler("k")(lambda job: calls.append(job.job_id))
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("k"), cancel_frame())
    time.sleep(0.1)  # the reader thread applies the cancel meanwhile
    gate.set()
    frames = s.frames.until_terminal()
    assert [which(f) for f in frames] == ["event", "error"]
    assert frames[0].event.kind == pb.EVENT_KIND_ACCEPTED  # not a refusal: it is an outcome
    assert frames[1].error.code == "CANCELLED" and frames[1].error.sequence == 2
    assert calls == []


def test_a_job_while_another_runs_is_refused_busy(session_factory):
    gate = threading.Event()
    ex = Executor("python")

    @ex.handler("first")
    def first(job: Job):
        assert gate.wait(5)
        return 1

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("first", job_id="a"))
    s.frames.next()
    s.frames.next()
    s.send(job_frame("first", job_id="b"))
    refusal = s.frames.next().error
    assert refusal.job_id == "b"
    assert refusal.code == "EXECUTOR_BUSY"
    assert refusal.sequence == 1
    assert "'a' is still running" in refusal.message
    gate.set()
    assert s.frames.until_terminal()[-1].result.output == b"1"
    # Once "a" has its terminal, the next job is welcome.
    s.send(job_frame("first", job_id="c"))
    assert s.frames.until_terminal()[-1].result.job_id == "c"


def test_shutdown_then_eof_lets_the_running_job_finish(session_factory):
    release = threading.Event()
    ex = Executor("python")

    @ex.handler("wait")
    def wait(job: Job):
        assert release.wait(5)
        return {"cancelled": job.cancelled}

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("wait"))
    s.frames.next()
    s.frames.next()
    s.send(shutdown_frame())
    s.close_input()
    time.sleep(0.05)
    release.set()
    assert json.loads(s.frames.until_terminal()[-1].result.output) == {"cancelled": False}
    assert s.wait() == 0


def test_malformed_input_frame_cancels_the_job_and_exits_one(session_factory):
    ex = Executor("python")
    ex.handler("slow")(lambda job: job.sleep(30))
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("slow"))
    s.frames.next()
    s.frames.next()
    s.send_raw(b"\x05\xff\xff\xff\xff\xff")  # a 5-byte body that is not a SupervisorFrame
    err = s.frames.next(timeout=5).error
    assert err.code == "CANCELLED"
    assert json.loads(err.details) == {"reason": "PROTOCOL_ERROR"}
    assert "invalid frame from the supervisor" in err.message
    assert s.wait() == 1


def test_oversize_input_frame_is_a_protocol_error(session_factory):
    ex = Executor("python", max_frame_bytes=1024)
    ex.handler("k")(lambda job: 1)
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("k", raw_input=b'"' + b"x" * 2000 + b'"'))
    assert s.wait() == 1  # nothing was run
    s.frames.collector.wait_eof(5)
    assert s.frames.rest() == b""  # not a single frame after the hello


def test_oversize_terminal_becomes_result_too_large(session_factory):
    ex = Executor("python", max_frame_bytes=4096)
    ex.handler("big")(lambda job: "x" * 10_000)
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("big"))
    frames = s.frames.until_terminal()
    err = frames[-1].error
    assert err.code == "RESULT_TOO_LARGE"
    assert not err.retryable
    assert err.sequence == 3
    assert "write large outputs as artifacts" in err.message


def test_hello_announces_protocol_1_1_features_and_the_frame_limit(session_factory):
    s = session_factory(Executor("python", max_frame_bytes=65536))
    hello = s.hello()
    assert list(hello.protocol_versions) == ["1.0", "1.1"]
    assert list(hello.features) == ["frame_limits"]
    assert hello.max_frame_bytes == 65536
    s.close_input()
    assert s.wait() == 0


def test_a_result_over_the_supervisors_limit_is_result_too_large(session_factory):
    """Protocol 1.1: the job states the supervisor's frame limit, lower than the
    SDK's own cap; a result over it is RESULT_TOO_LARGE (not retryable), never an
    oversized frame, and an event over it raises in the handler. The same result
    fits a job that states no limit (a 1.0 supervisor)."""
    seen = []
    ex = Executor("python", max_frame_bytes=65536)

    @ex.handler("big")
    def big(job: Job):
        seen.append((job.protocol_version, job.features))
        return "x" * 5000

    @ex.handler("chatty")
    def chatty(job: Job):
        with pytest.raises(ValueError, match="4096"):
            job.save_checkpoint(b"c" * 5000)
        return "small"

    s = session_factory(ex)
    s.hello()
    limited = {"negotiated_version": "1.1", "negotiated_features": ["frame_limits"]}
    s.send(job_frame("big", job_id="j1", max_frame_bytes=4096, **limited))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "RESULT_TOO_LARGE"
    assert not err.retryable
    assert "4096" in err.message
    assert seen[-1] == ("1.1", ["frame_limits"])

    s.send(job_frame("big", job_id="j2"))
    res = s.frames.until_terminal()[-1].result
    assert len(res.output) == 5002
    assert seen[-1] == ("", [])

    s.send(job_frame("chatty", job_id="j3", max_frame_bytes=4096))
    assert s.frames.until_terminal()[-1].result.output == b'"small"'
    s.close_input()
    assert s.wait() == 0


def test_oversize_event_raises_in_the_handler_without_using_a_sequence(session_factory):
    seen = []
    ex = Executor("python", max_frame_bytes=4096)

    @ex.handler("cp")
    def cp(job: Job):
        try:
            job.save_checkpoint(b"c" * 10_000)
        except ValueError as e:
            seen.append(str(e))
        job.heartbeat()
        return "ok"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("cp"))
    frames = s.frames.until_terminal()
    assert "exceeds the frame cap" in seen[0]
    assert "its checkpoint of 10000 bytes" in seen[0]
    assert [sequence_of(f) for f in frames] == [1, 2, 3, 4]


def test_the_oversize_event_error_says_what_is_large(session_factory):
    """The error names what the event carries (it said "checkpoint too large?" for an
    event without any checkpoint)."""
    seen = []
    ex = Executor("python", max_frame_bytes=4096)

    @ex.handler("chatty")
    def chatty(job: Job):
        for kwargs in ({}, {"checkpoint": b"c" * 3000}):
            try:
                job.progress("m" * 5000, **kwargs)
            except ValueError as e:
                seen.append(str(e))
        return "ok"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("chatty"))
    s.frames.until_terminal()
    no_checkpoint, both = seen
    assert "exceeds the frame cap of 4096 bytes" in no_checkpoint
    assert "its message of 5000 bytes" in no_checkpoint
    assert "checkpoint" not in no_checkpoint
    assert "its checkpoint of 3000 bytes and its message of 5000 bytes" in both


def test_invalid_artifact_entries_are_artifact_invalid(session_factory):
    ex = Executor("python")
    entry = {"name": "x", "path": "../x", "sha256": "00", "size": 1}
    ex.handler("escape")(lambda job: Result(1, [entry]))
    ex.handler("junk")(lambda job: Result(1, [42]))
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("escape"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "ARTIFACT_INVALID" and not err.retryable
    assert "not a relative path inside the output directory" in err.message
    s.send(job_frame("junk", job_id="job-2"))
    assert s.frames.until_terminal()[-1].error.code == "ARTIFACT_INVALID"


def test_event_after_the_terminal_is_refused_locally(session_factory):
    kept = []
    ex = Executor("python")

    @ex.handler("keep")
    def keep(job: Job):
        kept.append(job)
        return 1

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("keep"))
    s.frames.until_terminal()
    with pytest.raises(RuntimeError, match="cannot follow the terminal"):
        kept[0].progress("late")
    s.close_input()
    assert s.wait() == 0
    assert all(not (which(f) == "event" and f.event.message == "late") for f in s.frames.frames)


def test_progress_validates_fraction(session_factory):
    ex = Executor("python")

    @ex.handler("frac")
    def frac(job: Job):
        job.progress("too far", fraction=1.5)  # clamped
        job.progress("ok", fraction=1)
        # a division by zero is no 100 %: no fraction, as NaN (PROTOCOL.md)
        job.progress("x/0", fraction=float("inf"))
        job.progress("-x/0", fraction=float("-inf"))
        job.progress("0/0", fraction=float("nan"))
        return "ok"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("frac"))
    frames = s.frames.until_terminal()
    assert frames[-1].result.output == b'"ok"'
    progress = events(frames, pb.EVENT_KIND_PROGRESS)
    assert [e.fraction for e in progress[:2]] == [1.0, 1.0]
    assert [e.message for e in progress[2:]] == ["x/0", "-x/0", "0/0"]
    assert not any(e.HasField("fraction") for e in progress[2:])


def test_artifact_helper_hashes_files_and_refuses_escapes(session_factory, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (tmp_path / "outside.txt").write_text("x")
    ex = Executor("python")

    @ex.handler("art")
    def art(job: Job):
        os.makedirs(job.output_path("sub"))
        with open(job.output_path("sub", "data.bin"), "wb") as f:
            f.write(b"payload" * 1000)
        entry = job.artifact("sub/data.bin", media_type="application/x-test", derived_from=["in-1"])
        for bad in ("../outside.txt", str(tmp_path / "outside.txt")):
            with pytest.raises(ExecutorError, match="not below the output directory"):
                job.artifact(bad)
        return Result(
            {"ok": True},
            [
                entry,
                {"name": "n", "path": "sub/data.bin", "sha256": entry.sha256, "size": entry.size},
            ],
        )

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("art", output_dir=str(out_dir)))
    result = s.frames.until_terminal()[-1].result
    assert json.loads(result.output) == {"ok": True}
    first, second = result.artifacts
    assert first.name == "data.bin"
    assert first.path == "sub/data.bin"
    assert first.sha256 == hashlib.sha256(b"payload" * 1000).hexdigest()
    assert first.size == 7000
    assert first.media_type == "application/x-test"
    assert list(first.derived_from) == ["in-1"]
    assert second.name == "n" and second.media_type == "application/octet-stream"


def test_artifact_value_object():
    a = Artifact("n", "p", "ab", 3, "text/plain", ["x"])
    assert a == Artifact("n", "p", "ab", 3, "text/plain", ["x"])
    assert a != Artifact("n", "p", "ab", 4, "text/plain", ["x"])
    assert a.to_proto() == wire.ArtifactManifestEntry(
        name="n", path="p", sha256="ab", size=3, media_type="text/plain", derived_from=["x"]
    )
    assert pb.ArtifactManifestEntry.FromString(a.to_proto().encode()) == pb.ArtifactManifestEntry(
        name="n", path="p", sha256="ab", size=3, media_type="text/plain", derived_from=["x"]
    )


def test_cancelled_raised_by_the_handler_itself_is_cancelled(session_factory):
    ex = Executor("python")

    @ex.handler("gives-up")
    def gives_up(job: Job):
        raise Cancelled("nothing to do")

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("gives-up"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "CANCELLED" and not err.retryable


def test_broken_output_ends_the_session_with_status_one():
    r, w = os.pipe()
    in_r, in_w = os.pipe()
    os.close(r)  # nobody reads the frames: the first write fails with EPIPE
    ex = Executor("python")
    try:
        import io

        assert ex.serve(io.FileIO(in_r, "r"), io.FileIO(w, "w")) == 1
    finally:
        os.close(in_w)


def test_handler_registration_rules():
    ex = Executor("python")
    ex.handler("a")(lambda job: None)
    with pytest.raises(ValueError, match="already registered"):
        ex.handler("a")(lambda job: None)
    with pytest.raises(TypeError, match="not callable"):
        ex.add_handler("b", 42)
    with pytest.raises(ValueError, match="executor_kind"):
        Executor("")


def test_run_moves_stray_stdout_to_stderr(tmp_path):
    """Prints (before and during run) and child processes writing to fd 1 end up on
    stderr; stdout carries frames only. Also: a child cannot read the frame stdin."""
    script = tmp_path / "exe.py"
    script.write_text(
        textwrap.dedent(
            """
            import subprocess, sys
            from durable_executor import Executor, claim_stdio
            streams = claim_stdio()  # done early: a program that prints while starting up
            print("printed before run")
            assert claim_stdio() is streams  # run() reuses the same frame streams
            ex = Executor("python")

            @ex.handler("noisy")
            def noisy(job):
                print("printed by the handler")
                sys.stdout.write("written via sys.stdout\\n")
                child = subprocess.run(
                    ["sh", "-c", "echo echoed by a child; cat; echo cat-done"],
                    check=True,
                )
                return "clean"

            sys.exit(ex.run())
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=PKG_ROOT)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        frames = FrameStream(ByteCollector(proc.stdout))
        err = ByteCollector(proc.stderr)
        assert which(frames.next()) == "hello"
        proc.stdin.write(
            b"".join(
                durable_executor.encode_frame(f.SerializeToString()) for f in (job_frame("noisy"),)
            )
        )
        proc.stdin.flush()
        got = frames.until_terminal()
        assert got[-1].result.output == b'"clean"'
        proc.stdin.close()
        assert proc.wait(10) == 0
        frames.collector.wait_eof(5)
        assert frames.rest() == b""  # nothing but frames on stdout
        err.wait_eof(5)
        text = err.data.decode()
        for line in (
            "printed before run",
            "printed by the handler",
            "written via sys.stdout",
            "echoed by a child",
            "cat-done",
        ):
            assert line in text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def test_run_exits_when_a_cancelled_handler_outlives_stdin(tmp_path):
    """Once stdin ends mid-job, a handler that ignores its cancel gets stop_grace,
    then the process exits 1: an executor never outlives its supervisor."""
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from durable_executor import Executor
            ex = Executor("python", stop_grace=0.3)

            @ex.handler("stuck")
            def stuck(job):
                while True:
                    time.sleep(0.01)  # ignores job.cancelled

            sys.exit(ex.run())
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=PKG_ROOT),
        start_new_session=True,
    )
    try:
        frames = FrameStream(ByteCollector(proc.stdout))
        err = ByteCollector(proc.stderr)
        assert which(frames.next()) == "hello"
        proc.stdin.write(durable_executor.encode_frame(job_frame("stuck").SerializeToString()))
        proc.stdin.flush()
        frames.next()
        frames.next()
        t0 = time.monotonic()
        proc.stdin.close()
        assert proc.wait(10) == 1
        assert 0.25 < time.monotonic() - t0 < 5
        err.wait_eof(5)
        assert b"did not return within 0.3s of being cancelled (STDIN_CLOSED); exiting" in err.data
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def test_a_checkpoint_the_next_attempt_could_not_receive_is_refused(session_factory):
    """A checkpoint is handed back inside the next attempt's job frame, beside the
    input: one that leaves that frame over the executor's own cap is refused when
    saved (it was stored, and every later attempt failed JOB_TOO_LARGE)."""
    seen = []
    ex = Executor("python", max_frame_bytes=65536)

    @ex.handler("cp")
    def cp(job: Job):
        for size in (30_000, 20_000):
            try:
                job.save_checkpoint(b"c" * size)
                seen.append(size)
            except ValueError as e:
                seen.append(str(e))
        return "ok"

    s = session_factory(ex)
    s.hello()
    big_input = {"data": "i" * 40_000}
    s.send(job_frame("cp", big_input, checkpoint=b"o" * 25_000))
    frames = s.frames.until_terminal()
    refused, accepted = seen
    assert "checkpoint of 30000 bytes" in refused
    assert "next attempt's job frame" in refused
    assert "frame cap of 65536 bytes" in refused
    assert accepted == 20_000
    # the refused one used no sequence number; the accepted one went out
    assert [sequence_of(f) for f in frames] == [1, 2, 3, 4]
    sent = events(frames, pb.EVENT_KIND_HEARTBEAT)
    assert [len(e.checkpoint) for e in sent] == [20_000]
    # the estimate is the job the supervisor would build next, within its slack
    for size, fits in ((20_000, True), (30_000, False)):
        nxt = job_frame("cp", big_input, checkpoint=b"c" * size, attempt=2)
        assert (len(nxt.SerializeToString()) <= 65536) == fits


def test_a_checkpoint_leaves_room_for_the_next_attempts_paths(session_factory):
    """The next attempt may run on another worker, whose work_dir (or kind of
    process) names its output directory differently: the largest checkpoint the
    SDK accepts still fits a next job whose paths are longer (re-check audit:
    29 bytes more failed it JOB_TOO_LARGE)."""
    largest = []
    ex = Executor("python", max_frame_bytes=65536)

    @ex.handler("cp")
    def cp(job: Job):
        lo, hi = 0, 65536
        while lo < hi:  # the largest size save_checkpoint takes
            mid = (lo + hi + 1) // 2
            try:
                job._check_next_job_fits(mid)
                lo = mid
            except ValueError:
                hi = mid - 1
        largest.append(lo)
        return "ok"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("cp", {"n": 1}, output_dir="/tmp/durable-job-python-abc123"))
    s.frames.until_terminal()
    (n,) = largest
    assert 0 < n < 65536 - 4096
    longer = "/srv/another-worker/" + "w" * 3000 + "/durable-0123456789abcdef-abc123"
    nxt = job_frame("cp", {"n": 1}, checkpoint=b"c" * n, attempt=2, output_dir=longer)
    assert len(nxt.SerializeToString()) <= 65536
