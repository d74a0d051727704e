"""Text the wire cannot carry: every job still ends with exactly one terminal.

Python holds a byte it could not decode (a file name from ``os.listdir``, an
environment value) as a lone surrogate such as ``'\\udcff'``, which UTF-8 cannot
encode. Before, one in a handler's output or in ``ExecutorError`` details made
the SDK raise UnicodeEncodeError out of ``serve()``: the process died without a
terminal and the step ended EXECUTOR_CRASHED (retryable: every retry crashed).
"""

from __future__ import annotations

import json
import os

from _harness import job_frame, which

from durable_executor import Executor, ExecutorError, Job, Result, wire

SURROGATE = "\udcff"  # what os.listdir gives for the byte 0xff of a file name
ESCAPED = "\\udcff"  # how the SDK writes it in text: a backslash escape


def test_output_that_is_not_utf8_is_output_invalid_and_serving_goes_on(session_factory, tmp_path):
    ex = Executor("python")

    @ex.handler("listdir")
    def listdir(job: Job):
        d = job.output_path("d")
        os.makedirs(d)
        open(os.path.join(os.fsencode(d), b"report-\xff.csv"), "wb").close()
        return {"files": os.listdir(d)}  # ['report-\udcff.csv']

    ex.handler("echo")(lambda job: job.input)
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("listdir", output_dir=str(tmp_path)))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "OUTPUT_INVALID"
    assert not err.retryable
    assert "not valid UTF-8" in err.message and ESCAPED in err.message
    s.send(job_frame("echo", {"still": "serving"}, job_id="job-2"))
    assert json.loads(s.frames.until_terminal()[-1].result.output) == {"still": "serving"}
    s.close_input()
    assert s.wait() == 0


def test_error_text_and_details_with_surrogates_are_sent_escaped(session_factory):
    ex = Executor("python")

    @ex.handler("fails")
    def fails(job: Job):
        raise ExecutorError(
            "BAD_NAME",
            f"cannot read report-{SURROGATE}.csv",
            retryable=False,
            details={"file": f"report-{SURROGATE}.csv", f"key-{SURROGATE}": [SURROGATE, 1]},
        )

    @ex.handler("raises")
    def raises(job: Job):
        raise FileNotFoundError(f"no such file: report-{SURROGATE}.csv")

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("fails"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "BAD_NAME" and not err.retryable
    assert err.message == f"cannot read report-{ESCAPED}.csv"
    assert json.loads(err.details) == {
        "file": f"report-{ESCAPED}.csv",
        f"key-{ESCAPED}": [ESCAPED, 1],
    }
    s.send(job_frame("raises", job_id="job-2"))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "HANDLER_ERROR" and err.retryable
    assert err.message == f"FileNotFoundError: no such file: report-{ESCAPED}.csv"
    s.close_input()
    assert s.wait() == 0


def test_surrogates_in_events_and_checkpoints_do_not_crash(session_factory):
    seen = []
    ex = Executor("python")

    @ex.handler("events")
    def events(job: Job):
        job.progress(f"reading report-{SURROGATE}.csv", fraction=0.5)
        job.save_checkpoint_json({"file": f"report-{SURROGATE}.csv"}, f"at {SURROGATE}")
        return "ok"

    @ex.handler("resume")
    def resume(job: Job):
        seen.append(job.checkpoint_json())
        return "ok"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("events"))
    frames = s.frames.until_terminal()
    assert frames[-1].result.output == b'"ok"'
    assert frames[2].event.message == f"reading report-{ESCAPED}.csv"
    assert frames[3].event.message == f"at {ESCAPED}"
    checkpoint = frames[3].event.checkpoint
    s.send(job_frame("resume", job_id="job-2", checkpoint=checkpoint))
    s.frames.until_terminal()
    assert seen == [{"file": f"report-{SURROGATE}.csv"}]  # the next attempt reads it back


def test_artifacts_whose_text_is_not_utf8_are_artifact_invalid(session_factory, tmp_path):
    ex = Executor("python")

    @ex.handler("file")
    def file(job: Job):
        open(os.path.join(os.fsencode(job.output_dir), b"r\xff.csv"), "wb").close()
        return Result(1, [job.artifact(f"r{SURROGATE}.csv")])

    entries = [
        {"name": f"r{SURROGATE}", "path": "r.csv", "sha256": "00", "size": 1},
        {"name": "r", "path": f"r{SURROGATE}.csv", "sha256": "00", "size": 1},
        {"name": "r", "path": "r.csv", "sha256": "00", "size": 1, "derived_from": [SURROGATE]},
        wire.ArtifactManifestEntry(name="r", path="r.csv", sha256="00", size=-1),
    ]
    for i, entry in enumerate(entries):
        ex.handler(f"entry{i}")(lambda job, entry=entry: Result(1, [entry]))
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("file", output_dir=str(tmp_path)))
    err = s.frames.until_terminal()[-1].error
    assert err.code == "ARTIFACT_INVALID" and not err.retryable
    assert "UTF-8" in err.message
    for i in range(len(entries)):
        s.send(job_frame(f"entry{i}", job_id=f"job-{i}"))
        err = s.frames.until_terminal()[-1].error
        assert err.code == "ARTIFACT_INVALID" and not err.retryable, (i, err)
    s.close_input()
    assert s.wait() == 0


def test_a_terminal_that_does_not_encode_is_replaced_by_one_that_does(session_factory):
    """The last line of defence: whatever makes the terminal fail to encode, a
    JobError that does goes out with the same sequence, and serving goes on."""
    ex = Executor("python")

    @ex.handler("huge-delay")
    def huge_delay(job: Job):
        raise ExecutorError("SLOW", "later", next_retry_delay_ms=1 << 64)  # over uint64

    ex.handler("echo")(lambda job: job.input)
    s = session_factory(ex)
    s.hello()
    s.send(job_frame("huge-delay"))
    frames = s.frames.until_terminal()
    err = frames[-1].error
    assert err.sequence == 3
    assert err.code == "HANDLER_ERROR" and err.retryable
    assert "next_retry_delay_ms" in err.message and "SLOW" in err.message
    s.send(job_frame("echo", 5, job_id="job-2"))
    assert s.frames.until_terminal()[-1].result.output == b"5"
    assert all(which(f) != "hello" for f in s.frames.frames[1:])
    s.close_input()
    assert s.wait() == 0


def test_other_outcomes_that_cannot_be_sent_as_they_are_still_get_a_terminal(session_factory):
    """Values of the wrong type where the SDK expected text or bytes used to raise
    out of serve() too (no terminal): each now ends its job, and serving goes on."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    def raise_unprintable(job: Job) -> None:
        raise Unprintable()

    def message_not_str(job: Job) -> None:
        raise ExecutorError("MINE", 42)  # type: ignore[arg-type]

    ex = Executor("python")
    ex.handler("unprintable")(raise_unprintable)
    ex.handler("output-json-str")(lambda job: Result(output_json="{}"))
    ex.handler("message-not-str")(message_not_str)
    ex.handler("path-not-str")(
        lambda job: Result(1, [{"name": "n", "path": 5, "sha256": "00", "size": 1}])
    )
    s = session_factory(ex)
    s.hello()
    want = [
        ("unprintable", "HANDLER_ERROR", "Unprintable"),
        ("output-json-str", "OUTPUT_INVALID", "output_json must be bytes"),
        ("message-not-str", "MINE", "42"),
        ("path-not-str", "ARTIFACT_INVALID", "path"),
    ]
    for i, (kind, code, text) in enumerate(want):
        s.send(job_frame(kind, job_id=f"job-{i}"))
        err = s.frames.until_terminal()[-1].error
        assert err.code == code and text in err.message, (kind, err)
    s.close_input()
    assert s.wait() == 0
