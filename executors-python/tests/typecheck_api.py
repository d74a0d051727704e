"""Checked by ``mypy --strict`` (scripts/lint), not run by pytest: the public API's
types as a user sees them. An error here means a signature lost its type; an unused
``type: ignore`` means a mistake stopped being caught."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, assert_type

from durable_executor import Artifact, Cancelled, Executor, ExecutorError, Job, Result, wire

ex = Executor("python", {"region": "eu"}, max_jobs_per_process=0, interrupt_on_cancel=True)


@ex.handler("sync")
def sync_handler(job: Job) -> dict[str, int]:
    job.progress("half", fraction=0.5, checkpoint=b"cp")
    entry: Artifact = job.artifact("out.bin", media_type="application/x-test", derived_from=["a"])
    assert entry.size >= 0
    return {"attempt": job.attempt}


@ex.handler("async")
async def async_handler(job: Job) -> str:
    await asyncio.sleep(0)
    return job.kind


@ex.handler("result")
def result_handler(job: Job) -> Result:
    return Result(output_json=b"{}")


def check(job: Job) -> None:
    # The decorator returns the function unchanged, with its own type.
    assert_type(sync_handler(job), dict[str, int])
    coro = async_handler(job)
    _ = assert_type(coro, Coroutine[Any, Any, str])
    coro.close()
    assert_type(result_handler(job), Result)
    assert_type(job.cancelled, bool)
    assert_type(job.checkpoint, bytes | None)
    assert_type(job.time_remaining(), float | None)
    assert_type(ex.hello(), wire.Hello)
    assert_type(ex.run(), int)
    assert issubclass(Cancelled, BaseException)
    job.progress("x", fraction="half")  # type: ignore[arg-type]
    raise ExecutorError("CODE", "message", retryable=False, details={"k": 1})


@ex.handler("wrong")  # type: ignore[type-var]  # a handler takes a Job
def wrong(job: int) -> None:
    pass
