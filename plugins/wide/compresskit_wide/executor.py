"""``wide-triton``: run WIDE's routed FFNs through the Triton kernels.

Sample YAML::

    executor: {name: wide-triton, config: {backend: auto}}

``convert`` swaps every routed MLP for :class:`KernelMLP`, which computes, per token, only the
FFN channel groups its router kept: the routing layout once per FFN, then gate and up as one
output-width GEMM with the SwiGLU fused in its epilogue, then down as a reduction-width GEMM
over the active groups. Attention still runs the reference path (its kernels are to come).
The result equals the reference (``torch`` executor) up to floating-point rounding.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from compresskit import Executor, PluginConfig
from compresskit.errors import KernelUnavailableError
from compresskit.modeling import decoder_layers, replace_module
from compresskit.routing import RoutedProjection
from compresskit_wide import kernels


class TritonExecutorConfig(PluginConfig):
    backend: Literal["auto", "triton", "torch"] = Field(
        "auto",
        description="auto: Triton for CUDA tensors, the reference otherwise; triton: always (errors if it cannot).",
    )


class KernelMLP(nn.Module):
    """A SwiGLU MLP whose channel groups are skipped per token by the kernels.

    ``x: [B, T, D] -> [B, T, D]``; the execute mask comes from the routed ``down_proj`` (its router
    tap ran on the residual before the post-attention norm).
    """

    def __init__(self, base_layer: nn.Module, backend: str) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.base_layer
        proj: RoutedProjection = mlp.down_proj
        mask = proj._mask
        if mask is None or mask.shape[:2] != x.shape[:2]:
            raise RuntimeError(
                f"layer {proj.layer_idx}: no routing decision for this input; the router tap did not run"
            )
        proj._mask = None
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, D]
        m2 = mask.reshape(-1, mask.shape[-1]).bool()  # [M, G]
        # gate/up with the fused SwiGLU leaves h exactly zero in every inactive group, so down may
        # take the plain dense product; each operator computes the routing layout it needs
        # (decode: none for gate/up, the active groups for the down loop; prefill: the sorted tokens)
        h = kernels.masked_out_gemm(x2, mlp.gate_proj.weight, m2, mlp.up_proj.weight, backend=self.backend)
        y = kernels.masked_reduce_gemm(h, proj.base_layer.weight, m2, input_is_masked=True, backend=self.backend)
        return y.view(*shape[:-1], y.shape[-1])


class TritonExecutor(Executor):
    Config = TritonExecutorConfig

    def check(self, model: nn.Module) -> None:
        if self.config.backend == "triton":
            reason = kernels.triton_available()
            if reason:
                raise KernelUnavailableError(f"executor wide-triton: {reason}")
        routed = 0
        for i, layer in enumerate(decoder_layers(model)):
            mlp = layer.mlp
            if not isinstance(getattr(mlp, "down_proj", None), RoutedProjection):
                continue
            routed += 1
            for name in ("gate_proj", "up_proj"):
                if type(getattr(mlp, name)) is not nn.Linear or getattr(mlp, name).bias is not None:
                    kind = type(getattr(mlp, name)).__name__
                    raise KernelUnavailableError(
                        f"executor wide-triton: layer {i} mlp.{name} is {kind}, not a plain bias-free Linear; "
                        "merge LoRA first (training stage lora: merge: true) or use executor torch"
                    )
            if type(mlp.down_proj.base_layer) is not nn.Linear:
                raise KernelUnavailableError(
                    f"executor wide-triton: layer {i} down_proj is not a plain Linear; "
                    "merge LoRA first or use executor torch"
                )
        if not routed:
            raise KernelUnavailableError("executor wide-triton: the model has no WIDE-routed FFN (pruner: wide)")

    def convert(self, model: nn.Module) -> nn.Module:
        for layer in decoder_layers(model):
            if isinstance(getattr(layer.mlp, "down_proj", None), RoutedProjection):
                replace_module(layer, "mlp", KernelMLP(layer.mlp, self.config.backend))
        return model
