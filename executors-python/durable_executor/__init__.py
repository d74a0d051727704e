"""Python SDK for executors of the durable workflow runtime (executor protocol v1).

An executor is a set of handlers by job kind::

    import sys
    from durable_executor import Executor, Job

    ex = Executor(executor_kind="python", labels={"region": "eu"})

    @ex.handler("demo.echo")
    def echo(job: Job) -> object:
        return job.input

    sys.exit(ex.run())

See ``proto/PROTOCOL.md`` for the wire rules this package implements. The
protocol's messages are encoded by :mod:`durable_executor.wire` (pure Python): the
package needs no protobuf runtime.
"""

from . import wire
from ._version import SDK_NAME, __version__
from .executor import (
    ARTIFACT_INVALID,
    BAD_CHECKPOINT,
    BAD_INPUT,
    CANCELLED,
    DEFAULT_MEDIA_TYPE,
    DEFAULT_STOP_GRACE,
    EXECUTOR_BUSY,
    HANDLER_ERROR,
    HANDLER_PANIC,
    HANDLER_TIMEOUT,
    MIN_REDACT_BYTES,
    OUTPUT_BROKEN,
    OUTPUT_INVALID,
    PROTOCOL_ERROR,
    RESULT_TOO_LARGE,
    STDIN_CLOSED,
    UNSUPPORTED_KIND,
    Artifact,
    Cancelled,
    Executor,
    ExecutorError,
    InputArtifact,
    Job,
    Result,
    claim_stdio,
)
from .framing import (
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

__all__ = [
    "ARTIFACT_INVALID",
    "BAD_CHECKPOINT",
    "BAD_INPUT",
    "CANCELLED",
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MEDIA_TYPE",
    "DEFAULT_STOP_GRACE",
    "EXECUTOR_BUSY",
    "HANDLER_ERROR",
    "HANDLER_PANIC",
    "HANDLER_TIMEOUT",
    "MIN_REDACT_BYTES",
    "OUTPUT_BROKEN",
    "OUTPUT_INVALID",
    "PROTOCOL_ERROR",
    "RESULT_TOO_LARGE",
    "SDK_NAME",
    "STDIN_CLOSED",
    "UNSUPPORTED_KIND",
    "Artifact",
    "Cancelled",
    "Executor",
    "ExecutorError",
    "FrameError",
    "FrameTooLarge",
    "InputArtifact",
    "Job",
    "Result",
    "__version__",
    "claim_stdio",
    "decode_varint",
    "encode_frame",
    "encode_varint",
    "iter_frames",
    "read_frame",
    "split_frames",
    "wire",
    "write_frame",
]
