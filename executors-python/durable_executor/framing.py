"""Length-delimited framing: a base-128 varint byte length, then that many bytes.

This is the standard "delimited" form (``protodelim`` in Go,
``encode_length_delimited`` in prost). The reader checks the announced length
against a cap *before* allocating the body, and tells a clean end of stream
(exactly between two frames) from a truncated frame.

Streams are duck-typed: a reader needs ``read(n)`` (short reads are fine, as
from a raw ``io.FileIO`` on a pipe; ``b""`` means end of stream), a writer
needs ``write(b)`` and optionally ``flush()``.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Protocol

    class BinaryReader(Protocol):
        """What a frame reader reads from: ``read(n)`` returning up to ``n`` bytes
        (``b""`` at end of stream; ``None`` only from a non-blocking stream)."""

        def read(self, n: int, /) -> bytes | None: ...

    class BinaryWriter(Protocol):
        """What frames are written to: ``write(b)`` returning the bytes written
        (``flush()`` is called when the stream has one)."""

        def write(self, data: memoryview, /) -> int | None: ...


#: Default cap on one frame's body, in bytes (PROTOCOL.md: 8 MiB).
DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024

#: A base-128 varint of a 64-bit value takes at most 10 bytes.
MAX_VARINT_BYTES = 10

_UINT64_MAX = (1 << 64) - 1


class FrameError(Exception):
    """The byte stream is not a valid sequence of frames (truncated, bad varint)."""


class FrameTooLarge(FrameError):
    """A frame's announced length is over the receiver's cap."""

    def __init__(self, length: int, cap: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the cap of {cap} bytes")
        self.length = length
        self.cap = cap


def encode_varint(value: int) -> bytes:
    """Encode a non-negative integer below 2**64 as a base-128 varint."""
    if value < 0 or value > _UINT64_MAX:
        raise ValueError(f"varint value out of range: {value}")
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(buf: bytes | bytearray | memoryview, pos: int = 0) -> tuple[int, int]:
    """Decode a varint from ``buf`` at ``pos``; return ``(value, position after it)``.

    Raises :class:`FrameError` if the buffer ends inside the varint or the varint is
    longer than 10 bytes / over 64 bits.
    """
    value = 0
    shift = 0
    end = len(buf)
    for i in range(MAX_VARINT_BYTES):
        if pos >= end:
            raise FrameError("truncated frame: data ends inside the length prefix")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value > _UINT64_MAX or (i == MAX_VARINT_BYTES - 1 and byte > 1):
                raise FrameError("malformed length prefix: varint overflows 64 bits")
            return value, pos
        shift += 7
    raise FrameError(f"malformed length prefix: varint longer than {MAX_VARINT_BYTES} bytes")


def encode_frame(message: bytes) -> bytes:
    """Return ``message`` prefixed by its length as a varint."""
    return encode_varint(len(message)) + message


def _read_exact(stream: BinaryReader, n: int) -> bytes:
    """Read exactly ``n`` bytes, looping over short reads; fewer only at end of stream."""
    data = stream.read(n)
    if data is None:
        raise FrameError("non-blocking stream has no data; frame streams must be blocking")
    if len(data) == n or not data:
        return data
    chunks = [data]
    got = len(data)
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(
    stream: BinaryReader, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> bytes | None:
    """Read one frame's body from ``stream``.

    Returns ``None`` on a clean end of stream (no byte of a next frame was read).
    Raises :class:`FrameTooLarge` when the announced length is over
    ``max_frame_bytes`` (before reading or allocating the body) and
    :class:`FrameError` when the stream ends inside the length prefix or the body,
    or the prefix is not a valid varint.
    """
    value = 0
    shift = 0
    for i in range(MAX_VARINT_BYTES):
        b = stream.read(1)
        if not b:
            if b is None:
                raise FrameError("non-blocking stream has no data; frame streams must be blocking")
            if i == 0:
                return None
            raise FrameError(
                f"truncated frame: end of stream after {i} byte(s) of the length prefix"
            )
        byte = b[0]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value > _UINT64_MAX or (i == MAX_VARINT_BYTES - 1 and byte > 1):
                raise FrameError("malformed length prefix: varint overflows 64 bits")
            break
        shift += 7
    else:
        raise FrameError(f"malformed length prefix: varint longer than {MAX_VARINT_BYTES} bytes")

    if value > max_frame_bytes:
        raise FrameTooLarge(value, max_frame_bytes)
    if value == 0:
        return b""
    body = _read_exact(stream, value)
    if len(body) != value:
        raise FrameError(f"truncated frame: end of stream after {len(body)} of {value} body bytes")
    return body


def write_all(stream: BinaryWriter, data: bytes) -> None:
    """Write all of ``data`` (looping over short writes) and flush."""
    view = memoryview(data)
    while view:
        n = stream.write(view)
        if n is None:
            raise BlockingIOError("frame stream is non-blocking and would block")
        if n >= len(view):
            break
        view = view[n:]
    flush = getattr(stream, "flush", None)
    if flush is not None:
        flush()


def write_frame(stream: BinaryWriter, message: bytes) -> None:
    """Write ``message`` as one frame (length prefix and body in one write) and flush."""
    write_all(stream, encode_frame(message))


def iter_frames(
    stream: BinaryReader, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Iterator[bytes]:
    """Yield frame bodies from ``stream`` until a clean end of stream."""
    while True:
        body = read_frame(stream, max_frame_bytes)
        if body is None:
            return
        yield body


def split_frames(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[bytes]:
    """Split an in-memory buffer holding whole frames into their bodies.

    Raises :class:`FrameError` if the buffer does not end exactly at a frame boundary.
    """
    view = memoryview(data)
    frames: list[bytes] = []
    pos = 0
    while pos < len(view):
        length, pos = decode_varint(view, pos)
        if length > max_frame_bytes:
            raise FrameTooLarge(length, max_frame_bytes)
        if pos + length > len(view):
            raise FrameError(
                f"truncated frame: end of data after {len(view) - pos} of {length} body bytes"
            )
        frames.append(bytes(view[pos : pos + length]))
        pos += length
    return frames
