"""``wide-triton``: run WIDE's routed layers through the kernel dispatch.

Sample YAML::

    executor: {name: wide-triton, config: {backend: auto, attention: true}}

``convert`` swaps every routed MLP for :class:`KernelMLP` (gate and up as one output-width GEMM
with the SwiGLU fused in its epilogue, computing only the channel groups each token's router
kept; down on the zero-filled result). With ``attention: true`` every routed attention also runs
through the dispatch: :class:`KernelQ` computes only the query heads of the kept head groups, and
the model's attention implementation becomes ``"wide_routed"`` (registered with transformers'
``AttentionInterface``), which runs the routed decode / prefill attention for those heads and
writes zeros for the others (so ``o_proj`` skips its masking); whatever it does not cover (a
padding or static-cache mask, dropout, a sliding window, another scale) goes to transformers' SDPA
function unchanged. ``o_proj`` reduces over the kept head groups through :class:`KernelReduce`. Under
``backend: auto`` each operator takes the Triton kernel only where the H200 benchmark measured it
faster (``kernels.policy.use_kernel``). The result equals the reference (``torch`` executor) up to
floating-point rounding.
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
from compresskit_wide.kernels import ops
from compresskit_wide.kernels.policy import use_kernel


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
        description="count the realised sparsity in every pass (what the evaluator reports); false for serving: "
        "it saves three small kernels (a cast, a sum, an add) a routed decision, and the sparsity is then not counted",
    )


ATTENTION_IMPLEMENTATION = "wide_routed"


def routed_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function contract (``query: [B, Hq, T, D]``, ``key, value: [B, Hkv,
    S, D]`` after the cache update; returns ``[B, T, Hq, D]`` and no weights) for a routed
    attention: the head-group decision of the layer's routed ``o_proj`` selects the heads that run.
    Cases the routed kernels do not cover, and under ``backend="auto"`` those where the dense path
    was measured faster, go to transformers' SDPA function (the routed ``o_proj`` then zeroes the
    skipped heads, as in the reference path)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    proj = getattr(module, "o_proj", None)
    mask = getattr(proj, "_mask", None)
    backend = getattr(module, "_wide_backend", None)
    b, _, t, d = query.shape
    covered = (
        backend is not None
        and mask is not None
        and tuple(mask.shape[:2]) == (b, t)
        and attention_mask is None  # plain causal: no padding, no static-cache mask
        and not dropout
        and (scaling is None or abs(scaling * d**0.5 - 1.0) < 1e-6)
        and kwargs.get("sliding_window") is None
        and kwargs.get("softcap") is None
        and getattr(module, "is_causal", True)
    )
    if covered and backend == "auto":  # the routed kernel only where it was measured faster
        op, rows = ("attn_decode", b) if t == 1 else ("attn_prefill", t)
        covered = query.is_cuda and use_kernel(op, rows, context=key.shape[2])
    if not covered:  # o_proj zeroes the heads its router skipped either way
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    heads_on = mask.bool()
    if t == 1:  # decode: every sequence sees the whole cache (no padding mask was needed)
        lens = torch.full((b,), key.shape[2], dtype=torch.int32, device=query.device)
        out = ops.routed_attention_decode(query[:, :, 0], key, value, lens, heads_on[:, 0], backend=backend)
        out = out[:, None].contiguous()
    else:
        out = ops.routed_attention_prefill(query, key, value, heads_on, backend=backend)  # [B, T, H, D]
    proj.mark_input_zeroed()  # the routed operators write exact zeros for skipped heads: o_proj need not
    return out, None


def register_attention() -> None:
    """Make ``"wide_routed"`` a transformers attention implementation (with SDPA's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, routed_attention_forward)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)


class KernelRouter(nn.Module):
    """A routed projection's inference decision through ``ops.router_decide``: its router's
    bottleneck, logits and comparison fused (one or two launches) under "triton" and "auto" on a GPU
    (``policy.use_kernel``); the reference's five or six launches otherwise. Holds
    a reference to the router (its weights stay where they are saved from)."""

    def __init__(self, router: nn.Module, backend: str) -> None:
        super().__init__()
        self.__dict__["router"] = router  # a reference, not a submodule
        self.backend = backend

    def forward(self, x_raw: torch.Tensor) -> torch.Tensor:
        r = self.router
        x2 = x_raw.reshape(-1, x_raw.shape[-1])
        execute = ops.router_decide(
            x2, r.down.weight, r.down.bias, r.up.weight, r.up.bias, backend=self.backend
        )  # [M, G], bool: what the routed operators read (no cast launch in each of them)
        return execute.view(*x_raw.shape[:-1], execute.shape[-1])


class KernelQ(nn.Module):
    """The q projection of a routed attention: only the query heads of the head groups the
    layer's router kept. The others are never read (the routed attention gathers the active
    heads' queries; the dense attention's outputs for them are zeroed by the routed ``o_proj``), so
    where the dense product is the faster path it is taken as it is, without a zeroing launch."""

    def __init__(self, base_layer: nn.Linear, o_proj: RoutedProjection, backend: str) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.__dict__["o_proj"] = o_proj  # a reference: it lives beside q_proj in the attention
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.o_proj._mask
        if mask is None or mask.shape[:2] != x.shape[:2]:  # no decision in flight: the dense q (exact)
            return self.base_layer(x)
        x2 = x.reshape(-1, x.shape[-1])
        y = ops.masked_out_gemm(
            x2,
            self.base_layer.weight,
            mask.reshape(-1, mask.shape[-1]).bool(),
            zero_inactive=False,
            backend=self.backend,
        )
        return y.view(*x.shape[:-1], y.shape[-1])


class KernelReduce(nn.Module):
    """A routed ``o_proj``'s inference product (``RoutedProjection.fast_product``): the reduction over
    the head groups its router kept through ``ops.masked_reduce_gemm`` (at decode sizes the
    kernel reads only those groups' weight columns; elsewhere the masked dense product, the plain
    one where the routed attention has zeroed the skipped heads already). Holds a reference to the
    projection's Linear (its weight stays where it is saved from)."""

    def __init__(self, base_layer: nn.Linear, backend: str) -> None:
        super().__init__()
        self.__dict__["base_layer"] = base_layer  # a reference, not a submodule
        self.backend = backend

    def forward(self, x: torch.Tensor, mask: torch.Tensor, zeroed: bool) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        m2 = mask.reshape(-1, mask.shape[-1]).bool()
        y = ops.masked_reduce_gemm(
            x2, self.base_layer.weight, m2, input_is_masked=zeroed, backend=self.backend
        )  # fmt: skip
        return y.view(*x.shape[:-1], y.shape[-1])


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
        h = ops.masked_out_gemm(x2, mlp.gate_proj.weight, m2, mlp.up_proj.weight, backend=self.backend)
        y = ops.masked_reduce_gemm(h, proj.base_layer.weight, m2, input_is_masked=True, backend=self.backend)
        return y.view(*shape[:-1], y.shape[-1])


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

    def runtime_blocks(self, layer: nn.Module, index: int, head_dim: int):
        """WIDE's routed blocks (``blocks.py``) for the inference runtime."""
        from compresskit_wide.blocks import wide_blocks

        return wide_blocks(
            layer, head_dim, self.config.backend, attention=self.config.attention, count=self.config.track_stats
        )

    def convert(self, model: nn.Module) -> nn.Module:
        routed_attention = False
        for module in list(model.modules()):  # (a list: fast_decide adds modules)
            if isinstance(module, RoutedProjection):
                module.track_stats = self.config.track_stats
                if module.router is not None and self.config.backend != "torch":
                    module.fast_decide = KernelRouter(module.router, self.config.backend)
        for layer in decoder_layers(model):
            if isinstance(getattr(layer.mlp, "down_proj", None), RoutedProjection):
                replace_module(layer, "mlp", KernelMLP(layer.mlp, self.config.backend))
            attn = getattr(layer, "self_attn", None)
            o_proj = getattr(attn, "o_proj", None)
            if not (self.config.attention and isinstance(o_proj, RoutedProjection)):
                continue
            base = o_proj.base_layer
            if self.config.backend != "torch" and type(base) is nn.Linear and base.bias is None:
                o_proj.fast_product = KernelReduce(base, self.config.backend)  # else the masked dense product
            if o_proj.leader is None:
                q = getattr(attn, "q_proj", None)
                if type(q) is nn.Linear and q.bias is None:  # else q stays dense (exact either way)
                    replace_module(attn, "q_proj", KernelQ(q, o_proj, self.config.backend))
                attn._wide_backend = self.config.backend
                routed_attention = True
        if routed_attention:
            register_attention()
            model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
        return model
