"""The pure-Python codec (durable_executor.wire) against the protobuf runtime.

The generated classes (durable_executor/_gen, protobuf is a dev dependency) are the
reference: random messages must encode to the very bytes protobuf's deterministic
serialization produces, and any byte string (valid, truncated, garbage, with unknown
fields) must decode to what protobuf decodes, or fail where protobuf fails.
"""

from __future__ import annotations

import itertools
import random

import pytest
from google.protobuf.message import DecodeError as PbDecodeError

from durable_executor import wire
from durable_executor._gen.durable.executor.v1 import executor_pb2 as pb

MESSAGES = [
    wire.ArtifactRef,
    wire.ArtifactManifestEntry,
    wire.Job,
    wire.Cancel,
    wire.Shutdown,
    wire.Hello,
    wire.ProgressEvent,
    wire.JobResult,
    wire.JobError,
]
SUPERVISOR = {wire.Job: "job", wire.Cancel: "cancel", wire.Shutdown: "shutdown"}
EXECUTOR = {
    wire.Hello: "hello",
    wire.ProgressEvent: "event",
    wire.JobResult: "result",
    wire.JobError: "error",
}

TEXTS = ["", "a", "job-1", "é", "✓ ünïcode", "\U0001f600", "x" * 200, "with\nnewline", "\x7f"]
INTS = {
    wire._UINT32: [0, 1, 127, 128, 300, 2**31, 2**32 - 1],
    wire._UINT64: [0, 1, 2**32, 2**63, 2**64 - 1],
    wire._OPT_UINT64: [0, 1, 2**40, 2**64 - 1],
    wire._INT32: [0, 1, -1, 2**31 - 1, -(2**31), 5, 99],
    wire._INT64: [0, 1, -1, 1767229200000, 2**63 - 1, -(2**63)],
}


def pb_class(cls):
    return getattr(pb, cls.__name__)


def random_value(rng: random.Random, kind: int, sub, depth: int = 0):
    if kind == wire._STRING:
        return rng.choice(TEXTS)
    if kind == wire._BYTES:
        return rng.choice([b"", b"\x00", b'{"a":1}', bytes(rng.randrange(256) for _ in range(40))])
    if kind in INTS:
        if kind == wire._OPT_UINT64 and rng.random() < 0.3:
            return None
        return rng.choice(INTS[kind])
    if kind == wire._BOOL:
        return rng.random() < 0.5
    if kind == wire._OPT_BYTES:
        return rng.choice([None, b"", b"\x00\x01", b"resume"])
    if kind == wire._OPT_DOUBLE:
        return rng.choice([None, 0.0, -0.0, 0.5, 1.0, 1e-300, 0.1 + 0.2])
    if kind == wire._REP_STRING:
        return [rng.choice(TEXTS) for _ in range(rng.randrange(4))]
    if kind == wire._REP_MESSAGE:
        return [random_message(rng, sub, depth + 1) for _ in range(rng.randrange(3))]
    if kind == wire._MAP_STRING_STRING:
        return {rng.choice(TEXTS): rng.choice(TEXTS) for _ in range(rng.randrange(5))}
    raise AssertionError(kind)


def random_message(rng: random.Random, cls, depth: int = 0):
    msg = cls()
    for _, attr, kind, sub in cls._FIELDS:
        if rng.random() < 0.75:
            setattr(msg, attr, random_value(rng, kind, sub, depth))
    return msg


def to_pb(msg):
    """The same message as a generated protobuf object."""
    out = pb_class(type(msg))()
    for _, attr, kind, _sub in type(msg)._FIELDS:
        value = getattr(msg, attr)
        if kind == wire._REP_MESSAGE:
            getattr(out, attr).extend(to_pb(v) for v in value)
        elif kind == wire._REP_STRING:
            getattr(out, attr).extend(value)
        elif kind == wire._MAP_STRING_STRING:
            getattr(out, attr).update(value)
        elif value is not None:
            setattr(out, attr, value)
    return out


def from_pb(obj, cls):
    """A generated protobuf object as a wire message (the reference decoding)."""
    msg = cls()
    for _, attr, kind, sub in cls._FIELDS:
        value = getattr(obj, attr)
        if kind == wire._REP_MESSAGE:
            value = [from_pb(v, sub) for v in value]
        elif kind == wire._REP_STRING:
            value = list(value)
        elif kind == wire._MAP_STRING_STRING:
            value = dict(value)
        elif kind in (wire._OPT_BYTES, wire._OPT_DOUBLE, wire._OPT_UINT64):
            value = value if obj.HasField(attr) else None
        setattr(msg, attr, value)
    return msg


def upb_orders_maps_alike(msg) -> bool:
    """upb (protobuf's Python runtime) sorts a map key after the keys it is a prefix
    of ("ab" before "a", "" last); Go and this codec sort map keys bytewise ("", "a",
    "ab"), which PROTOCOL.md's "map entries sorted by key" means. Byte comparisons
    with upb only hold when no key is a prefix of another."""
    for _, attr, kind, _sub in type(msg)._FIELDS:
        value = getattr(msg, attr)
        if kind == wire._MAP_STRING_STRING:
            keys = sorted(value)
            if any(b.startswith(a) for a, b in itertools.pairwise(keys)):
                return False
        elif kind == wire._REP_MESSAGE and not all(upb_orders_maps_alike(v) for v in value):
            return False
    return True


def same_as_upb(got, want) -> bool:
    """``got == want``, except that a map entry holding unknown fields is kept here
    (as Go and prost keep it) where upb drops it."""
    if type(got) is not type(want):
        return False
    if got is None:
        return True
    for _, attr, kind, _sub in type(got)._FIELDS:
        a, b = getattr(got, attr), getattr(want, attr)
        if kind == wire._MAP_STRING_STRING:
            if not set(b) <= set(a):  # (a dropped entry may have replaced a value)
                return False
        elif kind == wire._REP_MESSAGE:
            if len(a) != len(b) or not all(same_as_upb(x, y) for x, y in zip(a, b, strict=True)):
                return False
        elif a != b and not (a != a and b != b):  # NaN == NaN here
            return False
    return True


def pb_frame_decode(data: bytes, supervisor: bool):
    frame_cls = pb.SupervisorFrame if supervisor else pb.ExecutorFrame
    members = SUPERVISOR if supervisor else EXECUTOR
    frame = frame_cls.FromString(data)
    which = frame.WhichOneof("frame")
    if which is None:
        return None
    cls = next(c for c, name in members.items() if name == which)
    return from_pb(getattr(frame, which), cls)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_random_messages_encode_like_protobuf_and_round_trip(cls):
    rng = random.Random(f"wire-{cls.__name__}")
    for _ in range(300):
        msg = random_message(rng, cls)
        data = msg.encode()
        reference = to_pb(msg).SerializeToString(deterministic=True)
        if upb_orders_maps_alike(msg):
            assert data == reference, msg
        assert cls.decode(reference) == msg
        assert cls.decode(data) == msg
        assert from_pb(pb_class(cls).FromString(data), cls) == msg


@pytest.mark.parametrize("cls", list(SUPERVISOR) + list(EXECUTOR), ids=lambda c: c.__name__)
def test_frames_encode_like_protobuf(cls):
    rng = random.Random(f"frame-{cls.__name__}")
    supervisor = cls in SUPERVISOR
    frame_cls = pb.SupervisorFrame if supervisor else pb.ExecutorFrame
    name = (SUPERVISOR if supervisor else EXECUTOR)[cls]
    encode = wire.encode_supervisor_frame if supervisor else wire.encode_executor_frame
    decode = wire.decode_supervisor_frame if supervisor else wire.decode_executor_frame
    for _ in range(100):
        msg = random_message(rng, cls)
        data = encode(msg)
        reference = frame_cls()
        getattr(reference, name).CopyFrom(to_pb(msg))
        if upb_orders_maps_alike(msg):
            assert data == reference.SerializeToString(deterministic=True)
        assert decode(data) == msg
    assert encode(None) == b"" and decode(b"") is None


def test_map_entries_are_sorted_bytewise_by_key():
    hello = wire.Hello(labels={"ab": "1", "": "2", "a": "3", "é": "4", "z": "5"})
    data = hello.encode()
    order = [
        data.index(k) for k in (b"\x0a\x00\x12", b"\x0a\x01a\x12", b"\x0a\x02ab", b"z", b"\xc3\xa9")
    ]
    assert order == sorted(order)
    assert wire.Hello.decode(data) == hello


def test_empty_message_in_a_frame_is_still_that_member():
    assert wire.encode_supervisor_frame(wire.Shutdown()) == b"\x1a\x00"
    assert wire.decode_supervisor_frame(b"\x1a\x00") == wire.Shutdown()
    with pytest.raises(TypeError, match="cannot carry"):
        wire.encode_supervisor_frame(wire.Hello())  # type: ignore[arg-type]


def _mutations(rng: random.Random, data: bytes):
    yield data
    for cut in range(len(data)):
        yield data[:cut]
    for _ in range(40):
        b = bytearray(data)
        if b:
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        yield bytes(b)
    for _ in range(20):
        yield bytes(rng.randrange(256) for _ in range(rng.randrange(1, 30)))


def _unknown_fields(rng: random.Random) -> bytes:
    """Fields with numbers no message uses, of every wire type (groups included)."""
    choices = [
        b"\xf8\x07\x96\x01",  # field 127, varint
        b"\xf9\x07" + bytes(8),  # field 127, fixed64
        b"\xfa\x07\x03abc",  # field 127, length-delimited
        b"\xfd\x07" + bytes(4),  # field 127, fixed32
        b"\xfb\x07\x08\x01\xfc\x07",  # field 127, a group holding field 1 = 1
    ]
    return b"".join(rng.choice(choices) for _ in range(rng.randrange(1, 4)))


@pytest.mark.parametrize("supervisor", [True, False], ids=["supervisor", "executor"])
def test_any_bytes_decode_like_protobuf(supervisor):
    """Truncations, corruptions, garbage, unknown fields, repeated and competing oneof
    members: the wire decoder succeeds exactly when protobuf does, with the same
    message, and otherwise raises DecodeError (never anything else)."""
    rng = random.Random(f"fuzz-{supervisor}")
    members = list(SUPERVISOR if supervisor else EXECUTOR)
    encode = wire.encode_supervisor_frame if supervisor else wire.encode_executor_frame
    decode = wire.decode_supervisor_frame if supervisor else wire.decode_executor_frame
    checked = failed = 0
    for _ in range(60):
        parts = [
            encode(random_message(rng, rng.choice(members))) for _ in range(rng.randrange(1, 3))
        ]
        if rng.random() < 0.5:
            parts.insert(rng.randrange(len(parts) + 1), _unknown_fields(rng))
        for data in _mutations(rng, b"".join(parts)):
            try:
                want = pb_frame_decode(data, supervisor)
            except PbDecodeError:
                with pytest.raises(wire.DecodeError):
                    decode(data)
                failed += 1
            else:
                assert same_as_upb(decode(data), want), data
            checked += 1
    assert failed > 100 and checked - failed > 100  # both sides were exercised


def test_map_entries_with_unknown_fields_are_kept():
    entry = b"\x0a\x01k\x12\x01v\x18\x05"  # key, value, and an unknown field 3
    data = b"\x22" + bytes([len(entry)]) + entry
    assert wire.Hello.decode(data).labels == {"k": "v"}


def test_tags_must_fit_32_bits_with_a_field_number():
    assert wire.Shutdown.decode(b"\x8a\x80\x80\x80\x00\x00") == wire.Shutdown()  # 5 bytes: ok
    for data in (b"\x80\x80\x80\x80\x10", b"\x8a\x80\x80\x80\x80\x00\x00", b"\x00", b"\x0c"):
        with pytest.raises(wire.DecodeError):
            wire.decode_supervisor_frame(data)
        with pytest.raises(PbDecodeError):
            pb.SupervisorFrame.FromString(data)


def test_strings_must_be_utf8_and_known_fields_with_another_wire_type_are_unknown():
    with pytest.raises(wire.DecodeError, match="UTF-8"):
        wire.Shutdown.decode(b"\x0a\x02\xc3\x28")
    with pytest.raises(wire.DecodeError, match="UTF-8"):
        wire.Job.decode(b"\x7a\x06\x0a\x02\xff\xfe\x12\x00")  # a secrets map key
    # Shutdown.reason (field 1) sent as a varint: skipped, as protobuf does.
    assert wire.Shutdown.decode(b"\x08\x01") == wire.Shutdown()
    assert pb.Shutdown.FromString(b"\x08\x01").reason == ""


def test_optional_fields_and_int_conversions():
    event = wire.ProgressEvent(fraction=0.0, checkpoint=b"")
    assert event.encode() == b"\x29" + bytes(8) + b"\x32\x00"  # present although default
    assert wire.ProgressEvent.decode(event.encode()) == event
    assert wire.ProgressEvent.decode(b"").fraction is None
    assert (
        wire.Hello.decode(wire.Hello(max_jobs_per_process=-1).encode()).max_jobs_per_process == -1
    )
    err = wire.JobError(next_retry_delay_ms=0)
    assert wire.JobError.decode(err.encode()).next_retry_delay_ms == 0
    with pytest.raises(ValueError, match="within"):
        wire.Job(attempt=2**32).encode()
    with pytest.raises(ValueError, match="within"):
        wire.Job(deadline_unix_ms=2**63).encode()
    with pytest.raises(TypeError, match="expected str"):
        wire.Shutdown(reason=b"x").encode()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected bytes"):
        wire.JobResult(output="x").encode()  # type: ignore[arg-type]


def test_job_repr_hides_secret_values():
    job = wire.Job(job_id="j", secrets={"TOKEN": "hunter2-secret"})
    assert "hunter2-secret" not in repr(job) and "TOKEN" in repr(job)


def test_enum_names():
    assert wire.cancel_reason_name(wire.CANCEL_REASON_DEADLINE) == "CANCEL_REASON_DEADLINE"
    assert wire.cancel_reason_name(42) == "CANCEL_REASON_42"
    assert wire.event_kind_name(wire.EVENT_KIND_HEARTBEAT) == "EVENT_KIND_HEARTBEAT"
    for name, value in pb.CancelReason.items():
        assert getattr(wire, name) == value
    for name, value in pb.EventKind.items():
        assert getattr(wire, name) == value
    for name, value in pb.ProtocolVersion.items():
        assert getattr(wire, name) == value
