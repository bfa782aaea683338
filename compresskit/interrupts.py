"""Stopping a run cleanly on SIGINT and SIGTERM.

Ctrl-C, a scheduler's or container's SIGTERM, and a SIGINT sent to a process that inherited
SIGINT as ignored (a background job of a shell script) all end a run the same way: the signal
raises :class:`Interrupted` (a ``KeyboardInterrupt``) in the main thread, training stages write a
checkpoint at the last finished step, the staging directory stays, and the CLI exits with
``128 + signal number`` (130 for SIGINT, 143 for SIGTERM). The same command resumes the run.

Code that must not be cut in half (an optimiser step and its bookkeeping) runs inside
:func:`deferred`: a signal that arrives there is raised when the block ends.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal; ``exit_code`` is what the CLI returns (128 + signal number)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


_depth = 0
_pending: int | None = None


def _handler(signum, frame) -> None:
    global _pending
    if _depth:
        _pending = signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT / SIGTERM (when :func:`handle_signals` is active) until the block ends."""
    global _depth, _pending
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _pending is not None:
            signum, _pending = _pending, None
            raise Interrupted(signum)


@contextlib.contextmanager
def handle_signals() -> Iterator[None]:
    """Route SIGTERM and SIGINT (also when it was inherited as ignored) to :class:`Interrupted`
    for the duration of the block; the previous handlers are put back afterwards."""
    global _pending
    wanted = (signal.SIGINT, signal.SIGTERM)
    try:
        previous = {s: signal.signal(s, _handler) for s in wanted}
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    _pending = None
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
