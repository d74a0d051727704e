"""Length-delimited framing: varints, round trips, truncation, the size cap."""

from __future__ import annotations

import io

import pytest

from durable_executor import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameError,
    FrameTooLarge,
    decode_varint,
    encode_frame,
    encode_varint,
    iter_frames,
    read_frame,
    split_frames,
    write_frame,
)
from durable_executor._gen.durable.executor.v1 import executor_pb2 as pb


class RecordingStream:
    """A readable stream that records every requested read size."""

    def __init__(self, data: bytes, chunk: int | None = None) -> None:
        self._buf = io.BytesIO(data)
        self._chunk = chunk
        self.requests: list[int] = []

    def read(self, n: int) -> bytes:
        self.requests.append(n)
        if self._chunk is not None:
            n = min(n, self._chunk)
        return self._buf.read(n)


class ShortWriter:
    """A writable stream that accepts at most 3 bytes per write call."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.flushed = False

    def write(self, b) -> int:
        part = bytes(b[:3])
        self.data += part
        return len(part)

    def flush(self) -> None:
        self.flushed = True


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, b"\x00"),
        (1, b"\x01"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (300, b"\xac\x02"),
        (64 * 1024 * 1024, b"\x80\x80\x80\x20"),
        (2**64 - 1, b"\xff" * 9 + b"\x01"),
    ],
)
def test_varint_known_encodings_round_trip(value, encoded):
    assert encode_varint(value) == encoded
    assert decode_varint(encoded) == (value, len(encoded))
    assert decode_varint(b"\xaa" + encoded + b"tail", 1) == (value, 1 + len(encoded))


@pytest.mark.parametrize("value", [-1, 2**64])
def test_varint_rejects_out_of_range_values(value):
    with pytest.raises(ValueError, match="out of range"):
        encode_varint(value)


def test_decode_varint_rejects_truncated_overlong_and_overflowing_input():
    with pytest.raises(FrameError, match="truncated"):
        decode_varint(b"\x80\x80")
    with pytest.raises(FrameError, match="longer than 10 bytes"):
        decode_varint(b"\x80" * 10 + b"\x01")
    with pytest.raises(FrameError, match="overflows 64 bits"):
        decode_varint(b"\xff" * 9 + b"\x02")


def test_round_trip_of_several_frames_then_clean_eof():
    messages = [
        pb.ExecutorFrame(hello=pb.Hello(executor_kind="python", kinds=["a", "b"])),
        pb.ExecutorFrame(),  # encodes to zero bytes: an empty frame is still a frame
        pb.ExecutorFrame(result=pb.JobResult(job_id="j", sequence=3, output=b"x" * 1000)),
    ]
    out = io.BytesIO()
    for m in messages:
        write_frame(out, m.SerializeToString(deterministic=True))
    stream = io.BytesIO(out.getvalue())
    decoded = []
    for _ in messages:
        body = read_frame(stream)
        assert body is not None
        decoded.append(pb.ExecutorFrame.FromString(body))
    assert decoded == messages
    assert read_frame(stream) is None  # clean EOF exactly between frames
    assert read_frame(stream) is None  # and it stays EOF
    assert [pb.ExecutorFrame.FromString(b) for b in iter_frames(io.BytesIO(out.getvalue()))] == (
        messages
    )


def test_empty_stream_is_a_clean_eof():
    assert read_frame(io.BytesIO(b"")) is None
    assert list(iter_frames(io.BytesIO(b""))) == []


def test_eof_inside_the_length_prefix_is_a_truncated_frame():
    # 0x80 announces that more varint bytes follow.
    with pytest.raises(FrameError, match="truncated frame: end of stream after 1 byte"):
        read_frame(io.BytesIO(b"\x80"))


def test_eof_inside_the_body_is_a_truncated_frame():
    data = encode_frame(b"hello world")
    with pytest.raises(FrameError, match="after 10 of 11 body bytes"):
        read_frame(io.BytesIO(data[:-1]))
    # A whole frame followed by a partial one: the first reads, the second fails.
    stream = io.BytesIO(data + data[:3])
    assert read_frame(stream) == b"hello world"
    with pytest.raises(FrameError, match="truncated"):
        read_frame(stream)


def test_overlong_varint_prefix_is_malformed():
    with pytest.raises(FrameError, match="longer than 10 bytes"):
        read_frame(io.BytesIO(b"\xff" * 11))


def test_oversize_frame_is_rejected_before_the_body_is_read_or_allocated():
    announced = 64 * 1024 * 1024
    stream = RecordingStream(encode_varint(announced) + b"x" * 100)
    with pytest.raises(FrameTooLarge) as info:
        read_frame(stream)
    assert info.value.length == announced
    assert info.value.cap == DEFAULT_MAX_FRAME_BYTES
    assert "exceeds the cap" in str(info.value)
    assert isinstance(info.value, FrameError)
    # Only the 4 varint bytes were requested, one at a time: nothing sized by the length.
    assert stream.requests == [1, 1, 1, 1]


def test_cap_is_inclusive_and_configurable():
    assert read_frame(io.BytesIO(encode_frame(b"1234")), max_frame_bytes=4) == b"1234"
    with pytest.raises(FrameTooLarge):
        read_frame(io.BytesIO(encode_frame(b"12345")), max_frame_bytes=4)


def test_short_reads_are_reassembled():
    body = bytes(range(256)) * 3
    stream = RecordingStream(encode_frame(body) + encode_frame(b"next"), chunk=7)
    assert read_frame(stream) == body
    assert read_frame(stream) == b"next"
    assert read_frame(stream) is None


def test_write_frame_completes_short_writes_and_flushes():
    out = ShortWriter()
    write_frame(out, b"0123456789abcdef")
    assert bytes(out.data) == encode_frame(b"0123456789abcdef")
    assert out.flushed


def test_split_frames():
    data = encode_frame(b"a") + encode_frame(b"") + encode_frame(b"ccc")
    assert split_frames(data) == [b"a", b"", b"ccc"]
    with pytest.raises(FrameError, match="truncated"):
        split_frames(data[:-1])
    with pytest.raises(FrameTooLarge):
        split_frames(encode_frame(b"abc"), max_frame_bytes=2)
