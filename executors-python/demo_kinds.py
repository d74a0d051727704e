"""The Python demo executor's kinds: the demo kinds of proto/PROTOCOL.md ("Demo executors").

``demo_executor.py`` runs them (``.venv/bin/python executors-python/demo_executor.py``);
they live in this module because an imported module's bytecode is cached while a
script is compiled at every start, and executors start for every attempt.
Environment:
  DEMO_LABELS  labels offered in Hello, ``k=v,k2=v2`` (default none)
  DEMO_KINDS   kinds offered in Hello, comma separated (default all demo kinds)

Exit status: 0 after a clean end, 1 after a broken frame stream, 2 for a bad
environment, 3 when a demo kind crashes on purpose (as the Go demo executor).
"""

from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs ~10 ms of start-up: annotations only
    from collections.abc import Callable, Mapping
    from typing import Any, NoReturn, TypeAlias

    #: A JSON object, as decoded by json.loads.
    JSONObject: TypeAlias = dict[str, Any]

try:
    from durable_executor import (
        BAD_CHECKPOINT,
        Cancelled,
        Executor,
        ExecutorError,
        Job,
        Result,
        wire,
    )
    from durable_executor.framing import encode_varint
except ImportError:  # not installed: use the package beside this module
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from durable_executor import (
        BAD_CHECKPOINT,
        Cancelled,
        Executor,
        ExecutorError,
        Job,
        Result,
        wire,
    )
    from durable_executor.framing import encode_varint

EXECUTOR_KIND = "python"

#: demo.misbehave "oversize": the frame length announced (64 MiB, over any sane cap).
OVERSIZE_ANNOUNCED_BYTES = 64 * 1024 * 1024
#: demo.misbehave "stderr_flood": bytes written to stderr (50 MB).
STDERR_FLOOD_BYTES = 50_000_000
#: demo.misbehave "stdout_print": lines printed to stdout.
STDOUT_PRINT_LINES = 1000
#: Exit status of demo.misbehave "crash" / "garbage" / "oversize" and of demo.effect
#: "crash_after_effect".
CRASH_EXIT_CODE = 3
#: demo.sleep input limits.
MAX_SLEEP_MS = 30 * 24 * 3600 * 1000
MAX_SLEEP_STEPS = 100_000


# ---------------------------------------------------------------------------
# Input helpers: every malformed input is BAD_INPUT (not retryable).


def _bad_input(job: Job, message: str) -> ExecutorError:
    return ExecutorError("BAD_INPUT", f"{job.kind}: {message}", retryable=False)


def _object_input(job: Job) -> JSONObject:
    value = job.input  # raises BAD_INPUT when not JSON
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad_input(job, f"input must be a JSON object, got {type(value).__name__}")
    return value


def _int(
    job: Job,
    obj: JSONObject,
    key: str,
    default: int,
    minimum: int = 0,
    maximum: int | None = None,
) -> int:
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bounds = f">= {minimum}" if maximum is None else f"within {minimum}..{maximum}"
        raise _bad_input(job, f"{key!r} must be an integer {bounds}, got {value!r}")
    return value


def _bool(job: Job, obj: JSONObject, key: str, default: bool) -> bool:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad_input(job, f"{key!r} must be true or false, got {value!r}")
    return value


def _str(job: Job, obj: JSONObject, key: str, default: str) -> str:
    value = _opt_str(job, obj, key)
    return default if value is None else value


def _opt_str(job: Job, obj: JSONObject, key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad_input(job, f"{key!r} must be a string, got {value!r}")
    return value


def _exit_now(code: int) -> NoReturn:
    """Leave at once, without a terminal (frames are already flushed on write)."""
    try:
        sys.stderr.flush()
    finally:
        os._exit(code)


# ---------------------------------------------------------------------------
# Kinds


def echo(job: Job) -> Result:
    """demo.echo: output = input (byte for byte, once it is known to be JSON)."""
    job.input  # noqa: B018 - validates the input as JSON (BAD_INPUT otherwise)
    return Result(output_json=job.input_bytes if job.input_bytes.strip() else b"null")


def sleep(job: Job) -> JSONObject:
    """demo.sleep {ms, steps}: sleep in equal slices, one PROGRESS per slice."""
    args = _object_input(job)
    ms = _int(job, args, "ms", 1000, maximum=MAX_SLEEP_MS)
    steps = _int(job, args, "steps", 10, minimum=1, maximum=MAX_SLEEP_STEPS)
    start = time.monotonic()
    for i in range(1, steps + 1):
        # Aim at absolute slice ends so per-slice overhead does not accumulate.
        job.sleep(start + ms * i / steps / 1000.0 - time.monotonic())
        job.progress(f"slept {ms * i // steps} of {ms} ms", fraction=i / steps)
    return {"slept_ms": ms}


def fail(job: Job) -> JSONObject:
    """demo.fail {code, retryable, fail_attempts, message}."""
    args = _object_input(job)
    code = _str(job, args, "code", "DEMO_FAILURE")
    retryable = _bool(job, args, "retryable", True)
    fail_attempts = None
    if args.get("fail_attempts") is not None:
        fail_attempts = _int(job, args, "fail_attempts", 0)
    message = _opt_str(job, args, "message")
    if fail_attempts is None or job.attempt <= fail_attempts:
        try:
            error = ExecutorError(
                code or "DEMO_FAILURE",
                message if message is not None else f"demo.fail: failing attempt {job.attempt}",
                retryable=retryable,
            )
        except ValueError as e:
            raise _bad_input(job, str(e)) from None
        raise error
    return {"attempt": job.attempt}


def artifact(job: Job) -> Result:
    """demo.artifact {name, content, repeat}: input artifacts' bytes, then the content."""
    args = _object_input(job)
    name = _str(job, args, "name", "artifact.txt")
    content = _str(job, args, "content", "")
    repeat = _int(job, args, "repeat", 1)
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise _bad_input(job, f"'name' must be a relative path without '.'/'..', got {name!r}")
    if not job.output_dir:
        raise _bad_input(job, "the job has no output_dir")

    path = job.output_path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = content.encode("utf-8")
    with open(path, "wb") as out:
        for ref in job.input_artifacts:
            with open(ref.path, "rb") as src:
                while True:
                    chunk = src.read(1 << 20)
                    if not chunk:
                        break
                    out.write(chunk)
        if data and repeat:
            per_write = max(1, (1 << 20) // len(data))
            block = data * min(per_write, repeat)
            left = repeat
            while left >= per_write:
                out.write(block)
                left -= per_write
                job.raise_if_cancelled()
            if left:
                out.write(data * left)
    entry = job.artifact(
        name,
        name=name,
        media_type="text/plain",
        derived_from=[ref.id for ref in job.input_artifacts],
    )
    return Result({"name": name, "size": entry.size, "sha256": entry.sha256}, [entry])


def effect(job: Job) -> JSONObject:
    """demo.effect {sink, fail_after_effect, crash_after_effect}: an idempotent side effect."""
    args = _object_input(job)
    sink = _opt_str(job, args, "sink")
    if not sink:
        raise _bad_input(job, "'sink' (a file path) is required")
    fail_after = _bool(job, args, "fail_after_effect", False)
    crash_after = _bool(job, args, "crash_after_effect", False)

    marker = f"effect-done:{job.idempotency_key}".encode()
    performed = False
    if job.checkpoint != marker:
        fd = os.open(sink, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{job.idempotency_key}\n".encode())
            os.fsync(fd)  # the effect is durable before the checkpoint says it happened
        finally:
            os.close(fd)
        performed = True
        job.progress("effect performed", checkpoint=marker)
    if fail_after and job.attempt == 1:
        raise ExecutorError("EFFECT_FAILED", "failing after the effect (attempt 1)", retryable=True)
    if crash_after and job.attempt == 1:
        _exit_now(CRASH_EXIT_CODE)
    return {"effect_performed": performed}


def resume(job: Job) -> JSONObject:
    """demo.resume {items, ms, sink}: process items 0..items-1, ms each, checkpointing
    {"next": i + 1} after every item; an attempt resumes at the previous attempt's
    checkpoint. With a sink, appends "<attempt> <item>" per item processed."""
    args = _object_input(job)
    items = _int(job, args, "items", 10, maximum=MAX_SLEEP_STEPS)
    ms = _int(job, args, "ms", 100, maximum=MAX_SLEEP_MS // max(items, 1))
    sink = _opt_str(job, args, "sink")
    saved = job.checkpoint_json(default={})
    start = saved.get("next", 0) if isinstance(saved, dict) else None
    if not isinstance(start, int) or isinstance(start, bool):
        raise ExecutorError(
            BAD_CHECKPOINT, f"checkpoint {saved!r} is not {{next: int}}", retryable=False
        )
    start = min(max(start, 0), items)
    for i in range(start, items):
        job.sleep(ms / 1000.0)
        if sink:
            fd = os.open(sink, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{job.attempt} {i}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        job.save_checkpoint_json({"next": i + 1}, f"item {i + 1} of {items} done", (i + 1) / items)
    return {"started_at": start, "items": items, "attempt": job.attempt}


def finish_on_cancel(job: Job) -> JSONObject:
    """demo.finish_on_cancel {wait_ms}: wait up to wait_ms (default 30 s) for a cancel;
    when it arrives, ignore it and finish at once with {"finished_after_cancel": true}
    (a result after a cancel, which the supervisor keeps within the grace). Without a
    cancel: {"finished_after_cancel": false}."""
    args = _object_input(job)
    wait_ms = _int(job, args, "wait_ms", 30_000, maximum=MAX_SLEEP_MS)
    # Tells the supervisor (and tests) that the handler is waiting for the cancel.
    job.progress("demo.finish_on_cancel: waiting for a cancel")
    cancelled = job.cancel_event.wait(wait_ms / 1000.0)
    return {"finished_after_cancel": cancelled}


def _event(job: Job, sequence: int, message: str) -> wire.ProgressEvent:
    return wire.ProgressEvent(
        job_id=job.job_id,
        sequence=sequence,
        kind=wire.EVENT_KIND_PROGRESS,
        message=message,
        at_unix_ms=time.time_ns() // 1_000_000,
    )


def _mode_crash(job: Job) -> NoReturn:
    _exit_now(CRASH_EXIT_CODE)


def _wait_for_cancel(job: Job) -> NoReturn:
    job.cancel_event.wait()
    raise Cancelled(f"demo.misbehave: {job.cancel_reason}")


def _mode_garbage(job: Job) -> NoReturn:
    # 0xff opens a length prefix announcing far more bytes than follow, so the stream
    # cannot be resynchronised: exit 3, and the supervisor sees a truncated frame at the
    # end of the stream rather than waiting for bytes that never come.
    text = b"this is not a protobuf frame: demo.misbehave mode garbage"
    job.unsafe_write_raw((b"\xff" + text).ljust(64, b".")[:64])
    _exit_now(CRASH_EXIT_CODE)


def _mode_oversize(job: Job) -> NoReturn:
    # A length prefix announcing 64 MiB, then some bytes; exit 3 (as garbage).
    job.unsafe_write_raw(encode_varint(OVERSIZE_ANNOUNCED_BYTES) + b"*" * 1024)
    _exit_now(CRASH_EXIT_CODE)


def _mode_backwards(job: Job) -> NoReturn:
    # PROGRESS sequence 5, then PROGRESS sequence 3; then wait to be cancelled.
    job.unsafe_send_frame(_event(job, 5, "demo.misbehave backwards: sequence 5"))
    job.unsafe_send_frame(_event(job, 3, "demo.misbehave backwards: sequence 3"))
    _wait_for_cancel(job)


def _mode_after_terminal(job: Job) -> NoReturn:
    job.unsafe_send_frame(
        wire.JobResult(job_id=job.job_id, sequence=3, output=b'{"mode":"after_terminal"}')
    )
    job.unsafe_send_frame(_event(job, 4, "demo.misbehave after_terminal: an event after it"))
    # Then wait to be cancelled (the SDK sends no terminal of its own: one went out).
    _wait_for_cancel(job)


def _mode_hang(job: Job) -> NoReturn:
    # No further frame; only a cancel (or stdin closing) ends it.
    _wait_for_cancel(job)


def _mode_ignore_cancel(job: Job) -> NoReturn:
    import signal
    from types import FrameType

    def ignore(signum: int, frame: FrameType | None) -> None:
        sys.stderr.write("demo.misbehave ignore_cancel: ignoring SIGTERM\n")
        sys.stderr.flush()

    signal.signal(signal.SIGTERM, ignore)
    # Tells the supervisor (and tests) that the SIGTERM handler is in place.
    job.progress("demo.misbehave ignore_cancel: ignoring cancel and SIGTERM")
    while True:
        time.sleep(3600)


def _mode_grandchild(job: Job) -> JSONObject:
    import subprocess

    # Same process group and session as this executor: the supervisor must kill it.
    child = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)
    return {"grandchild_pid": child.pid}


def _mode_stdout_print(job: Job) -> JSONObject:
    for i in range(STDOUT_PRINT_LINES):
        line = f"demo.misbehave stdout_print: line {i + 1} of {STDOUT_PRINT_LINES}"
        if i % 2:
            os.write(1, (line + "\n").encode())  # straight to fd 1, like a child process would
        else:
            print(line)
    sys.stdout.flush()
    return {"lines_printed": STDOUT_PRINT_LINES}


def _mode_stderr_flood(job: Job) -> JSONObject:
    sys.stderr.flush()
    chunk = (b"stderr_flood " * 80 + b"\n") * 1000  # about 1 MiB
    written = 0
    while written < STDERR_FLOOD_BYTES:
        view = memoryview(chunk)[: STDERR_FLOOD_BYTES - written]
        while view:
            n = os.write(2, view)
            view = view[n:]
            written += n
    return {"stderr_bytes": written}


MISBEHAVE_MODES: dict[str, Callable[[Job], object]] = {
    "crash": _mode_crash,
    "garbage": _mode_garbage,
    "oversize": _mode_oversize,
    "backwards": _mode_backwards,
    "after_terminal": _mode_after_terminal,
    "hang": _mode_hang,
    "ignore_cancel": _mode_ignore_cancel,
    "grandchild": _mode_grandchild,
    "stdout_print": _mode_stdout_print,
    "stderr_flood": _mode_stderr_flood,
}


def misbehave(job: Job) -> object:
    """demo.misbehave {mode}: break the protocol on purpose, one way per mode."""
    args = _object_input(job)
    mode = _opt_str(job, args, "mode")
    run = MISBEHAVE_MODES.get(mode or "")
    if run is None:
        raise _bad_input(job, f"'mode' must be one of {sorted(MISBEHAVE_MODES)}, got {mode!r}")
    return run(job)


KINDS: dict[str, Callable[[Job], object]] = {
    "demo.echo": echo,
    "demo.sleep": sleep,
    "demo.fail": fail,
    "demo.artifact": artifact,
    "demo.effect": effect,
    "demo.misbehave": misbehave,
    "demo.finish_on_cancel": finish_on_cancel,
    "demo.resume": resume,
}


# ---------------------------------------------------------------------------


def parse_labels(text: str) -> dict[str, str]:
    """Parse ``k=v,k2=v2``: blank entries are skipped, keys and values trimmed; raise
    ValueError on an entry without '=' or a key given twice."""
    labels: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"DEMO_LABELS: entry {item!r} is not key=value")
        if key in labels:
            raise ValueError(f"DEMO_LABELS: label {key!r} given twice")
        labels[key] = value.strip()
    return labels


def parse_kinds(text: str | None) -> list[str]:
    """The DEMO_KINDS list (duplicates dropped); unset or blank means every demo kind.
    Raise ValueError on a name that is not a demo kind."""
    kinds: list[str] = []
    for kind in (text or "").split(","):
        kind = kind.strip()
        if not kind or kind in kinds:
            continue
        if kind not in KINDS:
            known = ", ".join(sorted(KINDS))
            raise ValueError(f"DEMO_KINDS: unknown kind {kind!r} (known: {known})")
        kinds.append(kind)
    return kinds or sorted(KINDS)


def build_executor(environ: Mapping[str, str] | None = None) -> Executor:
    if environ is None:
        environ = os.environ
    labels = parse_labels(environ.get("DEMO_LABELS", ""))
    ex = Executor(EXECUTOR_KIND, labels)
    for kind in parse_kinds(environ.get("DEMO_KINDS")):
        ex.add_handler(kind, KINDS[kind])
    return ex


def main() -> int:
    try:
        ex = build_executor()
    except ValueError as e:
        sys.stderr.write(f"demo_executor: {e}\n")
        return 2
    return ex.run()
