"""The runtime's blocks, and the one contract every block keeps, dense or a plugin's.

A decoder layer is two blocks, attention then MLP. A block reads the residual stream ``x: [B, T,
hidden]`` (it applies its own norm) and returns what it adds. Everything a block needs travels in
its arguments as tensors (``Step``), so a block compiles with ``torch.compile`` and replays in a
CUDA graph. The contract (:class:`Block`)::

    block(x, delta, carry, step, *cache) -> (x + delta, out, carry_out)

``delta`` is what the block before returned (zeros before the first): each block adds it inside its
own compiled graph, where the add fuses with the block's first work (its norm). ``carry`` is what
the block before handed on, or None: a plugin whose blocks fuse across the boundary between them
passes whatever tensor its next block reads; a block that hands nothing returns None. ``cache`` is
the layer's ``(keys, values)`` for an attention block, nothing for an MLP block.

These are the dense blocks. A plugin supplies its own through ``Executor.runtime_blocks`` (all of a
model's at once, so that it can link its blocks to each other); the helpers here (:func:`rope`,
:func:`write_cache`, :func:`attend`, :func:`stacked_linear`) are theirs to use too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from compresskit.routing import RoutedProjection, RouterTap


class Step(NamedTuple):
    """What every block of one forward reads.

    ``cos, sin``: ``[B, T, D]`` rotary tables at each token's position; ``slots``: ``[T]`` (long) the
    cache slots the tokens are written to; ``mask``: ``[B, 1, T, S]`` bool, which of the first ``S``
    cache slots each token sees, or None for a prompt that starts at slot 0 without padding (plain
    causal over the first ``T`` slots); ``valid``: ``[B, T]`` the real (non-padding) tokens, or None
    when all are; ``padded``: whether any sequence of the batch is left-padded."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None
    valid: torch.Tensor | None
    padded: bool


def base_module(module: nn.Module) -> nn.Module:
    """The module under any routing wrapper (``RouterTap``, ``RoutedProjection``): what the model
    computed before it was routed. Other wrappers (a LoRA layer) are kept."""
    while isinstance(module, (RoutedProjection, RouterTap)):
        module = module.base_layer
    return module


def is_routed(module: nn.Module) -> bool:

    return isinstance(module, (RoutedProjection, RouterTap))


def stacked_linear(modules: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight, bias)`` of several ``nn.Linear`` modules that read one input (q, k and v; gate and
    up) stacked by rows, so that one product replaces several: at decode each product is a launch
    and a pass over its weight, and a larger one uses the GPU better. The modules keep their
    Parameters, re-pointed at their rows of the stacked tensors (no second copy of the weights stays;
    the model computes, trains and saves as before). Modules stacked once are found stacked again
    (another runtime on the same model). None where the modules are not all plain ``nn.Linear`` of
    one input size, dtype and device, with biases on all or none. A runtime reads the stacked
    tensors it was built with: build it after the last change that replaces a weight tensor (an
    in-place change, as a LoRA merge makes, is seen)."""
    if not modules or any(type(m) is not nn.Linear for m in modules):
        return None
    first = modules[0].weight
    if (
        any(
            m.in_features != first.shape[1] or m.weight.dtype != first.dtype or m.weight.device != first.device
            for m in modules
        )
        or len({m.bias is None for m in modules}) > 1
    ):
        return None

    def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
        data = [t.data for t in tensors]
        width = data[0].shape[1:]
        rows = sum(d.shape[0] for d in data)
        offset = data[0].storage_offset()
        stacked = all(d.is_contiguous() for d in data) and all(
            d.untyped_storage().data_ptr() == data[0].untyped_storage().data_ptr()
            and d.storage_offset() == prev.storage_offset() + prev.numel()
            for prev, d in zip(data, data[1:], strict=False)
        )
        if stacked:  # stacked by an earlier runtime
            return data[0].as_strided((rows, *width), data[0].stride(), offset)
        out = torch.cat(data)
        start = 0
        for t, d in zip(tensors, data, strict=True):
            t.data = out[start : start + d.shape[0]]
            start += d.shape[0]
        return out

    with torch.no_grad(), torch.inference_mode(False):  # normal tensors even under inference mode (trainable later)
        weight = stack([m.weight for m in modules])
        bias = stack([m.bias for m in modules]) if modules[0].bias is not None else None
    return weight, bias


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``q: [B, H, T, D]``, ``k: [B, Hkv, T, D]`` rotated by ``cos, sin: [B, T, D]`` (transformers'
    own rotation for the Llama family)."""
    return apply_rotary_pos_emb(q, k, cos, sin)


def write_cache(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """Write ``k, v: [B, Hkv, T, D]`` at cache slots ``slots: [T]`` of ``keys, values: [B, Hkv, S, D]``
    (in place; the slots are a tensor, so one captured graph serves every decode step)."""
    keys.index_copy_(2, slots, k)
    values.index_copy_(2, slots, v)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: Step, scale: float) -> torch.Tensor:
    """``q: [B, H, T, D]`` over the cache ``keys, values: [B, Hkv, S, D]`` (GQA: ``H`` a multiple of
    ``Hkv``) -> ``[B, H, T, D]``, seeing what ``step.mask`` allows."""
    t = q.shape[2]
    if step.mask is None:  # a fresh, unpadded prompt: causal over its own slots (flash attention's case)
        return F.scaled_dot_product_attention(
            q, keys[:, :, :t], values[:, :, :t], is_causal=True, scale=scale, enable_gqa=True
        )
    s = step.mask.shape[-1]
    keys, values = keys[:, :, :s], values[:, :, :s]
    if t == 1:  # decode: each KV head's query group as one small product, K and V read once
        b, h, _, d = q.shape
        hkv = keys.shape[1]
        qg = q.reshape(b, hkv, h // hkv, d)  # [B, Hkv, A, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [B, Hkv, A, S]
        scores = scores.masked_fill(~step.mask.view(b, 1, 1, s), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).view(b, h, 1, d)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask, scale=scale, enable_gqa=True)


class Block(nn.Module):
    """One sublayer on the runtime. ``forward(x, delta, carry, step, *cache) -> (x, out, carry)``: the
    residual stream with ``delta`` added, what this block adds to it, and what it hands the next block
    (None). This forward adds ``delta``, calls ``compute(x, step, *cache)`` (the sublayer's output)
    and hands nothing on; a plugin's block whose work fuses with the add or across blocks overrides
    ``forward`` itself. ``graphable``: whether the block may be compiled and captured in a CUDA graph
    (False for one that keeps state between calls)."""

    graphable = True

    def forward(self, x: torch.Tensor, delta: torch.Tensor, carry, step: Step, *cache: torch.Tensor):
        x = x + delta
        return x, self.compute(x, step, *cache), None


class Attention(Block):
    """A Llama-family self-attention: norm, q / k / v (one product where they stack:
    :func:`stacked_linear`), (Qwen3's per-head norms), RoPE, cache write, attention, o. ``dense=True``
    reads the modules under any routing wrapper (the base model); ``False`` calls the layer's modules
    as they are (a routed model's own eager path)."""

    def __init__(self, layer: nn.Module, head_dim: int, *, dense: bool = True) -> None:
        super().__init__()
        attn = layer.self_attn
        pick = base_module if dense else (lambda m: m)
        self.norm = pick(layer.input_layernorm)
        self.q_proj, self.k_proj, self.v_proj = pick(attn.q_proj), pick(attn.k_proj), pick(attn.v_proj)
        self.o_proj = pick(attn.o_proj)
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.head_dim = head_dim
        self.scale = float(getattr(attn, "scaling", None) or head_dim**-0.5)
        # a routed model's modules keep their decision between calls: eager only
        self.graphable = not any(is_routed(m) for m in (self.norm, self.q_proj, self.o_proj))
        self.qkv = stacked_linear([self.q_proj, self.k_proj, self.v_proj])
        self.kv = stacked_linear([self.k_proj, self.v_proj])  # found inside the q / k / v stack where that is
        self.kv_sizes = [m.out_features for m in (self.k_proj, self.v_proj)] if self.kv else None

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step):
        """``q: [B, T, H * D]``, ``k, v: [B, T, Hkv * D]`` -> rotated ``q: [B, H, T, D]``, ``k, v: [B, Hkv, T, D]``."""
        b, t, _ = q.shape
        q, k, v = (y.view(b, t, -1, self.head_dim).transpose(1, 2) for y in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k, step.cos, step.sin)
        return q, k, v

    def keys_values(self, h: torch.Tensor, q: torch.Tensor, step: Step):
        """``h: [B, T, hidden]`` (normed), ``q: [B, T, H * D]`` -> rotated ``q: [B, H, T, D]``,
        ``k, v: [B, Hkv, T, D]``."""
        if self.kv is not None:
            k, v = F.linear(h, *self.kv).split(self.kv_sizes, dim=-1)
        else:
            k, v = self.k_proj(h), self.v_proj(h)
        return self.heads(q, k, v, step)

    def compute(self, x: torch.Tensor, step: Step, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm(x)
        if self.qkv is not None:
            q, k, v = self.heads(*F.linear(h, *self.qkv).split([self.q_proj.out_features, *self.kv_sizes], -1), step)
        else:
            q, k, v = self.keys_values(h, self.q_proj(h), step)
        write_cache(keys, values, k, v, step.slots)
        out = attend(q, keys, values, step, self.scale)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(Block):
    """A Llama-family MLP after its norm: ``down(act(gate(h)) * up(h))``, gate and up in one product
    where they stack (:func:`stacked_linear`); else the model's own module."""

    def __init__(self, layer: nn.Module, *, dense: bool = True) -> None:
        super().__init__()
        pick = base_module if dense else (lambda m: m)
        self.norm = pick(layer.post_attention_layernorm)
        mlp = layer.mlp
        parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")]
        self.mlp, self.gate_up = mlp, None
        if None not in parts and (dense or not is_routed(parts[2])):
            gate, up, down, self.act = parts
            self.gate_up = stacked_linear([gate, up])
            if self.gate_up is not None or (dense and is_routed(down)):
                self.gate_proj, self.up_proj, self.down_proj = gate, up, base_module(down) if dense else down
                self.mlp = None
        self.graphable = not is_routed(self.norm) and not (self.mlp is not None and _has_routed(self.mlp))

    def compute(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        h = self.norm(x)
        if self.mlp is not None:
            return self.mlp(h)
        if self.gate_up is not None:
            gate, up = F.linear(h, *self.gate_up).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))


def _has_routed(module: nn.Module) -> bool:
    return any(is_routed(m) for m in module.modules())
