"""``wide-triton``: WIDE's routed blocks (``blocks.py``) on the inference runtime.

Sample YAML::

    executor: {name: wide-triton, config: {backend: auto, attention: true}}
    executor: {name: wide-triton, config: {consensus: {quorum: 0.5, budget: 0.6}}}  # batch consensus
    executor: {name: wide-triton, config: {consensus: {over: tile, tile: 64, quorum: 0.0, budget: 0.5}}}  # tiles

The executor supplies the runtime's blocks and nothing else (``runtime_blocks``): each block routes,
then runs only the kept groups through the kernel dispatch (``kernels.ops``); under ``backend: auto``
each operator takes the Triton kernel only where the H200 benchmark measured it faster
(``kernels.policy.use_kernel``). ``convert`` leaves the transformers model as it is, so the
evaluator scores it through the reference path (``compresskit.routing``), which the blocks equal up
to floating-point rounding (the runtime's parity tests).

``consensus`` (off by default) routes a batch by consensus: at each position the real tokens of the batch's
sequences share one set of groups per router (``compresskit_wide.consensus.Consensus``), so that a routed product
reads that set's weights, not the union of every token's choices. It applies wherever two or more sequences
run together, in the runtime's blocks and, through ``convert``, in the reference path that evaluation scores:
evaluated with a batch of B sequences, the model is scored as it would decode B sequences at once (a
teacher-forced simulation). **With consensus on, a sequence's output depends on its batch mates.** A batch of
one is per-token routing exactly. With ``over: tile`` the tokens of each tile of ``tile`` positions of a
sequence share the set instead (tile-coherent routing, for prefill): a prompt decides tile by tile, a decode
step (one token) per token; a token's output then depends on the other tokens of its tile. The blocks
compute what the rule decides; the reduction kernels do not yet skip a tile's dropped groups as whole blocks,
so it changes no speed yet (docs/consensus.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import nn

from compresskit import Executor, PluginConfig
from compresskit.errors import KernelUnavailableError
from compresskit.modeling import decoder_layers
from compresskit.routing import RoutedProjection
from compresskit_wide.consensus import Consensus, set_consensus
from compresskit_wide.kernels import ops


class TritonExecutorConfig(PluginConfig):
    backend: Literal["auto", "triton", "torch"] = Field(
        "auto",
        description="auto: on CUDA tensors, each Triton kernel where it was measured faster, dense fallbacks "
        "elsewhere; the references on the CPU. triton: always the kernels (errors if they cannot run). "
        "torch: the references.",
    )
    attention: bool = Field(
        True, description="also route the attention (q projection and the attention itself) through the kernels"
    )
    track_stats: bool = Field(
        True,
        description="the runtime's blocks count the realised sparsity of every pass (what bench, the speed "
        "measurement and evaluation.engine runtime report); false for serving: nothing is counted, and the "
        "sparsity is reported as not measured",
    )
    consensus: Consensus | None = Field(
        None,
        description="shared routing (module docstring): with over: batch a batch's sequences share each router's "
        "groups at every position (a sequence's output then depends on its batch mates), with over: tile the "
        "tokens of each tile of a sequence do. None: per-token routing",
    )


class TritonExecutor(Executor):
    Config = TritonExecutorConfig

    def check(self, model: nn.Module) -> None:
        if self.config.backend == "triton":
            reason = ops.triton_available()
            if reason:
                raise KernelUnavailableError(f"executor wide-triton: {reason}")
        routed = 0
        for i, layer in enumerate(decoder_layers(model)):
            o_proj = getattr(getattr(layer, "self_attn", None), "o_proj", None)
            routed += self.config.attention and isinstance(o_proj, RoutedProjection)
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
            raise KernelUnavailableError(
                "executor wide-triton: the model has no WIDE-routed FFN or attention (pruner: wide)"
            )

    def runtime_blocks(self, model: nn.Module, head_dim: int):
        """WIDE's routed blocks (``blocks.py``) for the inference runtime, each linked to the next."""
        from compresskit_wide.blocks import link, wide_blocks

        cfg = self.config
        consensus = cfg.consensus
        pairs = [
            wide_blocks(
                layer, head_dim, cfg.backend, attention=cfg.attention, count=cfg.track_stats, consensus=consensus
            )
            for layer in decoder_layers(model)
        ]
        link([block for pair in pairs for block in pair])
        return pairs

    def convert(self, model: nn.Module) -> nn.Module:
        """The model as it is, its routers set to ``consensus`` (the reference path then decides as the
        runtime's blocks do): what runs fast is the runtime's blocks (``runtime_blocks``)."""
        set_consensus(model, self.config.consensus)
        return model
