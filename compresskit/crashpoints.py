"""Crash points: the places where the crash campaign (``tests/crash``) kills a run on purpose.

A crash point is a named place between two steps that change files: a temporary file written and not
yet renamed, a model directory built and not yet moved, a training step finished and not yet
checkpointed. Two environment variables drive them, for the process that reads them:

* ``COMPRESSKIT_CRASH_AT=N``: the process kills itself with SIGKILL at the N-th point it passes (1-based),
  as a power cut, the OOM killer or ``kill -9`` would: no handler runs, no ``finally``, no cleanup;
* ``COMPRESSKIT_CRASH_TRACE=FILE``: each point passed appends its name to FILE, one a line (how the
  campaign learns the points of a run before it kills one at each).

With neither set a point costs two lookups in ``os.environ``.
"""

from __future__ import annotations

import os
import signal

AT = "COMPRESSKIT_CRASH_AT"
TRACE = "COMPRESSKIT_CRASH_TRACE"

_passed = 0


def point(name: str) -> None:
    """Mark that the process is at crash point ``name`` (a short, stable description of where)."""
    global _passed
    at, trace = os.environ.get(AT), os.environ.get(TRACE)
    if at is None and trace is None:
        return
    _passed += 1
    if trace:
        with open(trace, "a") as f:
            f.write(" ".join(name.split()) + "\n")
    if at is not None and _passed == int(at):
        os.kill(os.getpid(), signal.SIGKILL)
