"""User-facing errors.

Every error a user can cause by what they wrote (a recipe, a CLI flag, a path) is a
:class:`CompressKitError`; the CLI prints its message on one line and exits with code 2.
Anything else is an internal error (exit code 1).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(given: str, allowed: Iterable[str], *, what: str = "value") -> str:
    """Format "'x' is not a known <what>. Did you mean: y? Available: a, b, c"."""
    allowed = sorted(set(allowed))
    close = difflib.get_close_matches(given, allowed, n=3, cutoff=0.6)
    msg = f"unknown {what} {given!r}."
    if close:
        msg += f" Did you mean: {', '.join(close)}?"
    msg += f" Available: {', '.join(allowed) if allowed else '(none installed)'}"
    return msg


class CompressKitError(Exception):
    """Base class of errors caused by user input (exit code 2)."""

    exit_code = 2


class RecipeError(CompressKitError, ValueError):
    """A recipe (or a --set override) is malformed or has an invalid value."""


class RecipeProblems(RecipeError):
    """Several problems of one recipe, found together (``compresskit validate`` lists them all); the CLI
    prints one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


class PluginNotFoundError(CompressKitError, KeyError):
    """No plugin of that name is installed in the group asked for."""

    def __str__(self) -> str:  # KeyError quotes its message; we don't want that
        return str(self.args[0]) if self.args else ""


class PluginLoadError(CompressKitError, ImportError):
    """A plugin is installed but failed to import."""


class TargetNotFoundError(CompressKitError, ValueError):
    """A pruner's targets matched no module of the model."""


class ModelNotFoundError(CompressKitError, FileNotFoundError):
    """A model path, alias or hub id could not be resolved to weights on this machine."""


class ArtifactError(CompressKitError, ValueError):
    """A saved model or checkpoint is missing, incomplete or corrupt."""


class KernelUnavailableError(CompressKitError, RuntimeError):
    """An executor cannot run on this machine (no CUDA, no Triton, unsupported dtype or shape)."""


class RuntimeUnsupportedError(CompressKitError):
    """The inference runtime cannot run this model as it is: a model type it does not know, or routed modules
    whose method gives no runtime block for them (the message says why and what to do)."""


class OutputExistsError(CompressKitError, FileExistsError):
    """The output directory holds a finished run of a different recipe."""


class OutputLockedError(CompressKitError):
    """Another live process is writing the output directory (``compresskit.locking``)."""


class DiskFullError(CompressKitError, OSError):
    """A write ran out of disk space: the message names the path and the space it needs; the run stays resumable."""


def check_divides(field: str, size: int, total: int, what: str) -> None:
    """Raise ``RecipeError("<field>: <size> does not divide <what> <total>; valid: 1, 2, ...")``
    unless ``size`` divides ``total`` (group sizes against head counts and FFN widths)."""
    if size < 1 or total % size:
        valid = ", ".join(str(d) for d in range(1, total + 1) if total % d == 0)
        raise RecipeError(f"{field}: {size} does not divide {what} {total}; valid: {valid}")
