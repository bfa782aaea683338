"""Progress reporting without a UI dependency.

Library code reports long steps through a :class:`Progress`; the CLI plugs in a rich
implementation (``compresskit.report.RichProgress``) on a terminal and a plain, stable
line-per-step one elsewhere. The default does nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator


class Task:
    """One long step. ``advance(n)`` moves it on; ``update(**fields)`` sets text shown beside it."""

    def advance(self, n: float = 1) -> None:
        pass

    def update(self, **fields: object) -> None:
        pass


class Progress:
    """No-op progress: the library default."""

    @contextlib.contextmanager
    def task(self, description: str, total: float | None = None) -> Iterator[Task]:
        yield Task()

    def log(self, message: str) -> None:
        pass


def _fields(fields: dict[str, object]) -> str:
    """`` k=v`` for each field, a float to 4 significant digits (a loss of 8.584, not 8.584386825561523)."""
    return "".join(f" {k}={v:.4g}" if isinstance(v, float) else f" {k}={v}" for k, v in fields.items())


HEARTBEAT_S = 30.0  # off a terminal, a running step prints a line at least this often (as it advances)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class _PlainTask(Task):
    """A step of :class:`PlainProgress`: each ``advance`` or ``update`` at least ``interval`` seconds after the
    last line prints one: done and total, rate, ETA and the fields set so far."""

    def __init__(self, progress: PlainProgress, description: str, total: float | None) -> None:
        self.progress, self.description, self.total = progress, description, total
        self.done = 0.0
        self.fields: dict[str, object] = {}
        self.t0 = self.last = progress.clock()

    def advance(self, n: float = 1) -> None:
        self.done += n
        self._beat()

    def update(self, **fields: object) -> None:
        self.fields.update(fields)
        self._beat()

    def _beat(self) -> None:
        now = self.progress.clock()
        if now - self.last < self.progress.interval:
            return
        self.last = now
        elapsed = max(now - self.t0, 1e-9)
        rate = self.done / elapsed
        if not self.total and not self.done:  # a step that counts nothing: alive, and for how long
            parts = ["still running"]
        else:
            parts = [
                f"{self.done:g}/{self.total:g} ({100 * self.done / self.total:.0f}%)"
                if self.total
                else f"{self.done:g}"
            ]
            parts.append(f"{rate:.3g}/s" if rate >= 1 else f"{1 / rate:.3g} s each" if rate > 0 else "none done yet")
            if self.total and rate > 0:
                parts.append(f"ETA {_duration(max(self.total - self.done, 0) / rate)}")
        parts.append(f"{_duration(elapsed)} so far")
        extra = _fields(self.fields)
        self.progress.log(f"{self.description}: {', '.join(parts)}{extra}")


class PlainProgress(Progress):
    """Stable text for logs and pipes: one line when a step starts and one when it ends, and while it runs a
    line at least every ``interval`` seconds (``HEARTBEAT_S``): done and total, rate and ETA. ``clock``: the
    time source (tests give a fake one, with ``tick`` off)."""

    def __init__(self, stream=None, *, interval: float = HEARTBEAT_S, clock=time.monotonic, tick: bool = True) -> None:
        self.stream = stream or sys.stderr
        self.interval = interval
        self.clock = clock
        self.tick = tick  # the thread that prints for a step that does not advance (tests with a fake clock: off)

    def _tick(self, task: _PlainTask, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            task._beat()

    @contextlib.contextmanager
    def task(self, description: str, total: float | None = None) -> Iterator[Task]:
        print(f"[compresskit] {description} ...", file=self.stream, flush=True)
        task = _PlainTask(self, description, total)
        # a step that does not advance for a while (one long call) still says it is alive: a thread wakes every
        # interval and prints where the step stands unless an advance printed since
        stop = threading.Event()
        ticker = None
        if self.tick:
            ticker = threading.Thread(target=self._tick, args=(task, stop), daemon=True)
            ticker.start()
        try:
            yield task
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
        extra = _fields(task.fields)
        print(
            f"[compresskit] {description}: done in {self.clock() - task.t0:.1f}s{extra}", file=self.stream, flush=True
        )

    def log(self, message: str) -> None:
        print(f"[compresskit] {message}", file=self.stream, flush=True)
