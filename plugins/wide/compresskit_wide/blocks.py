"""WIDE's blocks for the inference runtime (``compresskit.runtime``): each block routes, then runs
only what its router kept, with the decision a plain tensor of its own forward.

Attention: router (on the residual) -> execute ``[M, G]`` -> q for the kept head groups only, and
k and v: one routed product over q / k / v stacked (k and v its rows that every token runs), except
where q's prefill kernel runs (then q alone, and k, v in one cuBLAS product) -> RoPE, cache write ->
attention (the routed kernel where ``auto`` measured it faster and the batch is unpadded: only the
kept heads, zeros for the rest; else the runtime's attention over all
heads) -> o over the kept head groups. MLP: router -> gate+up for the kept channel groups with the
SwiGLU fused -> down over them. The ops are PyTorch operators (``kernels.ops``), so that
``torch.compile`` traces a whole decode step and a whole prefill with them inside. Each block
counts the real tokens it routed and the groups it ran (``stat_tokens`` / ``stat_skipped``, as
``compresskit.routing.measured_sparsity`` reads them).

A block whose last product runs the reduction kernel (o, down at decode sizes) carries to the next
WIDE block (the runtime's ``carry``, ``compresskit.runtime.blocks``) the shares of its router's first
product, written by that kernel's programs; the next block's router then runs only its decision's
launch, which also adds the residual and applies the norm (``router_norm_from_shares``). The executor
links each block to the next (:func:`link`). Where no shares came (a prefill past the reduction kernel's sizes,
the first block), the router's first launch writes them itself (``router_shares``, on ``x + delta``) where
``ops`` takes it, and the decision's launch adds and normalises as before.
"""

from __future__ import annotations

import torch
from torch import nn

from compresskit.routing import Counting, RoutedProjection, mask_input_groups
from compresskit.runtime.blocks import Attention, Block, Step, attend, base_module, stacked_linear, write_cache
from compresskit_wide.consensus import Consensus, from_voters, to_voters
from compresskit_wide.kernels import ops  # (registers the operators; and what a block asks before it calls one)
from compresskit_wide.kernels.common import zero_inactive_groups

_ops = torch.ops.compresskit_wide  # registered by importing kernels.ops
router_decide = _ops.router_decide.default
router_shares = _ops.router_shares.default
router_decide_from_shares = _ops.router_decide_from_shares.default
router_norm_from_shares = _ops.router_norm_from_shares.default
router_norm_out_gemm = _ops.router_norm_out_gemm.default
masked_reduce_gemm_shares = _ops.masked_reduce_gemm_shares.default
masked_out_gemm = _ops.masked_out_gemm.default
masked_reduce_gemm = _ops.masked_reduce_gemm.default
consensus_decide = _ops.consensus_decide.default
routed_attention_decode = _ops.routed_attention_decode.default
routed_attention_prefill = _ops.routed_attention_prefill.default

# norms whose forward is Llama's RMSNorm (what router_norm_from_shares computes)
LLAMA_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def plain_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight of a plain bias-free ``nn.Linear`` (what the kernels read), else None."""
    return module.weight if type(module) is nn.Linear and module.bias is None else None


class _Routing(Counting):
    """A WIDE router's decision through ``router_decide`` (or from the shares the block before
    carried over), counted (``Counting``) unless ``count`` is off; and what this block carries on.
    Under ``consensus`` (a batch of two or more sequences) the router gives its margins, and
    ``consensus_decide`` turns them into the batch's shared decision."""

    def _setup_routing(
        self, proj: RoutedProjection, backend: str, count: bool, consensus: Consensus | None = None
    ) -> None:
        # (called after self.norm is set)
        # where the block before carried the shares, the decision's launch also adds the residual and
        # applies the block's RMSNorm (router_norm_from_shares): one launch instead of two
        self.norm_in_router = type(self.norm).__name__ in LLAMA_RMS_NORMS
        router = proj.router
        self.router_down, self.router_up = router.down, router.up
        self.backend = backend
        self.setup_counts(proj, proj.groups, counting=count)
        # the rule, and as plain values for its launch (consensus_decide's)
        self.rule = consensus
        self.consensus = None
        if consensus is not None:
            share_set, follow = consensus.share == "set", consensus.follow or 0.0
            self.consensus = {"cap": consensus.cap(proj.groups), "quorum": consensus.quorum, "share_set": share_set}
            self.consensus["follow"] = follow
        self.next_router_down = None  # the next WIDE block's router bottleneck (link)

    def own_shares(self, x: torch.Tensor, delta: torch.Tensor, shares: torch.Tensor | None) -> torch.Tensor | None:
        """The shares the router decides from: those the block before handed on; where none came, the router's
        first launch on its own (``router_shares``, on ``x + delta``) where the decision's launch can take the
        add and the norm and ``ops.own_shares_backend`` takes it, so that the block starts with two launches where
        it ran three; else None (the router runs whole, after the add)."""
        if shares is not None or not self._norm_fits(x):
            return shares
        m = x.shape[0] * x.shape[1]
        backend = ops.own_shares_backend(self.backend, m, x)
        if backend is None:
            return None
        w_down, columns = self.router_down.weight, ops.ROUTER_SHARE_COLUMNS
        return router_shares(x.reshape(m, -1), delta.reshape(m, -1), w_down, columns, backend=backend)

    def _norm_fits(self, x: torch.Tensor) -> bool:
        """Whether the decision's launch can take the block's norm: Llama's RMSNorm in ``x``'s dtype (else torch
        would promote)."""
        return self.norm_in_router and self.norm.weight.dtype == x.dtype

    def _norm_from_shares(self, shares: torch.Tensor | None, x: torch.Tensor) -> bool:
        """Whether the decision's launch takes the residual add and the norm too: the shares came, and the
        norm fits it (:meth:`_norm_fits`)."""
        return shares is not None and self._norm_fits(x)

    def enter_product(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        valid: torch.Tensor | None,
        shares: torch.Tensor | None,
        w: torch.Tensor,
        *,
        w_up: torch.Tensor | None,
        dense_rows: int,
        zero_inactive: bool,
        shared: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's start (:meth:`enter`) and its first product, ``masked_out_gemm`` of the normalised rows
        by ``w`` (``w_up``, ``dense_rows``, ``zero_inactive``, ``shared``: as there): ``(execute, x, out)``.
        Where the shares came and each token decides for itself, one operator does both
        (``router_norm_out_gemm``: at decode sizes the decision in the product's prologue)."""
        b, t, dim = x.shape
        agree = self.rule is not None and self.rule.applies(b, t)
        shares = self.own_shares(x, delta, shares)
        product = {"w_up": w_up, "dense_rows": dense_rows, "zero_inactive": zero_inactive, "backend": self.backend}
        if self._norm_from_shares(shares, x) and not agree:
            count = self.counting and valid is None
            route, norm = self._route_operands(), self._norm_operands(x, delta)
            counted = {"counts": self.stat_counts, "count": count}
            out, execute, x2 = router_norm_out_gemm(shares, w, **route, **norm, **counted, **product)
            return self._counted(execute, b, t, valid, False, count), x2.view(b, t, dim), out
        execute, x, h = self._start(x, delta, valid, shares)
        return execute, x, masked_out_gemm(h, w, execute, shared=shared, **product)

    def _route_operands(self) -> dict[str, torch.Tensor]:
        """The router's operands past its bottleneck's weight, as the deciding operators take them."""
        return {"b_down": self.router_down.bias, "w_route": self.router_up.weight, "b_route": self.router_up.bias}

    def _norm_operands(self, x: torch.Tensor, delta: torch.Tensor) -> dict:
        """The residual add's and the RMSNorm's operands, as the operators that take them take them."""
        dim = x.shape[-1]
        rows = {"x": x.reshape(-1, dim), "delta": delta.reshape(-1, dim)}
        return {**rows, "norm_w": self.norm.weight, "eps": self.norm.variance_epsilon}

    def enter(
        self, x: torch.Tensor, delta: torch.Tensor, valid: torch.Tensor | None, shares: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's start: ``(execute [B * T, G], x, h [B * T, D])``, ``x`` the residual with
        ``delta`` added and ``h`` its norm; the decision, the add and the norm in one launch where the
        shares came (and the norm is Llama's RMSNorm in ``x``'s dtype), else as three steps."""
        return self._start(x, delta, valid, self.own_shares(x, delta, shares))

    def _start(
        self, x: torch.Tensor, delta: torch.Tensor, valid: torch.Tensor | None, shares: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`enter` from the shares as :meth:`own_shares` resolved them."""
        b, t, dim = x.shape
        if self._norm_from_shares(shares, x):
            agree = self.rule is not None and self.rule.applies(b, t)
            count = self.counting and valid is None and not agree
            route, norm = self._route_operands(), self._norm_operands(x, delta)
            execute, x2, h = router_norm_from_shares(
                shares, **route, **norm, counts=self.stat_counts, count=count, backend=self.backend, margin=agree
            )
            return self._counted(execute, b, t, valid, agree, count), x2.view(b, t, dim), h
        x = x + delta
        execute = self.decide(x, valid, shares)
        return execute, x, self.norm(x).reshape(b * t, dim)

    def decide(self, x: torch.Tensor, valid: torch.Tensor | None, shares: torch.Tensor | None) -> torch.Tensor:
        """``x: [B, T, D]`` (the residual) -> execute ``[B * T, G]`` (bool), counted; from ``shares``
        (``[S, B * T, R]``, handed on by the block before) where they came."""
        b, t = x.shape[:2]
        agree = self.rule is not None and self.rule.applies(b, t)  # margins, then the shared decision
        count = self.counting and valid is None and not agree  # every token real: the router's launch counts
        how = {**self._route_operands(), "counts": self.stat_counts, "count": count, "backend": self.backend}
        if shares is not None:
            execute = router_decide_from_shares(shares, **how, margin=agree)
        else:
            execute = router_decide(x.reshape(-1, x.shape[-1]), self.router_down.weight, **how, margin=agree)
        return self._counted(execute, b, t, valid, agree, count)

    def _counted(
        self, decided: torch.Tensor, b: int, t: int, valid: torch.Tensor | None, agree: bool, counted: bool
    ) -> torch.Tensor:
        """The execute mask from what the router gave (``decided``: its decision, or its margins where the
        batch or tile agrees), counted where the router's launch did not count it. Under ``over: tile`` the
        rows go to the rule's layout (a tile's tokens as the voters) and back around the launch."""
        if agree:
            how = {**self.consensus, "counts": self.stat_counts, "count": self.counting, "backend": self.backend}
            if self.rule.over == "batch":
                real = None if valid is None else valid.reshape(-1).bool()
                return consensus_decide(decided, real, batch=b, **how)
            g = decided.shape[-1]
            real = torch.ones(b, t, dtype=torch.bool, device=decided.device) if valid is None else valid.bool()
            margins = to_voters(decided.view(b, t, g), self.rule, 0.0)  # [S, tiles, G]
            voters = to_voters(real, self.rule, False).reshape(-1)
            execute = consensus_decide(margins.reshape(-1, g), voters, batch=margins.shape[0], **how)
            return from_voters(execute.view(margins.shape), self.rule, b, t).reshape(b * t, g)
        if self.counting and not counted:
            self.count(decided, valid)
        return decided

    def shared(self, b: int, t: int) -> bool:
        """Whether every token of a ``[b, t]`` step runs the same groups: a decode step of a batch under a
        consensus whose tokens run the whole set (at prefill each position has its own set)."""
        return self.rule is not None and self.rule.over == "batch" and self.consensus["share_set"] and b > 1 and t == 1

    def last_product(
        self, a: torch.Tensor, w: torch.Tensor, execute: torch.Tensor, zeroed: bool, x: torch.Tensor, shared: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reduction ``a: [M, K]`` by ``w`` over the kept groups -> ``([M, N], carry)``: with the
        next router's shares where this block is linked to a next WIDE block and the reduction kernel
        runs (``x: [B, T, D]``: the block's input, to which the caller adds the output), else None.
        ``shared``: the tokens all run one set (past the decode kernel's tiles the split-K tile reduction reads
        it once, and its second launch writes the shares); under tile-coherent routing at prefill they agree in
        tiles, which the tile reduction reads once each, handing nothing on."""
        m, t = a.shape[0], x.shape[1]
        nxt = self.next_router_down
        tile = self.rule.tile if self.rule is not None and self.rule.over == "tile" and t > 1 else 0
        how = {"input_is_masked": zeroed, "shared": shared}
        if nxt is not None:
            where = {"groups": execute.shape[-1], "zeroed": zeroed, "shared": shared, "tiled": bool(tile)}
            backend = ops.handoff_backend(self.backend, m, **where, x=a)
            if backend is not None:
                hand = {"residual": x.reshape(m, -1), "share_w": nxt.weight}
                return masked_reduce_gemm_shares(a, w, execute, **hand, **how, backend=backend)
        return masked_reduce_gemm(a, w, execute, **how, backend=self.backend, tile=tile, tokens=t), None


class WideAttention(Attention, _Routing):
    def __init__(
        self, layer: nn.Module, head_dim: int, backend: str, count: bool = True, consensus: Consensus | None = None
    ) -> None:
        super().__init__(layer, head_dim, dense=True)
        self._setup_routing(layer.self_attn.o_proj, backend, count, consensus)
        self.wq, self.wo = plain_weight(self.q_proj), plain_weight(self.o_proj)
        # q / k / v stacked without biases (stacked_linear): one routed product, k and v its dense rows,
        # wherever q's prefill kernel does not run (at decode one launch where q's kernel and k / v were two)
        routed_qkv = self.wq is not None and self.qkv is not None and self.qkv[1] is None
        self.wqkv = self.qkv[0] if routed_qkv else None
        self.qkv_sizes = [self.q_proj.out_features, *self.kv_sizes] if routed_qkv else None
        self.kv_rows = sum(self.kv_sizes) if routed_qkv else 0

    def _routed_attention(self, rows: int, t: int, context: int, step: Step, q: torch.Tensor) -> str | None:
        """The routed attention's backend where it runs (an unpadded batch, the standard scale, and where
        ``ops.routed_attention_backend`` takes it), else None (the runtime's attention)."""
        if step.padded or abs(self.scale * self.head_dim**0.5 - 1.0) > 1e-6 or (t > 1 and step.mask is not None):
            return None
        return ops.routed_attention_backend(self.backend, rows, t, context, q)

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor, carry, step: Step, keys: torch.Tensor, values: torch.Tensor
    ):
        b, t, _ = x.shape
        shared = self.shared(b, t)
        if self.wqkv is not None and ops.qkv_in_one_product(self.backend, b * t, shared):
            # the kept queries, k and v for every token: [B * T, G], [B, T, D], [B * T, N]
            how = {"w_up": None, "dense_rows": self.kv_rows, "zero_inactive": False, "shared": shared}
            execute, x, qkv = self.enter_product(x, delta, step.valid, carry, self.wqkv, **how)
            q, k, v = self.heads(*qkv.view(b, t, -1).split(self.qkv_sizes, dim=-1), step)
        else:
            execute, x, h2 = self.enter(x, delta, step.valid, carry)  # [B * T, G], [B, T, D], [B * T, D]
            h = h2.view(b, t, -1)
            if self.wq is not None:  # the kept head groups' queries only (the others are never read)
                q = masked_out_gemm(h2, self.wq, execute, zero_inactive=False, backend=self.backend, shared=shared)
            else:
                q = self.q_proj(h2)
            q, k, v = self.keys_values(h, q.view(b, t, -1), step)
        write_cache(keys, values, k, v, step.slots)
        context = keys.shape[2] if step.mask is None else step.mask.shape[-1]
        routed = self._routed_attention(b, t, context, step, q)
        if routed and t == 1:
            lens = (step.slots[-1:] + 1).to(torch.int32).expand(b)
            out = routed_attention_decode(q[:, :, 0], keys, values, lens, execute, backend=routed)
        elif routed:  # [B, T, H, D]
            mask = execute.view(b, t, -1)
            out = routed_attention_prefill(q, keys[:, :, :t], values[:, :, :t], mask, backend=routed)
        else:  # all heads; o reads the kept ones
            out = attend(q, keys, values, step, self.scale).transpose(1, 2)
        out = out.reshape(b * t, -1)  # [M, H * D]
        zeroed = routed is not None
        if self.wo is not None and not zeroed and ops.zeroes_before_reduce(b * t, t):
            # a prefill's o past the decode kernels' sizes runs the reduction's dense fallback, which would zero
            # the skipped heads in a pass of its own: zeroed here, the select joins the block's graph
            out, zeroed = zero_inactive_groups(out, execute), True
        if self.wo is not None:
            y, shares = self.last_product(out, self.wo, execute, zeroed, x, shared)
        else:
            y, shares = self.o_proj(mask_input_groups(out, execute)), None
        return x, y.view(b, t, -1), shares


class WideMLP(Block, _Routing):
    def __init__(self, layer: nn.Module, backend: str, count: bool = True, consensus: Consensus | None = None) -> None:
        super().__init__()
        mlp = layer.mlp
        self.norm = base_module(layer.post_attention_layernorm)  # under the router tap
        self._setup_routing(mlp.down_proj, backend, count, consensus)
        # gate and up stacked in memory (their Parameters re-pointed, no copy kept): the dense fallback's one product
        stacked_linear([mlp.gate_proj, mlp.up_proj])
        self.wg, self.wu = mlp.gate_proj.weight, mlp.up_proj.weight
        self.wd = mlp.down_proj.base_layer.weight

    def forward(self, x: torch.Tensor, delta: torch.Tensor, carry, step: Step):
        b, t, _ = x.shape
        shared = self.shared(b, t)
        # gate+up with the SwiGLU fused leaves the skipped groups exactly zero: down reads the kept ones
        how = {"w_up": self.wu, "dense_rows": 0, "zero_inactive": True, "shared": shared}
        execute, x, g = self.enter_product(x, delta, step.valid, carry, self.wg, **how)
        y, shares = self.last_product(g, self.wd, execute, True, x, shared)
        return x, y.view(b, t, -1), shares


def wide_blocks(
    layer: nn.Module, head_dim: int, backend: str, *, attention: bool, count: bool, consensus: Consensus | None = None
):
    """``(attention, mlp)`` WIDE blocks for a decoder layer's routed sublayers (None where it is not
    routed, or, for the MLP, where its projections are not plain Linears: the runtime then runs the
    layer's modules as they are); ``consensus``: the batch's routing rule (None: per token)."""
    attn_block = mlp_block = None
    o_proj = getattr(layer.self_attn, "o_proj", None)
    if attention and isinstance(o_proj, RoutedProjection) and o_proj.router is not None:
        attn_block = WideAttention(layer, head_dim, backend, count, consensus and consensus.for_kind("attention"))
    mlp = layer.mlp
    down = getattr(mlp, "down_proj", None)
    if (
        isinstance(down, RoutedProjection)
        and down.router is not None
        and all(plain_weight(m) is not None for m in (mlp.gate_proj, mlp.up_proj, down.base_layer))
    ):
        mlp_block = WideMLP(layer, backend, count, consensus)
    return attn_block, mlp_block


def link(blocks: list[nn.Module | None]) -> None:
    """Link each WIDE block of ``blocks`` (in the order the model runs them; None where the runtime's
    dense block runs) to the block after it: where that is a WIDE block too, this one carries it the
    shares of its router's first product."""
    for block, after in zip(blocks, [*blocks[1:], None], strict=True):
        if isinstance(block, _Routing):
            block.next_router_down = after.router_down if isinstance(after, _Routing) else None
