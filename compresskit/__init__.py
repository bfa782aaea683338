"""compresskit: LLM compression with pluggable pruners, one shared evaluator and honest numbers.

Public API::

    import compresskit
    result = compresskit.apply("recipes/quickstart.yaml", overrides=["evaluation.limit=50"])
    model, tokenizer = compresskit.load("runs/quickstart/model")
"""

from compresskit.interfaces import Executor, PluginConfig, Pruner, Trainer
from compresskit.recipe import load_recipe

__version__ = "0.1.0"

__all__ = ["Executor", "PluginConfig", "Pruner", "Trainer", "apply", "load", "load_recipe", "__version__"]


def __getattr__(name: str):
    # apply/load pull in transformers; import them only when asked for.
    if name == "apply":
        from compresskit.api import apply

        return apply
    if name == "load":
        from compresskit.artifacts import load

        return load
    raise AttributeError(f"module 'compresskit' has no attribute {name!r}")
