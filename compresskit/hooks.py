"""Tracked forward hooks: observe activations and always come off again.

with HookSet() as hooks:
    hooks.forward(layer, fn)          # fn(module, args, kwargs, output)
    model(batch)                      # hooks observe
# every hook removed here, also after an exception
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


class HookSet:
    def __init__(self) -> None:
        self._handles: list = []

    def forward(self, module: nn.Module, fn: Callable) -> None:
        """``fn(module, args, kwargs, output)`` after ``module`` runs."""
        self._handles.append(module.register_forward_hook(fn, with_kwargs=True))

    def forward_pre(self, module: nn.Module, fn: Callable) -> None:
        """``fn(module, args, kwargs)`` before ``module`` runs (return None: observe only)."""
        self._handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __len__(self) -> int:
        return len(self._handles)

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def first_tensor(args: tuple, kwargs: dict, name: str = "hidden_states"):
    """The first positional tensor argument, or ``kwargs[name]``."""
    return args[0] if args else kwargs[name]


def output_tensor(output):
    """A module's main output: the tensor itself, or the first element of a tuple."""
    return output[0] if isinstance(output, tuple) else output
