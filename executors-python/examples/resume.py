# examples/resume.py: a step that resumes where the previous attempt's checkpoint says
import sys
from typing import Any

from durable_executor import Executor, Job

ex = Executor(executor_kind="python")
ROWS = 10


@ex.handler("rows.import")
def import_rows(job: Job) -> dict[str, Any]:
    state = job.checkpoint_json(default={"next": 0})  # None or absent: start at row 0
    start = int(state["next"])
    for row in range(start, ROWS):
        job.sleep(0.01)  # ... import row (keyed on job.idempotency_key and row) ...
        # after a crash, a timeout or a lost worker the next attempt continues here
        job.save_checkpoint_json({"next": row + 1}, "imported a row", fraction=(row + 1) / ROWS)
    return {"resumed_at": start}


if __name__ == "__main__":
    sys.exit(ex.run())
