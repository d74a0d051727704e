"""Golden frames shared by every language (proto/golden/<name>.bin + <name>.json).

Each ``.bin`` is a stream of delimited frames; the ``.json`` beside it gives the
direction and the protojson of every frame. This SDK must decode each stream with
its own framing, find the messages the JSON describes, and re-encode them
deterministically to the very same bytes: with its own pure-Python codec
(durable_executor.wire, what the SDK runs on) and, as a check of the files
themselves, with the generated protobuf classes.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from google.protobuf import json_format

from durable_executor import encode_frame, read_frame, wire
from durable_executor._gen.durable.executor.v1 import executor_pb2 as pb

GOLDEN_DIR = (Path(__file__).parent / ".." / ".." / "proto" / "golden").resolve()

DIRECTIONS = {
    "supervisor_to_executor": pb.SupervisorFrame,
    "executor_to_supervisor": pb.ExecutorFrame,
}
WIRE_DIRECTIONS = {
    "supervisor_to_executor": (
        {"job": wire.Job, "cancel": wire.Cancel, "shutdown": wire.Shutdown},
        wire.decode_supervisor_frame,
        wire.encode_supervisor_frame,
    ),
    "executor_to_supervisor": (
        {
            "hello": wire.Hello,
            "event": wire.ProgressEvent,
            "result": wire.JobResult,
            "error": wire.JobError,
        },
        wire.decode_executor_frame,
        wire.encode_executor_frame,
    ),
}
ENUMS = {
    **{name: getattr(wire, name) for name in pb.CancelReason.keys()},  # noqa: SIM118
    **{name: getattr(wire, name) for name in pb.EventKind.keys()},  # noqa: SIM118
    **{name: getattr(wire, name) for name in pb.ProtocolVersion.keys()},  # noqa: SIM118
}


def golden_pairs() -> list[str]:
    if not GOLDEN_DIR.is_dir():
        return []
    return sorted(p.stem for p in GOLDEN_DIR.glob("*.bin") if p.with_suffix(".json").is_file())


def read_bodies(raw: bytes) -> list[bytes]:
    stream = io.BytesIO(raw)
    bodies = []
    while True:
        body = read_frame(stream)
        if body is None:
            return bodies
        bodies.append(body)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def from_protojson(cls, obj: dict):
    """A wire message from its protojson (an independent reading of the .json files:
    int64s as strings, bytes as base64, enums by name, snake or camel field names)."""
    msg = cls()
    for _, attr, kind, sub in cls._FIELDS:
        key = attr if attr in obj else _camel(attr)
        if key not in obj:
            continue
        value = obj[key]
        if kind in (wire._BYTES, wire._OPT_BYTES):
            value = base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_")
        elif kind in (wire._UINT32, wire._UINT64, wire._OPT_UINT64, wire._INT64):
            value = int(value)
        elif kind == wire._INT32:
            value = ENUMS[value] if isinstance(value, str) and value in ENUMS else int(value)
        elif kind == wire._OPT_DOUBLE:
            value = float(value)
        elif kind == wire._REP_MESSAGE:
            value = [from_protojson(sub, v) for v in value]
        elif kind == wire._REP_STRING:
            value = list(value)
        elif kind == wire._MAP_STRING_STRING:
            value = dict(value)
        setattr(msg, attr, value)
    return msg


def test_golden_directory_has_pairs():
    """Fails (never skips) when there is nothing to check."""
    assert golden_pairs(), f"no <name>.bin + <name>.json pairs in {GOLDEN_DIR}"


def test_every_bin_has_a_json_and_vice_versa():
    bins = {p.stem for p in GOLDEN_DIR.glob("*.bin")}
    jsons = {p.stem for p in GOLDEN_DIR.glob("*.json")}
    assert bins == jsons, f"unpaired golden files: {sorted(bins ^ jsons)}"


def _load(name: str):
    if name == "<none>":
        pytest.fail(f"no golden pairs in {GOLDEN_DIR}")
    raw = (GOLDEN_DIR / f"{name}.bin").read_bytes()
    spec = json.loads((GOLDEN_DIR / f"{name}.json").read_text(encoding="utf-8"))
    assert spec["direction"] in DIRECTIONS, f"{name}: unknown direction {spec['direction']!r}"
    assert spec["frames"], f"{name}: no frames listed"
    return raw, spec


@pytest.mark.parametrize("name", golden_pairs() or ["<none>"])
def test_golden_pair_decodes_and_reencodes_byte_for_byte_with_the_pure_codec(name):
    raw, spec = _load(name)
    members, decode, encode = WIRE_DIRECTIONS[spec["direction"]]

    decoded = [decode(body) for body in read_bodies(raw)]
    expected = []
    for frame in spec["frames"]:
        (which, obj), *more = frame.items()
        assert not more, f"{name}: a frame with two members: {frame}"
        expected.append(from_protojson(members[which], obj))
    assert len(decoded) == len(expected), f"{name}: {len(decoded)} frames in .bin"
    for i, (got, want) in enumerate(zip(decoded, expected, strict=True)):
        assert got == want, f"{name}: frame {i} differs from the JSON:\n{got}\nvs\n{want}"

    reencoded = b"".join(encode_frame(encode(m)) for m in expected)
    assert reencoded == raw, f"{name}: deterministic re-encoding differs from the .bin"


@pytest.mark.parametrize("name", golden_pairs() or ["<none>"])
def test_golden_pair_decodes_and_reencodes_byte_for_byte_with_protobuf(name):
    raw, spec = _load(name)
    cls = DIRECTIONS[spec["direction"]]

    decoded = [cls.FromString(body) for body in read_bodies(raw)]
    expected = [json_format.Parse(json.dumps(frame), cls()) for frame in spec["frames"]]
    assert len(decoded) == len(expected), f"{name}: {len(decoded)} frames in .bin"
    for i, (got, want) in enumerate(zip(decoded, expected, strict=True)):
        assert got == want, f"{name}: frame {i} differs from the JSON:\n{got}\nvs\n{want}"

    reencoded = b"".join(encode_frame(m.SerializeToString(deterministic=True)) for m in expected)
    assert reencoded == raw, f"{name}: deterministic re-encoding differs from the .bin"
