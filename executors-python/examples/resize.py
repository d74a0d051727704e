# examples/resize.py: a handler with input, progress, a checkpoint and an artifact
import sys

from durable_executor import Executor, ExecutorError, Job, Result

ex = Executor(executor_kind="python", labels={"region": "eu"})


@ex.handler("thumbs.resize")
def resize(job: Job) -> Result:
    args = job.input  # parsed JSON (None when empty; BAD_INPUT if invalid)
    if not isinstance(args, dict) or "width" not in args:
        raise ExecutorError("MISSING_WIDTH", "input needs a width", retryable=False)
    done = int(job.checkpoint or b"0")  # an earlier attempt got this far
    for step in range(done, 10):
        job.sleep(0.01)  # raises Cancelled at once when the job is cancelled
        job.progress(f"step {step}", fraction=(step + 1) / 10, checkpoint=b"%d" % (step + 1))
    with open(job.output_path("out.png"), "wb") as f:
        f.write(b"...")
    thumb = job.artifact("out.png", media_type="image/png")
    return Result({"width": args["width"], "resumed_at": done}, [thumb])


if __name__ == "__main__":
    sys.exit(ex.run())
