"""_fastjson returns exactly what json does (values, text and errors), without
importing json on the plain path; and a job's whole path (input, output, the
reader thread, the cancel flag) imports neither json nor threading."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest

from durable_executor import _fastjson

VALUES = [
    None,
    True,
    False,
    0,
    -1,
    2**70,
    1.5,
    -0.0,
    1e300,
    3.141592653589793,
    "",
    "plain",
    'quote " backslash \\ slash / nl \n tab \t',
    "unicode é 漢字 🎉",
    "lone surrogate \udcff",
    "\x00\x1f\x7f",
    [],
    {},
    [1, [2, [3, {"a": [None]}]]],
    {"b": 1, "a": 2, "é": {"nested": [1.0, "x"]}},
    {'key with "quote"': "v"},
    (1, 2),
    {1: "int key", 2.5: "float key", None: "none key"},
    {True: "bool key", False: "another"},
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"ensure_ascii": False},
        {"ensure_ascii": False, "allow_nan": False, "separators": (",", ":")},
        {"separators": (",", ":"), "allow_nan": False},
    ],
    ids=["default", "unicode", "compact-unicode", "compact"],
)
def test_dumps_is_json_dumps(value, kwargs):
    assert _fastjson.dumps(value, **kwargs) == json.dumps(value, **kwargs)


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), [float("-inf")], {"x": object()}, {(1, 2): 3}, b"bytes"],
    ids=repr,
)
def test_dumps_errors_are_json_errors(value):
    for kwargs in ({}, {"allow_nan": False}):
        try:
            want: object = json.dumps(value, **kwargs)
        except Exception as e:
            want = (type(e), str(e))
        try:
            got: object = _fastjson.dumps(value, **kwargs)
        except Exception as e:
            got = (type(e), str(e))
        assert got == want, kwargs


def test_dumps_of_a_cycle_is_json_error():
    cycle: list[object] = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="Circular reference detected"):
        _fastjson.dumps(cycle)


TEXTS = [
    b"{}",
    b'  {"a": [1, 2.5, -3e5, true, false, null]}\n',
    b'"x"',
    b"12345678901234567890123",
    b"-0.0",
    '{"é": "漢字"}'.encode(),
    b'"\\ud83c\\udf89 \\u00e9"',
    b'"\\udcff"',
    b"[NaN, Infinity, -Infinity]",
    b'{"a": 1, "a": 2}',
    "\ufeff{}".encode(),
    '{"x": 1}'.encode("utf-16"),
    '{"x": 1}'.encode("utf-32-le"),
    "{}",
    " [1] ",
]


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("text", TEXTS, ids=repr)
def test_loads_is_json_loads(text):
    assert _same(_fastjson.loads(text), json.loads(text))


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"   ",
        b"{",
        b"[1,]",
        b"{} {}",
        b"{'a': 1}",
        b"\xff\xfe\xfd",
        b"tru",
        "\ufeff{}",
        b"[1] x",
    ],
    ids=repr,
)
def test_loads_errors_are_json_errors(text):
    with pytest.raises(ValueError) as want:
        json.loads(text)
    with pytest.raises(ValueError) as got:
        _fastjson.loads(text)
    assert (type(got.value), str(got.value)) == (type(want.value), str(want.value))


SCRIPT = textwrap.dedent(
    """
    import sys
    from durable_executor import Executor

    ex = Executor("python", max_jobs_per_process=2)
    WATCHED = ("json", "threading", "re", "functools", "collections", "enum")

    @ex.handler("echo")
    def echo(job):
        return {"got": job.input, "text": "é \\u2028"}

    @ex.handler("loaded")
    def loaded(job):
        return sorted(m for m in WATCHED if m in sys.modules)

    sys.exit(ex.run())
    """
)


def test_a_job_imports_neither_json_nor_threading(tmp_path):
    from _harness import job_frame, shutdown_frame, which

    from durable_executor import encode_frame, read_frame
    from durable_executor._gen.durable.executor.v1 import executor_pb2 as pb

    script = tmp_path / "ex.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:

        def result_of(frame: pb.SupervisorFrame) -> object:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(encode_frame(frame.SerializeToString()))
            proc.stdin.flush()
            while True:
                body = read_frame(proc.stdout)
                assert body is not None, "the executor ended before the job's terminal"
                f = pb.ExecutorFrame.FromString(body)
                assert which(f) != "error", f
                if which(f) == "result":
                    return json.loads(f.result.output)

        read_frame(proc.stdout)  # the hello
        echoed = result_of(job_frame("echo", {"a": [1, 2.5, None]}, job_id="j1"))
        assert echoed == {"got": {"a": [1, 2.5, None]}, "text": "é \u2028"}
        loaded = result_of(job_frame("loaded", job_id="j2"))
        assert loaded == [], "a job's path imported these modules"
        # its second job was its last (max_jobs_per_process=2): it may have
        # ended already, and the shutdown then meets a closed pipe (a CI
        # run's BrokenPipeError); either way it exits 0
        try:
            proc.stdin.write(encode_frame(shutdown_frame().SerializeToString()))
            proc.stdin.close()
        except BrokenPipeError:
            pass
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
