"""The executor runtime: handlers by kind, the job context, and the protocol loop.

One process serves jobs one after another. The main thread runs the handlers (so
they may install signal handlers); a daemon reader thread keeps reading stdin
while a handler runs, so a ``Cancel`` (or the end of stdin) sets the job's
cancel event at once. ``async def`` handlers run on an event loop in the same
thread, and a cancel cancels their task. Every frame is written under one lock,
and a job's sequence numbers are assigned under that same lock, so frames leave
in sequence order whatever thread emits them.

Imports are kept minimal on purpose: executors are spawned per attempt and the
start-up cost is on every step's critical path. A job's whole path (the Hello,
the reader thread, the cancel flag, the inbox) runs on the builtin ``_thread``:
``threading`` costs ~3 ms of imports (``functools``, ``collections``), so it is
imported only when a handler asks for ``cancel_event`` or a cancelled handler
needs its watchdog timer; ``json``, ``asyncio``, ``signal``, ``hashlib`` and
``traceback`` when first needed. Nothing here imports ``typing`` or
``google.protobuf`` at run time.
"""

from __future__ import annotations

import _thread
import io
import math
import os
import sys
import time

from . import _fastjson, wire
from ._version import SDK_NAME, __version__
from .framing import DEFAULT_MAX_FRAME_BYTES, FrameError, encode_frame, read_frame, write_all

TYPE_CHECKING = False
if TYPE_CHECKING:
    import asyncio
    import threading
    from collections.abc import Callable, Coroutine, Iterable, Mapping
    from types import FrameType
    from typing import Any, Protocol, TypeAlias, TypeVar

    from .framing import BinaryReader, BinaryWriter

    #: A handler: ``fn(job)`` returning a JSON-able value or a :class:`Result`, or an
    #: ``async def`` doing the same (sync or async, both are ``Callable[[Job], object]``).
    Handler: TypeAlias = Callable[["Job"], object]
    _H = TypeVar("_H", bound=Handler)

    class _ProtobufFrame(Protocol):
        """A generated ``executor_pb2.ExecutorFrame`` (accepted by ``unsafe_send_frame``)."""

        def SerializeToString(self, *, deterministic: bool = ...) -> bytes: ...
        def WhichOneof(self, oneof_group: str, /) -> str | None: ...


# Codes the SDKs produce (PROTOCOL.md, "Stable error codes": every code whose
# "produced by" column names the SDK).
#: The job stopped because of a cancel (a Cancel frame, or stdin ended mid-job).
CANCELLED = "CANCELLED"
#: Refusal: no handler for the job's kind.
UNSUPPORTED_KIND = "UNSUPPORTED_KIND"
#: Refusal: a Job arrived while another one was running (a supervisor bug).
EXECUTOR_BUSY = "EXECUTOR_BUSY"
#: The handler raised an exception that is not an ExecutorError (retryable).
HANDLER_ERROR = "HANDLER_ERROR"
#: The handler panicked. Produced by the Go SDK only (Python has no panics: an
#: unexpected exception is HANDLER_ERROR); exported so code can name every SDK code.
HANDLER_PANIC = "HANDLER_PANIC"
#: The handler ran out of time (its context's deadline passed). Produced by the Go SDK
#: only (a Python handler reads :meth:`Job.time_remaining` and chooses its own code);
#: exported so code can name every SDK code.
HANDLER_TIMEOUT = "HANDLER_TIMEOUT"
#: The job's input is not valid JSON (or not what the kind expects); not retryable.
BAD_INPUT = "BAD_INPUT"
#: The handler's output is not JSON; not retryable.
OUTPUT_INVALID = "OUTPUT_INVALID"
#: An artifact manifest entry the handler returned is not valid; not retryable.
ARTIFACT_INVALID = "ARTIFACT_INVALID"
#: The terminal frame would exceed the frame cap; not retryable.
RESULT_TOO_LARGE = "RESULT_TOO_LARGE"
#: :meth:`Job.checkpoint_json` found a previous checkpoint that is not JSON; not
#: retryable (the next attempt would get the same one).
BAD_CHECKPOINT = "BAD_CHECKPOINT"

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

#: An artifact's media type when none is given (the supervisor's default too).
DEFAULT_MEDIA_TYPE = "application/octet-stream"

#: Secret values shorter than this (in UTF-8 bytes) are redacted only where a whole
#: string equals them, never inside other text (the supervisor's rule: a 1-byte
#: secret would otherwise turn every such character of every message into a marker).
MIN_REDACT_BYTES = 4

_CODE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_REDACTED = "[REDACTED]"
_UNSET: Any = object()
_INT32_MAX = (1 << 31) - 1


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


def _json_error(what: str, e: ValueError | RecursionError) -> str:
    """The message for JSON ``json`` could not read (the input, a checkpoint): valid JSON
    whose integer has more digits than ``int()`` converts here, or that nests deeper than
    the interpreter's recursion limit, is said to be that, not invalid JSON."""
    if isinstance(e, RecursionError):
        return (
            f"{what} nests deeper than this interpreter parses (sys.getrecursionlimit() = "
            f"{sys.getrecursionlimit()})"
        )
    if "int_max_str_digits" in str(e) or "Exceeds the limit" in str(e):
        return (
            f"{what} has an integer of more digits than this interpreter converts "
            f"(sys.get_int_max_str_digits() = {sys.get_int_max_str_digits()}): call "
            f"sys.set_int_max_str_digits() in the executor to raise the limit ({e})"
        )
    return f"{what} is not valid JSON: {e}"


def _json_text(value: object, what: str) -> str:
    try:
        return _fastjson.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"{what} is not JSON-serializable: {e}") from None


def _encode_json(value: object, what: str) -> bytes:
    """``value`` as compact UTF-8 JSON. ValueError when it is not JSON-serializable,
    or when a string in it holds a lone surrogate (how Python keeps a byte it could
    not decode, as in a file name from ``os.listdir``): UTF-8 cannot encode it, and
    the output is data, which the SDK does not alter."""
    text = _json_text(value, what)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = _escape_surrogates(text[e.start : e.end])
        raise ValueError(
            f"{what} is not valid UTF-8: a string in it holds the lone surrogate {bad} "
            "(a byte Python could not decode, as in a file name from os.listdir; "
            "decode such text with errors='replace' or send it as bytes in an artifact)"
        ) from None


def _encode_details(value: object, what: str) -> bytes:
    """``value`` as compact UTF-8 JSON, a lone surrogate in a string (or a key) written
    as the text of its backslash escape, as :func:`_clean_text` does in messages:
    details are evidence, sent as well as they can be. ValueError when ``value`` is not
    JSON-serializable."""
    text = _json_text(value, what)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate can stand only inside a JSON string, where json.dumps leaves
        # it raw: written as an escaped backslash then "udcff", the string holds the
        # text a message would.
        return "".join(
            f"\\\\u{ord(c):04x}" if "\ud800" <= c <= "\udfff" else c for c in text
        ).encode("utf-8")


def _escape_surrogates(text: str) -> str:
    """Lone surrogates as backslash escapes (``'\\udcff'``); other text unchanged."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _exception_text(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:  # a broken __str__ must not cost the job its terminal
        text = "<str() of the exception failed>"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _clean_text(text: str) -> str:
    """Text the wire accepts: NUL (refused by the supervisor) becomes U+FFFD, lone
    surrogates (not UTF-8) become backslash escapes."""
    if "\0" in text:
        text = text.replace("\0", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = _escape_surrogates(text)
    return text


def _is_cancellation(e: BaseException) -> bool:
    """``Cancelled``, or ``asyncio.CancelledError`` (without importing asyncio)."""
    if isinstance(e, Cancelled):
        return True
    aio = sys.modules.get("asyncio")
    return aio is not None and isinstance(e, aio.CancelledError)


# ---------------------------------------------------------------------------
# Errors


class Cancelled(BaseException):
    """The job was cancelled. Raised by :meth:`Job.sleep` / :meth:`Job.raise_if_cancelled`
    (and in a blocked handler by ``Executor(interrupt_on_cancel=True)``).

    It derives from ``BaseException``, like ``asyncio.CancelledError`` and
    ``KeyboardInterrupt``, so that ``except Exception:`` in handler code does not
    swallow it: catch it by name (``except Cancelled:``) to clean up, and re-raise.

    A handler stops because of a cancel by raising it (or letting it propagate); the
    SDK then reports ``JobError{code: "CANCELLED", retryable: false}``. Once the job
    is cancelled, any other exception is reported as ``CANCELLED`` too. A handler
    that returns a value has finished: its result is sent even after a cancel (the
    supervisor keeps it when it arrives within the cancel grace).
    """

    def __init__(self, message: str = "job cancelled", reason: str | None = None) -> None:
        super().__init__(message)
        #: The cancel reason (see :attr:`Job.cancel_reason`), ``None`` if unknown.
        self.reason = reason


class ExecutorError(Exception):
    """A failure the handler reports on purpose: becomes ``JobError``.

    ``code`` is a stable UPPER_SNAKE_CASE string, ``details`` a JSON object (a dict)
    or ``None``, ``next_retry_delay_ms`` replaces the retry policy's backoff for the
    next attempt, within the step's ``retry.max_interval_ms`` (a longer delay waits
    ``max_interval_ms``: the spec's author bounds how long any retry waits).
    Never put secrets in ``message`` or ``details`` (the SDK redacts the job's
    secret values from both as a last line of defence).
    """

    def __init__(
        self,
        code: str,
        message: str = "",
        retryable: bool = True,
        details: Mapping[str, object] | None = None,
        next_retry_delay_ms: int | None = None,
    ) -> None:
        if not isinstance(code, str) or not code or not set(code) <= _CODE_CHARS:
            raise ValueError(f"error code must be non-empty UPPER_SNAKE_CASE, got {code!r}")
        if details is not None and not isinstance(details, dict):
            # imported only here: the SDK's start stays light (a one-shot
            # process pays every import on every job)
            from collections.abc import Mapping as _Mapping

            if not isinstance(details, _Mapping):
                raise TypeError(
                    f"details must be a mapping (a JSON object) or None, got {type(details)}"
                )
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
        # a copy as a dict: any Mapping is taken, as the type says (a
        # MappingProxyType was refused at run time; SDK audit)
        self.details: Mapping[str, object] | None = dict(details) if details is not None else None
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
        media_type: str = DEFAULT_MEDIA_TYPE,
        derived_from: Iterable[str] = (),
    ) -> None:
        self.name = name
        self.path = path
        self.sha256 = sha256
        self.size = size
        self.media_type = media_type
        self.derived_from: list[str] = list(derived_from)

    def to_proto(self) -> wire.ArtifactManifestEntry:
        """The protocol message (:class:`durable_executor.wire.ArtifactManifestEntry`)."""
        return wire.ArtifactManifestEntry(
            name=self.name,
            path=self.path,
            sha256=self.sha256,
            size=self.size,
            media_type=self.media_type,
            derived_from=self.derived_from,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Artifact):
            return NotImplemented
        return all(getattr(self, s) == getattr(other, s) for s in self.__slots__)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"Artifact(name={self.name!r}, path={self.path!r}, sha256={self.sha256!r}, "
            f"size={self.size}, media_type={self.media_type!r}, "
            f"derived_from={self.derived_from!r})"
        )


class InputArtifact:
    """An artifact produced by an upstream step, materialised read-only at ``path``."""

    __slots__ = ("id", "media_type", "name", "path", "sha256", "size", "step_name")

    def __init__(self, ref: wire.ArtifactRef) -> None:
        self.id: str = ref.id
        self.name: str = ref.name
        self.sha256: str = ref.sha256
        self.size: int = ref.size
        self.media_type: str = ref.media_type
        self.path: str = ref.path
        self.step_name: str = ref.step_name

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
    An artifact is an :class:`Artifact` (from :meth:`Job.artifact`), a
    :class:`durable_executor.wire.ArtifactManifestEntry`, or a dict of
    :class:`Artifact`'s arguments.
    """

    __slots__ = ("artifacts", "output", "output_json")

    def __init__(
        self,
        output: object = None,
        artifacts: Iterable[Artifact | wire.ArtifactManifestEntry | Mapping[str, Any]] = (),
        *,
        output_json: bytes | None = None,
    ) -> None:
        if output_json is not None and output is not None:
            raise ValueError("give either output or output_json, not both")
        self.output = output
        self.output_json = output_json
        self.artifacts = list(artifacts)

    def __repr__(self) -> str:
        return f"Result(output={self.output!r}, artifacts={self.artifacts!r})"


def _artifact_to_proto(item: object) -> wire.ArtifactManifestEntry:
    from collections.abc import Mapping

    if isinstance(item, Artifact):
        entry = item.to_proto()
    elif isinstance(item, wire.ArtifactManifestEntry):
        entry = item
    elif isinstance(item, Mapping):
        try:
            entry = Artifact(**item).to_proto()
        except (TypeError, ValueError) as e:
            raise _TerminalError(ARTIFACT_INVALID, f"artifact {item!r}: {e}") from None
    else:
        kind = type(item).__name__
        raise _TerminalError(ARTIFACT_INVALID, f"an artifact must be an Artifact or a dict: {kind}")
    texts = [("name", entry.name), ("path", entry.path), ("sha256", entry.sha256)]
    texts += [("media_type", entry.media_type)]
    texts += [(f"derived_from[{i}]", d) for i, d in enumerate(entry.derived_from)]
    for field, value in texts:
        if isinstance(value, str) and value != _escape_surrogates(value):
            raise _TerminalError(
                ARTIFACT_INVALID,
                f"artifact {entry.name!r}: its {field} {value!r} is not valid UTF-8 (a byte "
                "Python could not decode, as in a file name from os.listdir)",
            )
    try:
        entry.encode()  # wrong types, a size out of range
    except (TypeError, ValueError) as e:
        raise _TerminalError(ARTIFACT_INVALID, f"artifact {entry.name!r}: {e}") from None
    path = entry.path
    if not path or path.startswith("/") or "\0" in path or ".." in path.split("/"):
        raise _TerminalError(
            ARTIFACT_INVALID,
            f"artifact {entry.name!r}: path {path!r} is not a relative path inside the "
            "output directory",
        )
    return entry


def _check_relative(path: str) -> None:
    """Refuse a path that is empty, absolute or has a ``..`` part (the Go SDK's rule)."""
    parts = path.replace(os.sep, "/").split("/")
    if not path or os.path.isabs(path) or ".." in parts or "\0" in path:
        raise ValueError(
            f"path {path!r} is not a relative path inside the output directory "
            "(empty, absolute, or with a '..' part)"
        )


# ---------------------------------------------------------------------------
# Redaction


class _Redactor:
    """Replaces the secret values handed to one job with ``[REDACTED]``.

    The supervisor's rules (``supervisor/src/secrets.rs``, ``Redactor``; the Go SDK
    has the same), so that what the SDK sends is what the supervisor would store:

    1. every value of at least :data:`MIN_REDACT_BYTES` UTF-8 bytes, and its
       JSON-escaped and percent-encoded forms, is replaced wherever it occurs,
       scanning left to right and taking the longest value at each position;
    2. a shorter non-empty value is replaced only where it is the whole string
       (replacing ``"1"`` inside every number would garble the text and tell
       where the secret is); an empty value never;
    3. if the result still contains a value (values overlapping each other), the
       whole string is replaced.

    Built only for a job that has secrets (``re`` and ``json`` cost imports).
    """

    def __init__(self, secrets: Mapping[str, str]) -> None:
        import re

        needles: set[str] = set()
        short: set[str] = set()
        for value in secrets.values():
            if not value:
                continue
            if len(value.encode("utf-8", "surrogatepass")) < MIN_REDACT_BYTES:
                short.add(value)
            else:
                needles.update(_redaction_forms(value))
        self.short = frozenset(short)
        # Longest first: an alternation takes the first that matches at a position.
        self.needles = sorted(needles, key=lambda n: (-len(n.encode("utf-8", "surrogatepass")), n))
        self.pattern = re.compile("|".join(map(re.escape, self.needles))) if needles else None

    def _leaks(self, text: str) -> bool:
        return any(n in text for n in self.needles)

    def text(self, text: str) -> str:
        if not text:
            return text
        if text in self.short:
            return _REDACTED
        if self.pattern is None:
            return text
        out = self.pattern.sub(_REDACTED, text)
        if self._leaks(out):
            for fallback in (_REDACTED, "***"):
                if not self._leaks(fallback):
                    return fallback
            return ""
        return out

    def value(self, value: object) -> object:
        """Every string inside a JSON-like value, object keys included. A number whose
        text contains a value becomes a redacted string; two keys that become equal
        are kept apart with a ``#2``, ``#3``, ... suffix."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, (int, float)):
            text = repr(value) if isinstance(value, float) else str(value)
            red = self.text(text)
            return value if red == text else red
        if isinstance(value, dict):
            out: dict[str, object] = {}
            for k in sorted(value, key=str):
                key = self.text(str(k))
                i = 2
                while key in out:
                    key = self.text(f"{self.text(str(k))}#{i}")
                    i += 1
                out[key] = self.value(value[k])
            return out
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value


def _redaction_forms(value: str) -> list[str]:
    """The forms a value is looked for in: as it is, JSON-escaped (inside JSON text),
    percent-encoded (in a URL); those of at least MIN_REDACT_BYTES bytes."""
    forms = [value, _fastjson.dumps(value, ensure_ascii=False)[1:-1]]
    raw = value.encode("utf-8", "surrogatepass")
    keep = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~"
    forms.append("".join(chr(c) if c in keep else f"%{c:02X}" for c in raw))
    out: list[str] = []
    for form in forms:
        if len(form.encode("utf-8", "surrogatepass")) >= MIN_REDACT_BYTES and form not in out:
            out.append(form)
    return out


# ---------------------------------------------------------------------------
# The job context


#: Bytes a job frame may grow by between attempts besides its checkpoint and
#: its paths (the attempt number's varint, the frame's length prefix).
_NEXT_JOB_SLACK = 16
#: What one local path of the job (its output directory, each input
#: artifact's) may take on the next attempt: another worker's `work_dir`, or
#: another kind of process, names it differently (re-check audit: 29 bytes
#: more failed the next attempt JOB_TOO_LARGE). Linux's PATH_MAX.
_PATH_ROOM = 4096


def _varint_len(n: int) -> int:
    size = 1
    while n > 0x7F:
        n >>= 7
        size += 1
    return size


def _checkpoint_field_len(n: int | None) -> int:
    """Bytes of a ``Job.checkpoint`` (field 13) of ``n`` bytes in an encoded job:
    tag, length, data; 0 when absent (``None``)."""
    if n is None:
        return 0
    return 1 + _varint_len(n) + n


class Job:
    """One attempt of one step, as handed to a handler.

    Fields mirror the protocol's ``Job`` message; ``input`` is the parsed JSON
    input (``None`` when the input is empty; raises ``ExecutorError(BAD_INPUT)``
    when it is not JSON), ``input_bytes`` the raw bytes, ``checkpoint`` the last
    checkpoint of an earlier attempt (``None`` when there is none, ``b""`` when
    one was reported empty).
    """

    def __init__(self, msg: wire.Job, session: _Session, frame_len: int | None = None) -> None:
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
        self.checkpoint: bytes | None = msg.checkpoint
        self.output_dir: str = msg.output_dir
        self.secrets: dict[str, str] = dict(msg.secrets)
        self.labels: dict[str, str] = dict(msg.labels)
        #: Protocol 1.1: the revision the supervisor chose ("" from a 1.0
        #: supervisor) and the features it agreed to.
        self.protocol_version: str = msg.negotiated_version
        self.features: list[str] = list(msg.negotiated_features)

        self._session = session
        # The cap on this job's frames: the SDK's own, lowered to the
        # supervisor's limit when the job states one (protocol 1.1).
        self._max_frame_bytes = session.max_frame_bytes
        if 0 < msg.max_frame_bytes < self._max_frame_bytes:
            self._max_frame_bytes = msg.max_frame_bytes
        # This job's frame without its checkpoint: the next attempt's job is
        # this one with the last checkpoint reported in its place, and it must
        # fit this executor's own cap to be received at all.
        if frame_len is None:
            frame_len = len(wire.encode_supervisor_frame(msg))
        old = None if msg.checkpoint is None else len(msg.checkpoint)
        self._job_len_without_checkpoint = frame_len - _checkpoint_field_len(old)
        self._input: Any = _UNSET
        self._lock = _thread.allocate_lock()  # cancel state vs the async task binding
        self._cancel = _Flag()
        # the threading.Event handed out by cancel_event, made on first use
        self._cancel_event: threading.Event | None = None
        self._cancel_reason: str | None = None
        self._cancel_message = ""
        self._cancel_grace_ms = 0
        self._seq = 0
        self._terminal_sent = False
        # async handlers: the task running the handler, and its loop
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # interrupt_on_cancel (main thread only)
        self._interrupt_armed = False
        self._interrupt_fired = False
        self._interrupt_pending = False
        self._redactor: _Redactor | None = None

    def __repr__(self) -> str:
        # Never show secrets.
        return (
            f"Job(job_id={self.job_id!r}, kind={self.kind!r}, attempt={self.attempt}, "
            f"step_run_id={self.step_run_id!r})"
        )

    # -- input -------------------------------------------------------------

    @property
    def input(self) -> Any:
        """The step input, parsed from JSON (``None`` when empty)."""
        if self._input is _UNSET:
            if not self.input_bytes.strip():
                self._input = None
            else:
                try:
                    self._input = _fastjson.loads(self.input_bytes)
                except (ValueError, RecursionError) as e:
                    raise ExecutorError(
                        BAD_INPUT, _json_error("job input", e), retryable=False
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
        with self._lock:
            if self._cancel_event is None:
                import threading  # only a handler that asks for it pays the import

                self._cancel_event = threading.Event()
                if self._cancel.is_set():
                    self._cancel_event.set()
            return self._cancel_event

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
        """Sleep ``seconds``, returning early by raising :class:`Cancelled` on cancel.

        Blocks the thread: in an ``async def`` handler use ``await asyncio.sleep()``
        (the task is cancelled on cancel)."""
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
        """Any thread: set the cancel, cancel the async task, interrupt a blocked handler."""
        with self._lock:
            if self._cancel.is_set():
                return
            self._cancel_reason = reason
            self._cancel_message = message
            self._cancel_grace_ms = grace_ms
            self._cancel.set()
            if self._cancel_event is not None:
                self._cancel_event.set()
            loop = self._loop
        if loop is not None:
            try:  # noqa: SIM105 - contextlib is an import on the start-up path
                loop.call_soon_threadsafe(self._cancel_task)
            except RuntimeError:  # the loop is closed: the handler is done
                pass
        self._session.interrupt(self)

    def _cancel_task(self) -> None:
        """In the handler's event loop: cancel its task (if it is still running)."""
        task = self._task
        if task is not None and not task.done():
            task.cancel(self._cancelled_text())

    def _bind_task(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        with self._lock:
            self._loop = loop
            self._task = task
            cancelled = self._cancel.is_set()
        if cancelled:
            # Cancelled before the task started: cancel it at its first suspension
            # (scheduled, not now, so a handler that never awaits keeps its result).
            loop.call_soon(self._cancel_task)

    def _unbind_task(self) -> None:
        with self._lock:
            self._loop = None
            self._task = None

    def _cancelled_text(self) -> str:
        text = f"job cancelled ({self._cancel_reason or 'by the handler'})"
        if self._cancel_message:
            text += f": {self._cancel_message}"
        return text

    # -- events ------------------------------------------------------------

    def progress(
        self, message: str = "", fraction: float | None = None, checkpoint: bytes | None = None
    ) -> None:
        """Send a PROGRESS event (a message, a fraction, an optional checkpoint).

        ``fraction`` is the part done, 0.0..1.0: a value outside is clamped into it
        (a computation that overshoots is not worth failing a job for); ``None`` or
        NaN sends no fraction (as the Go SDK's NoFraction). Any event resets the
        supervisor's heartbeat timeout. Thread-safe. Raises RuntimeError once the
        job's terminal was sent.
        """
        self._emit(wire.EVENT_KIND_PROGRESS, message, fraction, checkpoint)

    def heartbeat(self, checkpoint: bytes | None = None) -> None:
        """Send a HEARTBEAT event (liveness only, optionally with a checkpoint).

        The SDK sends none of its own: when ``heartbeat_timeout_ms`` is set, a handler
        silent for longer (a long :meth:`sleep` included) ends ``HEARTBEAT_TIMEOUT``."""
        self._emit(wire.EVENT_KIND_HEARTBEAT, "", None, checkpoint)

    def checkpoint_json(self, default: Any = None) -> Any:
        """The previous attempt's checkpoint decoded from JSON, or ``default`` when
        no earlier attempt reported one (or it was empty): a handler resumes from
        it. A checkpoint that is not JSON raises ``ExecutorError(BAD_CHECKPOINT)``
        (not retryable). The counterpart of :meth:`save_checkpoint_json`."""
        if self.checkpoint is None or not self.checkpoint.strip():
            return default
        try:
            return _fastjson.loads(self.checkpoint)
        except (ValueError, RecursionError) as e:
            # a RecursionError was HANDLER_ERROR, retried to fail alike (audit 95)
            raise ExecutorError(
                BAD_CHECKPOINT,
                _json_error(f"the previous checkpoint of {self.kind!r}", e),
                retryable=False,
            ) from None

    def save_checkpoint_json(
        self, value: Any, message: str = "", fraction: float | None = None
    ) -> None:
        """Report resume state as JSON on a PROGRESS event (with a message and a
        fraction, as :meth:`progress`); the next attempt reads it back with
        :meth:`checkpoint_json`."""
        data = _fastjson.dumps(value, separators=(",", ":"), allow_nan=False).encode()
        self._emit(wire.EVENT_KIND_PROGRESS, message, fraction, data)

    def save_checkpoint(self, data: bytes) -> None:
        """Report opaque resume state; the next attempt receives it as ``checkpoint``.

        Sent on a HEARTBEAT event. (The incoming checkpoint is the ``checkpoint``
        attribute, hence this name.)
        """
        if data is None:
            raise TypeError("checkpoint data must be bytes, not None")
        self._emit(wire.EVENT_KIND_HEARTBEAT, "", None, data)

    def _emit(
        self,
        kind: int,
        message: str,
        fraction: float | None,
        checkpoint: bytes | str | None,
    ) -> None:
        event = wire.ProgressEvent(job_id=self.job_id, kind=kind)
        if message:
            event.message = _clean_text(self._scrub(str(message)))
        if fraction is not None:
            try:
                fraction = float(fraction)
            except OverflowError:
                # an integer past a float (10**400) is past 1 or below 0:
                # clamped as any other (audit 95: it failed the handler)
                fraction = 1.0 if fraction > 0 else 0.0
            # NaN (0/0) and ±infinity (x/0) send no fraction, as None: a
            # division by zero is no 100 % (PROTOCOL.md, audit 94)
            if math.isfinite(fraction):
                event.fraction = min(max(fraction, 0.0), 1.0)
        if checkpoint is not None:
            if isinstance(checkpoint, str):
                checkpoint = checkpoint.encode("utf-8")
            event.checkpoint = bytes(checkpoint)
        session = self._session
        with session.write_lock:
            session.writer = _thread.get_ident()
            try:
                if self._terminal_sent:
                    raise RuntimeError(f"job {self.job_id}: an event cannot follow the terminal")
                event.sequence = self._seq + 1
                event.at_unix_ms = _now_ms()
                data = wire.encode_executor_frame(event)
                if len(data) > self._max_frame_bytes:
                    raise ValueError(self._oversize_event_text(event, len(data)))
                if checkpoint is not None:
                    self._check_next_job_fits(len(checkpoint))
                self._seq += 1
                session.write_locked(encode_frame(data))
            finally:
                session.writer = 0
        self._raise_deferred_interrupt()

    def _check_next_job_fits(self, checkpoint_len: int) -> None:
        """Refuse a checkpoint that would leave the next attempt a job frame
        over this executor's own cap: the supervisor could not send it, and
        every later attempt would fail ``JOB_TOO_LARGE``. Room is left for
        the job's paths to differ on the next attempt (4 KiB each); secret
        values that grow cannot be foreseen."""
        cap = self._session.max_frame_bytes
        next_len = (
            self._job_len_without_checkpoint
            + _checkpoint_field_len(checkpoint_len)
            + _NEXT_JOB_SLACK
            + _PATH_ROOM * (1 + len(self.input_artifacts))
        )
        if next_len > cap:
            raise ValueError(
                f"a checkpoint of {checkpoint_len} bytes would make the next attempt's job frame "
                f"about {next_len} bytes, over this executor's frame cap of {cap} bytes "
                "(Executor(max_frame_bytes=...)): the next attempt could not receive it; "
                "keep checkpoints smaller (large state belongs in artifacts); it was not sent"
            )

    def _oversize_event_text(self, event: wire.ProgressEvent, size: int) -> str:
        parts = []
        if event.checkpoint:
            parts.append(f"its checkpoint of {len(event.checkpoint)} bytes")
        if event.message:
            parts.append(f"its message of {len(event.message.encode('utf-8'))} bytes")
        text = f"event frame of {size} bytes exceeds the frame cap of {self._max_frame_bytes} bytes"
        if parts:
            text += f" ({' and '.join(parts)})"
        return text + "; it was not sent"

    # -- terminal ----------------------------------------------------------

    def _send_terminal(self, msg: wire.JobResult | wire.JobError) -> None:
        """Send ``msg`` (a JobResult or JobError) as the job's one terminal."""
        session = self._session
        with session.write_lock:
            if self._terminal_sent:
                return
            self._seq += 1
            msg.sequence = self._seq
            try:
                data = wire.encode_executor_frame(msg)
            except (TypeError, ValueError) as e:
                # Not encodable (a field of the wrong type or out of range, text that is
                # not UTF-8): send a JobError that is rather than no terminal at all.
                replacement = self._unencodable(msg, e)
                _log(f"job {self.job_id}: the terminal does not encode; {replacement.message}")
                data = wire.encode_executor_frame(replacement)
            if len(data) > self._max_frame_bytes:
                text = (
                    f"the terminal frame of {len(data)} bytes exceeds the frame cap of "
                    f"{self._max_frame_bytes} bytes; write large outputs as artifacts"
                )
                _log(f"job {self.job_id}: {text}")
                data = wire.encode_executor_frame(
                    wire.JobError(
                        job_id=self.job_id,
                        sequence=self._seq,
                        code=RESULT_TOO_LARGE,
                        message=text,
                        retryable=False,
                    )
                )
            self._terminal_sent = True
            # No longer running: from here a new Job is welcome, a Cancel is moot.
            session.deactivate(self)
            session.write_locked(encode_frame(data))

    def _unencodable(self, msg: wire.JobResult | wire.JobError, e: Exception) -> wire.JobError:
        """The JobError sent instead of a terminal that does not encode (the Go SDK's
        rule): a result becomes OUTPUT_INVALID (not retryable: it would fail the same
        way), an error HANDLER_ERROR, retryable as the handler said. Its every field
        encodes."""
        if isinstance(msg, wire.JobError):
            code, retryable = HANDLER_ERROR, bool(msg.retryable)
            what = f"error (code {_clean_text(str(msg.code))})"
        else:
            code, retryable, what = OUTPUT_INVALID, False, "result"
        text = _clean_text(self._scrub(f"the job's {what} could not be encoded as a frame: {e}"))
        return wire.JobError(
            job_id=self.job_id,
            sequence=msg.sequence,
            code=code,
            message=text[:1024],
            retryable=retryable,
        )

    def _finish_error(
        self,
        code: str,
        message: str,
        retryable: bool,
        details: Mapping[str, object] | None = None,
        next_retry_delay_ms: int | None = None,
    ) -> None:
        err = wire.JobError(
            job_id=self.job_id,
            code=_clean_text(str(code)),
            message=_clean_text(self._scrub(str(message))),
            retryable=bool(retryable),
        )
        if details:
            try:
                err.details = _encode_details(self._scrub_value(details), "the error details")
            except ValueError as e:
                _log(f"job {self.job_id}: dropping error details: {_clean_text(str(e))}")
        if next_retry_delay_ms is not None:
            err.next_retry_delay_ms = next_retry_delay_ms
        self._send_terminal(err)

    def _finish_cancelled(self, after: BaseException | None = None) -> None:
        message = self._cancelled_text()
        details: dict[str, object] = {}
        if self._cancel_reason:
            details["reason"] = self._cancel_reason
        if after is not None and not _is_cancellation(after):
            raised = _exception_text(after)
            message += f"; the handler then raised {raised}"
            # the supervisor keeps it beside its own cancel (PROTOCOL.md)
            details["handler_error"] = raised
        self._finish_error(CANCELLED, message, False, details or None)

    def _finish_result(self, value: object) -> None:
        result = value if isinstance(value, Result) else Result(value)
        try:
            if result.output_json is not None:
                if not isinstance(result.output_json, (bytes, bytearray, memoryview)):
                    kind = type(result.output_json).__name__
                    raise _TerminalError(OUTPUT_INVALID, f"output_json must be bytes, not {kind}")
                output = bytes(result.output_json)
                # empty is `null`, as the supervisor and the Go SDK take it
                try:
                    if output:
                        _fastjson.check(output)
                except ValueError as e:
                    raise _TerminalError(
                        OUTPUT_INVALID,
                        f"the handler's output is not valid JSON ({len(output)} bytes): {e}",
                    ) from None
                except RecursionError:
                    # a process that crashed on it failed every attempt alike,
                    # EXECUTOR_CRASHED (audit 94)
                    raise _TerminalError(
                        OUTPUT_INVALID,
                        f"the handler's output nests deeper than any JSON the supervisor stores "
                        f"({len(output)} bytes; a value may nest 128 levels)",
                    ) from None
            else:
                try:
                    output = _encode_json(result.output, "the handler's output")
                except ValueError as e:
                    raise _TerminalError(OUTPUT_INVALID, str(e)) from None
            artifacts = [_artifact_to_proto(a) for a in result.artifacts]
        except _TerminalError as e:
            self._finish_error(e.code, e.message, False)
            return
        self._send_terminal(wire.JobResult(job_id=self.job_id, output=output, artifacts=artifacts))

    # -- redaction ---------------------------------------------------------

    def _scrub(self, text: str) -> str:
        """Redact the job's secret values from ``text`` (rules: :class:`_Redactor`)."""
        if not self.secrets or not text:
            return text
        if self._redactor is None:
            self._redactor = _Redactor(self.secrets)
        return self._redactor.text(text)

    def _scrub_value(self, value: object) -> object:
        """Redact every string (keys too) inside a JSON-like value."""
        if not self.secrets:
            return value
        if self._redactor is None:
            self._redactor = _Redactor(self.secrets)
        return self._redactor.value(value)

    # -- artifacts ---------------------------------------------------------

    def output_path(self, *parts: str) -> str:
        """Join ``parts`` below ``output_dir``. Raises ValueError for a part that is
        empty, absolute or contains ``..`` (it would escape the output directory),
        or when the job has no output directory (the Go SDK's ``OutputPath``)."""
        if not self.output_dir:
            raise ValueError("the job has no output_dir")
        for part in parts:
            _check_relative(part)
        return os.path.join(self.output_dir, *parts)

    def artifact(
        self,
        path: str,
        *,
        name: str | None = None,
        media_type: str = DEFAULT_MEDIA_TYPE,
        derived_from: Iterable[str] = (),
    ) -> Artifact:
        """Build the manifest entry of a regular file the job wrote below ``output_dir``.

        ``path`` is relative to ``output_dir`` (or absolute, as returned by
        :meth:`output_path`); the file, symlinks resolved, must be a regular file
        below ``output_dir``, and the entry's ``path`` is its location relative to
        it. Hashes the file (sha256) and takes its size. ``name`` defaults (when
        ``None`` or empty) to the file's base name, ``media_type`` (when empty) to
        :data:`DEFAULT_MEDIA_TYPE`; ``derived_from`` lists ids of input artifacts
        (:attr:`InputArtifact.id`). The Go SDK's ``FileArtifact`` has the same rules.

        A path outside the output directory, a missing file or one that is not a
        regular file raises ``ExecutorError(ARTIFACT_INVALID, retryable=False)``
        (the job fails with it if the handler lets it propagate); a failure to read
        the file raises OSError.
        """
        import hashlib  # only handlers that produce artifacts pay for it
        import stat

        def invalid(why: str) -> ExecutorError:
            return ExecutorError(ARTIFACT_INVALID, f"artifact {path!r}: {why}", retryable=False)

        if not self.output_dir:
            raise invalid("the job has no output directory")
        if not path:
            raise invalid("no path")
        base = os.path.realpath(self.output_dir)
        full = os.path.realpath(os.path.join(base, path))
        if not full.startswith(base + os.sep):
            raise invalid(f"not below the output directory {self.output_dir}")
        try:
            mode = os.stat(full).st_mode
        except OSError as e:
            raise invalid(e.strerror or str(e)) from None
        if not stat.S_ISREG(mode):  # checked before open: opening a FIFO would block
            raise invalid("not a regular file")
        rel = os.path.relpath(full, base).replace(os.sep, "/")
        if rel != _escape_surrogates(rel):
            # A manifest is UTF-8 text: the name cannot be sent, and a replaced byte
            # would name another file.
            raise invalid("the file name is not valid UTF-8 (rename the file)")
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
            name=name or rel.rsplit("/", 1)[-1],
            path=rel,
            sha256=digest.hexdigest(),
            size=size,
            media_type=media_type or DEFAULT_MEDIA_TYPE,
            derived_from=derived_from,
        )

    # -- interrupt_on_cancel -------------------------------------------------

    def _raise_deferred_interrupt(self) -> None:
        """After an SDK write in the main thread: raise the interrupt deferred while
        the frame was being written (never raised in the middle of a frame)."""
        if self._interrupt_pending and self._interrupt_armed:
            self._interrupt_pending = False
            if _thread.get_ident() == self._session.main_ident:
                self._interrupt_fired = True
                raise Cancelled(self._cancelled_text(), self._cancel_reason)

    # -- escape hatches for protocol conformance tests ---------------------

    def unsafe_send_frame(self, frame: wire.ExecutorMessage | _ProtobufFrame) -> None:
        """Write ``frame`` (a :mod:`durable_executor.wire` executor message, or a
        generated protobuf ``ExecutorFrame``) as is, bypassing sequencing. A
        JobResult/JobError sent this way counts as the job's terminal: the SDK sends
        none of its own afterwards (the job still counts as running until its handler
        returns). Exists to build misbehaving executors for protocol tests."""
        if isinstance(frame, wire.Message):
            data = wire.encode_executor_frame(frame)
            terminal = isinstance(frame, (wire.JobResult, wire.JobError))
        else:
            data = frame.SerializeToString(deterministic=True)
            terminal = frame.WhichOneof("frame") in ("result", "error")
        session = self._session
        with session.write_lock:
            session.writer = _thread.get_ident()
            try:
                if terminal:
                    self._terminal_sent = True
                session.write_locked(encode_frame(data))
            finally:
                session.writer = 0
        self._raise_deferred_interrupt()

    def unsafe_write_raw(self, data: bytes) -> None:
        """Write raw bytes on the frame stream (no framing). For protocol tests."""
        session = self._session
        with session.write_lock:
            session.writer = _thread.get_ident()
            try:
                session.write_locked(bytes(data))
            finally:
                session.writer = 0
        self._raise_deferred_interrupt()


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

    ``max_jobs_per_process`` (sent in Hello): N > 0 serves N jobs, then the process
    ends; 0 or negative (the default, -1) serves jobs until stdin ends or a Shutdown
    arrives (persistent mode; Hello then says -1), as in the Go SDK.
    ``max_frame_bytes`` caps frames both ways; announce at least 64 KiB (65536): a
    supervisor refuses an executor whose Hello says less (no job would fit).
    ``stop_grace``: once stdin ends
    mid-job, the cancelled handler has this many seconds to return before a
    process started with :meth:`run` exits anyway (status 1), so an executor never
    outlives its supervisor. ``advertise_kinds``: extra kinds listed in Hello
    without a handler (their jobs are refused with UNSUPPORTED_KIND), for tests.

    ``interrupt_on_cancel``: when a cancel arrives while a (sync) handler runs, the
    SDK sends ``interrupt_signal`` (default SIGUSR1) to the main thread, whose signal
    handler raises :class:`Cancelled` in the handler: a handler blocked in
    ``time.sleep``, ``select``, a socket or pipe read, ``subprocess`` waits... is
    woken up, like Ctrl-C wakes a program with KeyboardInterrupt. It needs
    :meth:`serve` / :meth:`run` on the main thread, and the signal must not be used
    otherwise by the program. Limits in the README ("Interrupting blocked handlers").
    """

    def __init__(
        self,
        executor_kind: str,
        labels: Mapping[str, str] | None = None,
        *,
        max_jobs_per_process: int = -1,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        stop_grace: float = DEFAULT_STOP_GRACE,
        advertise_kinds: Iterable[str] = (),
        interrupt_on_cancel: bool = False,
        interrupt_signal: int | None = None,
    ) -> None:
        if not executor_kind:
            raise ValueError("executor_kind must be non-empty")
        self.executor_kind = executor_kind
        self.labels: dict[str, str] = dict(labels or {})
        self.max_jobs_per_process = int(max_jobs_per_process)
        self.max_frame_bytes = int(max_frame_bytes)
        self.stop_grace = float(stop_grace)
        self.advertise_kinds: list[str] = list(advertise_kinds)
        self.interrupt_on_cancel = bool(interrupt_on_cancel)
        self.interrupt_signal = interrupt_signal
        self._handlers: dict[str, Handler] = {}

    def handler(self, kind: str) -> Callable[[_H], _H]:
        """Decorator: register ``fn(job) -> output | Result`` (or an ``async def``)
        for jobs of ``kind``; returns ``fn`` unchanged (its type too)."""

        def register(fn: _H) -> _H:
            self.add_handler(kind, fn)
            return fn

        return register

    def add_handler(self, kind: str, fn: Handler) -> None:
        """Register ``fn`` for jobs of ``kind`` (ValueError if already registered)."""
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

    def hello(self) -> wire.Hello:
        """The Hello this executor sends (``max_jobs_per_process``: N > 0 as is,
        -1 for unlimited)."""
        n = self.max_jobs_per_process
        return wire.Hello(
            protocol_version=wire.PROTOCOL_VERSION_1,
            executor_kind=self.executor_kind,
            kinds=self.kinds,
            labels=self.labels,
            sdk_name=SDK_NAME,
            sdk_version=__version__,
            max_jobs_per_process=min(n, _INT32_MAX) if n > 0 else -1,
            pid=os.getpid(),
            protocol_versions=wire.PROTOCOL_VERSIONS,
            features=[wire.FEATURE_FRAME_LIMITS],
            max_frame_bytes=self.max_frame_bytes,
        )

    def serve(self, in_stream: BinaryReader, out_stream: BinaryWriter) -> int:
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
        code = _Session(self, in_stream, out_stream, exit_when_stuck=True).run()
        _end_without_stray_threads(code)
        return code


def _end_without_stray_threads(code: int) -> None:
    """End the process now, with ``code``, when a thread (not a daemon) that a
    handler, or the program before :meth:`run`, started is still running once
    serving is over.

    Python's exit waits for every such thread, so one a handler left behind (a
    ``threading.Thread`` sleeping 20 s) held an idle executor for 20 s after its
    stdin closed: the supervisor, done with the process, waited out its grace and
    signalled the group, and a later job waited on that (SDK audit 89). The
    protocol asks an idle executor to exit at once on EOF, as the Go SDK does
    (goroutines never hold up an exit). ``atexit`` functions still run, and the
    standard streams are flushed. Only on the main thread (where :meth:`run` is
    meant to be called): elsewhere the caller decides when the process ends.
    """
    threading = sys.modules.get("threading")
    if threading is None:  # nothing imported it: no thread of that kind exists
        return
    me = threading.current_thread()
    if me is not threading.main_thread():
        return
    stray = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
    if not stray:
        return
    names = ", ".join(repr(t.name) for t in stray[:5]) + (", ..." if len(stray) > 5 else "")
    _log(
        f"{len(stray)} thread(s) still run ({names}); the executor ends without waiting "
        "for them (make such threads daemons, or join them before the handler returns)"
    )
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


_claimed: tuple[io.RawIOBase | io.BytesIO, io.FileIO] | None = None
_claim_lock = _thread.allocate_lock()


def claim_stdio() -> tuple[io.RawIOBase | io.BytesIO, io.FileIO]:
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


def _claim_stdio() -> tuple[io.RawIOBase | io.BytesIO, io.FileIO]:
    out_fd = os.dup(1)  # fails (EBADF) if stdout is closed: nothing to speak on
    try:
        os.dup2(2, 1)
    except OSError:  # no stderr: discard stray output
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
    old = sys.stdout
    if old is not None:
        try:  # noqa: SIM105 - contextlib is an import on the start-up path
            old.flush()  # anything still buffered goes to fd 1, i.e. stderr now
        except (OSError, ValueError):
            pass
    sys.stdout = open(  # noqa: SIM115 - lives as long as the process
        1,
        "w",
        buffering=1,
        encoding=getattr(old, "encoding", None) or "utf-8",
        errors="backslashreplace",
        closefd=False,
    )

    frame_in: io.RawIOBase | io.BytesIO
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


def _on_main_thread() -> bool:
    threading = sys.modules.get("threading")
    if threading is None:  # nothing started a thread through threading: the main one
        return True
    return bool(threading.current_thread() is threading.main_thread())


class _Flag:
    """``threading.Event``'s ``is_set``/``set``/``wait`` on a bare ``_thread`` lock.

    The gate is held until the flag is set; ``set`` releases it once, and every
    waiter that gets through passes it on (releases it again)."""

    __slots__ = ("_gate", "_set")

    def __init__(self) -> None:
        self._set = False
        self._gate = _thread.allocate_lock()
        self._gate.acquire()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        """Set the flag; callers serialize their calls (the job's ``_lock``)."""
        if not self._set:
            self._set = True
            self._gate.release()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if timeout is None:
            got = self._gate.acquire()
        else:
            got = self._gate.acquire(True, max(timeout, 0.0))
        if got:
            self._gate.release()
        return self._set


class _Inbox:
    """A minimal blocking FIFO for one consumer (``queue`` and ``threading`` cost
    imports on the start-up path)."""

    def __init__(self) -> None:
        self._items: list[object] = []  # a few items at most
        self._mutex = _thread.allocate_lock()
        # the consumer's gate while it waits for an item (held: it blocks)
        self._waiter: Any = None

    def put(self, item: object) -> None:
        with self._mutex:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.release()

    def get(self) -> object:
        while True:
            with self._mutex:
                if self._items:
                    return self._items.pop(0)
                waiter = _thread.allocate_lock()
                waiter.acquire()
                self._waiter = waiter
            waiter.acquire()


class _Session:
    """One conversation over one pair of streams.

    Lock order: ``write_lock`` before ``jobs_lock``; a job's ``_lock`` is taken alone.
    """

    def __init__(
        self,
        executor: Executor,
        in_stream: BinaryReader,
        out_stream: BinaryWriter,
        exit_when_stuck: bool,
    ) -> None:
        self.ex = executor
        self.in_stream = in_stream
        self.out_stream = out_stream
        self.exit_when_stuck = exit_when_stuck
        self.max_frame_bytes = executor.max_frame_bytes
        self.write_lock = _thread.allocate_lock()
        #: The thread writing a frame under write_lock (0: none); read by the
        #: interrupt signal handler, which never raises in the middle of a frame.
        self.writer = 0
        self.output_broken = False
        self.input_broken = False
        self.shutting_down = False
        self.queue = _Inbox()
        # Jobs received and not finished (terminal not sent or handler still running).
        self.jobs: dict[str, Job] = {}
        self.jobs_lock = _thread.allocate_lock()
        self.runner: asyncio.Runner | None = None
        # interrupt_on_cancel
        self.main_ident = 0
        self.interrupt_signal = 0
        self.interrupt_job: Job | None = None

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

    def refuse(
        self, job_id: str, code: str, message: str, details: Mapping[str, object] | None = None
    ) -> None:
        """Answer a job with a JobError before ACCEPTED: it was not run."""
        err = wire.JobError(job_id=job_id, sequence=1, code=code, message=message, retryable=False)
        if details:
            err.details = _encode_details(details, "refusal details")
        with self.write_lock:
            self.write_locked(encode_frame(wire.encode_executor_frame(err)))

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

        import threading

        timer = threading.Timer(grace, check)
        timer.daemon = True
        timer.start()

    # -- interrupt_on_cancel -------------------------------------------------

    def install_interrupt(self) -> Any:
        """Install the interrupt signal's handler; return the previous one."""
        import signal

        sig = self.ex.interrupt_signal
        self.interrupt_signal = int(sig if sig is not None else signal.SIGUSR1)
        self.main_ident = _thread.get_ident()
        previous = signal.signal(self.interrupt_signal, self.on_interrupt_signal)
        signal.siginterrupt(self.interrupt_signal, True)  # blocking calls fail with EINTR
        return previous

    def on_interrupt_signal(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler (main thread): raise Cancelled in the running handler."""
        job = self.interrupt_job
        if job is None or not job._interrupt_armed or job._interrupt_fired or not job.cancelled:
            return  # late or stray: nothing to interrupt
        if self.writer == _thread.get_ident():
            job._interrupt_pending = True  # raised once the frame is written
            return
        job._interrupt_fired = True
        raise Cancelled(job._cancelled_text(), job._cancel_reason)

    def interrupt(self, job: Job) -> None:
        """Any thread, after ``job`` was cancelled: wake its blocked handler."""
        if self.main_ident and self.interrupt_job is job and job._interrupt_armed:
            import signal

            try:
                signal.pthread_kill(self.main_ident, self.interrupt_signal)
            except (OSError, ValueError) as e:  # the main thread is gone
                _log(f"cannot interrupt the handler of job {job.job_id!r}: {e}")

    # -- input -------------------------------------------------------------

    def read_loop(self) -> None:
        reason, message = STDIN_CLOSED, "stdin closed while the job was running"
        try:
            while True:
                body = read_frame(self.in_stream, self.max_frame_bytes)
                if body is None:
                    return
                self.dispatch(wire.decode_supervisor_frame(body), len(body))
        except (FrameError, wire.DecodeError) as e:
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

    def dispatch(self, msg: wire.SupervisorMessage | None, frame_len: int | None = None) -> None:
        if isinstance(msg, wire.Job):
            with self.jobs_lock:
                running = next(iter(self.jobs), None)
                if running is None and not self.shutting_down:
                    job = Job(msg, self, frame_len)
                    self.jobs[job.job_id] = job
            if running is not None:
                _log(f"job {msg.job_id!r} arrived while job {running!r} is running; refusing it")
                self.refuse(
                    msg.job_id,
                    EXECUTOR_BUSY,
                    f"job {running!r} is still running; this executor runs one job at a time",
                )
            elif self.shutting_down:
                _log(f"job {msg.job_id!r} arrived after Shutdown; refusing it")
                self.refuse(msg.job_id, EXECUTOR_BUSY, "this executor received Shutdown")
            else:
                self.queue.put(job)
        elif isinstance(msg, wire.Cancel):
            with self.jobs_lock:
                target = self.jobs.get(msg.job_id)
            if target is None:
                # Normal when a cancel crosses the job's terminal on the wire.
                _log(f"ignoring cancel for job {msg.job_id!r}: it is not running")
                return
            reason = wire.cancel_reason_name(msg.reason).removeprefix("CANCEL_REASON_")
            target._request_cancel(reason, msg.message, msg.grace_ms)
        elif isinstance(msg, wire.Shutdown):
            self.shutting_down = True
            self.queue.put(_SHUTDOWN)
        else:
            _log("ignoring a supervisor frame of an unknown type")

    # -- main loop ---------------------------------------------------------

    def run(self) -> int:
        if self.ex.interrupt_on_cancel and not _on_main_thread():
            raise RuntimeError(
                "interrupt_on_cancel needs serve()/run() on the main thread: handlers run "
                "there, and Python runs signal handlers only in the main thread"
            )
        previous_handler: Any = None
        try:
            with self.write_lock:
                self.write_locked(encode_frame(wire.encode_executor_frame(self.ex.hello())))
            if self.output_broken:
                return 1
            if self.ex.interrupt_on_cancel:  # after the Hello: `signal` costs an import
                previous_handler = self.install_interrupt()
            # a bare thread (as a daemon: it never holds up the exit); `threading`
            # would cost milliseconds of imports on every one-shot job's path
            _thread.start_new_thread(self.read_loop, ())

            limit = self.ex.max_jobs_per_process
            served = 0
            while not self.output_broken:
                item = self.queue.get()
                if item is _EOF or item is _SHUTDOWN:
                    break
                assert isinstance(item, Job)
                try:
                    self.run_job(item)
                finally:
                    self.deactivate(item)
                served += 1
                if 0 < limit <= served:
                    break
            return 1 if self.output_broken or self.input_broken else 0
        finally:
            self.interrupt_job = None
            if self.runner is not None:
                self.runner.close()
                self.runner = None
            if self.main_ident:
                import signal

                restore = signal.SIG_DFL if previous_handler is None else previous_handler
                signal.signal(self.interrupt_signal, restore)
                self.main_ident = 0

    def run_job(self, job: Job) -> None:
        handler = self.ex._handlers.get(job.kind)
        if handler is None:
            self.deactivate(job)
            self.refuse(
                job.job_id,
                UNSUPPORTED_KIND,
                f"no handler for kind {job.kind!r} (this executor handles: "
                f"{', '.join(sorted(self.ex._handlers))})",
                {"kind": job.kind, "handled_kinds": sorted(self.ex._handlers)},
            )
            return
        job._emit(wire.EVENT_KIND_ACCEPTED, "", None, None)
        if job.cancelled:  # cancelled before it started: an outcome, not a refusal
            job._finish_cancelled()
            return
        job._emit(wire.EVENT_KIND_RUNNING, "", None, None)
        try:
            value = self.call_handler(job, handler)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit included: sys.exit() ends the job, not us
            if job._terminal_sent:
                return
            if job.cancelled:
                job._finish_cancelled(after=e)
            elif _is_cancellation(e):
                job._finish_error(CANCELLED, f"job cancelled by the handler: {e}", False)
            elif isinstance(e, ExecutorError):
                job._finish_error(e.code, e.message, e.retryable, e.details, e.next_retry_delay_ms)
            else:
                import traceback  # only on the failure path

                trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                _log(f"handler for {job.kind!r} raised (job {job.job_id}):\n{job._scrub(trace)}")
                message = _exception_text(e)
                if isinstance(e, SystemExit):
                    # The process serves on (a persistent one: the next job); the job
                    # failed, as with any exception. (Go: runtime.Goexit is HANDLER_PANIC.)
                    message = (
                        f"the handler raised SystemExit (exit code {e.code!r}): sys.exit() "
                        "in a handler fails the job, the executor keeps serving"
                    )
                job._finish_error(HANDLER_ERROR, message, True)
            return
        if job._terminal_sent:
            return
        # The terminal reflects what the handler did: a handler that returns has
        # finished, also after a cancel, and its result is sent (the supervisor keeps
        # it within the cancel grace). Stopping because of a cancel is raising
        # Cancelled (job.sleep / job.raise_if_cancelled do) or any exception.
        job._finish_result(value)

    def call_handler(self, job: Job, handler: Handler) -> object:
        """Run the handler: a sync one here (interruptible when the executor asks for
        it), an ``async def`` one on the session's event loop, as a task a cancel
        cancels."""
        if self.main_ident:
            self.interrupt_job = job
            job._interrupt_armed = True
            try:
                if job.cancelled:  # cancelled before it was armed: no signal was sent
                    job._interrupt_fired = True
                    raise Cancelled(job._cancelled_text(), job._cancel_reason)
                value = handler(job)
            finally:
                job._interrupt_armed = False
                self.interrupt_job = None
        else:
            value = handler(job)
        # only an awaitable can be a coroutine: a plain value does not pay for
        # importing collections (~2 ms on a one-shot job's path)
        if hasattr(value, "__await__"):
            from collections.abc import Coroutine

            if isinstance(value, Coroutine):
                return self.run_coroutine(job, value)
        return value

    def run_coroutine(self, job: Job, coro: Coroutine[Any, Any, object]) -> object:
        import asyncio

        if self.runner is None:
            # One loop for the session: a persistent executor's jobs share it (and
            # whatever loop-bound clients the handlers keep).
            self.runner = asyncio.Runner()

        async def main() -> object:
            task = asyncio.current_task()
            assert task is not None
            job._bind_task(asyncio.get_running_loop(), task)
            try:
                return await coro
            finally:
                job._unbind_task()

        try:
            return self.runner.run(main())
        finally:
            coro.close()  # a no-op once it ran; closes it if main() never started it
