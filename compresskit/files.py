"""Files written so that a reader, or a process killed in the middle, never meets half of one.

Every file compresskit writes is written whole beside its place under a temporary name, then renamed
into place (:func:`write_text`, :func:`write_json`); a folder is built beside its place and moved in
(:func:`staged_dir`), or its files renamed in one by one (:func:`staged_files`). A temporary's name
starts with a dot and holds ``.tmp-`` (:func:`temporary_prefix`), so that what a killed process left
is found and removed (:func:`sweep`) by the next process that holds the folder's lock
(:mod:`compresskit.locking`). A write that runs out of disk space says so in one line, with the path
and the space it needs (:func:`disk_space`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from compresskit import crashpoints
from compresskit.errors import ArtifactError, CompressKitError, DiskFullError, RecipeError

TMP_MARK = ".tmp-"  # what the name of every temporary file or folder compresskit writes holds
WRITE_MARGIN_BYTES = 1 << 20  # free space a write leaves beyond what it writes
# what saving a model needs beyond its tensors (the tokenizer's files, the config, the manifest) and a margin
MODEL_FILES_MARGIN_BYTES = 16 << 20


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file in the same folder, then rename)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> None:
    """Write text whole (:func:`write_file`)."""
    data = text.encode()
    write_file(path, lambda tmp: tmp.write_bytes(data), needed=len(data))


def write_file(path: Path, write: Callable[[Path], None], *, needed: int, what: str | None = None) -> None:
    """Write a file whole: ``write(tmp)`` writes it to a temporary beside ``path`` (``torch.save``, safetensors'
    ``save_file``, or text), with ``needed`` bytes and a margin of disk checked (:func:`disk_space`, whose errors
    name it ``what``), then it is renamed to ``path``, with the mode a plain ``open`` would give (0644 under the
    usual umask) where the writer keeps the temporary's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=temporary_prefix(path), dir=path.parent)
    tmp = Path(name)
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())
        finally:
            os.close(fd)
        with disk_space(path.parent, needed + WRITE_MARGIN_BYTES, what or f"writing {path.name}"):
            write(tmp)
        crashpoints.point(f"write {path.name}{f' ({what})' if what else ''}: the temporary file whole, not renamed")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def tensor_bytes(tensors) -> int:
    """Bytes the tensors among ``tensors`` hold (what saving them writes, less the file's header)."""
    return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))


def temporary_prefix(path: Path) -> str:
    """The prefix of a temporary file or folder that is renamed to ``path`` when whole (hidden, and marked
    so that :func:`compresskit.files.sweep` knows it for a leftover)."""
    return f".{Path(path).name}{TMP_MARK}"


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the disk that holds ``path`` (or would hold it: its nearest existing parent)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _out_of_space(exc: BaseException, path: Path) -> bool:
    """Whether the write error ``exc`` means that the disk holding ``path`` is full: an ``ENOSPC`` or
    ``EDQUOT`` error, a library's message of one, or (torch's checkpoint writer says only where its write
    stopped) next to nothing left free there."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    if "No space left" in text or "os error 28" in text or "Disk quota exceeded" in text:
        return True
    try:
        return free_bytes(path) < (1 << 20)
    except OSError:
        return False


@contextlib.contextmanager
def disk_space(path: Path, needed: int, what: str) -> Iterator[None]:
    """Writing ``what`` (about ``needed`` bytes) under ``path``: raise :class:`DiskFullError` before the
    block where the disk has less free, and turn a write error of the block that the disk filled up into
    one; both name the path and the space needed."""
    path = Path(path)

    def full() -> DiskFullError:
        return DiskFullError(
            f"{path}: not enough disk space for {what}: it needs about {_size(needed)}, "
            f"{_size(free_bytes(path))} free there; free some space and run the same command again"
        )

    if free_bytes(path) < needed:
        raise full()
    try:
        yield
    except CompressKitError:
        raise
    except Exception as exc:
        if _out_of_space(exc, path):
            raise full() from None
        raise


def read_json(path: Path, *, what: str = "file") -> Any:
    if not path.is_file():
        raise ArtifactError(f"{path}: {what} not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: {what} is corrupt (not valid JSON: {exc})") from None


def check_creatable(path: Path, field: str) -> None:
    """Raise :class:`RecipeError` naming ``field`` unless ``path`` is a directory that exists or can
    be created, in a parent where a run can stage its outputs beside it. Probes with a temporary
    directory that is removed at once: nothing is left behind."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise RecipeError(f"{field}: {str(path)!r} exists and is not a directory")
    probe = path.absolute().parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise RecipeError(f"{field}: cannot create {str(path)!r}: {str(probe)!r} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".compresskit-probe-", dir=probe))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise RecipeError(
            f"{field}: cannot create {str(path)!r} ({reason} in {str(probe)!r}); choose a writable directory"
        ) from None


def check_replaceable(path: Path, field: str, ours: tuple[str, ...]) -> None:
    """Raise :class:`RecipeError` naming ``field`` where ``path`` is a folder holding files other than
    ``ours`` (what the command writes there, and replaces as one folder): nothing of the user's is lost."""
    path = Path(path).expanduser()
    others = sorted(p.name for p in path.iterdir() if p.name not in ours) if path.is_dir() else []
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise RecipeError(
            f"{field}: {str(path)!r} holds other files than this command writes ({shown}), which writing it "
            f"would remove; give a new or empty folder, or one that holds only {', '.join(ours)}"
        )


def _make_dir(tmp_prefix: str, parent: Path) -> Path:
    """``mkdtemp`` with the mode a plain ``mkdir`` would give (0755 under the usual umask)."""
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def _umask_modes(root: Path) -> None:
    """Give every file under ``root`` the mode a plain ``open`` would (some writers, safetensors
    among them, create 0600 files) and every folder a plain ``mkdir``'s."""
    mask = _umask()
    for path in (root, *root.rglob("*")):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """Build a directory next to ``target`` and move it into place only when the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _make_dir(temporary_prefix(target), target.parent)
    try:
        yield tmp
        _umask_modes(tmp)
        crashpoints.point(f"stage {target.name}: the folder whole, not moved into place")
        replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def staged_files(target: Path) -> Iterator[Path]:
    """Build files in a folder next to ``target``; when the block succeeds, move each into
    ``target`` (one atomic rename per file), leaving every other file of ``target`` as it was."""
    target.mkdir(parents=True, exist_ok=True)
    tmp = _make_dir(temporary_prefix(target), target.parent)
    try:
        yield tmp
        for item in sorted(tmp.iterdir()):
            crashpoints.point(f"stage {target.name}/{item.name}: the file whole, not moved into place")
            os.replace(item, target / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(src: Path, target: Path) -> None:
    """Move ``src`` to ``target``, replacing an existing ``target`` with one rename each (the old one set
    aside under a temporary name, then removed: a reader finds the old folder, none, or the new one,
    never a mix)."""
    if target.exists():
        old = target.with_name(f"{temporary_prefix(target)}old-{os.getpid()}")
        os.replace(target, old)
        crashpoints.point(f"replace {target.name}: the old folder set aside, the new one not yet moved")
        os.replace(src, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, target)


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is a temporary file or folder that compresskit writes and renames into place (what
    a killed process leaves behind)."""
    name = Path(path).name
    return name.startswith(".") and TMP_MARK in name


def sweep(directory: Path) -> list[Path]:
    """Remove the temporaries that killed processes left in ``directory`` (at any depth) and beside it; for
    a folder whose lock the caller holds, where no other process writes. Returns what was removed."""
    directory = Path(directory)
    found = []
    if directory.is_dir():
        found += [p for p in directory.rglob(f".*{TMP_MARK}*") if is_temporary(p)]
    if directory.parent.is_dir():
        found += sorted(directory.parent.glob(f".{directory.name}{TMP_MARK}*"))
    removed = []
    for path in sorted(found, key=lambda p: len(p.parts)):  # (a folder before what is in it)
        if not os.path.lexists(path):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        removed.append(path)
    return removed
