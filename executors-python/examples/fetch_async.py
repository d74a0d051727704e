# examples/fetch_async.py: an async handler, cancelled through its task
import asyncio
import sys

from durable_executor import Executor, Job

ex = Executor(executor_kind="python")


async def fetch_one(url: str) -> int:
    await asyncio.sleep(0.05)  # stands for an HTTP request
    return len(url)


@ex.handler("demo.fetch")
async def fetch(job: Job) -> dict[str, int]:
    urls: list[str] = job.input["urls"]
    try:
        sizes = await asyncio.gather(*(fetch_one(url) for url in urls))
    except asyncio.CancelledError:  # a cancel cancels this task (and gather its children)
        job.progress("cancelled: nothing to clean up")
        raise  # stops because of the cancel: CANCELLED
    return dict(zip(urls, sizes, strict=True))


if __name__ == "__main__":
    sys.exit(ex.run())
