"""Progress reporting without a UI dependency.

Library code reports long steps through a :class:`Progress`; the CLI plugs in a rich
implementation (``compresskit.report.RichProgress``) on a terminal and a plain, stable
line-per-step one elsewhere. The default does nothing.
"""

from __future__ import annotations

import contextlib
import sys
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


class _PlainTask(Task):
    def __init__(self) -> None:
        self.done = 0.0
        self.fields: dict[str, object] = {}

    def advance(self, n: float = 1) -> None:
        self.done += n

    def update(self, **fields: object) -> None:
        self.fields.update(fields)


class PlainProgress(Progress):
    """Stable text for logs and pipes: one line when a step starts and one when it ends."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr

    @contextlib.contextmanager
    def task(self, description: str, total: float | None = None) -> Iterator[Task]:
        print(f"[compresskit] {description} ...", file=self.stream, flush=True)
        t0 = time.perf_counter()
        task = _PlainTask()
        yield task
        extra = "".join(f" {k}={v}" for k, v in task.fields.items())
        print(
            f"[compresskit] {description}: done in {time.perf_counter() - t0:.1f}s{extra}", file=self.stream, flush=True
        )

    def log(self, message: str) -> None:
        print(f"[compresskit] {message}", file=self.stream, flush=True)
