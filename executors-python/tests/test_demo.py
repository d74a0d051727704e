"""The demo executor as a child process: every kind and every misbehave mode
(PROTOCOL.md, "Demo executors")."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import time

import pytest
from _harness import DemoProcess, cancel_frame, is_terminal, job_frame, sequence_of, which

from durable_executor import FrameError, FrameTooLarge, read_frame
from durable_executor._gen.durable.executor.v1 import executor_pb2 as pb

ALL_KINDS = [
    "demo.artifact",
    "demo.echo",
    "demo.effect",
    "demo.fail",
    "demo.finish_on_cancel",
    "demo.misbehave",
    "demo.resume",
    "demo.sleep",
]


@pytest.fixture
def demo():
    procs = []

    def start(**env) -> DemoProcess:
        p = DemoProcess(env)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill_group()  # nothing outlives the test, grandchildren included


def result_json(frames) -> object:
    assert which(frames[-1]) == "result", frames[-1]
    return json.loads(frames[-1].result.output)


def progress_events(frames):
    return [
        f.event for f in frames if which(f) == "event" and f.event.kind == pb.EVENT_KIND_PROGRESS
    ]


def start_job(p: DemoProcess, frame) -> None:
    """Hello, send the job, consume ACCEPTED and RUNNING."""
    p.hello()
    p.send(frame)
    assert p.frames.next().event.kind == pb.EVENT_KIND_ACCEPTED
    assert p.frames.next().event.kind == pb.EVENT_KIND_RUNNING


def finish_cleanly(p: DemoProcess) -> None:
    p.close_input()
    assert p.wait() == 0
    p.stdout.wait_eof(5)
    assert p.frames.rest() == b"", "bytes after the last frame on stdout"


# -- hello --------------------------------------------------------------------


def test_hello_defaults(demo):
    p = demo()
    hello = p.hello()
    assert hello.protocol_version == pb.PROTOCOL_VERSION_1
    assert hello.executor_kind == "python"
    assert list(hello.kinds) == ALL_KINDS
    assert dict(hello.labels) == {}
    assert hello.sdk_name == "durable-executor-python"
    assert hello.max_jobs_per_process == -1
    assert hello.pid == p.proc.pid
    finish_cleanly(p)


def test_hello_labels_and_kinds_from_the_environment(demo):
    p = demo(DEMO_LABELS="gpu=none, region=eu-west,empty=", DEMO_KINDS="demo.sleep,demo.echo")
    hello = p.hello()
    assert dict(hello.labels) == {"gpu": "none", "region": "eu-west", "empty": ""}
    assert list(hello.kinds) == ["demo.echo", "demo.sleep"]
    p.send(job_frame("demo.fail"))  # registered by the demo, but not offered here
    err = p.frames.next().error
    assert err.code == "UNSUPPORTED_KIND" and err.sequence == 1
    finish_cleanly(p)


def test_blank_demo_kinds_means_all_and_duplicates_are_dropped(demo):
    assert list(demo(DEMO_KINDS=" , ").hello().kinds) == ALL_KINDS
    assert list(demo(DEMO_KINDS="demo.echo,demo.echo").hello().kinds) == ["demo.echo"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DEMO_KINDS": "demo.echo,demo.nope"}, "DEMO_KINDS: unknown kind 'demo.nope' (known: "),
        ({"DEMO_LABELS": "novalue"}, "DEMO_LABELS: entry 'novalue' is not key=value"),
        ({"DEMO_LABELS": "a=1,a=2"}, "DEMO_LABELS: label 'a' given twice"),
    ],
)
def test_bad_environment_exits_two_before_hello(demo, env, message):
    p = demo(**env)
    assert p.wait() == 2
    p.stdout.wait_eof(5)
    assert bytes(p.stdout.data) == b""  # no hello
    p.stderr.wait_eof(5)
    assert message in p.stderr_text()


def test_eof_with_no_job_exits_zero(demo):
    p = demo()
    p.hello()
    finish_cleanly(p)


# -- demo.echo ------------------------------------------------------------------


def test_echo_returns_the_input_bytes(demo):
    raw = b'{"z": 1, "a": [true, null, 1.5e3], "s": "caf\xc3\xa9"}'
    p = demo()
    frames = p.run_job(job_frame("demo.echo", raw_input=raw))
    assert [sequence_of(f) for f in frames] == [1, 2, 3]
    assert frames[-1].result.output == raw
    finish_cleanly(p)


def test_echo_of_no_input_is_null_and_of_bad_json_is_bad_input(demo):
    p = demo()
    assert p.run_job(job_frame("demo.echo"))[-1].result.output == b"null"
    p.send(job_frame("demo.echo", raw_input=b"{oops", job_id="job-2"))
    err = p.frames.until_terminal()[-1].error
    assert err.code == "BAD_INPUT" and not err.retryable
    finish_cleanly(p)


# -- demo.sleep -----------------------------------------------------------------


def test_sleep_reports_one_progress_event_per_slice(demo):
    p = demo()
    t0 = time.monotonic()
    frames = p.run_job(job_frame("demo.sleep", {"ms": 200, "steps": 4}))
    elapsed = time.monotonic() - t0
    assert result_json(frames) == {"slept_ms": 200}
    fractions = [e.fraction for e in progress_events(frames)]
    assert fractions == [0.25, 0.5, 0.75, 1.0]
    assert [sequence_of(f) for f in frames] == list(range(1, 8))
    assert elapsed >= 0.2
    finish_cleanly(p)


def test_sleep_defaults_to_ten_slices(demo):
    p = demo()
    frames = p.run_job(job_frame("demo.sleep", {"ms": 50}))
    assert len(progress_events(frames)) == 10
    assert result_json(frames) == {"slept_ms": 50}
    finish_cleanly(p)


def test_sleep_honours_cancel_within_100ms(demo):
    p = demo()
    start_job(p, job_frame("demo.sleep", {"ms": 60_000, "steps": 2}))
    time.sleep(0.05)
    t0 = time.monotonic()
    p.send(cancel_frame())
    frame = p.frames.next(timeout=5)
    elapsed = time.monotonic() - t0
    assert which(frame) == "error"
    assert frame.error.code == "CANCELLED"
    assert not frame.error.retryable
    assert elapsed < 0.1, f"demo.sleep took {elapsed * 1000:.1f} ms to honour the cancel"
    finish_cleanly(p)


# -- demo.finish_on_cancel ------------------------------------------------------


def test_finish_on_cancel_returns_a_result_after_the_cancel(demo):
    """The terminal reflects what the handler did: it finished, so a JobResult."""
    p = demo()
    start_job(p, job_frame("demo.finish_on_cancel", {}))
    waiting = p.frames.next()
    assert waiting.event.kind == pb.EVENT_KIND_PROGRESS
    assert "waiting for a cancel" in waiting.event.message
    t0 = time.monotonic()
    p.send(cancel_frame())
    frame = p.frames.next(timeout=5)
    elapsed = time.monotonic() - t0
    assert which(frame) == "result", frame
    assert frame.result.sequence == 4
    assert json.loads(frame.result.output) == {"finished_after_cancel": True}
    assert elapsed < 0.1, f"demo.finish_on_cancel took {elapsed * 1000:.1f} ms"
    finish_cleanly(p)


def test_finish_on_cancel_without_a_cancel(demo):
    p = demo()
    frames = p.run_job(job_frame("demo.finish_on_cancel", {"wait_ms": 50}))
    assert len(progress_events(frames)) == 1
    assert result_json(frames) == {"finished_after_cancel": False}
    finish_cleanly(p)


@pytest.mark.parametrize("args", [{"wait_ms": -1}, {"wait_ms": "soon"}, [1]])
def test_finish_on_cancel_rejects_bad_input(demo, args):
    p = demo()
    err = p.run_job(job_frame("demo.finish_on_cancel", args))[-1].error
    assert err.code == "BAD_INPUT" and not err.retryable


@pytest.mark.parametrize(
    "args", [{"ms": "long"}, {"ms": -1}, {"ms": 31 * 24 * 3600 * 1000}, {"steps": 0}, [1]]
)
def test_sleep_rejects_bad_input(demo, args):
    p = demo()
    err = p.run_job(job_frame("demo.sleep", args))[-1].error
    assert err.code == "BAD_INPUT"
    assert not err.retryable
    assert err.message.startswith("demo.sleep: ")
    finish_cleanly(p)


# -- demo.fail ------------------------------------------------------------------


def test_fail_defaults_fail_every_attempt(demo):
    p = demo()
    err = p.run_job(job_frame("demo.fail", {}, attempt=7))[-1].error
    assert err.code == "DEMO_FAILURE"
    assert err.retryable
    assert err.message == "demo.fail: failing attempt 7"
    assert err.details == b""
    finish_cleanly(p)


def test_fail_until_fail_attempts_then_succeed(demo):
    args = {"code": "FLAKY_THING", "retryable": False, "fail_attempts": 2, "message": "nope"}
    p = demo()
    p.hello()
    for attempt in (1, 2):
        p.send(job_frame("demo.fail", args, attempt=attempt, job_id=f"a{attempt}"))
        err = p.frames.until_terminal()[-1].error
        assert (err.code, err.retryable, err.message) == ("FLAKY_THING", False, "nope")
    p.send(job_frame("demo.fail", args, attempt=3, job_id="a3"))
    assert result_json(p.frames.until_terminal()) == {"attempt": 3}
    finish_cleanly(p)


def test_fail_with_an_invalid_code_is_bad_input(demo):
    p = demo()
    err = p.run_job(job_frame("demo.fail", {"code": "lower-case"}))[-1].error
    assert err.code == "BAD_INPUT"
    finish_cleanly(p)


# -- demo.artifact ---------------------------------------------------------------


def test_artifact_writes_content_and_manifest(demo, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    p = demo()
    frames = p.run_job(
        job_frame(
            "demo.artifact",
            {"name": "report.txt", "content": "abc", "repeat": 3},
            output_dir=str(out),
        )
    )
    expected = b"abcabcabc"
    assert (out / "report.txt").read_bytes() == expected
    digest = hashlib.sha256(expected).hexdigest()
    assert result_json(frames) == {"name": "report.txt", "size": 9, "sha256": digest}
    (entry,) = frames[-1].result.artifacts
    assert entry == pb.ArtifactManifestEntry(
        name="report.txt", path="report.txt", sha256=digest, size=9, media_type="text/plain"
    )
    finish_cleanly(p)


def test_artifact_concatenates_input_artifacts_and_derives_from_them(demo, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    a = tmp_path / "a.bin"
    a.write_bytes(b"first|")
    b = tmp_path / "b.bin"
    b.write_bytes(b"second|")
    refs = [
        pb.ArtifactRef(id="id-a", name="a", path=str(a), size=6, step_name="s1"),
        pb.ArtifactRef(id="id-b", name="b", path=str(b), size=7, step_name="s2"),
    ]
    p = demo()
    frames = p.run_job(
        job_frame("demo.artifact", {"content": "tail"}, output_dir=str(out), input_artifacts=refs)
    )
    expected = b"first|second|tail"
    assert (out / "artifact.txt").read_bytes() == expected  # the default name
    (entry,) = frames[-1].result.artifacts
    assert entry.name == "artifact.txt" and entry.path == "artifact.txt"
    assert entry.size == len(expected)
    assert entry.sha256 == hashlib.sha256(expected).hexdigest()
    assert list(entry.derived_from) == ["id-a", "id-b"]
    assert entry.media_type == "text/plain"
    finish_cleanly(p)


def test_artifact_large_repeat_and_escaping_name(demo, tmp_path):
    p = demo()
    frames = p.run_job(
        job_frame(
            "demo.artifact", {"content": "0123456789", "repeat": 300_000}, output_dir=str(tmp_path)
        )
    )
    assert result_json(frames)["size"] == 3_000_000
    assert (tmp_path / "artifact.txt").stat().st_size == 3_000_000
    p.send(
        job_frame(
            "demo.artifact", {"name": "../escape.txt"}, output_dir=str(tmp_path), job_id="job-2"
        )
    )
    err = p.frames.until_terminal()[-1].error
    assert err.code == "BAD_INPUT"
    assert not (tmp_path.parent / "escape.txt").exists()
    finish_cleanly(p)


# -- demo.effect -----------------------------------------------------------------


def test_effect_is_skipped_when_the_checkpoint_says_it_was_done(demo, tmp_path):
    sink = tmp_path / "sink.txt"
    p = demo()
    frames = p.run_job(job_frame("demo.effect", {"sink": str(sink)}, idempotency_key="key-42"))
    assert result_json(frames) == {"effect_performed": True}
    (event,) = progress_events(frames)
    assert event.checkpoint == b"effect-done:key-42"
    assert sink.read_text() == "key-42\n"

    # The next attempt gets the first attempt's last checkpoint: no second line.
    p.send(
        job_frame(
            "demo.effect",
            {"sink": str(sink)},
            idempotency_key="key-42",
            attempt=2,
            checkpoint=event.checkpoint,
            job_id="job-2",
        )
    )
    frames = p.frames.until_terminal()
    assert result_json(frames) == {"effect_performed": False}
    assert progress_events(frames) == []
    assert sink.read_text() == "key-42\n"
    finish_cleanly(p)


def test_effect_with_an_unrelated_checkpoint_performs_the_effect(demo, tmp_path):
    sink = tmp_path / "sink.txt"
    p = demo()
    frames = p.run_job(
        job_frame(
            "demo.effect", {"sink": str(sink)}, idempotency_key="k", checkpoint=b"effect-done:other"
        )
    )
    assert result_json(frames) == {"effect_performed": True}
    assert sink.read_text() == "k\n"
    finish_cleanly(p)


def test_effect_fail_after_effect_on_attempt_one_only(demo, tmp_path):
    sink = tmp_path / "sink.txt"
    args = {"sink": str(sink), "fail_after_effect": True}
    p = demo()
    frames = p.run_job(job_frame("demo.effect", args, idempotency_key="k"))
    assert progress_events(frames)[0].checkpoint == b"effect-done:k"
    err = frames[-1].error
    assert err.code == "EFFECT_FAILED" and err.retryable
    p.send(
        job_frame(
            "demo.effect",
            args,
            idempotency_key="k",
            attempt=2,
            checkpoint=b"effect-done:k",
            job_id="job-2",
        )
    )
    assert result_json(p.frames.until_terminal()) == {"effect_performed": False}
    assert sink.read_text() == "k\n"
    finish_cleanly(p)


def test_effect_crash_after_effect_exits_three_without_terminal(demo, tmp_path):
    sink = tmp_path / "sink.txt"
    p = demo()
    start_job(
        p,
        job_frame(
            "demo.effect", {"sink": str(sink), "crash_after_effect": True}, idempotency_key="k"
        ),
    )
    event = p.frames.next().event
    assert event.kind == pb.EVENT_KIND_PROGRESS and event.checkpoint == b"effect-done:k"
    assert p.wait() == 3
    p.stdout.wait_eof(5)
    assert p.frames.rest() == b""  # no terminal, nothing else
    assert sink.read_text() == "k\n"


def test_effect_requires_a_sink(demo):
    p = demo()
    err = p.run_job(job_frame("demo.effect", {}))[-1].error
    assert err.code == "BAD_INPUT" and "'sink'" in err.message
    finish_cleanly(p)


# -- demo.misbehave ----------------------------------------------------------------


def misbehave(mode: str):
    return job_frame("demo.misbehave", {"mode": mode})


def test_misbehave_crash_exits_three_without_terminal(demo):
    p = demo()
    start_job(p, misbehave("crash"))
    assert p.wait() == 3
    p.stdout.wait_eof(5)
    assert p.frames.rest() == b""


def test_misbehave_garbage_is_undecodable(demo):
    p = demo()
    start_job(p, misbehave("garbage"))
    assert p.wait() == 3
    p.stdout.wait_eof(5)
    rest = p.frames.rest()
    assert len(rest) == 64
    assert rest[0] == 0xFF
    assert rest[1:].isascii()
    with pytest.raises(FrameError):
        read_frame(io.BytesIO(rest))


def test_misbehave_oversize_announces_64_mib(demo):
    p = demo()
    start_job(p, misbehave("oversize"))
    assert p.wait() == 3
    p.stdout.wait_eof(5)
    rest = p.frames.rest()
    assert len(rest) > 4  # the header, then some bytes
    with pytest.raises(FrameTooLarge) as info:
        read_frame(io.BytesIO(rest))
    assert info.value.length == 64 * 1024 * 1024


def test_misbehave_backwards_sends_sequence_5_then_3(demo):
    p = demo()
    start_job(p, misbehave("backwards"))
    first, second = p.frames.next().event, p.frames.next().event
    assert (first.kind, first.sequence) == (pb.EVENT_KIND_PROGRESS, 5)
    assert (second.kind, second.sequence) == (pb.EVENT_KIND_PROGRESS, 3)
    # Then it waits to be cancelled.
    p.frames.expect_no_frame(0.2)
    p.send(cancel_frame())
    assert p.frames.next().error.code == "CANCELLED"
    finish_cleanly(p)


def test_misbehave_after_terminal_sends_a_frame_after_the_result(demo):
    p = demo()
    start_job(p, misbehave("after_terminal"))
    terminal = p.frames.next()
    assert which(terminal) == "result"
    late = p.frames.next()
    assert which(late) == "event"
    assert late.event.kind == pb.EVENT_KIND_PROGRESS
    assert late.event.sequence > terminal.result.sequence
    # Then it waits to be cancelled, and the SDK adds no terminal of its own.
    p.frames.expect_no_frame(0.2)
    p.send(cancel_frame())
    p.frames.expect_no_frame(0.2)
    p.close_input()
    assert p.wait() == 0
    p.stdout.wait_eof(5)
    assert p.frames.rest() == b""
    assert sum(is_terminal(f) for f in p.frames.frames) == 1


def test_misbehave_hang_is_silent_until_cancelled(demo):
    p = demo()
    start_job(p, misbehave("hang"))
    p.frames.expect_no_frame(0.5)
    p.send(cancel_frame())
    err = p.frames.next(timeout=5).error
    assert err.code == "CANCELLED"
    finish_cleanly(p)


def test_misbehave_ignore_cancel_survives_cancel_and_sigterm(demo):
    p = demo()
    start_job(p, misbehave("ignore_cancel"))
    installed = p.frames.next().event  # sent once the SIGTERM handler is in place
    assert installed.kind == pb.EVENT_KIND_PROGRESS
    assert "ignoring cancel and SIGTERM" in installed.message
    p.send(cancel_frame())
    os.killpg(p.pgid, signal.SIGTERM)
    p.stderr.wait_for(lambda c: b"ignoring SIGTERM" in c.data, 5)
    p.frames.expect_no_frame(0.5)
    assert p.proc.poll() is None, "the process should have survived SIGTERM"
    p.kill_group()
    assert p.proc.returncode == -signal.SIGKILL


def _process_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_misbehave_grandchild_leaves_a_sleep_in_the_process_group(demo):
    p = demo()
    frames = p.run_job(misbehave("grandchild"))
    pid = result_json(frames)["grandchild_pid"]
    assert _process_state(pid) not in (None, "Z")
    assert os.getpgid(pid) == p.pgid  # same group: killing the group reaches it
    assert os.getsid(pid) == p.pgid  # not detached into a session of its own
    # The exec may still be finishing when the result arrives (the cmdline reads
    # empty for a moment): poll briefly.
    deadline = time.monotonic() + 5
    while True:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")[:2]
        if argv == [b"sleep", b"300"] or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert argv == [b"sleep", b"300"]
    p.kill_group()
    deadline = time.monotonic() + 5
    while _process_state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _process_state(pid) in (None, "Z"), "the grandchild survived the group kill"


def test_misbehave_stdout_print_keeps_the_frame_stream_clean(demo):
    p = demo()
    frames = p.run_job(misbehave("stdout_print"))
    assert [sequence_of(f) for f in frames] == [1, 2, 3]
    assert result_json(frames) == {"lines_printed": 1000}
    finish_cleanly(p)  # stdout holds only whole frames
    p.stderr.wait_eof(5)
    prefix = "demo.misbehave stdout_print: line "
    lines = [ln for ln in p.stderr_text().splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1000


def test_misbehave_stderr_flood_writes_50_mb_then_succeeds():
    with DemoProcess(keep_stderr=False) as p:
        frames = p.run_job(misbehave("stderr_flood"), timeout=30)
        assert result_json(frames) == {"stderr_bytes": 50_000_000}
        finish_cleanly(p)
        p.stderr.wait_eof(5)
        assert p.stderr.total == 50_000_000


def test_misbehave_unknown_mode_is_bad_input(demo):
    p = demo()
    err = p.run_job(misbehave("explode"))[-1].error
    assert err.code == "BAD_INPUT"
    assert "'mode' must be one of" in err.message
    finish_cleanly(p)
