"""Shared fixtures: a tiny Llama checkpoint on disk (random init, built from a config) and a
fresh working directory per test. Markers: ``slow`` (uses the real embedded model), ``gpu``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # Triton kernels run in its CPU interpreter; set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
TESTS = Path(__file__).parent


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from compresskit.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture
def tiny_recipe(tiny_model_dir, tmp_path) -> dict:
    """A recipe mapping that runs end to end on the tiny model in seconds."""
    return {
        "name": "tiny",
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"calibration": {"n_samples": 4, "seq_len": 32, "batch_size": 2}},
        "evaluation": {
            "tasks": ["perplexity", "piqa", "next_sentence"],
            "limit": 6,
            "perplexity_docs": 1,
            "next_sentence_items": 6,
            "batch_size": 4,
            "max_length": 512,
        },
        "output": {"dir": str(tmp_path / "run")},
    }


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
