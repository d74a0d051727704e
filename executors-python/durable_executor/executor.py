"""The executor runtime: handlers by kind, the job context, and the protocol loop.

One process serves jobs one after another. The main thread runs the handlers (so
they may install signal handlers); a daemon reader thread keeps reading stdin
while a handler runs, so a ``Cancel`` (or the end of stdin) sets the job's
cancel event at once. Every frame is written under one lock, and a job's
sequence numbers are assigned under that same lock, so frames leave in sequence
order whatever thread emits them.

Imports are kept minimal on purpose: executors are spawned per attempt and the
start-up cost is on every step's critical path.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from queue import SimpleQueue

from google.protobuf.message import DecodeError

from ._gen.durable.executor.v1 import executor_pb2 as pb
from ._version import SDK_NAME, __version__
from .framing import DEFAULT_MAX_FRAME_BYTES, FrameError, encode_frame, read_frame, write_all

# Codes the SDK produces itself (see PROTOCOL.md, "Stable error codes").
#: The job stopped because of a cancel (a Cancel frame, or stdin ended mid-job).
CANCELLED = "CANCELLED"
#: Refusal: no handler for the job's kind.
UNSUPPORTED_KIND = "UNSUPPORTED_KIND"
#: Refusal: a Job arrived while another one was running (a supervisor bug).
EXECUTOR_BUSY = "EXECUTOR_BUSY"
#: The handler raised an exception that is not an ExecutorError (retryable).
HANDLER_ERROR = "HANDLER_ERROR"
#: The job's input is not valid JSON (or not what the kind expects); not retryable.
BAD_INPUT = "BAD_INPUT"
#: The handler's output is not JSON; not retryable.
OUTPUT_INVALID = "OUTPUT_INVALID"
#: An artifact manifest entry the handler returned is not valid; not retryable.
ARTIFACT_INVALID = "ARTIFACT_INVALID"
#: The terminal frame would exceed the frame cap; not retryable.
RESULT_TOO_LARGE = "RESULT_TOO_LARGE"

# Cancel reasons the SDK produces itself (no Cancel frame). A Cancel frame's reason is
# reported without its prefix: "REQUESTED", "ATTEMPT_TIMEOUT", "DEADLINE", ...
#: The supervisor closed stdin while the job ran.
STDIN_CLOSED = "STDIN_CLOSED"
#: stdin carried bytes that are not a valid frame.
PROTOCOL_ERROR = "PROTOCOL_ERROR"
#: The frame output could not be written (the supervisor is gone).
OUTPUT_BROKEN = "OUTPUT_BROKEN"

#: How long, after stdin ends mid-job, the handler has to return once cancelled
#: before a process started with :meth:`Executor.run` exits anyway.
DEFAULT_STOP_GRACE = 10.0

_CODE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_REDACTED = "[REDACTED]"
_UNSET = object()


def _log(message: str) -> None:
    """Write one line to stderr (the supervisor keeps its tail as the attempt's log)."""
    err = sys.stderr
    if err is None:
        return
    try:
        err.write(f"durable-executor[{os.getpid()}]: {message}\n")
        err.flush()
    except (OSError, ValueError):
        pass


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _encode_json(value, what: str) -> bytes:
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} is not JSON-serializable: {e}") from None
    return text.encode("utf-8")


def _exception_text(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ---------------------------------------------------------------------------
# Errors


class Cancelled(Exception):
    """The job was cancelled. Raised by :meth:`Job.sleep` / :meth:`Job.raise_if_cancelled`.

    A handler stops because of a cancel by raising it (or letting it propagate); the
    SDK then reports ``JobError{code: "CANCELLED", retryable: false}``. Once the job
    is cancelled, any other exception is reported as ``CANCELLED`` too. A handler
    that returns a value has finished: its result is sent even after a cancel (the
    supervisor keeps it when it arrives within the cancel grace).
    """

    def __init__(self, message: str = "job cancelled", reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class ExecutorError(Exception):
    """A failure the handler reports on purpose: becomes ``JobError``.

    ``code`` is a stable UPPER_SNAKE_CASE string, ``details`` a JSON object (a dict)
    or ``None``, ``next_retry_delay_ms`` overrides the retry policy's backoff.
    Never put secrets in ``message`` or ``details`` (the SDK redacts the job's
    secret values from both as a last line of defence).
    """

    def __init__(
        self,
        code: str,
        message: str = "",
        retryable: bool = True,
        details: dict | None = None,
        next_retry_delay_ms: int | None = None,
    ) -> None:
        if not isinstance(code, str) or not code or not set(code) <= _CODE_CHARS:
            raise ValueError(f"error code must be non-empty UPPER_SNAKE_CASE, got {code!r}")
        if details is not None and not isinstance(details, dict):
            raise TypeError(f"details must be a dict (a JSON object) or None, got {type(details)}")
        if next_retry_delay_ms is not None and (
            isinstance(next_retry_delay_ms, bool)
            or not isinstance(next_retry_delay_ms, int)
            or next_retry_delay_ms < 0
        ):
            raise ValueError(
                f"next_retry_delay_ms must be a non-negative int, got {next_retry_delay_ms!r}"
            )
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.retryable = bool(retryable)
        self.details = details
        self.next_retry_delay_ms = next_retry_delay_ms


class _TerminalError(Exception):
    """Internal: the handler's outcome cannot be sent as is; send this JobError."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ---------------------------------------------------------------------------
# Values


class Artifact:
    """An artifact manifest entry: a file the job wrote below its output directory.

    Build one with :meth:`Job.artifact`, which hashes the file; ``path`` is relative
    to the output directory with ``/`` separators.
    """

    __slots__ = ("derived_from", "media_type", "name", "path", "sha256", "size")

    def __init__(
        self,
        name: str,
        path: str,
        sha256: str,
        size: int,
        media_type: str = "application/octet-stream",
        derived_from=(),
    ) -> None:
        self.name = name
        self.path = path
        self.sha256 = sha256
        self.size = size
        self.media_type = media_type
        self.derived_from = list(derived_from)

    def to_proto(self) -> pb.ArtifactManifestEntry:
        return pb.ArtifactManifestEntry(
            name=self.name,
            path=self.path,
            sha256=self.sha256,
            size=self.size,
            media_type=self.media_type,
            derived_from=self.derived_from,
        )

    def __eq__(self, other) -> bool:
        if not isinstance(other, Artifact):
            return NotImplemented
        return all(getattr(self, s) == getattr(other, s) for s in self.__slots__)

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return (
            f"Artifact(name={self.name!r}, path={self.path!r}, sha256={self.sha256!r}, "
            f"size={self.size}, media_type={self.media_type!r}, "
            f"derived_from={self.derived_from!r})"
        )


class InputArtifact:
    """An artifact produced by an upstream step, materialised read-only at ``path``."""

    __slots__ = ("id", "media_type", "name", "path", "sha256", "size", "step_name")

    def __init__(self, ref: pb.ArtifactRef) -> None:
        self.id = ref.id
        self.name = ref.name
        self.sha256 = ref.sha256
        self.size = ref.size
        self.media_type = ref.media_type
        self.path = ref.path
        self.step_name = ref.step_name

    def read_bytes(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def __repr__(self) -> str:
        return (
            f"InputArtifact(id={self.id!r}, name={self.name!r}, path={self.path!r}, "
            f"size={self.size}, sha256={self.sha256!r}, step_name={self.step_name!r})"
        )


class Result:
    """A handler's successful outcome: an output JSON value plus artifacts.

    A handler may also return a bare JSON-able value, which means
    ``Result(value)``. ``output_json`` passes already-encoded JSON bytes through
    unchanged instead of encoding ``output`` (they must still be valid JSON).
    """

    __slots__ = ("artifacts", "output", "output_json")

    def __init__(self, output=None, artifacts=(), *, output_json: bytes | None = None) -> None:
        if output_json is not None and output is not None:
            raise ValueError("give either output or output_json, not both")
        self.output = output
        self.output_json = output_json
        self.artifacts = list(artifacts)

    def __repr__(self) -> str:
        return f"Result(output={self.output!r}, artifacts={self.artifacts!r})"


def _artifact_to_proto(item) -> pb.ArtifactManifestEntry:
    if isinstance(item, Artifact):
        entry = item.to_proto()
    elif isinstance(item, pb.ArtifactManifestEntry):
        entry = item
    elif isinstance(item, dict):
        try:
            entry = Artifact(**item).to_proto()
        except (TypeError, ValueError) as e:
            raise _TerminalError(ARTIFACT_INVALID, f"artifact {item!r}: {e}") from None
    else:
        kind = type(item).__name__
        raise _TerminalError(ARTIFACT_INVALID, f"an artifact must be an Artifact or a dict: {kind}")
    path = entry.path
    if not path or path.startswith("/") or "\0" in path or ".." in path.split("/"):
        raise _TerminalError(
            ARTIFACT_INVALID,
            f"artifact {entry.name!r}: path {path!r} is not a relative path inside the "
            "output directory",
        )
    return entry


# ---------------------------------------------------------------------------
# The job context


class Job:
    """One attempt of one step, as handed to a handler.

    Fields mirror the protocol's ``Job`` message; ``input`` is the parsed JSON
    input (``None`` when the input is empty; raises ``ExecutorError(BAD_INPUT)``
    when it is not JSON), ``input_bytes`` the raw bytes, ``checkpoint`` the last
    checkpoint of an earlier attempt (``None`` when there is none, ``b""`` when
    one was reported empty).
    """

    def __init__(self, msg: pb.Job, session: _Session) -> None:
        self.job_id: str = msg.job_id
        self.workflow_run_id: str = msg.workflow_run_id
        self.step_run_id: str = msg.step_run_id
        self.idempotency_key: str = msg.idempotency_key
        self.executor_kind: str = msg.executor_kind
        self.kind: str = msg.kind
        self.attempt: int = msg.attempt
        self.deadline_unix_ms: int = msg.deadline_unix_ms
        self.attempt_deadline_unix_ms: int = msg.attempt_deadline_unix_ms
        self.heartbeat_timeout_ms: int = msg.heartbeat_timeout_ms
        self.input_bytes: bytes = msg.input
        self.input_artifacts: list[InputArtifact] = [InputArtifact(r) for r in msg.input_artifacts]
        self.checkpoint: bytes | None = msg.checkpoint if msg.HasField("checkpoint") else None
        self.output_dir: str = msg.output_dir
        self.secrets: dict[str, str] = dict(msg.secrets)
        self.labels: dict[str, str] = dict(msg.labels)

        self._session = session
        self._input = _UNSET
        self._cancel = threading.Event()
        self._cancel_reason: str | None = None
        self._cancel_message = ""
        self._cancel_grace_ms = 0
        self._seq = 0
        self._terminal_sent = False

    def __repr__(self) -> str:
        # Never show secrets.
        return (
            f"Job(job_id={self.job_id!r}, kind={self.kind!r}, attempt={self.attempt}, "
            f"step_run_id={self.step_run_id!r})"
        )

    # -- input -------------------------------------------------------------

    @property
    def input(self):
        """The step input, parsed from JSON (``None`` when empty)."""
        if self._input is _UNSET:
            if not self.input_bytes.strip():
                self._input = None
            else:
                try:
                    self._input = json.loads(self.input_bytes)
                except ValueError as e:
                    raise ExecutorError(
                        BAD_INPUT, f"job input is not valid JSON: {e}", retryable=False
                    ) from None
        return self._input

    # -- cancellation ------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """True once the supervisor cancelled the job (or stdin ended mid-job).

        A handler that sees it and stops calls :meth:`raise_if_cancelled` (or raises
        :class:`Cancelled`): the job ends ``CANCELLED``. Returning instead means the
        work finished: the result is sent.
        """
        return self._cancel.is_set()

    @property
    def cancel_event(self) -> threading.Event:
        """The event set on cancel, to wait on or hand to other threads."""
        return self._cancel

    @property
    def cancel_reason(self) -> str | None:
        """The Cancel frame's reason without its prefix (``"REQUESTED"``,
        ``"ATTEMPT_TIMEOUT"``, ``"DEADLINE"``, ``"LEASE_LOST"``, ``"SHUTDOWN"``,
        ``"UNSPECIFIED"``), or ``"STDIN_CLOSED"`` / ``"PROTOCOL_ERROR"`` /
        ``"OUTPUT_BROKEN"``; ``None`` while not cancelled."""
        return self._cancel_reason

    @property
    def cancel_grace_ms(self) -> int:
        """How long the supervisor waits for the terminal after its Cancel (0: unknown)."""
        return self._cancel_grace_ms

    def raise_if_cancelled(self) -> None:
        """Raise :class:`Cancelled` if the job was cancelled."""
        if self._cancel.is_set():
            raise Cancelled(self._cancelled_text(), self._cancel_reason)

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, returning early by raising :class:`Cancelled` on cancel."""
        if seconds > 0:
            self._cancel.wait(seconds)
        self.raise_if_cancelled()

    def time_remaining(self) -> float | None:
        """Seconds until the earlier of the attempt and step deadlines (``None``: none)."""
        ends = [d for d in (self.deadline_unix_ms, self.attempt_deadline_unix_ms) if d > 0]
        if not ends:
            return None
        return (min(ends) - _now_ms()) / 1000.0

    def _request_cancel(self, reason: str, message: str = "", grace_ms: int = 0) -> None:
        if not self._cancel.is_set():
            self._cancel_reason = reason
            self._cancel_message = message
            self._cancel_grace_ms = grace_ms
            self._cancel.set()

    def _cancelled_text(self) -> str:
        text = f"job cancelled ({self._cancel_reason or 'by the handler'})"
        if self._cancel_message:
            text += f": {self._cancel_message}"
        return text

    # -- events ------------------------------------------------------------

    def progress(
        self, message: str = "", fraction: float | None = None, checkpoint: bytes | None = None
    ) -> None:
        """Send a PROGRESS event (a message, a 0..1 fraction, an optional checkpoint).

        Any event resets the supervisor's heartbeat timeout. Thread-safe. Raises
        RuntimeError once the job's terminal was sent.
        """
        self._emit(pb.EVENT_KIND_PROGRESS, message, fraction, checkpoint)

    def heartbeat(self, checkpoint: bytes | None = None) -> None:
        """Send a HEARTBEAT event (liveness only, optionally with a checkpoint)."""
        self._emit(pb.EVENT_KIND_HEARTBEAT, "", None, checkpoint)

    def save_checkpoint(self, data: bytes) -> None:
        """Report opaque resume state; the next attempt receives it as ``checkpoint``.

        Sent on a HEARTBEAT event. (The incoming checkpoint is the ``checkpoint``
        attribute, hence this name.)
        """
        if data is None:
            raise TypeError("checkpoint data must be bytes, not None")
        self._emit(pb.EVENT_KIND_HEARTBEAT, "", None, data)

    def _emit(self, kind: int, message: str, fraction, checkpoint) -> None:
        event = pb.ProgressEvent(job_id=self.job_id, kind=kind)
        if message:
            event.message = self._scrub(str(message))
        if fraction is not None:
            fraction = float(fraction)
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(f"fraction must be within 0.0..1.0, got {fraction!r}")
            event.fraction = fraction
        if checkpoint is not None:
            if isinstance(checkpoint, str):
                checkpoint = checkpoint.encode("utf-8")
            event.checkpoint = bytes(checkpoint)
        session = self._session
        with session.write_lock:
            if self._terminal_sent:
                raise RuntimeError(f"job {self.job_id}: an event cannot follow the terminal")
            event.sequence = self._seq + 1
            event.at_unix_ms = _now_ms()
            data = pb.ExecutorFrame(event=event).SerializeToString(deterministic=True)
            if len(data) > session.max_frame_bytes:
                raise ValueError(
                    f"event frame of {len(data)} bytes exceeds the frame cap of "
                    f"{session.max_frame_bytes} bytes (checkpoint too large?)"
                )
            self._seq += 1
            session.write_locked(encode_frame(data))

    # -- terminal ----------------------------------------------------------

    def _send_terminal(self, msg) -> None:
        """Send ``msg`` (a JobResult or JobError) as the job's one terminal."""
        session = self._session
        with session.write_lock:
            if self._terminal_sent:
                return
            self._seq += 1
            msg.sequence = self._seq
            if isinstance(msg, pb.JobResult):
                frame = pb.ExecutorFrame(result=msg)
            else:
                frame = pb.ExecutorFrame(error=msg)
            data = frame.SerializeToString(deterministic=True)
            if len(data) > session.max_frame_bytes:
                text = (
                    f"the terminal frame of {len(data)} bytes exceeds the frame cap of "
                    f"{session.max_frame_bytes} bytes; write large outputs as artifacts"
                )
                _log(f"job {self.job_id}: {text}")
                frame = pb.ExecutorFrame(
                    error=pb.JobError(
                        job_id=self.job_id,
                        sequence=self._seq,
                        code=RESULT_TOO_LARGE,
                        message=text,
                        retryable=False,
                    )
                )
                data = frame.SerializeToString(deterministic=True)
            self._terminal_sent = True
            # No longer running: from here a new Job is welcome, a Cancel is moot.
            session.deactivate(self)
            session.write_locked(encode_frame(data))

    def _finish_error(
        self,
        code: str,
        message: str,
        retryable: bool,
        details: dict | None = None,
        next_retry_delay_ms: int | None = None,
    ) -> None:
        err = pb.JobError(
            job_id=self.job_id, code=code, message=self._scrub(message), retryable=retryable
        )
        if details:
            try:
                err.details = _encode_json(self._scrub_value(details), "the error details")
            except TypeError as e:
                _log(f"job {self.job_id}: dropping error details: {e}")
        if next_retry_delay_ms is not None:
            err.next_retry_delay_ms = next_retry_delay_ms
        self._send_terminal(err)

    def _finish_cancelled(self, after: BaseException | None = None) -> None:
        message = self._cancelled_text()
        if after is not None and not isinstance(after, Cancelled):
            message += f"; the handler then raised {_exception_text(after)}"
        details = {"reason": self._cancel_reason} if self._cancel_reason else None
        self._finish_error(CANCELLED, message, False, details)

    def _finish_result(self, value) -> None:
        result = value if isinstance(value, Result) else Result(value)
        try:
            if result.output_json is not None:
                output = bytes(result.output_json)
                try:
                    json.loads(output)
                except ValueError as e:
                    raise _TerminalError(
                        OUTPUT_INVALID,
                        f"the handler's output is not valid JSON ({len(output)} bytes): {e}",
                    ) from None
            else:
                try:
                    output = _encode_json(result.output, "the handler's output")
                except TypeError as e:
                    raise _TerminalError(OUTPUT_INVALID, str(e)) from None
            artifacts = [_artifact_to_proto(a) for a in result.artifacts]
        except _TerminalError as e:
            self._finish_error(e.code, e.message, False)
            return
        self._send_terminal(pb.JobResult(job_id=self.job_id, output=output, artifacts=artifacts))

    def _scrub(self, text: str) -> str:
        """Replace every secret value of the job in ``text`` (longest first)."""
        if self.secrets and text:
            for value in sorted(self.secrets.values(), key=len, reverse=True):
                if value:
                    text = text.replace(value, _REDACTED)
        return text

    def _scrub_value(self, value):
        """:meth:`_scrub` every string (keys too) inside a JSON-like value."""
        if not self.secrets:
            return value
        if isinstance(value, str):
            return self._scrub(value)
        if isinstance(value, dict):
            return {self._scrub(str(k)): self._scrub_value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._scrub_value(v) for v in value]
        return value

    # -- artifacts ---------------------------------------------------------

    def output_path(self, *parts: str) -> str:
        """Join ``parts`` below ``output_dir`` (no check; see :meth:`artifact`)."""
        return os.path.join(self.output_dir, *parts)

    def artifact(
        self,
        path: str,
        *,
        name: str | None = None,
        media_type: str = "application/octet-stream",
        derived_from=(),
    ) -> Artifact:
        """Build a manifest entry for a file the job wrote below ``output_dir``.

        ``path`` is relative to ``output_dir`` or absolute; the file (symlinks
        resolved) must lie below ``output_dir``. Hashes the file (sha256) and takes
        its size. ``name`` defaults to the file's base name.
        """
        import hashlib  # only handlers that produce artifacts pay for it

        if not self.output_dir:
            raise ValueError("the job has no output_dir")
        base = os.path.realpath(self.output_dir)
        full = os.path.realpath(os.path.join(base, path))
        if not full.startswith(base + os.sep):
            raise ValueError(f"artifact path {path!r} is not below the output directory")
        rel = os.path.relpath(full, base).replace(os.sep, "/")
        digest = hashlib.sha256()
        size = 0
        with open(full, "rb") as f:
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                digest.update(chunk)
                size += len(chunk)
        return Artifact(
            name=name if name is not None else rel.rsplit("/", 1)[-1],
            path=rel,
            sha256=digest.hexdigest(),
            size=size,
            media_type=media_type,
            derived_from=derived_from,
        )

    # -- escape hatches for protocol conformance tests ---------------------

    def unsafe_send_frame(self, frame: pb.ExecutorFrame) -> None:
        """Write ``frame`` as is, bypassing sequencing. A JobResult/JobError sent this
        way counts as the job's terminal: the SDK sends none of its own afterwards
        (the job still counts as running until its handler returns). Exists to build
        misbehaving executors for protocol tests."""
        session = self._session
        with session.write_lock:
            if frame.WhichOneof("frame") in ("result", "error"):
                self._terminal_sent = True
            session.write_locked(encode_frame(frame.SerializeToString(deterministic=True)))

    def unsafe_write_raw(self, data: bytes) -> None:
        """Write raw bytes on the frame stream (no framing). For protocol tests."""
        session = self._session
        with session.write_lock:
            session.write_locked(bytes(data))


# ---------------------------------------------------------------------------
# The executor


_EOF = object()
_SHUTDOWN = object()


class Executor:
    """A set of handlers by job kind, served over the executor protocol.

    >>> ex = Executor(executor_kind="python", labels={"gpu": "none"})
    >>> @ex.handler("demo.echo")
    ... def echo(job):
    ...     return job.input
    >>> # sys.exit(ex.run())

    ``max_jobs_per_process`` (sent in Hello): negative = serve jobs until stdin
    ends or a Shutdown arrives (persistent mode), 0 or 1 = one job, N = N jobs.
    ``max_frame_bytes`` caps frames both ways. ``stop_grace``: once stdin ends
    mid-job, the cancelled handler has this many seconds to return before a
    process started with :meth:`run` exits anyway (status 1), so an executor never
    outlives its supervisor. ``advertise_kinds``: extra kinds listed in Hello
    without a handler (their jobs are refused with UNSUPPORTED_KIND), for tests.
    """

    def __init__(
        self,
        executor_kind: str,
        labels: dict[str, str] | None = None,
        *,
        max_jobs_per_process: int = -1,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        stop_grace: float = DEFAULT_STOP_GRACE,
        advertise_kinds=(),
    ) -> None:
        if not executor_kind:
            raise ValueError("executor_kind must be non-empty")
        self.executor_kind = executor_kind
        self.labels = dict(labels or {})
        self.max_jobs_per_process = int(max_jobs_per_process)
        self.max_frame_bytes = int(max_frame_bytes)
        self.stop_grace = float(stop_grace)
        self.advertise_kinds = list(advertise_kinds)
        self._handlers: dict = {}

    def handler(self, kind: str):
        """Decorator: register ``fn(job) -> output | Result`` for jobs of ``kind``."""

        def register(fn):
            self.add_handler(kind, fn)
            return fn

        return register

    def add_handler(self, kind: str, fn) -> None:
        if not kind:
            raise ValueError("kind must be non-empty")
        if kind in self._handlers:
            raise ValueError(f"a handler for kind {kind!r} is already registered")
        if not callable(fn):
            raise TypeError(f"handler for {kind!r} is not callable")
        self._handlers[kind] = fn

    @property
    def kinds(self) -> list[str]:
        """The kinds listed in Hello: the handled ones plus ``advertise_kinds``, sorted."""
        return sorted(set(self._handlers) | set(self.advertise_kinds))

    def hello(self) -> pb.Hello:
        return pb.Hello(
            protocol_version=pb.PROTOCOL_VERSION_1,
            executor_kind=self.executor_kind,
            kinds=self.kinds,
            labels=self.labels,
            sdk_name=SDK_NAME,
            sdk_version=__version__,
            max_jobs_per_process=self.max_jobs_per_process,
            pid=os.getpid(),
        )

    def serve(self, in_stream, out_stream) -> int:
        """Speak the protocol on the given binary streams until stdin ends, a Shutdown
        arrives while idle, or the job quota is served.

        Returns the exit status: 0 after a clean end, 1 after a broken stream
        (stdin carried an invalid frame, or the frame output failed).
        """
        return _Session(self, in_stream, out_stream, exit_when_stuck=False).run()

    def run(self) -> int:
        """Serve on this process's stdin/stdout; returns the exit status for sys.exit
        (as :meth:`serve`, or 2 when the standard streams cannot be set up).

        First moves the real stdout to a private descriptor used only for frames and
        points fd 1 (and ``sys.stdout``) at stderr, and moves stdin to a private
        descriptor with fd 0 at /dev/null (see :func:`claim_stdio`), so neither
        stray prints nor child processes can corrupt or steal frames.
        """
        try:
            in_stream, out_stream = claim_stdio()
        except OSError as e:
            _log(f"cannot set up the frame streams: {e}")
            return 2
        return _Session(self, in_stream, out_stream, exit_when_stuck=True).run()


_claimed = None
_claim_lock = threading.Lock()


def claim_stdio():
    """Take fds 0 and 1 for frames; return ``(frame_in, frame_out)`` raw binary streams.

    The private descriptors are close-on-exec, so child processes inherit neither.
    Child processes and ``print`` get fd 1 = stderr and fd 0 = /dev/null.
    Idempotent: later calls return the same streams. :meth:`Executor.run` calls it;
    a program that may print while starting up (before ``run``) should call it first,
    since bytes already written to the real stdout cannot be taken back.
    """
    global _claimed
    with _claim_lock:
        if _claimed is None:
            _claimed = _claim_stdio()
        return _claimed


def _claim_stdio():
    import contextlib
    import io

    out_fd = os.dup(1)  # fails (EBADF) if stdout is closed: nothing to speak on
    try:
        os.dup2(2, 1)
    except OSError:  # no stderr: discard stray output
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
    old = sys.stdout
    if old is not None:
        with contextlib.suppress(OSError, ValueError):
            old.flush()  # anything still buffered goes to fd 1, i.e. stderr now
    sys.stdout = open(  # noqa: SIM115 - lives as long as the process
        1,
        "w",
        buffering=1,
        encoding=getattr(old, "encoding", None) or "utf-8",
        errors="backslashreplace",
        closefd=False,
    )

    try:
        in_fd = os.dup(0)
    except OSError:  # stdin closed: an immediate clean EOF
        frame_in = io.BytesIO()
    else:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        frame_in = io.FileIO(in_fd, "r")
    # Unbuffered raw streams: no io lock a blocked daemon reader could hold at exit.
    frame_out = io.FileIO(out_fd, "w")
    return frame_in, frame_out


class _Session:
    """One conversation over one pair of streams.

    Lock order: ``write_lock`` before ``jobs_lock``.
    """

    def __init__(self, executor: Executor, in_stream, out_stream, exit_when_stuck: bool) -> None:
        self.ex = executor
        self.in_stream = in_stream
        self.out_stream = out_stream
        self.exit_when_stuck = exit_when_stuck
        self.max_frame_bytes = executor.max_frame_bytes
        self.write_lock = threading.Lock()
        self.output_broken = False
        self.input_broken = False
        self.shutting_down = False
        self.queue: SimpleQueue = SimpleQueue()
        # Jobs received and not finished (terminal not sent or handler still running).
        self.jobs: dict[str, Job] = {}
        self.jobs_lock = threading.Lock()

    # -- output ------------------------------------------------------------

    def write_locked(self, data: bytes) -> None:
        """Write bytes on the frame stream; the caller holds ``write_lock``.

        A failed write means the supervisor is gone: every job is cancelled and
        later writes are dropped (the session then ends with status 1).
        """
        if self.output_broken:
            return
        try:
            write_all(self.out_stream, data)
        except (OSError, ValueError) as e:
            self.output_broken = True
            _log(f"the frame output failed ({e}); cancelling the running job")
            self.cancel_all(OUTPUT_BROKEN, "the frame output to the supervisor failed")

    def refuse(self, msg: pb.Job, code: str, message: str, details: dict | None = None) -> None:
        """Answer a job with a JobError before ACCEPTED: it was not run."""
        err = pb.JobError(
            job_id=msg.job_id, sequence=1, code=code, message=message, retryable=False
        )
        if details:
            err.details = _encode_json(details, "refusal details")
        with self.write_lock:
            self.write_locked(
                encode_frame(pb.ExecutorFrame(error=err).SerializeToString(deterministic=True))
            )

    # -- job bookkeeping -----------------------------------------------------

    def deactivate(self, job: Job) -> None:
        with self.jobs_lock:
            if self.jobs.get(job.job_id) is job:
                del self.jobs[job.job_id]

    def cancel_all(self, reason: str, message: str) -> list[Job]:
        with self.jobs_lock:
            pending = list(self.jobs.values())
        for job in pending:
            job._request_cancel(reason, message)
        if pending:
            self.watch_stop(pending, reason)
        return pending

    def watch_stop(self, jobs: list[Job], reason: str) -> None:
        """After stdin or stdout broke mid-job: make sure the process ends even if
        the cancelled handler never returns."""
        grace = self.ex.stop_grace

        def check() -> None:
            stuck = [j for j in jobs if j.job_id in self.jobs]
            if not stuck:
                return
            _log(
                f"the handler for job {stuck[0].job_id!r} (kind {stuck[0].kind!r}) did not "
                f"return within {grace:g}s of being cancelled ({reason})"
                + ("; exiting" if self.exit_when_stuck else "")
            )
            if self.exit_when_stuck:
                # Avoid exiting in the middle of a frame, but do not wait forever for a
                # writer blocked on a pipe nobody reads.
                self.write_lock.acquire(timeout=1.0)
                os._exit(1)

        timer = threading.Timer(grace, check)
        timer.daemon = True
        timer.start()

    # -- input -------------------------------------------------------------

    def read_loop(self) -> None:
        reason, message = STDIN_CLOSED, "stdin closed while the job was running"
        try:
            while True:
                body = read_frame(self.in_stream, self.max_frame_bytes)
                if body is None:
                    return
                frame = pb.SupervisorFrame()
                frame.ParseFromString(body)
                self.dispatch(frame)
        except (FrameError, DecodeError) as e:
            self.input_broken = True
            reason = PROTOCOL_ERROR
            message = f"invalid frame from the supervisor: {_exception_text(e)}"
            _log(f"{message}; no more frames are read")
        except OSError as e:
            self.input_broken = True
            reason, message = PROTOCOL_ERROR, f"reading stdin failed: {e}"
            _log(message)
        except BaseException as e:  # never die silently: the main thread would wait forever
            self.input_broken = True
            reason = PROTOCOL_ERROR
            message = f"the frame reader failed: {_exception_text(e)}"
            _log(message)
        finally:
            # Shutdown then EOF is the normal way to stop a persistent executor: the
            # running job finishes. Any other end of input cancels it.
            if self.input_broken or not self.shutting_down:
                self.cancel_all(reason, message)
            self.queue.put(_EOF)

    def dispatch(self, frame: pb.SupervisorFrame) -> None:
        which = frame.WhichOneof("frame")
        if which == "job":
            msg = frame.job
            with self.jobs_lock:
                running = next(iter(self.jobs), None)
                if running is None and not self.shutting_down:
                    job = Job(msg, self)
                    self.jobs[job.job_id] = job
            if running is not None:
                _log(f"job {msg.job_id!r} arrived while job {running!r} is running; refusing it")
                self.refuse(
                    msg,
                    EXECUTOR_BUSY,
                    f"job {running!r} is still running; this executor runs one job at a time",
                )
            elif self.shutting_down:
                _log(f"job {msg.job_id!r} arrived after Shutdown; refusing it")
                self.refuse(msg, EXECUTOR_BUSY, "this executor received Shutdown")
            else:
                self.queue.put(job)
        elif which == "cancel":
            cancel = frame.cancel
            with self.jobs_lock:
                job = self.jobs.get(cancel.job_id)
            if job is None:
                # Normal when a cancel crosses the job's terminal on the wire.
                _log(f"ignoring cancel for job {cancel.job_id!r}: it is not running")
                return
            try:
                reason = pb.CancelReason.Name(cancel.reason)
            except ValueError:
                reason = f"CANCEL_REASON_{cancel.reason}"
            job._request_cancel(
                reason.removeprefix("CANCEL_REASON_"), cancel.message, cancel.grace_ms
            )
        elif which == "shutdown":
            self.shutting_down = True
            self.queue.put(_SHUTDOWN)
        else:
            _log("ignoring a supervisor frame of an unknown type")

    # -- main loop ---------------------------------------------------------

    def run(self) -> int:
        with self.write_lock:
            hello = pb.ExecutorFrame(hello=self.ex.hello())
            self.write_locked(encode_frame(hello.SerializeToString(deterministic=True)))
        if self.output_broken:
            return 1
        reader = threading.Thread(target=self.read_loop, name="durable-frame-reader", daemon=True)
        reader.start()

        limit = self.ex.max_jobs_per_process
        if limit == 0:
            limit = 1
        served = 0
        while not self.output_broken:
            item = self.queue.get()
            if item is _EOF or item is _SHUTDOWN:
                break
            try:
                self.run_job(item)
            finally:
                self.deactivate(item)
            served += 1
            if 0 < limit <= served:
                break
        return 1 if self.output_broken or self.input_broken else 0

    def run_job(self, job: Job) -> None:
        handler = self.ex._handlers.get(job.kind)
        if handler is None:
            self.deactivate(job)
            self.refuse(
                pb.Job(job_id=job.job_id),
                UNSUPPORTED_KIND,
                f"no handler for kind {job.kind!r} (this executor handles: "
                f"{', '.join(sorted(self.ex._handlers))})",
                {"kind": job.kind, "handled_kinds": sorted(self.ex._handlers)},
            )
            return
        job._emit(pb.EVENT_KIND_ACCEPTED, "", None, None)
        if job.cancelled:  # cancelled before it started: an outcome, not a refusal
            job._finish_cancelled()
            return
        job._emit(pb.EVENT_KIND_RUNNING, "", None, None)
        try:
            value = handler(job)
        except Exception as e:
            if job._terminal_sent:
                return
            if job.cancelled:
                job._finish_cancelled(after=e)
            elif isinstance(e, Cancelled):
                job._finish_error(CANCELLED, f"job cancelled by the handler: {e}", False)
            elif isinstance(e, ExecutorError):
                job._finish_error(e.code, e.message, e.retryable, e.details, e.next_retry_delay_ms)
            else:
                import traceback  # only on the failure path

                trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                _log(f"handler for {job.kind!r} raised (job {job.job_id}):\n{job._scrub(trace)}")
                job._finish_error(HANDLER_ERROR, _exception_text(e), True)
            return
        if job._terminal_sent:
            return
        # The terminal reflects what the handler did: a handler that returns has
        # finished, also after a cancel, and its result is sent (the supervisor keeps
        # it within the cancel grace). Stopping because of a cancel is raising
        # Cancelled (job.sleep / job.raise_if_cancelled do) or any exception.
        job._finish_result(value)
