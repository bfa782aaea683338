"""Seeds that depend only on the recipe.

Every random draw of a run (router and LoRA initialisation, data order, Gumbel noise) happens
in a named phase, and each phase starts from its own seed, derived from the recipe's ``seed``
and the phase's name. What ran before a phase (a dense reference computed or found in the
cache, another stage's number of steps) cannot change what the phase draws.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from collections.abc import Iterator

import numpy as np
import torch

from compresskit.errors import RecipeError


def phase_seed(seed: int, phase: str) -> int:
    """A 63-bit seed for ``phase`` of a run with recipe seed ``seed``: sha256 of both."""
    digest = hashlib.sha256(f"{seed}:{phase}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (every CUDA device's too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Inside, with ``enabled``, torch runs deterministic algorithms only (an op without one ends the
    run with a :class:`RecipeError` naming it and the field) and cuBLAS a fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG``, unless set already; it must be set before the process's first cuBLAS
    call on a GPU); the previous settings come back on exit."""
    if not enabled:
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    except RuntimeError as exc:
        if "does not have a deterministic implementation" not in str(exc):
            raise
        op = str(exc).split(" does not have", 1)[0].strip()
        raise RecipeError(
            f"deterministic: true, but {op} (run by this pipeline on this device) has no deterministic "
            "implementation in this torch; set deterministic: false to run it"
        ) from exc
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
