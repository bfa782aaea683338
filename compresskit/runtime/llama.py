"""The runtime's forward: embedding, then per decoder layer ``x += attention(norm(x))`` and
``x += mlp(norm(x))``, a final norm and the LM head, over a static KV cache.

Shapes: ``B`` sequences, ``T`` new tokens, ``S`` cache slots, ``H`` / ``Hkv`` query / KV heads of
``D`` each (read per layer from the projections, so pruned models need no other config).

Batches are left-padded: every sequence's tokens end at the same cache slot, and ``valid`` (``[B, S]``)
says which slots hold real tokens. A token's position (for RoPE) is its slot minus its sequence's
padding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from compresskit.errors import CompressKitError
from compresskit.modeling import decoder_layers
from compresskit.tokens import token_mask

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class StaticCache:
    """Keys and values of every layer, ``[B, Hkv, S, D]`` each, preallocated; ``valid``: ``[B, S]``
    (True where a slot holds a real token); ``end``: the first free slot."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    pad: torch.Tensor  # [B] left padding of each sequence
    end: int = 0

    @property
    def size(self) -> int:
        return self.valid.shape[1]


class Runtime:
    """The runtime over a loaded Llama-family ``model`` (its modules are used as they are)."""

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED:
            raise CompressKitError(
                f"runtime: model type {getattr(cfg, 'model_type', None)!r} is not supported; supported: "
                f"{', '.join(SUPPORTED)}"
            )
        self.model = model
        self.config = cfg
        self.layers = decoder_layers(model)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = model.model.rotary_emb
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    # -- the cache -----------------------------------------------------------------------------
    def new_cache(self, batch: int, slots: int) -> StaticCache:
        window = getattr(self.config, "sliding_window", None)
        if window and slots > window and getattr(self.config, "use_sliding_window", True):
            raise CompressKitError(
                f"runtime: this model attends over a sliding window of {window} tokens, which the runtime does not "
                f"implement; keep the prompt and the new tokens within {window} (asked: {slots})"
            )
        keys, values = [], []
        for layer in self.layers:
            hkv = layer.self_attn.k_proj.out_features // self.head_dim
            shape = (batch, hkv, slots, self.head_dim)
            keys.append(torch.zeros(shape, device=self.device, dtype=self.dtype))
            values.append(torch.zeros(shape, device=self.device, dtype=self.dtype))
        valid = torch.zeros(batch, slots, dtype=torch.bool, device=self.device)
        return StaticCache(keys, values, valid, torch.zeros(batch, dtype=torch.long, device=self.device))

    # -- the forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: StaticCache, *, new_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, V]`` of ``ids: [B, T]`` written at cache slots ``[end, end + T)``;
        ``new_valid: [B, T]`` marks their padding (default: all real)."""
        b, t = ids.shape
        start, stop = cache.end, cache.end + t
        if stop > cache.size:
            raise CompressKitError(f"runtime: {stop} tokens do not fit the cache of {cache.size} slots")
        cache.valid[:, start:stop] = True if new_valid is None else new_valid
        slots = torch.arange(start, stop, device=ids.device)
        positions = (slots[None, :] - cache.pad[:, None]).clamp_min(0)  # [B, T]
        # query t (slot start + t) sees the valid slots up to its own: [B, 1, T, stop]
        keys = torch.arange(stop, device=ids.device)
        allowed = (keys[None, :] <= slots[:, None])[None] & cache.valid[:, None, :stop]
        allowed = allowed[:, None]
        x = self.model.model.embed_tokens(ids)  # [B, T, hidden]
        cos, sin = self.rotary(x, positions)
        with token_mask(new_valid):  # a dynamic pruner counts (and routes) the real tokens only
            for i, layer in enumerate(self.layers):
                x = x + self._attention(layer, layer.input_layernorm(x), cos, sin, cache, i, start, stop, allowed)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.end = stop
        return self.model.lm_head(self.model.model.norm(x))

    def _attention(self, layer, x, cos, sin, cache, i, start, stop, allowed) -> torch.Tensor:
        attn = layer.self_attn
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = attn.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = attn.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm on each head's queries and keys
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # transformers' own (cos, sin: [B, T, D])
        cache.keys[i][:, :, start:stop] = k
        cache.values[i][:, :, start:stop] = v
        out = F.scaled_dot_product_attention(
            q,
            cache.keys[i][:, :, :stop],
            cache.values[i][:, :, :stop],
            attn_mask=allowed,
            scale=getattr(attn, "scaling", None),
            enable_gqa=True,
        )  # [B, H, T, D]
        return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    # -- generation ----------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        seed: int = 0,
        on_token: Callable[[int, int], None] | None = None,
    ) -> GenerationResult:
        """Continue each of ``prompts`` (token ids) by up to ``max_new_tokens``: greedy at temperature
        0, else sampled (``top_p``); a sequence stops at ``eos_token_id``. ``on_token(row, token)`` is
        called for each new token as it comes (streaming)."""
        if not prompts or any(not p for p in prompts):
            raise CompressKitError("runtime: every prompt needs at least one token")
        b, longest = len(prompts), max(len(p) for p in prompts)
        cache = self.new_cache(b, longest + max_new_tokens)
        ids = torch.zeros(b, longest, dtype=torch.long, device=self.device)
        real = torch.zeros(b, longest, dtype=torch.bool, device=self.device)
        for row, p in enumerate(prompts):
            ids[row, longest - len(p) :] = torch.tensor(p, device=self.device)
            real[row, longest - len(p) :] = True
            cache.pad[row] = longest - len(p)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        out: list[list[int]] = [[] for _ in range(b)]
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        self._sync()
        t0 = time.perf_counter()
        logits = self.forward(ids, cache, new_valid=real)[:, -1]
        self._sync()  # the GPU's work is done when the clock is read
        first = time.perf_counter()
        for step in range(max_new_tokens):
            token = _pick(logits, temperature, top_p, gen)  # [B]
            for row in range(b):
                if not done[row]:
                    out[row].append(int(token[row]))
                    if on_token is not None:
                        on_token(row, int(token[row]))
            if eos_token_id is not None:
                done |= token == eos_token_id
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            logits = self.forward(token[:, None], cache)[:, -1]
        self._sync()
        end = time.perf_counter()
        return GenerationResult(out, first - t0, end - first, sum(len(o) for o in out))


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # the new tokens of each prompt
    prefill_seconds: float  # to the first token's logits (TTFT)
    decode_seconds: float  # the rest
    new_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.prefill_seconds + self.decode_seconds, 1e-9)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """The next token of each row of ``logits: [B, V]``: the most likely at temperature 0, else a
    sample from the smallest set of tokens whose probability reaches ``top_p``."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the tokens before the mass is reached, and the one reaching it
        sorted_p = torch.where(keep, sorted_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
