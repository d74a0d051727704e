#!/usr/bin/env python3
"""The Python demo executor: the demo kinds of proto/PROTOCOL.md ("Demo executors").

Run it as a supervisor child: ``.venv/bin/python executors-python/demo_executor.py``.
Environment:
  DEMO_LABELS  labels offered in Hello, ``k=v,k2=v2`` (default none)
  DEMO_KINDS   kinds offered in Hello, comma separated (default all demo kinds)

Exit status: 0 after a clean end, 1 after a broken frame stream, 2 for a bad
environment, 3 when a demo kind crashes on purpose (as the Go demo executor).

The kinds are in demo_kinds.py beside this file: Python compiles a script at every
start (about 3 ms for the kinds) but caches the bytecode of a module it imports.
"""

import sys

if __name__ == "__main__":
    # sys.path[0] is this file's directory: demo_kinds and, when the SDK is not
    # installed, durable_executor are found beside it.
    from demo_kinds import main

    sys.exit(main())
