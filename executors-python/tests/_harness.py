"""Test helpers: a supervisor stand-in over os.pipe (in-process) or a child process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from durable_executor import FrameError, decode_varint, encode_frame
from durable_executor._gen.durable.executor.v1 import executor_pb2 as pb

DEMO = Path(__file__).resolve().parent.parent / "demo_executor.py"


def job_frame(
    kind: str,
    input_value=None,
    *,
    job_id: str = "job-1",
    raw_input: bytes | None = None,
    **fields,
) -> pb.SupervisorFrame:
    """A SupervisorFrame{job} with sensible identity fields."""
    if raw_input is None:
        raw_input = b"" if input_value is None else json.dumps(input_value).encode()
    job = pb.Job(
        job_id=job_id,
        workflow_run_id=fields.pop("workflow_run_id", "run-1"),
        step_run_id=fields.pop("step_run_id", "step-1"),
        idempotency_key=fields.pop("idempotency_key", "idem-1"),
        executor_kind=fields.pop("executor_kind", "python"),
        kind=kind,
        attempt=fields.pop("attempt", 1),
        input=raw_input,
        **fields,
    )
    return pb.SupervisorFrame(job=job)


def cancel_frame(job_id: str = "job-1", reason=pb.CANCEL_REASON_REQUESTED, message: str = ""):
    return pb.SupervisorFrame(
        cancel=pb.Cancel(job_id=job_id, reason=reason, grace_ms=1000, message=message)
    )


def shutdown_frame(reason: str = "done") -> pb.SupervisorFrame:
    return pb.SupervisorFrame(shutdown=pb.Shutdown(reason=reason))


def which(frame: pb.ExecutorFrame) -> str:
    return frame.WhichOneof("frame")


def is_terminal(frame: pb.ExecutorFrame) -> bool:
    return which(frame) in ("result", "error")


def sequence_of(frame: pb.ExecutorFrame) -> int:
    return getattr(frame, which(frame)).sequence


class ByteCollector:
    """Drains a readable fd/stream on a thread into a growing buffer."""

    def __init__(self, stream, keep: bool = True) -> None:
        self._stream = stream
        self._keep = keep
        self.data = bytearray()
        self.total = 0
        self.eof = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                read = getattr(self._stream, "read1", self._stream.read)
                chunk = read(1 << 16)
                if not chunk:
                    break
                with self._cond:
                    self.total += len(chunk)
                    if self._keep:
                        self.data += chunk
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass
        finally:
            with self._cond:
                self.eof = True
                self._cond.notify_all()

    def wait_for(self, predicate, timeout: float):
        """Wait until ``predicate(self)`` is truthy; return its value (or raise on timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate(self)
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"condition not met within {timeout}s (eof={self.eof}, {self.total} bytes)"
                    )
                self._cond.wait(left)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def wait_eof(self, timeout: float) -> None:
        self.wait_for(lambda c: c.eof, timeout)


class FrameStream:
    """Parses ExecutorFrames incrementally from a ByteCollector."""

    def __init__(self, collector: ByteCollector) -> None:
        self.collector = collector
        self.pos = 0
        self.frames: list[pb.ExecutorFrame] = []

    def _try_parse(self, c: ByteCollector):
        try:
            length, start = decode_varint(c.data, self.pos)
        except FrameError:
            return None
        if start + length > len(c.data):
            return None
        frame = pb.ExecutorFrame()
        frame.ParseFromString(bytes(c.data[start : start + length]))
        self.pos = start + length
        self.frames.append(frame)
        return frame

    def next(self, timeout: float = 10.0) -> pb.ExecutorFrame:
        """The next whole frame (raises TimeoutError if none arrives in time)."""
        return self.collector.wait_for(self._try_parse, timeout)

    def next_for_job(self, timeout: float = 10.0) -> pb.ExecutorFrame:
        frame = self.next(timeout)
        assert which(frame) != "hello", frame
        return frame

    def until_terminal(self, timeout: float = 10.0) -> list[pb.ExecutorFrame]:
        """Frames up to and including the next terminal."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            frame = self.next(max(0.0, deadline - time.monotonic()))
            out.append(frame)
            if is_terminal(frame):
                return out

    def rest(self) -> bytes:
        """Unparsed bytes after the last parsed frame."""
        return bytes(self.collector.data[self.pos :])

    def expect_no_frame(self, within: float) -> None:
        try:
            frame = self.next(within)
        except TimeoutError:
            return
        raise AssertionError(f"expected no frame within {within}s, got {frame}")


def write_frames(fd_or_stream, *frames: pb.SupervisorFrame) -> None:
    data = b"".join(encode_frame(f.SerializeToString(deterministic=True)) for f in frames)
    if isinstance(fd_or_stream, int):
        os.write(fd_or_stream, data)
    else:
        fd_or_stream.write(data)
        fd_or_stream.flush()


class PipeSession:
    """Runs ``executor.serve`` on a thread over two os.pipe pairs."""

    def __init__(self, executor) -> None:
        self.executor = executor
        in_r, self.in_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self._in = io.FileIO(in_r, "r")
        self._out = io.FileIO(out_w, "w")
        self.rc: int | None = None
        self.error: BaseException | None = None
        self.frames = FrameStream(ByteCollector(io.FileIO(self.out_r, "r")))
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.rc = self.executor.serve(self._in, self._out)
        except BaseException as e:
            self.error = e
        finally:
            self._out.close()  # EOF for the frame collector

    def send(self, *frames: pb.SupervisorFrame) -> None:
        write_frames(self.in_w, *frames)

    def send_raw(self, data: bytes) -> None:
        os.write(self.in_w, data)

    def close_input(self) -> None:
        if self.in_w >= 0:
            os.close(self.in_w)
            self.in_w = -1

    def hello(self) -> pb.Hello:
        frame = self.frames.next()
        assert which(frame) == "hello", frame
        return frame.hello

    def wait(self, timeout: float = 10.0) -> int:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "serve() did not return"
        if self.error is not None:
            raise self.error
        return self.rc

    def close(self) -> None:
        self.close_input()
        self._thread.join(5)
        # Do not close the read end here: the session's reader thread may still be in
        # read() on it (serve() can return before stdin ends), and a closed descriptor's
        # number is soon reused by the next pipe, which that thread would then read from.
        # With the write end closed it sees EOF and exits; the FileIO closes when freed.
        self._in = None


class DemoProcess:
    """The demo executor as a child process in its own session (process group)."""

    def __init__(self, env: dict | None = None, keep_stderr: bool = True) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("DEMO_")}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(DEMO)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,
        )
        self.pgid = self.proc.pid  # leader of its own session and group
        self.stdout = ByteCollector(self.proc.stdout)
        self.stderr = ByteCollector(self.proc.stderr, keep=keep_stderr)
        self.frames = FrameStream(self.stdout)

    def send(self, *frames: pb.SupervisorFrame) -> None:
        write_frames(self.proc.stdin, *frames)

    def close_input(self) -> None:
        if not self.proc.stdin.closed:
            self.proc.stdin.close()

    def hello(self) -> pb.Hello:
        frame = self.frames.next()
        assert which(frame) == "hello", frame
        return frame.hello

    def run_job(self, frame: pb.SupervisorFrame, timeout: float = 10.0) -> list[pb.ExecutorFrame]:
        """Hello, send ``frame``, return the job's frames up to its terminal."""
        self.hello()
        self.send(frame)
        return self.frames.until_terminal(timeout)

    def wait(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout)

    def stderr_text(self) -> str:
        return self.stderr.data.decode("utf-8", "replace")

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        # The collectors see EOF once every holder of the pipes is dead; close only then
        # (closing a buffered stream another thread is reading from can block).
        streams = [self.proc.stdin]
        for collector, stream in ((self.stdout, self.proc.stdout), (self.stderr, self.proc.stderr)):
            collector.join(5)
            if collector.eof:
                streams.append(stream)
        for stream in streams:
            with contextlib.suppress(OSError, ValueError):
                stream.close()

    def __enter__(self) -> DemoProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill_group()
