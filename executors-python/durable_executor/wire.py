"""The protocol's messages in pure Python: encode and decode without google.protobuf.

Executor protocol v1 (``proto/durable/executor/v1/executor.proto``): every message the
SDK reads or writes, with the same field names as the generated protobuf classes.
Encoding is protobuf's deterministic form (fields in number order, map entries sorted
by key, proto3 defaults left out, ``optional`` fields sent whenever set), so frames
are byte for byte what ``SerializeToString(deterministic=True)`` produces; the tests
check it against ``proto/golden`` and against the protobuf runtime. Decoding follows
protobuf's rules: unknown fields are skipped, a repeated scalar field keeps its last
value, embedded messages that occur twice are merged, the last member of a oneof
wins, strings must be valid UTF-8, enums are open (an unknown value stays an int).

Differences from the generated classes: ``optional`` fields are ``None`` when
absent (no ``HasField``), a frame's ``oneof`` is the message itself (see
:func:`decode_supervisor_frame` / :func:`encode_executor_frame`), enums are plain
ints.

Importing this module costs next to nothing (no import at all: ``struct`` is imported
by the first double), which is the point: executors start for every attempt.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import ClassVar, TypeAlias, TypeVar

    _M = TypeVar("_M", bound="Message")

__all__ = [
    "CANCEL_REASON_ATTEMPT_TIMEOUT",
    "CANCEL_REASON_DEADLINE",
    "CANCEL_REASON_LEASE_LOST",
    "CANCEL_REASON_REQUESTED",
    "CANCEL_REASON_SHUTDOWN",
    "CANCEL_REASON_UNSPECIFIED",
    "EVENT_KIND_ACCEPTED",
    "EVENT_KIND_HEARTBEAT",
    "EVENT_KIND_PROGRESS",
    "EVENT_KIND_RUNNING",
    "EVENT_KIND_UNSPECIFIED",
    "FEATURE_FRAME_LIMITS",
    "PROTOCOL_VERSIONS",
    "PROTOCOL_VERSION_1",
    "PROTOCOL_VERSION_UNSPECIFIED",
    "ArtifactManifestEntry",
    "ArtifactRef",
    "Cancel",
    "DecodeError",
    "ExecutorMessage",
    "Hello",
    "Job",
    "JobError",
    "JobResult",
    "Message",
    "ProgressEvent",
    "Shutdown",
    "SupervisorMessage",
    "cancel_reason_name",
    "decode_executor_frame",
    "decode_supervisor_frame",
    "encode_executor_frame",
    "encode_supervisor_frame",
    "event_kind_name",
]

# -- enums (plain ints: proto3 enums are open) ----------------------------------

PROTOCOL_VERSION_UNSPECIFIED = 0
PROTOCOL_VERSION_1 = 1
#: The protocol revisions this SDK speaks (Hello.protocol_versions).
PROTOCOL_VERSIONS = ("1.0", "1.1")
#: The SDK holds a job's frames to Job.max_frame_bytes (RESULT_TOO_LARGE).
FEATURE_FRAME_LIMITS = "frame_limits"

CANCEL_REASON_UNSPECIFIED = 0
CANCEL_REASON_REQUESTED = 1
CANCEL_REASON_ATTEMPT_TIMEOUT = 2
CANCEL_REASON_DEADLINE = 3
CANCEL_REASON_LEASE_LOST = 4
CANCEL_REASON_SHUTDOWN = 5

EVENT_KIND_UNSPECIFIED = 0
EVENT_KIND_ACCEPTED = 1
EVENT_KIND_RUNNING = 2
EVENT_KIND_PROGRESS = 3
EVENT_KIND_HEARTBEAT = 4

_CANCEL_REASON_NAMES = {
    0: "CANCEL_REASON_UNSPECIFIED",
    1: "CANCEL_REASON_REQUESTED",
    2: "CANCEL_REASON_ATTEMPT_TIMEOUT",
    3: "CANCEL_REASON_DEADLINE",
    4: "CANCEL_REASON_LEASE_LOST",
    5: "CANCEL_REASON_SHUTDOWN",
}
_EVENT_KIND_NAMES = {
    0: "EVENT_KIND_UNSPECIFIED",
    1: "EVENT_KIND_ACCEPTED",
    2: "EVENT_KIND_RUNNING",
    3: "EVENT_KIND_PROGRESS",
    4: "EVENT_KIND_HEARTBEAT",
}


def cancel_reason_name(value: int) -> str:
    """``"CANCEL_REASON_DEADLINE"`` for 3; ``"CANCEL_REASON_<n>"`` for a value this
    version does not know."""
    return _CANCEL_REASON_NAMES.get(value, f"CANCEL_REASON_{value}")


def event_kind_name(value: int) -> str:
    """``"EVENT_KIND_PROGRESS"`` for 3; ``"EVENT_KIND_<n>"`` for an unknown value."""
    return _EVENT_KIND_NAMES.get(value, f"EVENT_KIND_{value}")


class DecodeError(ValueError):
    """The bytes are not a valid encoding of the message (truncated, bad UTF-8, ...)."""


# -- field kinds ----------------------------------------------------------------

_STRING = 1
_BYTES = 2
_UINT32 = 3
_UINT64 = 4
_INT32 = 5  # also enums
_INT64 = 6
_BOOL = 7
_OPT_BYTES = 8
_OPT_DOUBLE = 9
_OPT_UINT64 = 10
_REP_STRING = 11
_REP_MESSAGE = 12
_MAP_STRING_STRING = 13

_WIRE_TYPE = {
    _STRING: 2,
    _BYTES: 2,
    _UINT32: 0,
    _UINT64: 0,
    _INT32: 0,
    _INT64: 0,
    _BOOL: 0,
    _OPT_BYTES: 2,
    _OPT_DOUBLE: 1,
    _OPT_UINT64: 0,
    _REP_STRING: 2,
    _REP_MESSAGE: 2,
    _MAP_STRING_STRING: 2,
}

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_RANGES = {
    _UINT32: (0, _U32),
    _UINT64: (0, _U64),
    _OPT_UINT64: (0, _U64),
    _INT32: (-(1 << 31), (1 << 31) - 1),
    _INT64: (-(1 << 63), (1 << 63) - 1),
}


def _pack_double(value: float) -> bytes:
    import struct

    return struct.pack("<d", value)


def _unpack_double(data: bytes, pos: int) -> float:
    import struct

    value: float = struct.unpack_from("<d", data, pos)[0]
    return value


def _tag(number: int, wire_type: int) -> bytes:
    out = bytearray()
    _put_varint(out, number << 3 | wire_type)
    return bytes(out)


def _put_varint(out: bytearray, value: int) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_len(out: bytearray, tag: bytes, data: bytes) -> None:
    out += tag
    _put_varint(out, len(data))
    out += data


# -- messages -------------------------------------------------------------------


class Message:
    """Base of the protocol's messages: equality by fields, ``encode`` / ``decode``."""

    __slots__ = ()
    #: (number, attribute, kind, message class of a repeated message field)
    _FIELDS: ClassVar[tuple[tuple[int, str, int, type[Message] | None], ...]] = ()
    #: number -> (attribute, kind, wire type, message class)
    _BY_NUMBER: ClassVar[dict[int, tuple[str, int, int, type[Message] | None]]] = {}
    _TAGS: ClassVar[tuple[bytes, ...]] = ()
    _SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls._BY_NUMBER = {n: (a, k, _WIRE_TYPE[k], m) for n, a, k, m in cls._FIELDS}
        cls._TAGS = tuple(_tag(n, _WIRE_TYPE[k]) for n, _, k, _ in cls._FIELDS)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, a) == getattr(other, a) for _, a, _, _ in self._FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        parts = []
        for _, attr, _, _ in self._FIELDS:
            value = getattr(self, attr)
            if attr in self._SECRET_FIELDS and value:
                value = {k: "***" for k in value}
            parts.append(f"{attr}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def encode(self) -> bytes:
        """The message's deterministic protobuf encoding."""
        out = bytearray()
        self._encode_to(out)
        return bytes(out)

    @classmethod
    def decode(cls: type[_M], data: bytes | bytearray | memoryview) -> _M:
        """Parse one message; raises :class:`DecodeError` when ``data`` is not one."""
        buf = bytes(data)
        return _decode(cls, buf, 0, len(buf))

    def _encode_to(self, out: bytearray) -> None:
        for (_, attr, kind, _), tag in zip(self._FIELDS, self._TAGS, strict=True):
            value = getattr(self, attr)
            if kind == _STRING:
                if value:
                    _put_len(out, tag, _utf8(value, self, attr))
            elif kind == _BYTES:
                if value:
                    _put_len(out, tag, _bytes(value, self, attr))
            elif kind == _BOOL:
                if value:
                    out += tag
                    out.append(1)
            elif kind in _RANGES:
                if value is None and kind == _OPT_UINT64:
                    continue
                if value or kind == _OPT_UINT64:
                    lo, hi = _RANGES[kind]
                    if (
                        isinstance(value, bool)
                        or not isinstance(value, int)
                        or not lo <= value <= hi
                    ):
                        raise ValueError(
                            f"{type(self).__name__}.{attr}: {value!r} is not an integer "
                            f"within {lo}..{hi}"
                        )
                    out += tag
                    _put_varint(out, value & _U64)
            elif kind == _OPT_BYTES:
                if value is not None:
                    _put_len(out, tag, _bytes(value, self, attr))
            elif kind == _OPT_DOUBLE:
                if value is not None:
                    out += tag
                    out += _pack_double(value)
            elif kind == _REP_STRING:
                for item in value:
                    _put_len(out, tag, _utf8(item, self, attr))
            elif kind == _REP_MESSAGE:
                for item in value:
                    _put_len(out, tag, item.encode())
            elif kind == _MAP_STRING_STRING:
                for key in sorted(value):
                    entry = bytearray()
                    # Map entries always carry both key and value (as protobuf does).
                    _put_len(entry, b"\x0a", _utf8(key, self, attr))
                    _put_len(entry, b"\x12", _utf8(value[key], self, attr))
                    _put_len(out, tag, bytes(entry))


def _utf8(value: object, msg: Message, attr: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{type(msg).__name__}.{attr}: expected str, got {type(value).__name__}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{type(msg).__name__}.{attr}: not valid UTF-8 text ({e})") from None


def _bytes(value: object, msg: Message, attr: str) -> bytes:
    if isinstance(value, str) or not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{type(msg).__name__}.{attr}: expected bytes, got {type(value).__name__}")
    return bytes(value)


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while shift < 70:
        if pos >= end:
            raise DecodeError("truncated message: it ends inside a varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & _U64, pos
        shift += 7
    raise DecodeError("malformed varint: longer than 10 bytes")


def _read_tag(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """A field's tag: a varint of at most 5 bytes and 32 bits, field number >= 1."""
    tag = 0
    for shift in (0, 7, 14, 21, 28):
        if pos >= end:
            raise DecodeError("truncated message: it ends inside a field tag")
        byte = data[pos]
        pos += 1
        tag |= (byte & 0x7F) << shift
        if byte < 0x80:
            if tag > _U32 or tag < 8:
                raise DecodeError(f"malformed message: invalid field tag {tag}")
            return tag, pos
    raise DecodeError("malformed message: a field tag longer than 5 bytes")


def _skip(data: bytes, pos: int, end: int, wire_type: int, number: int) -> int:
    """Skip an unknown field's value; return the position after it."""
    if wire_type == 0:
        return _varint(data, pos, end)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == 2:
        length, pos = _varint(data, pos, end)
        pos += length
    elif wire_type == 5:
        pos += 4
    elif wire_type == 3:  # a group: skip to its end-group tag
        while True:
            tag, pos = _read_tag(data, pos, end)
            if tag & 7 == 4:
                if tag >> 3 != number:
                    raise DecodeError("malformed message: mismatched end of group")
                return pos
            pos = _skip(data, pos, end, tag & 7, tag >> 3)
    else:
        raise DecodeError(f"malformed message: wire type {wire_type}")
    if pos > end:
        raise DecodeError("truncated message: a field runs past its end")
    return pos


def _text(data: bytes, pos: int, end: int) -> str:
    try:
        return data[pos:end].decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecodeError(f"a string field is not valid UTF-8: {e}") from None


def _decode(cls: type[_M], data: bytes, pos: int, end: int) -> _M:
    msg = cls()
    by_number = cls._BY_NUMBER
    while pos < end:
        tag, pos = _read_tag(data, pos, end)
        number = tag >> 3
        wire_type = tag & 7
        spec = by_number.get(number)
        if spec is None or spec[2] != wire_type:
            # Unknown field (or one sent with another wire type: unknown to protobuf too).
            if wire_type == 4:
                raise DecodeError("malformed message: unexpected end of group")
            pos = _skip(data, pos, end, wire_type, number)
            continue
        attr, kind, _, sub = spec
        if wire_type == 0:
            value, pos = _varint(data, pos, end)
            if kind == _BOOL:
                setattr(msg, attr, value != 0)
            elif kind == _INT32:
                value &= _U32
                setattr(msg, attr, value - (1 << 32) if value >> 31 else value)
            elif kind == _INT64:
                setattr(msg, attr, value - (1 << 64) if value >> 63 else value)
            elif kind == _UINT32:
                setattr(msg, attr, value & _U32)
            else:  # uint64, optional uint64
                setattr(msg, attr, value)
            continue
        if wire_type == 1:  # the one double
            if pos + 8 > end:
                raise DecodeError("truncated message: it ends inside a double")
            setattr(msg, attr, _unpack_double(data, pos))
            pos += 8
            continue
        length, pos = _varint(data, pos, end)
        stop = pos + length
        if stop > end:
            raise DecodeError("truncated message: a field runs past its end")
        if kind == _STRING:
            setattr(msg, attr, _text(data, pos, stop))
        elif kind in (_BYTES, _OPT_BYTES):
            setattr(msg, attr, data[pos:stop])
        elif kind == _REP_STRING:
            getattr(msg, attr).append(_text(data, pos, stop))
        elif kind == _REP_MESSAGE:
            assert sub is not None
            getattr(msg, attr).append(_decode(sub, data, pos, stop))
        else:  # map<string, string>
            key = val = ""
            p = pos
            while p < stop:
                etag, p = _read_tag(data, p, stop)
                if etag == 0x0A or etag == 0x12:
                    n, p = _varint(data, p, stop)
                    if p + n > stop:
                        raise DecodeError("truncated message: a map entry runs past its end")
                    if etag == 0x0A:
                        key = _text(data, p, p + n)
                    else:
                        val = _text(data, p, p + n)
                    p += n
                else:  # skipped; the entry is kept (as Go and prost do; upb drops it)
                    if etag & 7 == 4:
                        raise DecodeError("malformed message: unexpected end of group")
                    p = _skip(data, p, stop, etag & 7, etag >> 3)
            getattr(msg, attr)[key] = val
        pos = stop
    if pos != end:
        raise DecodeError("truncated message: a field runs past its end")
    return msg


class ArtifactRef(Message):
    """An input artifact, materialised read-only on local disk for this attempt."""

    __slots__ = ("id", "media_type", "name", "path", "sha256", "size", "step_name")
    _FIELDS = (
        (1, "id", _STRING, None),
        (2, "name", _STRING, None),
        (3, "sha256", _STRING, None),
        (4, "size", _UINT64, None),
        (5, "media_type", _STRING, None),
        (6, "path", _STRING, None),
        (7, "step_name", _STRING, None),
    )

    def __init__(
        self,
        id: str = "",
        name: str = "",
        sha256: str = "",
        size: int = 0,
        media_type: str = "",
        path: str = "",
        step_name: str = "",
    ) -> None:
        self.id = id
        self.name = name
        self.sha256 = sha256
        self.size = size
        self.media_type = media_type
        self.path = path
        self.step_name = step_name


class ArtifactManifestEntry(Message):
    """An artifact the executor wrote below ``Job.output_dir``."""

    __slots__ = ("derived_from", "media_type", "name", "path", "sha256", "size")
    _FIELDS = (
        (1, "name", _STRING, None),
        (2, "path", _STRING, None),
        (3, "sha256", _STRING, None),
        (4, "size", _UINT64, None),
        (5, "media_type", _STRING, None),
        (6, "derived_from", _REP_STRING, None),
    )

    def __init__(
        self,
        name: str = "",
        path: str = "",
        sha256: str = "",
        size: int = 0,
        media_type: str = "",
        derived_from: Iterable[str] = (),
    ) -> None:
        self.name = name
        self.path = path
        self.sha256 = sha256
        self.size = size
        self.media_type = media_type
        self.derived_from: list[str] = list(derived_from)


class Job(Message):
    """One attempt of one step (supervisor -> executor)."""

    __slots__ = (
        "attempt",
        "attempt_deadline_unix_ms",
        "checkpoint",
        "deadline_unix_ms",
        "executor_kind",
        "heartbeat_timeout_ms",
        "idempotency_key",
        "input",
        "input_artifacts",
        "job_id",
        "kind",
        "labels",
        "max_frame_bytes",
        "negotiated_features",
        "negotiated_version",
        "output_dir",
        "secrets",
        "step_run_id",
        "workflow_run_id",
    )
    _FIELDS = (
        (1, "job_id", _STRING, None),
        (2, "workflow_run_id", _STRING, None),
        (3, "step_run_id", _STRING, None),
        (4, "idempotency_key", _STRING, None),
        (5, "executor_kind", _STRING, None),
        (6, "kind", _STRING, None),
        (7, "attempt", _UINT32, None),
        (8, "deadline_unix_ms", _INT64, None),
        (9, "attempt_deadline_unix_ms", _INT64, None),
        (10, "heartbeat_timeout_ms", _UINT32, None),
        (11, "input", _BYTES, None),
        (12, "input_artifacts", _REP_MESSAGE, ArtifactRef),
        (13, "checkpoint", _OPT_BYTES, None),
        (14, "output_dir", _STRING, None),
        (15, "secrets", _MAP_STRING_STRING, None),
        (16, "labels", _MAP_STRING_STRING, None),
        (17, "negotiated_version", _STRING, None),
        (18, "negotiated_features", _REP_STRING, None),
        (19, "max_frame_bytes", _UINT64, None),
    )
    _SECRET_FIELDS = frozenset({"secrets"})

    def __init__(
        self,
        job_id: str = "",
        workflow_run_id: str = "",
        step_run_id: str = "",
        idempotency_key: str = "",
        executor_kind: str = "",
        kind: str = "",
        attempt: int = 0,
        deadline_unix_ms: int = 0,
        attempt_deadline_unix_ms: int = 0,
        heartbeat_timeout_ms: int = 0,
        input: bytes = b"",
        input_artifacts: Iterable[ArtifactRef] = (),
        checkpoint: bytes | None = None,
        output_dir: str = "",
        secrets: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        negotiated_version: str = "",
        negotiated_features: Iterable[str] = (),
        max_frame_bytes: int = 0,
    ) -> None:
        self.job_id = job_id
        self.workflow_run_id = workflow_run_id
        self.step_run_id = step_run_id
        self.idempotency_key = idempotency_key
        self.executor_kind = executor_kind
        self.kind = kind
        self.attempt = attempt
        self.deadline_unix_ms = deadline_unix_ms
        self.attempt_deadline_unix_ms = attempt_deadline_unix_ms
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.input = input
        self.input_artifacts: list[ArtifactRef] = list(input_artifacts)
        #: ``None`` when absent, ``b""`` when present but empty.
        self.checkpoint = checkpoint
        self.output_dir = output_dir
        self.secrets: dict[str, str] = dict(secrets or {})
        self.labels: dict[str, str] = dict(labels or {})
        #: Protocol 1.1: the revision the supervisor chose ("" from a 1.0
        #: supervisor), the agreed features, its frame limit (0 = not stated).
        self.negotiated_version = negotiated_version
        self.negotiated_features: list[str] = list(negotiated_features)
        self.max_frame_bytes = max_frame_bytes


class Cancel(Message):
    """Stop the job; a terminal is still owed (supervisor -> executor)."""

    __slots__ = ("grace_ms", "job_id", "message", "reason")
    _FIELDS = (
        (1, "job_id", _STRING, None),
        (2, "reason", _INT32, None),
        (3, "grace_ms", _UINT32, None),
        (4, "message", _STRING, None),
    )

    def __init__(
        self, job_id: str = "", reason: int = 0, grace_ms: int = 0, message: str = ""
    ) -> None:
        self.job_id = job_id
        #: A ``CANCEL_REASON_*`` value.
        self.reason = reason
        self.grace_ms = grace_ms
        self.message = message


class Shutdown(Message):
    """No more jobs will come on this stream (supervisor -> executor)."""

    __slots__ = ("reason",)
    _FIELDS = ((1, "reason", _STRING, None),)

    def __init__(self, reason: str = "") -> None:
        self.reason = reason


class Hello(Message):
    """The executor's first frame: what it is and what it can run."""

    __slots__ = (
        "executor_kind",
        "features",
        "kinds",
        "labels",
        "max_frame_bytes",
        "max_jobs_per_process",
        "pid",
        "protocol_version",
        "protocol_versions",
        "sdk_name",
        "sdk_version",
    )
    _FIELDS = (
        (1, "protocol_version", _INT32, None),
        (2, "executor_kind", _STRING, None),
        (3, "kinds", _REP_STRING, None),
        (4, "labels", _MAP_STRING_STRING, None),
        (5, "sdk_name", _STRING, None),
        (6, "sdk_version", _STRING, None),
        (7, "max_jobs_per_process", _INT32, None),
        (8, "pid", _UINT32, None),
        (9, "protocol_versions", _REP_STRING, None),
        (10, "features", _REP_STRING, None),
        (11, "max_frame_bytes", _UINT64, None),
    )

    def __init__(
        self,
        protocol_version: int = 0,
        executor_kind: str = "",
        kinds: Iterable[str] = (),
        labels: Mapping[str, str] | None = None,
        sdk_name: str = "",
        sdk_version: str = "",
        max_jobs_per_process: int = 0,
        pid: int = 0,
        protocol_versions: Iterable[str] = (),
        features: Iterable[str] = (),
        max_frame_bytes: int = 0,
    ) -> None:
        self.protocol_version = protocol_version
        self.executor_kind = executor_kind
        self.kinds: list[str] = list(kinds)
        self.labels: dict[str, str] = dict(labels or {})
        self.sdk_name = sdk_name
        self.sdk_version = sdk_version
        self.max_jobs_per_process = max_jobs_per_process
        self.pid = pid
        #: Protocol 1.1: the revisions spoken, the features offered, the
        #: largest frame accepted on stdin (0 = the default).
        self.protocol_versions: list[str] = list(protocol_versions)
        self.features: list[str] = list(features)
        self.max_frame_bytes = max_frame_bytes


class ProgressEvent(Message):
    """ACCEPTED, RUNNING, PROGRESS or HEARTBEAT (executor -> supervisor)."""

    __slots__ = ("at_unix_ms", "checkpoint", "fraction", "job_id", "kind", "message", "sequence")
    _FIELDS = (
        (1, "job_id", _STRING, None),
        (2, "sequence", _UINT64, None),
        (3, "kind", _INT32, None),
        (4, "message", _STRING, None),
        (5, "fraction", _OPT_DOUBLE, None),
        (6, "checkpoint", _OPT_BYTES, None),
        (7, "at_unix_ms", _INT64, None),
    )

    def __init__(
        self,
        job_id: str = "",
        sequence: int = 0,
        kind: int = 0,
        message: str = "",
        fraction: float | None = None,
        checkpoint: bytes | None = None,
        at_unix_ms: int = 0,
    ) -> None:
        self.job_id = job_id
        self.sequence = sequence
        #: An ``EVENT_KIND_*`` value.
        self.kind = kind
        self.message = message
        self.fraction = fraction
        self.checkpoint = checkpoint
        self.at_unix_ms = at_unix_ms


class JobResult(Message):
    """The job's successful terminal."""

    __slots__ = ("artifacts", "job_id", "output", "sequence")
    _FIELDS = (
        (1, "job_id", _STRING, None),
        (2, "sequence", _UINT64, None),
        (3, "output", _BYTES, None),
        (4, "artifacts", _REP_MESSAGE, ArtifactManifestEntry),
    )

    def __init__(
        self,
        job_id: str = "",
        sequence: int = 0,
        output: bytes = b"",
        artifacts: Iterable[ArtifactManifestEntry] = (),
    ) -> None:
        self.job_id = job_id
        self.sequence = sequence
        self.output = output
        self.artifacts: list[ArtifactManifestEntry] = list(artifacts)


class JobError(Message):
    """The job's failing terminal, or a refusal before ACCEPTED."""

    __slots__ = (
        "code",
        "details",
        "job_id",
        "message",
        "next_retry_delay_ms",
        "retryable",
        "sequence",
    )
    _FIELDS = (
        (1, "job_id", _STRING, None),
        (2, "sequence", _UINT64, None),
        (3, "code", _STRING, None),
        (4, "message", _STRING, None),
        (5, "retryable", _BOOL, None),
        (6, "details", _BYTES, None),
        (7, "next_retry_delay_ms", _OPT_UINT64, None),
    )

    def __init__(
        self,
        job_id: str = "",
        sequence: int = 0,
        code: str = "",
        message: str = "",
        retryable: bool = False,
        details: bytes = b"",
        next_retry_delay_ms: int | None = None,
    ) -> None:
        self.job_id = job_id
        self.sequence = sequence
        self.code = code
        self.message = message
        self.retryable = retryable
        self.details = details
        self.next_retry_delay_ms = next_retry_delay_ms


# -- frames (the oneofs) ----------------------------------------------------------

if TYPE_CHECKING:
    SupervisorMessage: TypeAlias = "Job | Cancel | Shutdown"
    ExecutorMessage: TypeAlias = "Hello | ProgressEvent | JobResult | JobError"
else:
    SupervisorMessage = ExecutorMessage = Message  # documentation only at run time

_SUPERVISOR_MEMBERS: dict[int, type[Message]] = {1: Job, 2: Cancel, 3: Shutdown}
_EXECUTOR_MEMBERS: dict[int, type[Message]] = {
    1: Hello,
    2: ProgressEvent,
    3: JobResult,
    4: JobError,
}
_SUPERVISOR_NUMBERS = {cls: n for n, cls in _SUPERVISOR_MEMBERS.items()}
_EXECUTOR_NUMBERS = {cls: n for n, cls in _EXECUTOR_MEMBERS.items()}


def _encode_frame(msg: Message | None, numbers: dict[type[Message], int], what: str) -> bytes:
    if msg is None:
        return b""
    number = numbers.get(type(msg))
    if number is None:
        raise TypeError(f"a {what} frame cannot carry a {type(msg).__name__}")
    out = bytearray()
    _put_len(out, _tag(number, 2), msg.encode())
    return bytes(out)


def _decode_frame(
    data: bytes | bytearray | memoryview, members: dict[int, type[Message]]
) -> Message | None:
    buf = bytes(data)
    end = len(buf)
    pos = 0
    number = 0
    msg: Message | None = None
    chunks: list[bytes] = []
    while pos < end:
        tag, pos = _read_tag(buf, pos, end)
        field, wire_type = tag >> 3, tag & 7
        cls = members.get(field)
        if cls is not None and wire_type == 2:
            length, pos = _varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise DecodeError("truncated message: a field runs past its end")
            msg = _decode(cls, buf, pos, stop)  # every occurrence must parse
            if field != number:  # another oneof member replaces the previous one
                number = field
                chunks = []
            chunks.append(buf[pos:stop])
            if len(chunks) > 1:  # the same member again: merged, as by parsing the
                joined = b"".join(chunks)  # concatenation of its occurrences
                msg = _decode(cls, joined, 0, len(joined))
            pos = stop
        else:
            if wire_type == 4:
                raise DecodeError("malformed message: unexpected end of group")
            pos = _skip(buf, pos, end, wire_type, field)
    return msg


def encode_supervisor_frame(msg: SupervisorMessage | None) -> bytes:
    """A ``SupervisorFrame`` holding ``msg`` (``None``: an empty frame)."""
    return _encode_frame(msg, _SUPERVISOR_NUMBERS, "SupervisorFrame")


def decode_supervisor_frame(data: bytes | bytearray | memoryview) -> SupervisorMessage | None:
    """The ``Job``, ``Cancel`` or ``Shutdown`` in a ``SupervisorFrame``; ``None`` when
    the frame holds none of them (empty, or a member this version does not know)."""
    return _decode_frame(data, _SUPERVISOR_MEMBERS)  # type: ignore[return-value]


def encode_executor_frame(msg: ExecutorMessage | None) -> bytes:
    """An ``ExecutorFrame`` holding ``msg`` (``None``: an empty frame)."""
    return _encode_frame(msg, _EXECUTOR_NUMBERS, "ExecutorFrame")


def decode_executor_frame(data: bytes | bytearray | memoryview) -> ExecutorMessage | None:
    """The ``Hello``, ``ProgressEvent``, ``JobResult`` or ``JobError`` in an
    ``ExecutorFrame``; ``None`` when it holds none of them."""
    return _decode_frame(data, _EXECUTOR_MEMBERS)  # type: ignore[return-value]
