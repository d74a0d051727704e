"""pyproject.toml says what is true: the Python tested, the licence, no dependency."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_requires_python_is_what_the_tests_run_on():
    m = re.fullmatch(r">=(\d+)\.(\d+)", PROJECT["requires-python"])
    assert m, PROJECT["requires-python"]
    lowest = (int(m.group(1)), int(m.group(2)))
    assert lowest == (3, 11)  # scripts/setup's venv; asyncio.Runner needs 3.11
    assert sys.version_info[:2] >= lowest
    assert f"Programming Language :: Python :: {lowest[0]}.{lowest[1]}" in PROJECT["classifiers"]
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert ruff["target-version"] == f"py{lowest[0]}{lowest[1]}"


def test_licence_is_the_workspaces():
    cargo = tomllib.loads((ROOT.parent / "Cargo.toml").read_text())
    assert PROJECT["license"] == cargo["workspace"]["package"]["license"] == "Apache-2.0"


def test_no_runtime_dependency_and_typed():
    assert PROJECT["dependencies"] == []
    assert "Typing :: Typed" in PROJECT["classifiers"]
    assert (ROOT / "durable_executor" / "py.typed").is_file()
