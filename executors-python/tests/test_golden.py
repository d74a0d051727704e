"""Golden frames shared by every language (proto/golden/<name>.bin + <name>.json).

Each ``.bin`` is a stream of delimited frames; the ``.json`` beside it gives the
direction and the protojson of every frame. This SDK must decode each stream with
its own framing, find the messages the JSON describes, and re-encode them
deterministically to the very same bytes.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from google.protobuf import json_format

from durable_executor import encode_frame, read_frame
from durable_executor._gen.durable.executor.v1 import executor_pb2 as pb

GOLDEN_DIR = (Path(__file__).parent / ".." / ".." / "proto" / "golden").resolve()

DIRECTIONS = {
    "supervisor_to_executor": pb.SupervisorFrame,
    "executor_to_supervisor": pb.ExecutorFrame,
}


def golden_pairs() -> list[str]:
    if not GOLDEN_DIR.is_dir():
        return []
    return sorted(p.stem for p in GOLDEN_DIR.glob("*.bin") if p.with_suffix(".json").is_file())


def test_golden_directory_has_pairs():
    """Fails (never skips) when there is nothing to check."""
    assert golden_pairs(), f"no <name>.bin + <name>.json pairs in {GOLDEN_DIR}"


def test_every_bin_has_a_json_and_vice_versa():
    bins = {p.stem for p in GOLDEN_DIR.glob("*.bin")}
    jsons = {p.stem for p in GOLDEN_DIR.glob("*.json")}
    assert bins == jsons, f"unpaired golden files: {sorted(bins ^ jsons)}"


@pytest.mark.parametrize("name", golden_pairs() or ["<none>"])
def test_golden_pair_decodes_and_reencodes_byte_for_byte(name):
    if name == "<none>":
        pytest.fail(f"no golden pairs in {GOLDEN_DIR}")
    raw = (GOLDEN_DIR / f"{name}.bin").read_bytes()
    spec = json.loads((GOLDEN_DIR / f"{name}.json").read_text(encoding="utf-8"))
    assert spec["direction"] in DIRECTIONS, f"{name}: unknown direction {spec['direction']!r}"
    cls = DIRECTIONS[spec["direction"]]
    assert spec["frames"], f"{name}: no frames listed"

    stream = io.BytesIO(raw)
    decoded = []
    while True:
        body = read_frame(stream)
        if body is None:
            break
        decoded.append(cls.FromString(body))

    expected = [json_format.Parse(json.dumps(frame), cls()) for frame in spec["frames"]]
    assert len(decoded) == len(expected), f"{name}: {len(decoded)} frames in .bin"
    for i, (got, want) in enumerate(zip(decoded, expected)):
        assert got == want, f"{name}: frame {i} differs from the JSON:\n{got}\nvs\n{want}"

    reencoded = b"".join(encode_frame(m.SerializeToString(deterministic=True)) for m in expected)
    assert reencoded == raw, f"{name}: deterministic re-encoding differs from the .bin"
