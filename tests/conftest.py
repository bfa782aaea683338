"""Shared fixtures: a tiny Llama checkpoint on disk (random init, built from a config) and a
fresh working directory per test. Markers: ``slow`` (left out by ``make test-fast``; pyproject.toml says
which), ``gpu``.

The tests leave the user's environment and caches as they found them:

* every cache they write (compresskit's dense references and conversions, stevedore's entry-point
  cache, the HF and Triton caches) lives in a temporary folder removed when the session ends; the
  user's converted embedded model and extracted text are only read from there (linked, never written);
* the test-fixture plugins (``tests/fixtures/toy_plugin``: two third-party pruners, ``toy-magnitude``
  and the routing ``toy-router`` that the core's tests use, and a broken one) are registered in this
  process only, through their ``.dist-info`` on ``sys.path`` (and ``PYTHONPATH`` for the processes the
  tests start), never installed.
"""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).parent


def _user_cache() -> Path:
    root = os.environ.get("COMPRESSKIT_CACHE")
    return Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "compresskit"


def _sandbox_caches() -> Path:
    """Point every cache at a temporary folder (before compresskit, stevedore, transformers or triton
    are imported, as they read these variables once)."""
    sandbox = Path(tempfile.mkdtemp(prefix="compresskit-tests-"))
    atexit.register(shutil.rmtree, sandbox, ignore_errors=True)
    user, cache = _user_cache(), sandbox / "compresskit"
    for sub in ("models", "data"):  # derived from packages, slow to rebuild: read the user's copies
        (cache / sub).mkdir(parents=True)
        if (user / sub).is_dir():
            for entry in (user / sub).iterdir():
                if not entry.name.startswith("."):
                    (cache / sub / entry.name).symlink_to(entry)
    os.environ["COMPRESSKIT_CACHE"] = str(cache)
    os.environ["XDG_CACHE_HOME"] = str(sandbox / "xdg")
    os.environ["HF_HOME"] = str(sandbox / "xdg" / "huggingface")
    os.environ["TRITON_CACHE_DIR"] = str(sandbox / "triton")
    return sandbox


SANDBOX = _sandbox_caches()
sys.path.append(str(TESTS / "fixtures" / "toy_plugin"))  # the package and its .dist-info (entry points)
# (and the processes the tests start: torchrun's ranks, scripts)
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [os.environ.get("PYTHONPATH"), str(TESTS / "fixtures" / "toy_plugin")])
)

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # Triton kernels run in its CPU interpreter; set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    from compresskit.testing import TINY_EVALUATION

    return {
        "name": "tiny",
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"calibration": {"n_samples": 4, "seq_len": 32, "batch_size": 2}},
        "evaluation": copy.deepcopy(TINY_EVALUATION),
        "output": {"dir": str(tmp_path / "run")},
    }


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
