#!/usr/bin/env python3
"""Start-up to hello: spawn executors, time process start -> the whole hello frame.

Usage (from executors-python/, with the real interpreter, never a pyenv shim)::

    ../.venv/bin/python tools/startup_bench.py [-n 20] ['CMD ...' ...]

Each CMD is one shell-split command line; the default is this interpreter running
demo_executor.py. With several commands the runs are interleaved (A B A B ...) so
that machine load affects all alike. For each command it prints the median, min and
max wall time from just before fork/exec until the hello frame (its varint length
and whole body) has been read from the child's stdout, and the child's CPU time
(user + sys, its whole life: it exits at once since stdin is closed after the hello).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def once(cmd: list[str]) -> tuple[float, float]:
    """(wall ms to the whole hello, the child's user+sys CPU ms over its life)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    assert proc.stdout is not None and proc.stdin is not None
    out = proc.stdout
    length = shift = 0
    while True:
        b = out.read(1)
        if not b:
            raise RuntimeError(f"EOF before the hello: {cmd}")
        length |= (b[0] & 0x7F) << shift
        shift += 7
        if not b[0] & 0x80:
            break
    got = 0
    while got < length:
        chunk = out.read(length - got)
        if not chunk:
            raise RuntimeError(f"EOF inside the hello: {cmd}")
        got += len(chunk)
    elapsed = time.perf_counter() - t0
    proc.stdin.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    out.close()
    return elapsed * 1000.0, (usage.ru_utime + usage.ru_stime) * 1000.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-n", type=int, default=20, help="runs per command (default 20)")
    p.add_argument("cmds", nargs="*", metavar="CMD")
    a = p.parse_args()
    cmds = [shlex.split(c) for c in a.cmds] or [
        [sys.executable, os.path.join(HERE, "demo_executor.py")]
    ]
    for cmd in cmds:
        once(cmd)  # warm the page cache and the bytecode caches
    runs: list[list[tuple[float, float]]] = [[] for _ in cmds]
    for _ in range(a.n):
        for i, cmd in enumerate(cmds):
            runs[i].append(once(cmd))
    for cmd, results in zip(cmds, runs, strict=True):
        wall = [r[0] for r in results]
        cpu = [r[1] for r in results]
        print(
            f"hello after: median {statistics.median(wall):.1f} ms "
            f"(min {min(wall):.1f}, max {max(wall):.1f}); child CPU: median "
            f"{statistics.median(cpu):.1f} ms (min {min(cpu):.1f})  [{shlex.join(cmd)}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
