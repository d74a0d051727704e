"""One meaning per option, the Go SDK's too: max_jobs_per_process, short secrets,
fractions, artifact helpers, the exported codes; and what importing the SDK costs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _harness import job_frame, which

import durable_executor
from durable_executor import DEFAULT_MEDIA_TYPE, Executor, ExecutorError, Job

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "proto" / "PROTOCOL.md"


@pytest.mark.parametrize("value", [0, -1, -7])
def test_max_jobs_per_process_zero_or_negative_is_unlimited_as_in_go(session_factory, value):
    ex = Executor("python", max_jobs_per_process=value)
    ex.handler("n")(lambda job: job.input)
    s = session_factory(ex)
    assert s.hello().max_jobs_per_process == -1
    for i in range(3):
        s.send(job_frame("n", i, job_id=f"j{i}"))
        assert s.frames.until_terminal()[-1].result.output == str(i).encode()
    s.close_input()
    assert s.wait() == 0


def test_max_jobs_per_process_n_serves_n_jobs(session_factory):
    ex = Executor("python", max_jobs_per_process=2)
    ex.handler("n")(lambda job: 1)
    s = session_factory(ex)
    assert s.hello().max_jobs_per_process == 2
    for i in range(2):
        s.send(job_frame("n", job_id=f"j{i}"))
        s.frames.until_terminal()
    assert s.wait() == 0  # without EOF or Shutdown
    assert Executor("python", max_jobs_per_process=2**40).hello().max_jobs_per_process == 2**31 - 1


def test_short_secrets_are_redacted_only_as_whole_strings(session_factory):
    """The supervisor's rule: values under 4 bytes only where a whole string equals
    them; longer ones wherever they occur (longest first)."""
    ex = Executor("python")

    @ex.handler("leaky")
    def leaky(job: Job) -> None:
        job.progress("abc")  # a whole message: redacted
        job.progress("abcdef and 1 and é")  # inside text: kept
        job.progress("token=longsecret-1, token=longsecret")
        raise ExecutorError(
            "LEAK",
            "abc",
            details={"abc": "abc", "k": "xabcx", "list": ["1", 1, "é"], "long": "a longsecret"},
        )

    s = session_factory(ex)
    s.hello()
    secrets = {
        "SHORT": "abc",
        "ONE": "1",
        "ACCENT": "é",
        "LONG": "longsecret",
        "LONGER": "longsecret-1",
    }
    s.send(job_frame("leaky", secrets=secrets))
    frames = s.frames.until_terminal()
    messages = [f.event.message for f in frames if which(f) == "event"][2:]
    assert messages == [
        "[REDACTED]",
        "abcdef and 1 and é",
        "token=[REDACTED], token=[REDACTED]",
    ]
    err = frames[-1].error
    assert err.message == "[REDACTED]"
    assert json.loads(err.details) == {
        "[REDACTED]": "[REDACTED]",
        "k": "xabcx",
        # a number whose text is a value is redacted too; "é" is 2 bytes: whole strings only
        "list": ["[REDACTED]", "[REDACTED]", "[REDACTED]"],
        "long": "a [REDACTED]",
    }
    assert durable_executor.MIN_REDACT_BYTES == 4


def test_redaction_follows_the_supervisors_rules(session_factory):
    """JSON-escaped and percent-encoded forms too, colliding keys kept apart, and a
    text that would still hold a value after the replacement replaced whole."""
    ex = Executor("python")

    @ex.handler("leaky")
    def leaky(job: Job) -> None:
        job.progress('{"token": "pa\\"ss/wörd"}')  # the value inside JSON text
        job.progress("https://x.example/?t=pa%22ss%2Fw%C3%B6rd")  # inside a URL
        job.progress("abcdXYZ")  # overlapping values: the leftmost is taken
        raise ExecutorError("LEAK", "x", details={'pa"ss/wörd': 1, "[REDACTED]": 2, "n": 12345})

    @ex.handler("marker")
    def marker(job: Job) -> None:
        job.progress("the ACTE value")  # "[REDACTED]" holds the value too: "***"

    s = session_factory(ex)
    s.hello()
    secrets = {"A": 'pa"ss/wörd', "B": "abcd", "C": "dXYZ", "D": "2345"}
    s.send(job_frame("leaky", secrets=secrets))
    frames = s.frames.until_terminal()
    messages = [f.event.message for f in frames if which(f) == "event"][2:]
    assert messages == [
        '{"token": "[REDACTED]"}',
        "https://x.example/?t=[REDACTED]",
        "[REDACTED]XYZ",
    ]
    details = json.loads(frames[-1].error.details)
    assert details == {"[REDACTED]": 2, "[REDACTED]#2": 1, "n": "1[REDACTED]"}

    s.send(job_frame("marker", job_id="j2", secrets={"E": "ACTE"}))
    frames = s.frames.until_terminal()
    assert [f.event.message for f in frames if which(f) == "event"][2:] == ["***"]


def test_progress_fractions_are_clamped_and_nan_or_inf_sends_none_as_in_go(session_factory):
    ex = Executor("python")

    @ex.handler("frac")
    def frac(job: Job) -> str:
        for value in (-0.1, 0, 0.25, 1, 1.0000001, math.inf, -math.inf, math.nan, None):
            job.progress(repr(value), fraction=value)
        return "ok"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("frac"))
    frames = s.frames.until_terminal()
    events = [f.event for f in frames if which(f) == "event" and f.event.kind == 3]
    got = [(e.message, e.fraction if e.HasField("fraction") else None) for e in events]
    assert got == [
        ("-0.1", 0.0),
        ("0", 0.0),
        ("0.25", 0.25),
        ("1", 1.0),
        ("1.0000001", 1.0),
        # a division by zero is no 100 %: ±inf sends none, as NaN (PROTOCOL.md)
        ("inf", None),
        ("-inf", None),
        ("nan", None),
        ("None", None),
    ]


def test_artifact_helpers_refuse_escapes_and_non_regular_files(session_factory, tmp_path):
    """The Go SDK's rules: output_path refuses escapes (ValueError); artifact() refuses
    a file outside, missing or not regular with ARTIFACT_INVALID (not retryable)."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside.txt").write_text("x")
    os.symlink(tmp_path / "outside.txt", out / "link-out")
    ex = Executor("python")
    checks = []

    @ex.handler("art")
    def art(job: Job) -> str:
        assert job.output_path("a", "b.txt") == os.path.join(str(out), "a", "b.txt")
        for bad in ("../x", "/etc/passwd", "a/../../x", ""):
            with pytest.raises(ValueError, match="not a relative path"):
                job.output_path(bad)
            checks.append(bad)
        os.mkdir(job.output_path("dir"))
        os.mkfifo(job.output_path("fifo"))
        for bad, why in (
            ("dir", "not a regular file"),
            ("fifo", "not a regular file"),
            ("missing", "No such file"),
            ("link-out", "not below the output directory"),
            ("../outside.txt", "not below the output directory"),
            ("", "no path"),
        ):
            with pytest.raises(ExecutorError, match=why) as caught:
                job.artifact(bad)
            assert (caught.value.code, caught.value.retryable) == ("ARTIFACT_INVALID", False)
            checks.append(bad)
        with open(job.output_path("f.txt"), "w") as f:
            f.write("data")
        entry = job.artifact(job.output_path("f.txt"), name="", media_type="")
        assert (entry.name, entry.path, entry.media_type) == ("f.txt", "f.txt", DEFAULT_MEDIA_TYPE)
        job.artifact("dir")  # propagates: the job fails with it
        return "not reached"

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("art", output_dir=str(out)))
    err = s.frames.until_terminal()[-1].error
    assert (err.code, err.retryable) == ("ARTIFACT_INVALID", False)
    assert len(checks) == 10


def test_every_code_an_sdk_produces_is_exported():
    """Every code PROTOCOL.md's table says an SDK produces is a constant here."""
    rows = re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", PROTOCOL_MD.read_text(), re.M)
    sdk_codes = {code for code, produced_by in rows if "SDK" in produced_by}
    assert {"CANCELLED", "HANDLER_ERROR", "UNSUPPORTED_KIND"} <= sdk_codes
    for code in sdk_codes:
        assert getattr(durable_executor, code) == code, code
        assert code in durable_executor.__all__


def test_text_the_wire_refuses_is_cleaned(session_factory):
    ex = Executor("python")

    @ex.handler("odd")
    def odd(job: Job) -> None:
        job.progress("nul\0here")
        raise RuntimeError("bad name \udcff")  # a lone surrogate (os.fsdecode of bytes)

    s = session_factory(ex)
    s.hello()
    s.send(job_frame("odd"))
    frames = s.frames.until_terminal()
    assert frames[2].event.message == "nul\ufffdhere"
    assert frames[-1].error.message == "RuntimeError: bad name \\udcff"


def test_importing_the_sdk_imports_no_protobuf_json_typing_or_asyncio():
    code = (
        "import sys, durable_executor; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('google', 'json', 'typing', 'asyncio', 'signal', 'queue', 're', 'enum', 'inspect')]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
