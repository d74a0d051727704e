"""A test executor (Python SDK) whose jobs leave a writer behind.

Kinds:
  leftover.leave   {"after_ms": N, "how": "path" | "cwd"}: N ms after the job
                   returned, out.txt is written into that job's output_dir: by
                   its path from a thread ("path", the default), or by a child
                   process started in it ("cwd") or in its parent ("parent",
                   writing out/out.txt); returns the dir.
  leftover.victim  {"hold_ms": N}: writes out.txt ("good") into its own
                   output_dir, declares it as an artifact, waits N ms, returns.
Used by tests/tests/persistent.rs: a warm process serves both, one after the
other, and the second job's artifact must be its own bytes.
"""

import os
import subprocess
import sys
import threading
import time

from durable_executor import Executor, Job, Result


def _ms(job: Job, key: str) -> float:
    value = job.input.get(key, 0) if isinstance(job.input, dict) else 0
    return float(value) / 1000.0


def leave(job: Job) -> dict:
    target = job.output_path("out.txt")
    delay = _ms(job, "after_ms")
    how = job.input.get("how") if isinstance(job.input, dict) else None
    if how in ("cwd", "parent"):
        # a child that runs in the job's output_dir (or in its parent) and
        # writes there by a relative path after the job returned
        cwd, name = (
            (job.output_dir, "out.txt") if how == "cwd" else (os.path.dirname(job.output_dir), "out/out.txt")
        )
        subprocess.Popen(
            ["sh", "-c", f"sleep {delay}; for i in 1 2 3 4 5 6; do echo late-child > {name}; sleep 0.2; done"],
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return {"dir": job.output_dir}

    def late() -> None:
        time.sleep(delay)
        try:
            with open(target, "wb") as f:
                f.write(b"written late by an earlier job's thread")
        except OSError as e:
            sys.stderr.write(f"leftover: the late write failed: {e}\n")

    threading.Thread(target=late, daemon=True).start()
    return {"dir": job.output_dir}


def victim(job: Job) -> Result:
    with open(job.output_path("out.txt"), "wb") as f:
        f.write(b"good")
    entry = job.artifact("out.txt", name="out.txt", media_type="text/plain")
    time.sleep(_ms(job, "hold_ms"))
    return Result({"dir": job.output_dir, "pid": os.getpid()}, [entry])


def main() -> int:
    ex = Executor("leftover", {})
    ex.add_handler("leftover.leave", leave)
    ex.add_handler("leftover.victim", victim)
    return ex.run()


if __name__ == "__main__":
    sys.exit(main())
