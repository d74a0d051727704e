"""The README's examples: each ```python block is a file of examples/, and runs."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from _harness import ByteCollector, FrameStream, PipeSession, cancel_frame, job_frame, which

import durable_executor

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"


def readme_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.M | re.S)


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_readme_python_block_is_an_example_file_and_vice_versa():
    blocks = readme_blocks()
    assert len(blocks) >= 3
    named = {}
    for block in blocks:
        first = block.splitlines()[0]
        m = re.match(r"# (examples/\w+\.py): ", first)
        assert m, f"a README python block must start with '# examples/<name>.py: ...': {first!r}"
        named[m.group(1)] = block
    for path, block in named.items():
        assert (ROOT / path).read_text() == block, f"README block differs from {path}"
    files = {f"examples/{p.name}" for p in EXAMPLES.glob("*.py")}
    assert files == set(named), "every example file is shown in the README"


@pytest.fixture
def session():
    sessions = []

    def make(module: ModuleType) -> PipeSession:
        s = PipeSession(module.ex)
        sessions.append(s)
        s.hello()
        return s

    yield make
    for s in sessions:
        s.close()


def test_resize(session, tmp_path):
    s = session(load("resize"))
    s.send(job_frame("thumbs.resize", {"width": 64}, output_dir=str(tmp_path)))
    frames = s.frames.until_terminal()
    progress = [f.event for f in frames if which(f) == "event"][2:]
    assert [e.checkpoint for e in progress] == [b"%d" % i for i in range(1, 11)]
    assert progress[-1].fraction == 1.0
    result = frames[-1].result
    assert json.loads(result.output) == {"width": 64, "resumed_at": 0}
    (thumb,) = result.artifacts
    assert (thumb.name, thumb.path, thumb.media_type) == ("out.png", "out.png", "image/png")
    assert thumb.sha256 == hashlib.sha256(b"...").hexdigest() and thumb.size == 3

    # The next attempt resumes from the checkpoint.
    out2 = tmp_path / "2"
    out2.mkdir()
    s.send(
        job_frame(
            "thumbs.resize", {"width": 64}, job_id="j2", output_dir=str(out2), checkpoint=b"7"
        )
    )
    frames = s.frames.until_terminal()
    assert len(frames) == 2 + 3 + 1
    assert json.loads(frames[-1].result.output)["resumed_at"] == 7

    s.send(job_frame("thumbs.resize", {"height": 1}, job_id="j3"))
    err = s.frames.until_terminal()[-1].error
    assert (err.code, err.retryable) == ("MISSING_WIDTH", False)


def test_resume_continues_at_the_checkpoint(session):
    s = session(load("resume"))
    s.send(job_frame("rows.import"))
    frames = s.frames.until_terminal()
    saved = [f.event.checkpoint for f in frames if which(f) == "event" and f.event.checkpoint]
    assert saved == [b'{"next":%d}' % i for i in range(1, 11)]
    assert json.loads(frames[-1].result.output) == {"resumed_at": 0}

    # the next attempt, handed the checkpoint, imports rows 7..9 only
    s.send(job_frame("rows.import", job_id="j2", checkpoint=b'{"next":7}'))
    frames = s.frames.until_terminal()
    saved = [f.event.checkpoint for f in frames if which(f) == "event" and f.event.checkpoint]
    assert saved == [b'{"next":8}', b'{"next":9}', b'{"next":10}']
    assert json.loads(frames[-1].result.output) == {"resumed_at": 7}

    s.send(job_frame("rows.import", job_id="j3", checkpoint=b"\x00not json"))
    err = s.frames.until_terminal()[-1].error
    assert (err.code, err.retryable) == ("BAD_CHECKPOINT", False)


def test_fetch_async(session):
    s = session(load("fetch_async"))
    urls = ["https://a.example", "https://bb.example"]
    s.send(job_frame("demo.fetch", {"urls": urls}))
    assert json.loads(s.frames.until_terminal()[-1].result.output) == {u: len(u) for u in urls}

    s.send(job_frame("demo.fetch", {"urls": urls}, job_id="j2"))
    s.frames.next(), s.frames.next()
    s.send(cancel_frame(job_id="j2"))
    frames = s.frames.until_terminal()
    assert frames[0].event.message == "cancelled: nothing to clean up"
    assert frames[-1].error.code == "CANCELLED"


def test_blocking_is_interrupted_by_a_cancel():
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "blocking.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        start_new_session=True,
    )
    try:
        frames = FrameStream(ByteCollector(proc.stdout))
        ByteCollector(proc.stderr)
        assert which(frames.next()) == "hello"
        proc.stdin.write(
            durable_executor.encode_frame(job_frame("demo.wait", 60).SerializeToString())
        )
        proc.stdin.flush()
        frames.next(), frames.next()
        waiting = frames.next().event.message
        pid = int(waiting.rsplit(" ", 1)[1])
        os.kill(pid, 0)  # the child runs
        t0 = time.monotonic()
        proc.stdin.write(durable_executor.encode_frame(cancel_frame().SerializeToString()))
        proc.stdin.flush()
        err = frames.next(timeout=5).error
        assert err.code == "CANCELLED" and time.monotonic() - t0 < 1.0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped by the handler
        proc.stdin.close()
        assert proc.wait(10) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
