"""``depth-skip``: dynamic depth's blocks for the inference runtime, and its executor.

Sample YAML::

    executor: {name: depth-skip}

For evaluation the executor changes nothing (the routed modules mask the skipped sublayers' outputs,
the reference). On the runtime (``compresskit generate``, ``bench``, the speed columns of ``apply``)
its blocks decide per token with the sublayer's router. A skipped attention sublayer still writes
its K and V to the cache (so later tokens see them), and skips q, the attention and o. A skipped FFN
does nothing. With one token in flight (batch 1 decode) the decision is read on the host and the
skipped work is not launched at all: that is where skipping saves time. Otherwise every token is
computed and the skipped ones' outputs are zeroed (the same result). Reading the decision on the
host means these blocks run eagerly (no CUDA graph can hold a branch on it).
"""

from __future__ import annotations

import torch
from torch import nn

from compresskit import Executor, PluginConfig
from compresskit.routing import RoutedProjection, decide
from compresskit.runtime.blocks import MLP, Attention, Counting, Step, rope, write_cache


class _Skipping(Counting):
    """A sublayer's router (one group: the whole sublayer) and the counts of its decisions."""

    def _setup_routing(self, proj: RoutedProjection) -> None:
        self.router = proj.router
        self.setup_counts(proj, 1)

    def decide(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """``x: [B, T, D]`` -> run ``[B, T]`` (bool), counted over the real tokens."""
        run = decide(self.router(x), sample=False, tau=1.0)[..., 0] > 0  # [B, T]
        self.count(run.reshape(-1, 1), valid)
        return run


class SkipAttention(Attention, _Skipping):
    def __init__(self, layer: nn.Module, head_dim: int) -> None:
        super().__init__(layer, head_dim, dense=True)
        self._setup_routing(layer.self_attn.o_proj)
        self.graphable = False  # the decision is read on the host

    def forward(self, x: torch.Tensor, step: Step, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        run = self.decide(x, step.valid)
        if b * t == 1 and not bool(run):  # K and V for the cache only
            h = self.norm(x)
            k = self.k_proj(h).view(1, 1, -1, self.head_dim).transpose(1, 2)
            v = self.v_proj(h).view(1, 1, -1, self.head_dim).transpose(1, 2)
            if self.k_norm is not None:
                k = self.k_norm(k)
            _, k = rope(k, k, step.cos, step.sin)  # (transformers' rotation takes a pair)
            write_cache(keys, values, k, v, step.slots)
            return torch.zeros_like(x)
        return super().forward(x, step, keys, values) * run[..., None].to(x.dtype)


class SkipMLP(MLP, _Skipping):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer, dense=True)  # the SwiGLU under the routed down_proj
        self._setup_routing(layer.mlp.down_proj)
        self.graphable = False  # the decision is read on the host

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        run = self.decide(x, step.valid)
        if x.shape[0] * x.shape[1] == 1 and not bool(run):
            return torch.zeros_like(x)
        return super().forward(x, step) * run[..., None].to(x.dtype)


class DepthSkipExecutor(Executor):
    Config = PluginConfig

    def convert(self, model: nn.Module) -> nn.Module:
        return model  # evaluation: the routed modules as they are

    def runtime_blocks(self, layer: nn.Module, index: int, head_dim: int):
        """Skipping blocks for a layer routed per sublayer; a layer with one decision for both (granularity
        ``layer``: the FFN follows the attention's router) runs its own modules."""
        attn = getattr(layer.self_attn, "o_proj", None)
        down = getattr(layer.mlp, "down_proj", None)
        if isinstance(down, RoutedProjection) and down.leader is not None:
            return None, None
        return (
            SkipAttention(layer, head_dim) if isinstance(attn, RoutedProjection) else None,
            SkipMLP(layer) if isinstance(down, RoutedProjection) else None,
        )
