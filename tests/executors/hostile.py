"""A hostile executor for the supervisor's guarantee tests (issue 6).

It speaks the protocol at the frame level, with no SDK policy in the way, and
misbehaves in the ways a third-party executor written from PROTOCOL.md might.
The job's kind selects the behaviour (`hostile.<mode>`):

- `refuse_bad_input`: a non-retryable BAD_INPUT error before ACCEPTED.
- `refuse_retryable`: a retryable error before ACCEPTED (a refusal).
- `nul_error`: ACCEPTED, then an error whose message contains a NUL.
- `nul_event`: ACCEPTED, a PROGRESS event whose message contains a NUL, a result.
- `nul_output`: ACCEPTED, a result whose output JSON holds "\\u0000".
- `huge_number_output`: ACCEPTED, a result whose output holds 1e999999 (beyond
  PostgreSQL's numeric).
- `huge_number_details`: ACCEPTED, a non-retryable error whose details hold 1e999999.
- `duplicate_key_output`: ACCEPTED, a result whose output gives one key twice.
- `chatty`: ACCEPTED, then PROGRESS events as fast as the pipe takes them,
  forever (a cancel frame is never read).
- `huge_retry_delay`: ACCEPTED, a retryable error with next_retry_delay_ms = 2^64-1.
- `escape`: forks a child that calls setsid, moves itself into the cgroup v2 root (root
  only) and sleeps; its pid is appended to HOSTILE_ESCAPE_LOG; then ACCEPTED and a result.
- `echo` (and `panic`, for a supervisor-side fault): ACCEPTED, a result with output = input.
- `secret_echo`: ACCEPTED, echoes every secret value it got into a progress
  message, the error message and details, and fails retryably.
- `garbage_secret`: ACCEPTED, then a frame that is not protobuf: 0xff 0xff and
  every secret value it got (the evidence the supervisor logs of it).
- `close_stdout`: ACCEPTED, then closes its stdout and exits 0 50 ms later (no terminal).
- `secret_memory` (for HOSTILE_JOBS > 1): ACCEPTED, a result whose output holds every
  secret value this process was handed, by this job or an earlier one.
- `late_frame`: ACCEPTED, a result, then after the input's `delay_ms` a PROGRESS event
  of the same job (a frame after its terminal).
- `late_frame_thread`: as `late_frame`, but the late event is written by a thread while the
  process goes on to its next jobs (it lands in whichever job runs then).
- `stray_thread`: ACCEPTED, a result, then a thread writes bytes that are no frame
  (`\xffgarbage`, a stray print) after the input's `delay_ms`, while the process goes on;
  with the input's `short` true, `\x05GARB`: a length of 5 and 4 bytes, completed by the
  first byte the process writes next.  With `empty_frame` true, `\x00`: a whole frame, an empty message of no known kind.
- `checkpoint_flood`: ACCEPTED, then PROGRESS events each carrying a checkpoint of
  the input's `size` bytes (`%08d` of its number, repeated), back to back for the
  input's `ms`, then a result `{"checkpoints": n}`; with the input's `count`,
  that many, then it sleeps (no result, no reading).
- `stray_bytes`: ACCEPTED, a result, then bytes that are no whole frame; with the input's
  `on_next_job` true, a frame that is no protobuf message is written once the process
  has read its next job, before anything else of it (as a print after a terminal lands
  once the next job was sent).
- `crash_at_once`: exits 3 as soon as it has read the job (no frame; a poison input).
- `refuse_once`: the first job of a step this process sees is refused (a retryable
  EXECUTOR_REFUSED before ACCEPTED); a later one (the same step again) gets ACCEPTED and a
  result with output = input.
- `mute`: reads the job and answers nothing, not even ACCEPTED; sleeps.
- `sleep`: ACCEPTED, then a result after the input's `ms`.
- `stderr_cut_secret`: ACCEPTED, a stderr line whose 1024-byte cut falls 8 bytes into its
  (first) secret, then stderr bytes whose last input `tail` bytes start 6 bytes before the
  secret's end, and a crash (exit 3, no terminal).
- `burst_exit`: ACCEPTED, then the input's `heartbeats` (default 3000) HEARTBEAT events and
  a result with output `{"burst": n}`, all in one write, and exits 0 at once (without
  waiting for EOF, as an SDK does after its `max_jobs_per_process`-th job).
- `print_hang`: ACCEPTED, then a line of text on its stdout (as a stray `print` would write it),
  then sleeps (no terminal: ended by a cancel or a timeout).
- `previous_id`: ACCEPTED, then a result with output = input under the job id of the job
  this process served before (this job's own id on a process's first job): an executor
  answering each job with the previous one's job_id.
- `all_previous_id`: ACCEPTED and a result with output = input, both under the previous job's id
  (this job's own on a process's first job).
- `stderr_chatty`: ACCEPTED, writes `secret <values>` (every secret value it
  got) and then `chatter <i>` for i in 1..=input's `lines` (default 2000) to
  stderr as fast as it can, then a result with output `{"lines": n + 1}`.

Environment: HOSTILE_DEAF (set: after the hello the process never reads its stdin, and
sleeps), HOSTILE_EXIT_AFTER_HELLO (set: the process exits 0 right after its hello),
HOSTILE_STOP_AFTER_HELLO (set: the process SIGSTOPs itself right after its hello),
HOSTILE_IGNORE_TERM (set: SIGTERM is ignored from the hello on), HOSTILE_LINGER (set:
neither EOF on stdin nor a Shutdown ends the process; it sleeps),
HOSTILE_SLOW_HELLO_FILE (a file: while it exists, a process sleeps the milliseconds it
holds before its hello: a slow start), HOSTILE_SLOW_AFTER_HELLO_MS (the process sleeps that long after its hello before it
reads its first job: an unresponsive one), HOSTILE_WRITE_AFTER_HELLO_MS (a thread writes
bytes that are no frame to stdout that long after the hello, while the process waits
for its first job), HOSTILE_SPAWN_LOG (a file: one line appended per process start),
HOSTILE_PROTOCOL_VERSION (the hello's version, default 1; a file named by
HOSTILE_PROTOCOL_VERSION_FILE, read at each start, overrides it), HOSTILE_KINDS
(comma separated kinds offered; default every mode above; a file named by
HOSTILE_KINDS_FILE, read at each start, overrides it: empty, no kinds). Protocol 1.1:
HOSTILE_VERSIONS_FILE (a file read at each start: its comma separated content
is the hello's protocol_versions; absent file or variable: none, a 1.0 hello),
HOSTILE_MAX_FRAME_BYTES (the hello's max_frame_bytes), HOSTILE_JOBS (the jobs one process
serves, default 1: the hello's max_jobs_per_process), HOSTILE_JOB_LOG (a file:
one line `<kind> <max_frame_bytes> <negotiated_version>` appended per job
received).
"""

import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "executors-python"))

from durable_executor._gen.durable.executor.v1 import executor_pb2 as pb  # noqa: E402
from durable_executor.framing import encode_frame, read_frame, write_frame  # noqa: E402

MODES = [
    "refuse_bad_input",
    "refuse_retryable",
    "nul_error",
    "nul_event",
    "nul_output",
    "huge_number_output",
    "huge_number_details",
    "duplicate_key_output",
    "chatty",
    "huge_retry_delay",
    "echo",
    "secret_echo",
    "garbage_secret",
    "stderr_chatty",
    "panic",
    "escape",
    "close_stdout",
    "secret_memory",
    "late_frame",
    "late_frame_thread",
    "stray_thread",
    "stray_bytes",
    "refuse_once",
    "crash_at_once",
    "mute",
    "checkpoint_flood",
    "sleep",
    "stderr_cut_secret",
    "burst_exit",
    "print_hang",
    "previous_id",
    "all_previous_id",
]


def _cgroup2_root() -> str | None:
    """Where the cgroup v2 hierarchy is mounted (None: no v2 mount)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == "cgroup2":
                return left.split(" ")[4]
    return None


def main() -> int:
    log = os.environ.get("HOSTILE_SPAWN_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    kinds = os.environ.get("HOSTILE_KINDS")
    kinds_file = os.environ.get("HOSTILE_KINDS_FILE")
    if kinds_file and os.path.exists(kinds_file):
        with open(kinds_file) as f:
            kinds = f.read().strip() or ","  # empty: a hello with no kinds
    versions: list[str] = []
    versions_file = os.environ.get("HOSTILE_VERSIONS_FILE")
    if versions_file and os.path.exists(versions_file):
        with open(versions_file) as f:
            versions = [v for v in f.read().strip().split(",") if v]
    protocol_version = int(os.environ.get("HOSTILE_PROTOCOL_VERSION", "1"))
    version_file = os.environ.get("HOSTILE_PROTOCOL_VERSION_FILE")
    if version_file and os.path.exists(version_file):
        with open(version_file) as f:
            protocol_version = int(f.read().strip())
    jobs = int(os.environ.get("HOSTILE_JOBS", "1"))
    hello = pb.ExecutorFrame(
        hello=pb.Hello(
            protocol_version=protocol_version,
            executor_kind="hostile",
            kinds=[k for k in kinds.split(",") if k] if kinds else ["hostile." + m for m in MODES],
            sdk_name="hostile",
            sdk_version="0",
            max_jobs_per_process=jobs,
            pid=os.getpid(),
            protocol_versions=versions,
            max_frame_bytes=int(os.environ.get("HOSTILE_MAX_FRAME_BYTES", "0")),
        )
    )
    slow_hello = os.environ.get("HOSTILE_SLOW_HELLO_FILE")
    if slow_hello and os.path.exists(slow_hello):
        with open(slow_hello) as f:
            time.sleep(int(f.read().strip() or "0") / 1000)  # a slow start
    write_frame(out, hello.SerializeToString())
    if os.environ.get("HOSTILE_EXIT_AFTER_HELLO"):
        return 0  # a crash right after the hello, before any job
    if os.environ.get("HOSTILE_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("HOSTILE_STOP_AFTER_HELLO"):
        os.kill(os.getpid(), signal.SIGSTOP)  # until a SIGCONT
    stray_ms = int(os.environ.get("HOSTILE_WRITE_AFTER_HELLO_MS", "0"))
    if stray_ms:

        def write_stray() -> None:
            time.sleep(stray_ms / 1000)
            out.write(b"\xffstray bytes while idle\n")

        threading.Thread(target=write_stray, daemon=True).start()
    slow_ms = int(os.environ.get("HOSTILE_SLOW_AFTER_HELLO_MS", "0"))
    if slow_ms:
        time.sleep(slow_ms / 1000)  # unresponsive, then reads its job
    if os.environ.get("HOSTILE_DEAF"):
        time.sleep(3600)  # never reads its stdin
        return 0
    seen_secrets: list[str] = []
    refused_steps: set[str] = set()
    stray_owed = False
    previous_job_id = ""
    linger = bool(os.environ.get("HOSTILE_LINGER"))
    for _ in range(jobs):
        raw = read_frame(inp)
        frame = pb.SupervisorFrame()
        if raw is not None:
            frame.ParseFromString(raw)
        if raw is None or frame.WhichOneof("frame") != "job":
            if linger:
                time.sleep(3600)  # neither EOF nor a Shutdown ends it
            return 0
        job = frame.job
        if stray_owed:
            stray_owed = False
            # a whole frame of 3 bytes that are no protobuf message
            out.write(b"\x03\xff\xff\xff")
        seen_secrets.extend(v for v in job.secrets.values() if v not in seen_secrets)
        job_log = os.environ.get("HOSTILE_JOB_LOG")
        if job_log:
            with open(job_log, "a") as f:
                f.write(f"{job.kind} {job.max_frame_bytes} {job.negotiated_version or '-'}\n")
        mode = job.kind.removeprefix("hostile.")
        seq = 0

        def send(**kw) -> None:
            write_frame(out, pb.ExecutorFrame(**kw).SerializeToString())

        def event(kind, message="") -> None:
            nonlocal seq
            seq += 1
            send(event=pb.ProgressEvent(job_id=job.job_id, sequence=seq, kind=kind, message=message))

        def error(code, message, retryable, details=b"", delay=None) -> None:
            nonlocal seq
            seq += 1
            e = pb.JobError(
                job_id=job.job_id, sequence=seq, code=code, message=message, retryable=retryable, details=details
            )
            if delay is not None:
                e.next_retry_delay_ms = delay
            send(error=e)

        def result(output: bytes) -> None:
            nonlocal seq
            seq += 1
            send(result=pb.JobResult(job_id=job.job_id, sequence=seq, output=output))

        if mode == "refuse_bad_input":
            error("BAD_INPUT", "this input can never work", False)
        elif mode == "refuse_retryable":
            error("TEMPORARILY_UNAVAILABLE", "not now", True)
        elif mode == "nul_error":
            event(pb.EVENT_KIND_ACCEPTED)
            error("BOOM", "before\x00after", True)
        elif mode == "nul_event":
            event(pb.EVENT_KIND_ACCEPTED)
            event(pb.EVENT_KIND_PROGRESS, "half\x00way")
            result(b'{"ok": true}')
        elif mode == "nul_output":
            event(pb.EVENT_KIND_ACCEPTED)
            result(b'{"text": "a\\u0000b"}')
        elif mode == "huge_number_output":
            event(pb.EVENT_KIND_ACCEPTED)
            result(b'{"n": [1, 1e999999]}')
        elif mode == "duplicate_key_output":
            event(pb.EVENT_KIND_ACCEPTED)
            result(b'{"a": 1, "b": {"x": 1, "x": 2}}')
        elif mode == "huge_number_details":
            event(pb.EVENT_KIND_ACCEPTED)
            error("BIG", "details beyond numeric", False, details=b'{"n": 1e999999, "ok": 2}')
        elif mode == "chatty":
            event(pb.EVENT_KIND_ACCEPTED)
            while True:
                event(pb.EVENT_KIND_PROGRESS, "chatter")
        elif mode == "huge_retry_delay":
            event(pb.EVENT_KIND_ACCEPTED)
            error("LATER", "retry much later", True, delay=2**64 - 1)
        elif mode == "escape":
            # a child that leaves the process group (setsid) and the attempt's
            # cgroup (into the cgroup v2 root, as root may), then sleeps
            child = os.fork()
            if child == 0:
                os.setsid()
                root = _cgroup2_root()
                if root:
                    try:
                        with open(os.path.join(root, "cgroup.procs"), "w") as f:
                            f.write(str(os.getpid()))
                    except OSError:
                        pass
                time.sleep(120)
                os._exit(0)
            escape_log = os.environ.get("HOSTILE_ESCAPE_LOG")
            if escape_log:
                with open(escape_log, "a") as f:
                    f.write(f"{child}\n")
            event(pb.EVENT_KIND_ACCEPTED)
            time.sleep(0.2)  # the child has left by now
            result(job.input or b"null")
        elif mode in ("echo", "panic"):
            event(pb.EVENT_KIND_ACCEPTED)
            result(job.input or b"null")
        elif mode == "garbage_secret":
            event(pb.EVENT_KIND_ACCEPTED)
            write_frame(out, b"\xff\xff" + " ".join(job.secrets.values()).encode())
            time.sleep(5)
        elif mode == "secret_echo":
            event(pb.EVENT_KIND_ACCEPTED)
            values = " ".join(job.secrets.values())
            event(pb.EVENT_KIND_PROGRESS, "progress " + values)
            details = json.dumps({"leak": values, "dsn": "host=db password=hunter2x user=u"}).encode()
            error("LEAK", "error " + values + " postgres://u:pw123456@h/db", True, details=details)
        elif mode == "close_stdout":
            event(pb.EVENT_KIND_ACCEPTED)
            out.close()  # the protocol's only handle on the pipe (fd 1 is stderr's)
            time.sleep(0.05)
            return 0
        elif mode == "stderr_chatty":
            event(pb.EVENT_KIND_ACCEPTED)
            n = int(json.loads(job.input or b"{}").get("lines", 2000))
            err = sys.stderr
            err.write("secret " + " ".join(job.secrets.values()) + "\n")
            for i in range(1, n + 1):
                err.write(f"chatter {i}\n")
            err.flush()
            result(json.dumps({"lines": n + 1}).encode())
        elif mode == "secret_memory":
            # every secret value this process was handed, by any of its jobs
            event(pb.EVENT_KIND_ACCEPTED)
            result(json.dumps({"seen": " ".join(seen_secrets)}).encode())
        elif mode == "previous_id":
            # this job's ACCEPTED, then its result under the previous job's id
            event(pb.EVENT_KIND_ACCEPTED)
            seq += 1
            answer_to = previous_job_id or job.job_id
            send(result=pb.JobResult(job_id=answer_to, sequence=seq, output=job.input or b"{}"))
        elif mode == "all_previous_id":
            # every frame of this job under the previous job's id
            answer_to = previous_job_id or job.job_id
            seq += 1
            send(event=pb.ProgressEvent(job_id=answer_to, sequence=seq, kind=pb.EVENT_KIND_ACCEPTED))
            seq += 1
            send(result=pb.JobResult(job_id=answer_to, sequence=seq, output=job.input or b"{}"))
        elif mode == "late_frame_thread":
            event(pb.EVENT_KIND_ACCEPTED)
            result(b'{"late": true}')
            late = encode_frame(
                pb.ExecutorFrame(
                    event=pb.ProgressEvent(
                        job_id=job.job_id, sequence=seq + 1, kind=pb.EVENT_KIND_PROGRESS, message="late"
                    )
                ).SerializeToString()
            )
            delay = json.loads(job.input or b"{}").get("delay_ms", 0) / 1000

            def write_late(frame: bytes = late, after: float = delay) -> None:
                time.sleep(after)
                out.write(frame)  # one write: whole between the main thread's frames

            threading.Thread(target=write_late, daemon=True).start()
        elif mode == "stray_thread":
            event(pb.EVENT_KIND_ACCEPTED)
            result(b'{"stray": true}')
            spec = json.loads(job.input or b"{}")
            pause = spec.get("delay_ms", 0) / 1000
            # short: a 5-byte "frame" of which 4 bytes come, completed by
            # whatever the process writes next (the next job's own frame)
            stray = b"\x05GARB" if spec.get("short") else b"\xffgarbage printed after a terminal\n"
            if spec.get("empty_frame"):
                stray = b"\x00"  # a whole frame: an empty message, of no known kind

            def write_stray(after: float = pause) -> None:
                time.sleep(after)
                out.write(stray)

            threading.Thread(target=write_stray, daemon=True).start()
        elif mode == "late_frame":
            # a result, then (after the input's delay_ms) a progress event of
            # the same job: a frame after its terminal
            event(pb.EVENT_KIND_ACCEPTED)
            result(b'{"late": true}')
            time.sleep(json.loads(job.input or b"{}").get("delay_ms", 0) / 1000)
            event(pb.EVENT_KIND_PROGRESS, "after the terminal")
        elif mode == "stderr_cut_secret":
            # a stderr line whose cut (at 1024 bytes) falls 8 bytes into the
            # secret, then a crash whose stderr tail (the input's tail bytes)
            # starts 6 bytes before the secret's end
            event(pb.EVENT_KIND_ACCEPTED)
            secret = next(iter(job.secrets.values()))
            tail = int(json.loads(job.input or b"{}").get("tail", 64))
            err = sys.stderr
            err.write("A" * (1024 - 8) + secret + "B" * 20 + "\n")
            err.write("Z" * 10 + secret + "Y" * (tail - 6))
            err.flush()
            os._exit(3)
        elif mode == "sleep":
            event(pb.EVENT_KIND_ACCEPTED)
            time.sleep(json.loads(job.input or b"{}").get("ms", 0) / 1000)
            result(b'{"slept": true}')
        elif mode == "checkpoint_flood":
            # PROGRESS events with a checkpoint of the input's `size` bytes,
            # back to back, for the input's `ms`; then a result counting them
            event(pb.EVENT_KIND_ACCEPTED)
            cfg = json.loads(job.input or b"{}")
            until = time.monotonic() + cfg.get("ms", 1000) / 1000
            n = 0
            count = cfg.get("count")
            while time.monotonic() < until and (count is None or n < count):
                n += 1
                seq += 1
                blob = (b"%08d" % n) * (cfg.get("size", 1024) // 8)
                send(event=pb.ProgressEvent(job_id=job.job_id, sequence=seq, kind=pb.EVENT_KIND_PROGRESS,
                                            message=f"checkpoint {n}", checkpoint=blob))
            if count is not None:
                time.sleep(3600)  # deaf and silent: ended by a timeout or a cancel
            result(json.dumps({"checkpoints": n}).encode())
        elif mode == "burst_exit":
            # a pipe's worth and more of frames, the result behind them, in
            # one write; then gone before the supervisor reads any of it
            event(pb.EVENT_KIND_ACCEPTED)
            n = int(json.loads(job.input or b"{}").get("heartbeats", 3000))
            burst = bytearray()
            for _ in range(n):
                seq += 1
                burst += encode_frame(pb.ExecutorFrame(event=pb.ProgressEvent(
                    job_id=job.job_id, sequence=seq, kind=pb.EVENT_KIND_HEARTBEAT)).SerializeToString())
            seq += 1
            burst += encode_frame(pb.ExecutorFrame(result=pb.JobResult(
                job_id=job.job_id, sequence=seq, output=json.dumps({"burst": n}).encode())).SerializeToString())
            out.write(bytes(burst))
            os._exit(0)
        elif mode == "print_hang":
            event(pb.EVENT_KIND_ACCEPTED)
            out.write(b"debug: hello from the handler\n")
            time.sleep(3600)
        elif mode == "mute":
            time.sleep(3600)  # reads the job, answers nothing (SIGTERM ends it)
        elif mode == "stray_bytes":
            # a result, then bytes that are no whole frame (a stray print)
            event(pb.EVENT_KIND_ACCEPTED)
            result(b'{"stray": true}')
            if json.loads(job.input or b"{}").get("on_next_job"):
                stray_owed = True
            else:
                out.write(b"\xffGARBAGE between jobs\n")
        elif mode == "crash_at_once":
            os._exit(3)
        elif mode == "refuse_once":
            if job.step_run_id not in refused_steps:
                refused_steps.add(job.step_run_id)
                error("EXECUTOR_REFUSED", "not this time", True)
            else:
                event(pb.EVENT_KIND_ACCEPTED)
                result(job.input or b"{}")
        else:
            error("BAD_INPUT", "unknown mode " + mode, False)
        previous_job_id = job.job_id
    # wait for EOF / shutdown, as an executor should
    while True:
        raw = read_frame(inp)
        if raw is None:
            return 0
        time.sleep(0)


if __name__ == "__main__":
    sys.exit(main())
