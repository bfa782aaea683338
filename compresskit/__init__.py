"""compresskit: LLM compression with pluggable pruners, one shared evaluator and honest numbers.

Public API::

    import compresskit
    result = compresskit.apply("recipes/quickstart.yaml", overrides=["evaluation.limit=50"])
    loaded = compresskit.load("runs/quickstart")         # .model, .tokenizer, .pruner: transformers, evaluate, train
    model, tokenizer, pruner = loaded                     # (it unpacks as a tuple too)
    text = compresskit.generator("runs/quickstart").generate("Once")   # the runtime (a run folder or its model/)

Every name is imported when first used, so that ``import compresskit`` (and the CLI's start) does
not pay for torch or transformers before they are needed.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Executor": "compresskit.interfaces",
    "PluginConfig": "compresskit.interfaces",
    "Pruner": "compresskit.interfaces",
    "Trainer": "compresskit.interfaces",
    "load_recipe": "compresskit.recipe",
    "apply": "compresskit.api",
    "load": "compresskit.artifacts",
    "generator": "compresskit.runtime",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'compresskit' has no attribute {name!r}")
