from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]

class CancelReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CANCEL_REASON_UNSPECIFIED: _ClassVar[CancelReason]
    CANCEL_REASON_REQUESTED: _ClassVar[CancelReason]
    CANCEL_REASON_ATTEMPT_TIMEOUT: _ClassVar[CancelReason]
    CANCEL_REASON_DEADLINE: _ClassVar[CancelReason]
    CANCEL_REASON_LEASE_LOST: _ClassVar[CancelReason]
    CANCEL_REASON_SHUTDOWN: _ClassVar[CancelReason]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_ACCEPTED: _ClassVar[EventKind]
    EVENT_KIND_RUNNING: _ClassVar[EventKind]
    EVENT_KIND_PROGRESS: _ClassVar[EventKind]
    EVENT_KIND_HEARTBEAT: _ClassVar[EventKind]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
CANCEL_REASON_UNSPECIFIED: CancelReason
CANCEL_REASON_REQUESTED: CancelReason
CANCEL_REASON_ATTEMPT_TIMEOUT: CancelReason
CANCEL_REASON_DEADLINE: CancelReason
CANCEL_REASON_LEASE_LOST: CancelReason
CANCEL_REASON_SHUTDOWN: CancelReason
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_ACCEPTED: EventKind
EVENT_KIND_RUNNING: EventKind
EVENT_KIND_PROGRESS: EventKind
EVENT_KIND_HEARTBEAT: EventKind

class SupervisorFrame(_message.Message):
    __slots__ = ("job", "cancel", "shutdown")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    job: Job
    cancel: Cancel
    shutdown: Shutdown
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "workflow_run_id", "step_run_id", "idempotency_key", "executor_kind", "kind", "attempt", "deadline_unix_ms", "attempt_deadline_unix_ms", "heartbeat_timeout_ms", "input", "input_artifacts", "checkpoint", "output_dir", "secrets", "labels", "negotiated_version", "negotiated_features", "max_frame_bytes")
    class SecretsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_KIND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    INPUT_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    SECRETS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NEGOTIATED_VERSION_FIELD_NUMBER: _ClassVar[int]
    NEGOTIATED_FEATURES_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    workflow_run_id: str
    step_run_id: str
    idempotency_key: str
    executor_kind: str
    kind: str
    attempt: int
    deadline_unix_ms: int
    attempt_deadline_unix_ms: int
    heartbeat_timeout_ms: int
    input: bytes
    input_artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactRef]
    checkpoint: bytes
    output_dir: str
    secrets: _containers.ScalarMap[str, str]
    labels: _containers.ScalarMap[str, str]
    negotiated_version: str
    negotiated_features: _containers.RepeatedScalarFieldContainer[str]
    max_frame_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., workflow_run_id: _Optional[str] = ..., step_run_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., executor_kind: _Optional[str] = ..., kind: _Optional[str] = ..., attempt: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., attempt_deadline_unix_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., input: _Optional[bytes] = ..., input_artifacts: _Optional[_Iterable[_Union[ArtifactRef, _Mapping]]] = ..., checkpoint: _Optional[bytes] = ..., output_dir: _Optional[str] = ..., secrets: _Optional[_Mapping[str, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., negotiated_version: _Optional[str] = ..., negotiated_features: _Optional[_Iterable[str]] = ..., max_frame_bytes: _Optional[int] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("job_id", "reason", "grace_ms", "message")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: CancelReason
    grace_ms: int
    message: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[_Union[CancelReason, str]] = ..., grace_ms: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ExecutorFrame(_message.Message):
    __slots__ = ("hello", "event", "result", "error")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    event: ProgressEvent
    result: JobResult
    error: JobError
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., event: _Optional[_Union[ProgressEvent, _Mapping]] = ..., result: _Optional[_Union[JobResult, _Mapping]] = ..., error: _Optional[_Union[JobError, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "executor_kind", "kinds", "labels", "sdk_name", "sdk_version", "max_jobs_per_process", "pid", "protocol_versions", "features", "max_frame_bytes")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_KIND_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SDK_NAME_FIELD_NUMBER: _ClassVar[int]
    SDK_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_JOBS_PER_PROCESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    executor_kind: str
    kinds: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    sdk_name: str
    sdk_version: str
    max_jobs_per_process: int
    pid: int
    protocol_versions: _containers.RepeatedScalarFieldContainer[str]
    features: _containers.RepeatedScalarFieldContainer[str]
    max_frame_bytes: int
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., executor_kind: _Optional[str] = ..., kinds: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., sdk_name: _Optional[str] = ..., sdk_version: _Optional[str] = ..., max_jobs_per_process: _Optional[int] = ..., pid: _Optional[int] = ..., protocol_versions: _Optional[_Iterable[str]] = ..., features: _Optional[_Iterable[str]] = ..., max_frame_bytes: _Optional[int] = ...) -> None: ...

class ProgressEvent(_message.Message):
    __slots__ = ("job_id", "sequence", "kind", "message", "fraction", "checkpoint", "at_unix_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sequence: int
    kind: EventKind
    message: str
    fraction: float
    checkpoint: bytes
    at_unix_ms: int
    def __init__(self, job_id: _Optional[str] = ..., sequence: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., message: _Optional[str] = ..., fraction: _Optional[float] = ..., checkpoint: _Optional[bytes] = ..., at_unix_ms: _Optional[int] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("job_id", "sequence", "output", "artifacts")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sequence: int
    output: bytes
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactManifestEntry]
    def __init__(self, job_id: _Optional[str] = ..., sequence: _Optional[int] = ..., output: _Optional[bytes] = ..., artifacts: _Optional[_Iterable[_Union[ArtifactManifestEntry, _Mapping]]] = ...) -> None: ...

class JobError(_message.Message):
    __slots__ = ("job_id", "sequence", "code", "message", "retryable", "details", "next_retry_delay_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    NEXT_RETRY_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sequence: int
    code: str
    message: str
    retryable: bool
    details: bytes
    next_retry_delay_ms: int
    def __init__(self, job_id: _Optional[str] = ..., sequence: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., retryable: bool = ..., details: _Optional[bytes] = ..., next_retry_delay_ms: _Optional[int] = ...) -> None: ...

class ArtifactManifestEntry(_message.Message):
    __slots__ = ("name", "path", "sha256", "size", "media_type", "derived_from")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    DERIVED_FROM_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    sha256: str
    size: int
    media_type: str
    derived_from: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., media_type: _Optional[str] = ..., derived_from: _Optional[_Iterable[str]] = ...) -> None: ...

class ArtifactRef(_message.Message):
    __slots__ = ("id", "name", "sha256", "size", "media_type", "path", "step_name")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_NAME_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    sha256: str
    size: int
    media_type: str
    path: str
    step_name: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., media_type: _Optional[str] = ..., path: _Optional[str] = ..., step_name: _Optional[str] = ...) -> None: ...
