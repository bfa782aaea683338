"""The reference executor: runs the finalized model as it is, in PyTorch."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from compresskit.errors import KernelUnavailableError
from compresskit.interfaces import Executor, PluginConfig


class TorchExecutorConfig(PluginConfig):
    compile: bool = Field(False, description="Wrap the forward pass in torch.compile (needs a C++ compiler).")


class TorchExecutor(Executor):
    """``torch``: the reference path. Masked dense execution, exactly the semantics every fast
    executor must reproduce. Runs anywhere PyTorch runs.

    Sample YAML::

        executor: {name: torch, config: {compile: false}}
    """

    Config = TorchExecutorConfig

    def check(self, model: nn.Module) -> None:
        if self.config.compile and not hasattr(torch, "compile"):
            raise KernelUnavailableError(
                "executor.config.compile: this PyTorch has no torch.compile; set compile: false"
            )

    def convert(self, model: nn.Module) -> nn.Module:
        if self.config.compile:
            model.forward = torch.compile(model.forward, dynamic=True)
        return model
