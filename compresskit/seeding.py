"""Seeds that depend only on the recipe.

Every random draw of a run (router and LoRA initialisation, data order, Gumbel noise) happens
in a named phase, and each phase starts from its own seed, derived from the recipe's ``seed``
and the phase's name. What ran before a phase (a dense reference computed or found in the
cache, another stage's number of steps) cannot change what the phase draws.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def phase_seed(seed: int, phase: str) -> int:
    """A 63-bit seed for ``phase`` of a run with recipe seed ``seed``: sha256 of both."""
    digest = hashlib.sha256(f"{seed}:{phase}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (every CUDA device's too)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
