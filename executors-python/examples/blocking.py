# examples/blocking.py: a handler blocked in a system call, woken up by a cancel
import subprocess
import sys

from durable_executor import Cancelled, Executor, Job

ex = Executor(executor_kind="python", interrupt_on_cancel=True)


@ex.handler("demo.wait")
def wait(job: Job) -> dict[str, int]:
    child = subprocess.Popen(["sleep", str(job.input or 60)])
    try:  # right away: the interrupt may land in any line after this one
        job.progress(f"waiting for pid {child.pid}")
        return {"exit_status": child.wait()}  # blocked in waitpid(): a cancel raises here
    except Cancelled:
        child.kill()  # clean up, then let it propagate: CANCELLED
        child.wait()
        raise


if __name__ == "__main__":
    sys.exit(ex.run())
