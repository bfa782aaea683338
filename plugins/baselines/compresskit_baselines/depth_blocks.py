"""``depth-skip``: dynamic depth's blocks for the inference runtime, and its executor.

Sample YAML::

    executor: {name: depth-skip}

For evaluation the executor changes nothing (the routed modules mask the skipped sublayers' outputs,
the reference). On the runtime (``compresskit generate``, ``bench``, the speed columns of ``apply``)
its blocks decide per token with the sublayer's router. A skipped attention sublayer still writes
its K and V to the cache (so later tokens see them), and skips q, the attention and o. A skipped FFN
does nothing. Run eagerly with one token in flight (batch 1 decode), a block reads the decision on
the host and launches none of the skipped work. Compiled, or captured in a CUDA graph, which cannot
branch on a decision, every token is computed and the skipped ones' outputs are zeroed (the same
result, no saving): on the H200 with SmolLM2-135M the eager skipping decoded 26x slower than the
graph (docs/runtime-h200.md), so a GPU runtime takes the graph, and ``--compile off`` measures the
skipping.
"""

from __future__ import annotations

import torch
from torch import nn

from compresskit import Executor, PluginConfig
from compresskit.modeling import decoder_layers
from compresskit.routing import Counting, RoutedProjection, decide
from compresskit.runtime.blocks import MLP, Attention, Step, rope, write_cache


def _on_host(tokens: int) -> bool:
    """Whether a block reads its decision on the host and skips the work: one token, run eagerly
    (neither traced by ``torch.compile`` nor captured in a CUDA graph)."""
    if tokens != 1 or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


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
    """The attention sublayer, skipped per token; ``hands_on``: its decision is the whole layer's (granularity
    ``layer``), carried to the layer's FFN block (:class:`FollowingSkipMLP`)."""

    def __init__(self, layer: nn.Module, head_dim: int, *, hands_on: bool = False) -> None:
        super().__init__(layer, head_dim, dense=True)
        self._setup_routing(layer.self_attn.o_proj)
        self.hands_on = hands_on

    def forward(self, x: torch.Tensor, delta: torch.Tensor, carry, step: Step, keys, values):
        x = x + delta
        run = self.decide(x, step.valid)
        return x, self._attend(x, run, step, keys, values), run if self.hands_on else None

    def _attend(self, x: torch.Tensor, run: torch.Tensor, step: Step, keys, values) -> torch.Tensor:
        b, t, _ = x.shape
        if _on_host(b * t) and not bool(run):  # K and V for the cache only
            h = self.norm(x)
            k = self.k_proj(h).view(1, 1, -1, self.head_dim).transpose(1, 2)
            v = self.v_proj(h).view(1, 1, -1, self.head_dim).transpose(1, 2)
            if self.k_norm is not None:
                k = self.k_norm(k)
            _, k = rope(k, k, step.cos, step.sin)  # (transformers' rotation takes a pair)
            write_cache(keys, values, k, v, step.slots)
            return torch.zeros_like(x)
        return self.compute(x, step, keys, values) * run[..., None].to(x.dtype)


class SkipMLP(MLP, _Skipping):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer, dense=True)  # the SwiGLU under the routed down_proj
        self._setup_routing(layer.mlp.down_proj)

    def compute(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        run = self.decide(x, step.valid)
        if _on_host(x.shape[0] * x.shape[1]) and not bool(run):
            return torch.zeros_like(x)
        return super().compute(x, step) * run[..., None].to(x.dtype)


class FollowingSkipMLP(MLP, Counting):
    """The FFN of a layer with one decision (granularity ``layer``): it runs where the layer's attention block
    decided to, the decision carried over from that block; counted for its own projection, as the routed
    modules count a follower."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer, dense=True)  # the SwiGLU under the routed down_proj
        self.setup_counts(layer.mlp.down_proj, 1)

    def forward(self, x: torch.Tensor, delta: torch.Tensor, carry, step: Step):
        x = x + delta
        run = carry  # [B, T] bool: the attention block's decision
        self.count(run.reshape(-1, 1), step.valid)
        if _on_host(x.shape[0] * x.shape[1]) and not bool(run):
            return x, torch.zeros_like(x), None
        return x, self.compute(x, step) * run[..., None].to(x.dtype), None


class DepthSkipExecutor(Executor):
    Config = PluginConfig

    def convert(self, model: nn.Module) -> nn.Module:
        return model  # evaluation: the routed modules as they are

    def runtime_blocks(self, model: nn.Module, head_dim: int):
        """Skipping blocks for each routed layer: one a sublayer, each with its router; or, for a layer with one
        decision for both (granularity ``layer``: the FFN follows the attention's router), the attention's block
        carrying its decision to the FFN's."""
        return [self._layer_blocks(layer, head_dim) for layer in decoder_layers(model)]

    @staticmethod
    def _layer_blocks(layer: nn.Module, head_dim: int):
        attn = getattr(layer.self_attn, "o_proj", None)
        down = getattr(layer.mlp, "down_proj", None)
        if isinstance(down, RoutedProjection) and down.leader is not None:
            if down.leader is not attn:
                return None, None  # (a decision from elsewhere: the runtime refuses the layer in one line)
            return SkipAttention(layer, head_dim, hands_on=True), FollowingSkipMLP(layer)
        return (
            SkipAttention(layer, head_dim) if isinstance(attn, RoutedProjection) else None,
            SkipMLP(layer) if isinstance(down, RoutedProjection) else None,
        )
