"""Locks on the folders compresskit writes, so that two processes never write one folder at once.

A command that writes a folder (``apply``'s ``output.dir`` with its ``.partial`` staging folder,
``eval --output``, ``bench --output``, ``compare --output``) holds :func:`hold` on it for its whole
life. The lock is an OS file lock (``filelock``; ``flock`` on POSIX) on ``.<name>.lock`` beside the
folder, and ``.<name>.lock.json`` beside it says who holds it: pid, host, start time and command. The
OS lets go of the lock when its process ends, however it ends, so a run killed with SIGKILL leaves
no lock behind, only its owner file: the next run takes the lock, finds that file, and says whose
work it takes over.

Caches that several processes fill at once (a converted model) take :func:`waiting` instead: the
second process waits for the first and then finds the work done.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from compresskit.errors import OutputLockedError
from compresskit.files import temporary_prefix, write_json


def lock_files(directory: Path) -> tuple[Path, Path]:
    """The lock file and the owner file of ``directory`` (beside it, in its real parent folder, so that two
    spellings of one folder share them)."""
    directory = Path(directory).expanduser().absolute()
    parent = directory.parent.resolve()
    return parent / f".{directory.name}.lock", parent / f".{directory.name}.lock.json"


def _owner() -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["compresskit", *sys.argv[1:]]) if sys.argv and sys.argv[0] else "",
    }


def read_owner(path: Path) -> dict | None:
    """The owner record in ``path``, or None where there is none (or it cannot be read)."""
    try:
        owner = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def describe(owner: dict | None) -> str:
    """``pid 123 on host h, started 2026-12-07T15:43:08+00:00: compresskit apply r.yaml`` (or what is known)."""
    if owner is None:
        return "a process that has not yet written its owner record"
    text = f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started {owner.get('started', '?')}"
    return f"{text}: {owner['command']}" if owner.get("command") else text


@contextlib.contextmanager
def hold(directory: Path, *, field: str, progress=None) -> Iterator[dict | None]:
    """Hold the lock on ``directory`` for the block, or raise :class:`OutputLockedError` (one line naming
    ``field``, the folder and the process that holds it) at once. Yields the owner record of a process
    that held it and stopped without letting go (killed, or its machine down), None otherwise; that
    process's work is the caller's to take over (``progress`` logs a line saying so)."""
    directory = Path(directory).expanduser().absolute()
    lock_path, owner_path = lock_files(directory)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise OutputLockedError(
            f"{field}: {directory} is being written by another compresskit process "
            f"({describe(read_owner(owner_path))}); wait for it to finish, or choose another folder"
        ) from None
    try:
        for tmp in owner_path.parent.glob(f"{temporary_prefix(owner_path)}*"):  # (a killed process's half record)
            tmp.unlink(missing_ok=True)
        stale = read_owner(owner_path)
        if stale is not None and progress is not None:
            progress.log(f"{field}: the process that held {directory} ({describe(stale)}) is gone; taking over")
        write_json(owner_path, _owner())
        yield stale
    finally:
        with contextlib.suppress(OSError):
            owner_path.unlink()
        lock.release()


@contextlib.contextmanager
def waiting(path: Path, what: str, progress=None) -> Iterator[None]:
    """Hold the lock ``<path>.lock`` for the block, waiting for another process that holds it (``what``,
    e.g. ``converting smollm2-135m``, is logged while it waits)."""
    lock_path = Path(path).with_name(f".{Path(path).name}.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        if progress is not None:
            progress.log(f"waiting for another process {what}")
        lock.acquire(timeout=-1)
    try:
        yield
    finally:
        lock.release()
