"""The protocol's behaviour scenarios are the supervisor's: ``supervisor
conformance`` (one implementation for every language) runs them against the
demo executor, which passes every one, none skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _harness import DEMO

REPO = Path(__file__).resolve().parents[2]


def supervisor_bin() -> Path:
    """$DURABLE_TEST_SUPERVISOR_BIN (scripts/test sets it after building the binary,
    and then it must exist), else the repository's target/debug/supervisor;
    without either the test is skipped, saying how to build it."""
    env = os.environ.get("DURABLE_TEST_SUPERVISOR_BIN")
    if env:
        path = Path(env)
        assert path.exists(), (
            f"DURABLE_TEST_SUPERVISOR_BIN={env} does not exist "
            "(scripts/test builds it with `cargo build --workspace --bins`)"
        )
        return path
    path = REPO / "target" / "debug" / "supervisor"
    if not path.exists():
        pytest.skip(
            f"the supervisor binary {path} is absent: build it with `cargo build -p supervisor` "
            "(scripts/test does) to run `supervisor conformance` against the demo executor"
        )
    return path


def test_the_demo_executor_passes_supervisor_conformance(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(
        "db_max_connections = 4\nhandshake_timeout_ms = 5000\n\n[[executors]]\n"
        f'name = "python-demo"\ncommand = {json.dumps(sys.executable)}\n'
        f"args = [{json.dumps(str(DEMO))}]\nconcurrency = 1\n"
    )
    proc = subprocess.run(
        [str(supervisor_bin()), "conformance", "--config", str(config), "--json"],
        capture_output=True,
        env={**os.environ, "RUST_LOG": "warn"},
        timeout=300,
        check=False,
    )
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"no JSON (exit {proc.returncode}): {proc.stdout!r}\n{proc.stderr.decode()}")
    [got] = report["executors"]
    assert got["executor"] == "python-demo"
    assert len(got["scenarios"]) == len(report["scenarios"]) >= 12
    failed = [s for s in got["scenarios"] if s["result"] != "pass"]
    assert not failed, failed
    assert report["passed"] and got["passed"]
    assert proc.returncode == 0, proc.stderr.decode()
