"""The runtime's forward: embedding, then per decoder layer ``x = x + attention(x)`` and
``x = x + mlp(x)`` (blocks that apply their own norm: ``blocks.py``), a final norm and the LM head,
over a static KV cache. On a GPU a prompt runs compiled (symbolic shapes) and decode steps compiled and
as CUDA graphs; on a CPU everything runs eagerly.

Shapes: ``B`` sequences, ``T`` new tokens, ``S`` cache slots, ``H`` / ``Hkv`` query / KV heads of
``D`` each (read per layer from the projections, so pruned models need no other config).

Batches are left-padded: every sequence's tokens end at the same cache slot, and ``valid`` (``[B, S]``)
says which slots hold real tokens. A token's position (for RoPE) is its slot minus its sequence's
padding.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from compresskit.errors import CompressKitError, RuntimeUnsupportedError
from compresskit.modeling import decoder_layers
from compresskit.routing import RoutedProjection, measured_sparsity
from compresskit.runtime.blocks import MLP, Attention, Block, Step, base_module
from compresskit.tokens import token_mask

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
KEPT_CACHES = 4  # caches (with their decode graphs) a runtime keeps for reuse, by batch and size
PREFILL_BUCKET = 256  # a captured prefill serves prompts of its length rounded up to a multiple of this
SHORT_PREFILL_BUCKET = 16  # the least rows a captured prefill runs (prefill_bucket)
KEPT_PREFILL_GRAPHS = 2  # captured prefills a cache keeps (the most recently used)
# compilations torch.compile keeps per block class: one per model width, batch, cache size and padding seen
# (dense and a pruned model share the dense block classes); past this the blocks would run eagerly
RECOMPILE_LIMIT = 64
# block classes one process may compile that share ``Block.forward`` (torch.compile counts compilations per
# function): dense, a plugin's, the baselines'
BLOCK_KINDS = 8


@dataclass
class StaticCache:
    """Keys and values of every layer, ``[B, Hkv, S, D]`` each, preallocated; ``valid``: ``[B, S]``
    (True where a slot holds a real token); ``pad``: ``[B]`` each sequence's left padding; ``end``:
    the first free slot; ``cos, sin``: ``[S, D]`` the rotary tables of positions ``0..S-1``;
    ``slot_ids``: ``arange(S)``. A decode graph, once captured, is kept with the cache it writes (one
    for padded batches, one for unpadded: a block may choose its path by ``Step.padded``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    pad: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_ids: torch.Tensor
    end: int = 0
    padded: bool = False
    graphs: dict[bool, _DecodeGraph] = field(default_factory=dict)  # by ``padded`` (blocks may branch on it)
    prefills: dict[int, _PrefillGraph] = field(default_factory=dict)  # by bucket length, least recent first

    @property
    def size(self) -> int:
        return self.valid.shape[1]

    def check_room(self, tokens: int) -> None:
        """Refuse, with one clear line, ``tokens`` more tokens than the cache has slots left."""
        if self.end + tokens > self.size:
            raise CompressKitError(f"runtime: {self.end + tokens} tokens do not fit the cache of {self.size} slots")

    def reset(self) -> None:
        """Empty the cache for a new batch of the same size (the keys need no clearing: unwritten
        slots are never seen)."""
        self.valid.zero_()
        self.pad.zero_()
        self.end, self.padded = 0, False


@dataclass
class _PrefillGraph:
    """A fresh prompt's prefill of ``bucket`` tokens captured as a CUDA graph: copy the prompt into
    the front of ``ids``, mark its tokens in ``valid`` (the tail is padding that the causal attention
    keeps away from them and the routers do not count), its last position into ``last``, replay, read
    ``logits`` (that position's)."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [B, bucket]
    valid: torch.Tensor  # [B, bucket]
    last: torch.Tensor  # [1]
    logits: torch.Tensor  # [B, 1, V]


@dataclass
class _DecodeGraph:
    """One decode step captured as a CUDA graph: write the token into ``ids``, its slot into ``slot``,
    replay, read ``logits``. The step also leaves its greedy token in ``next`` and feeds itself: it
    writes that token into ``ids`` and advances ``slot``, so greedy replays can follow each other with
    no host work between them."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [B, 1]
    slot: torch.Tensor  # [1]
    logits: torch.Tensor  # [B, V]
    next: torch.Tensor  # [B]


def _compile(block: nn.Module, prefill: bool = False):
    """A decode step's block: one graph of static shapes. A prompt's: symbolic shapes (one compilation
    for every length), where a plugin's block may still break its graph. Block classes that inherit
    ``Block.forward`` share its compilations, so the limit covers ``BLOCK_KINDS`` of them."""
    config = torch._dynamo.config
    limit = RECOMPILE_LIMIT * BLOCK_KINDS
    config.recompile_limit = max(config.recompile_limit, limit)
    if hasattr(config, "accumulated_recompile_limit"):  # (a cap over all of a function's compilations)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, limit)
    return torch.compile(block, fullgraph=not prefill, dynamic=prefill)


def _resolve(flag: bool | str, name: str, device: torch.device, graphable: bool, why: str) -> bool:
    if flag == "auto":
        return device.type == "cuda" and graphable
    if flag and device.type != "cuda" and name == "graphs":
        raise CompressKitError("runtime: CUDA graphs need a CUDA device; this model is on the CPU (graphs: false)")
    if flag and not graphable:
        raise CompressKitError(f"runtime: {name} asked, but {why}")
    return bool(flag)


def _unrunnable(layers, blocks, own: list, executor) -> str | None:
    """Why the runtime cannot run ``layers``: the first layer whose routed modules would fall to the runtime's own
    blocks (which read the modules under the routing wrappers' decisions kept between calls), because its
    method's blocks do not take them; None where every routed module runs as a method's block."""
    for i, (layer, pair) in enumerate(zip(layers, blocks, strict=True)):
        if not any(b in own and not b.graphable for b in pair):
            continue
        if any("lora_" in name for name, _ in layer.named_modules()):
            return (
                f"layer {i} carries LoRA adapters that are not merged, which its method's blocks do not run; merge "
                "them first (training stage lora: merge: true, or compresskit.modeling.lora_merged around the "
                "runtime's use; compresskit generate, bench and apply's speed columns do)"
            )
        method = f"executor {type(executor).__name__}" if executor is not None else "its pruner"
        return (
            f"layer {i} is routed and {method} gives no runtime block for it; score it through transformers "
            "(evaluation.engine: transformers), or give the method runtime blocks (docs/plugins.md)"
        )
    return None


def _eager_reason(blocks) -> str:
    """Why ``blocks`` cannot be compiled and graphed: the first one that keeps state."""
    for i, pair in enumerate(blocks):
        if not all(b.graphable for b in pair):
            return f"layer {i}'s blocks keep state between calls (graphable: false)"
    return "a block keeps state between calls"


def prefill_bucket(tokens: int) -> int:
    """The length of the captured prefill that serves a prompt of ``tokens``: rounded up to a multiple of
    ``PREFILL_BUCKET``; a prompt of up to half of it to the next power of two (at least ``SHORT_PREFILL_BUCKET``),
    so that a short prompt runs fewer than twice its rows (or the least) and a long one at most ``PREFILL_BUCKET - 1``
    more."""
    if tokens > PREFILL_BUCKET // 2:
        return -(-tokens // PREFILL_BUCKET) * PREFILL_BUCKET
    return max(SHORT_PREFILL_BUCKET, 1 << (tokens - 1).bit_length())


class Runtime:
    """The runtime over a loaded Llama-family ``model``: its weights are used where they are.

    ``executor``: a plugin executor whose ``runtime_blocks`` supply the blocks of the layers it
    runs (the runtime's dense blocks where it gives None). ``dense``: run the model's base computation (routing
    wrappers looked through), e.g. the dense reference of a routed model. ``compile`` / ``graphs``:
    decode steps compiled with ``torch.compile`` / replayed as CUDA graphs ("auto": on a GPU, when
    every block allows it; a compiled runtime compiles the prompt's prefill too, with symbolic shapes).
    ``prefill_graphs``: with CUDA graphs, a fresh unpadded prompt's prefill is captured too, once per
    ``prefill_bucket`` of its length (the host then launches one graph instead of every kernel; "auto": wherever
    decode steps are graphed)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        executor=None,
        dense: bool = False,
        compile: bool | str = "auto",
        graphs: bool | str = "auto",
        prefill_graphs: bool | str = "auto",
    ) -> None:
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED:
            raise RuntimeUnsupportedError(
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
        supplied = executor.runtime_blocks(model, self.head_dim) if executor is not None else None
        if supplied is not None and len(supplied) != len(self.layers):
            raise CompressKitError(
                f"runtime: executor {type(executor).__name__} supplied blocks for {len(supplied)} layers; "
                f"the model has {len(self.layers)}"
            )
        self.blocks: list[tuple[Block, Block]] = []
        own = []  # the runtime's own blocks (where the method supplied none)
        for i, layer in enumerate(self.layers):
            attn, mlp = supplied[i] if supplied is not None else (None, None)
            if attn is None:
                attn = Attention(layer, self.head_dim, dense=dense)
                own.append(attn)
            if mlp is None:
                mlp = MLP(layer, dense=dense)
                own.append(mlp)
            self.blocks.append((attn, mlp))
        if not dense:  # routed modules run only as a method's blocks: never eagerly in the runtime's own
            refused = _unrunnable(self.layers, self.blocks, own, executor)
            if refused:
                raise RuntimeUnsupportedError(f"runtime: {refused}")
        graphable = all(b.graphable for pair in self.blocks for b in pair)
        why = "a block of this model keeps state between calls"
        # why a GPU runs this model eagerly, for the reports (None where it need not)
        self.eager_reason = None if graphable else _eager_reason(self.blocks)
        self.compiled = _resolve(compile, "compile", self.device, graphable, why)
        self.graphs = _resolve(graphs, "graphs", self.device, graphable, why)
        if prefill_graphs is True and not self.graphs:
            raise CompressKitError("runtime: prefill_graphs asked, but decode steps are not replayed as CUDA graphs")
        self.prefill_graphs = self.graphs and prefill_graphs in (True, "auto")
        self._caches: dict[tuple[int, int], StaticCache] = {}
        self._steps = self.blocks  # what a decode step calls: the blocks, or their compiled forms
        self._prefill = self.blocks  # what a prompt's forward calls
        if self.compiled:  # one compilation per block class and shape, shared by every layer
            self._steps = [(_compile(a), _compile(m)) for a, m in self.blocks]
            # prompts: one compilation with symbolic lengths (elementwise work fused, fewer launches)
            self._prefill = [(_compile(a, prefill=True), _compile(m, prefill=True)) for a, m in self.blocks]

    @property
    def mode(self) -> str:
        """How decode steps run: "eager", "compiled", "CUDA graphs" or "compiled + CUDA graphs", with
        " (prefill too)" where a prompt's prefill is captured as well."""
        parts = [p for p, on in (("compiled", self.compiled), ("CUDA graphs", self.graphs)) if on]
        return " + ".join(parts) + (" (prefill too)" if self.prefill_graphs else "") if parts else "eager"

    def stat_blocks(self) -> list[nn.Module]:
        """What counts the decisions the runtime runs (``stat_tokens`` / ``stat_skipped``): the blocks that
        route, and the routed modules that the other blocks run as they are (a layer whose LoRA adapters are
        not merged): without them a report would leave those layers' skips out."""
        found: dict[int, nn.Module] = {}
        for block in (b for pair in self.blocks for b in pair):
            if hasattr(block, "stat_skipped"):
                found[id(block)] = block
            else:
                found.update((id(m), m) for m in block.modules() if isinstance(m, RoutedProjection))
        return list(found.values())

    def reset_counts(self, pruner=None) -> None:
        """Start the realised sparsity's count afresh: the counting blocks', and ``pruner``'s own count of its
        routed modules."""
        for block in self.stat_blocks():
            block.reset_stats()
        if pruner is not None:
            pruner.reset_sparsity(self.model)

    def counted_sparsity(self, pruner=None):
        """The realised sparsity (a ``SparsityReport``) since :meth:`reset_counts`: from the blocks that count
        (None, not measured, where one of them does not), else ``pruner``'s own count (None without one)."""
        blocks = self.stat_blocks()
        if blocks:
            if not all(b.counting for b in blocks):
                return None
            counted = measured_sparsity(blocks, self.config)
            return pruner.sparsity_of(self.model, counted) if pruner is not None else counted
        return pruner.sparsity(self.model) if pruner is not None else None

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
            hkv = base_module(layer.self_attn.k_proj).out_features // self.head_dim
            shape = (batch, hkv, slots, self.head_dim)
            keys.append(torch.zeros(shape, device=self.device, dtype=self.dtype))
            values.append(torch.zeros(shape, device=self.device, dtype=self.dtype))
        valid = torch.zeros(batch, slots, dtype=torch.bool, device=self.device)
        slot_ids = torch.arange(slots, device=self.device)
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        with torch.inference_mode(False), torch.no_grad():
            cos, sin = self.rotary(probe, slot_ids[None])  # [1, S, D]
        pad = torch.zeros(batch, dtype=torch.long, device=self.device)
        return StaticCache(keys, values, valid, pad, cos[0], sin[0], slot_ids)

    def release(self) -> None:
        """Drop every kept cache with its captured graphs (their memory pools go with them) and hand the
        freed memory back to the device: what a caller does before another model uses the same GPU."""
        self._caches.clear()
        if self.device.type == "cuda":
            gc.collect()  # (a captured graph may sit in a reference cycle)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _cache_for(self, batch: int, slots: int) -> StaticCache:
        """A cache of at least ``slots`` slots, reused (with its decode graph) between calls of one
        size (the ``KEPT_CACHES`` most recently used are kept): on a GPU the size is rounded up to a
        multiple of 256, so few graphs serve many lengths and cuBLAS sees aligned strides."""
        if self.graphs or self.device.type == "cuda":
            rounded = -(-slots // 256) * 256
            limit = getattr(self.config, "max_position_embeddings", None) or rounded
            window = getattr(self.config, "sliding_window", None) or rounded
            slots = max(slots, min(rounded, limit, window))
        key = (batch, slots)
        cache = self._caches.pop(key, None)
        if cache is None:
            while len(self._caches) >= KEPT_CACHES:  # the least recently used goes, with its graph
                self._caches.pop(next(iter(self._caches)))
            cache = self.new_cache(batch, slots)
        self._caches[key] = cache  # (most recently used last)
        cache.reset()
        return cache

    # -- the forward ---------------------------------------------------------------------------
    def _layers(self, x: torch.Tensor, step: Step, cache: StaticCache, blocks) -> torch.Tensor:
        # each block adds the one before it inside its own graph (the first adds zeros), and hands the next
        # block what it carries (the contract: blocks.py)
        delta, carry = torch.zeros_like(x), None
        for i, (attn, mlp) in enumerate(blocks):
            x, delta, carry = attn(x, delta, carry, step, cache.keys[i], cache.values[i])
            x, delta, carry = mlp(x, delta, carry, step)  # x: [B, T, hidden]
        return x + delta

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(x))

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, cache: StaticCache, *, new_valid: torch.Tensor | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` of ``ids: [B, T]`` written at cache slots ``[end, end + T)`` (compiled
        with symbolic shapes where decode steps are compiled, else eager; captured as a CUDA graph
        with ``prefill_graphs``); ``new_valid: [B, T]`` marks their padding (default: all real).
        ``last_only``: the last position's logits ``[B, 1, V]`` alone (what generation reads; the
        head's product over every position is the largest one of a long prompt's prefill)."""
        b, t = ids.shape
        cache.check_room(t)
        if self.prefill_graphs and last_only and not cache.end and not cache.padded and new_valid is None:
            bucket = prefill_bucket(t)
            if bucket <= cache.size:
                return self._prefill_replay(cache, ids, bucket)
        start, stop = cache.end, cache.end + t
        cache.valid[:, start:stop] = True if new_valid is None else new_valid
        slots = cache.slot_ids[start:stop]
        positions = (slots[None, :] - cache.pad[:, None]).clamp_min(0)  # [B, T]
        mask = None  # a fresh unpadded prompt: plain causal
        if start or cache.padded:  # query t (slot start + t) sees the valid slots up to its own: [B, 1, T, stop]
            allowed = (cache.slot_ids[None, :stop] <= slots[:, None])[None] & cache.valid[:, None, :stop]
            mask = allowed[:, None]
        step = Step(cache.cos[positions], cache.sin[positions], slots, mask, new_valid, cache.padded)
        x = self.model.model.embed_tokens(ids)  # [B, T, hidden]
        with token_mask(new_valid):  # a routed model's own modules count (and route) the real tokens only
            x = self._layers(x, step, cache, self._prefill)
        cache.end = stop
        return self._head(x[:, -1:] if last_only else x)

    def _prefill_step(self, cache: StaticCache, ids: torch.Tensor, valid: torch.Tensor, last: torch.Tensor):
        """A fresh prompt's prefill with a padded tail: ``ids, valid: [B, T]`` (the prompt's tokens
        first, ``valid`` False on the tail), written at slots ``[0, T)``; logits ``[B, 1, V]`` at
        position ``last: [1]``, the prompt's last token. The tail changes nothing the prompt's tokens
        compute (causal attention: each token sees only those before it) and is not counted by the
        routers; its slots are written but never seen (a decode step sees valid slots only, and writes
        each before it reads it). Every index is a tensor: what a CUDA graph replays."""
        t = ids.shape[1]
        slots = cache.slot_ids[:t]
        step = Step(cache.cos[:t][None], cache.sin[:t][None], slots, None, valid, False)
        x = self._layers(self.model.model.embed_tokens(ids), step, cache, self._prefill)
        return self._head(x.index_select(1, last))

    def _prefill_replay(self, cache: StaticCache, ids: torch.Tensor, bucket: int) -> torch.Tensor:
        """The prefill of the unpadded prompt ``ids: [B, T]`` into the empty ``cache`` through the graph
        captured for ``bucket`` tokens (captured on first use)."""
        g = cache.prefills.pop(bucket, None)
        if g is None:
            while len(cache.prefills) >= KEPT_PREFILL_GRAPHS:
                cache.prefills.pop(next(iter(cache.prefills)))
            g = self._capture_prefill(cache, ids.shape[0], bucket)
        cache.prefills[bucket] = g  # (most recently used last)
        t = ids.shape[1]
        g.ids[:, :t].copy_(ids)
        g.valid.zero_()
        g.valid[:, :t] = True
        g.last.fill_(t - 1)
        g.graph.replay()
        cache.valid[:, :t] = True
        cache.end = t
        return g.logits

    def _capture_prefill(self, cache: StaticCache, batch: int, bucket: int) -> _PrefillGraph:
        """Capture the prefill of ``bucket`` tokens into ``cache``."""
        ids = torch.full((batch, bucket), 3, dtype=torch.long, device=self.device)
        valid = torch.ones(batch, bucket, dtype=torch.bool, device=self.device)
        last = torch.full((1,), bucket - 1, dtype=torch.long, device=self.device)
        step = lambda: self._prefill_step(cache, ids, valid, last)  # noqa: E731
        graph, logits = self._record(step, step)
        return _PrefillGraph(graph, ids, valid, last, logits)

    def _record(self, warm: Callable[[], Any], step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """``step`` captured as a CUDA graph, with what it returns. ``warm`` runs twice first, on a side
        stream (compilation, autotuning); the blocks' counters are put back after it, so that only
        replays are counted."""
        counters = self._counters()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                warm()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        self._restore(counters)
        return graph, out

    def _decode_step(self, cache: StaticCache, ids: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """One decode step of ``ids: [B, 1]`` at cache slot ``slot: [1]`` -> logits ``[B, V]``, with
        every index a tensor (what a CUDA graph replays)."""
        cache.valid.index_fill_(1, slot, True)
        positions = (slot[None, :] - cache.pad[:, None]).clamp_min(0)  # [B, 1]
        allowed = (cache.slot_ids[None, :] <= slot[:, None]) & cache.valid  # [B, S]
        step = Step(cache.cos[positions], cache.sin[positions], slot, allowed[:, None, None], None, cache.padded)
        x = self._layers(self.model.model.embed_tokens(ids), step, cache, self._steps)
        return self._head(x)[:, -1]

    def _feed_step(self, cache: StaticCache, ids: torch.Tensor, slot: torch.Tensor):
        """A decode step that feeds the next: its greedy token ``[B]`` goes into ``ids`` and ``slot``
        advances by one. Returns ``(logits [B, V], token [B])``."""
        logits = self._decode_step(cache, ids, slot)
        token = logits.argmax(-1)
        ids.copy_(token[:, None])
        slot.add_(1)
        return logits, token

    def _graph(self, cache: StaticCache, token: torch.Tensor) -> _DecodeGraph:
        g = cache.graphs.get(cache.padded)
        if g is None:
            g = cache.graphs[cache.padded] = self._capture(cache, token)
        return g

    @torch.inference_mode()
    def greedy_tokens(self, cache: StaticCache, first: torch.Tensor, count: int) -> Iterator[list[int]]:
        """Greedy decoding from ``first: [B]`` (the token after the cache's content, on the device):
        yields ``count`` lists of ``B`` tokens, ``first``'s then each step's. Each step picks its token on
        the device and feeds it to the next (``_feed_step``, the captured graph with graphs), and the
        host enqueues a step before it reads the token of the one before: the GPU never waits for the
        host between steps. So when the caller stops early, one more step has run (written to the cache,
        and counted by routing blocks) than it read. Needs compiled decode steps or graphs."""
        if not (self.compiled or self.graphs):
            raise CompressKitError("runtime: greedy_tokens needs compiled decode steps or CUDA graphs")
        if count <= 0:
            return
        b = first.shape[0]
        if self.graphs:
            g = self._graph(cache, first)
            g.ids.copy_(first[:, None])
            g.slot.fill_(cache.end)

            def advance() -> torch.Tensor:
                g.graph.replay()
                return g.next
        else:
            ids, slot = first[:, None].clone(), cache.slot_ids[cache.end : cache.end + 1].clone()

            def advance() -> torch.Tensor:
                return self._feed_step(cache, ids, slot)[1]

        cuda = self.device.type == "cuda"
        host = torch.empty((count, b), dtype=torch.long, pin_memory=cuda)
        ready: list = [None] * count

        def stage(i: int, token: torch.Tensor) -> None:  # step i's tokens on their way to the host
            host[i].copy_(token, non_blocking=cuda)
            if cuda:
                ready[i] = torch.cuda.Event()
                ready[i].record()

        stage(0, first)
        for i in range(count):
            if i + 1 < count:
                cache.check_room(1)
                stage(i + 1, advance())
                cache.end += 1
            if ready[i] is not None:
                ready[i].synchronize()
            yield host[i].tolist()

    @torch.inference_mode()
    def decode(self, token: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """Logits ``[B, V]`` of one new token per sequence (``token: [B]``) at the cache's end."""
        cache.check_room(1)
        if not (self.graphs or self.compiled):
            return self.forward(token[:, None], cache)[:, -1]
        if not self.graphs:
            slot = cache.slot_ids[cache.end : cache.end + 1]
            logits = self._decode_step(cache, token[:, None], slot)
        else:
            g = self._graph(cache, token)
            g.ids.copy_(token[:, None])
            g.slot.fill_(cache.end)
            g.graph.replay()
            logits = g.logits
        cache.end += 1
        return logits

    def _capture(self, cache: StaticCache, token: torch.Tensor) -> _DecodeGraph:
        """Capture the decode step at the cache's end. The warm-up runs compute that same step (without
        feeding the next), so they write what the step writes."""
        ids = token[:, None].clone()
        slot = cache.slot_ids[cache.end : cache.end + 1].clone()
        graph, (logits, token) = self._record(
            lambda: self._decode_step(cache, ids, slot), lambda: self._feed_step(cache, ids, slot)
        )
        return _DecodeGraph(graph, ids, slot, logits, token)

    def _counters(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The routing blocks' counters with a copy of their values, for :meth:`_restore`."""
        return [(buf, buf.clone()) for b in self.stat_blocks() for n, buf in b.named_buffers() if "stat_" in n]

    @staticmethod
    def _restore(counters: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for buf, saved in counters:
                buf.copy_(saved)

    def warm_up(self, batch: int, prompt_tokens: int, max_new_tokens: int) -> float:
        """Compile and capture, outside any clock, what ``generate`` of ``batch`` prompts of up to
        ``prompt_tokens`` tokens and ``max_new_tokens`` new ones will run: a prefill of that shape and
        two decode steps into the cache it will use. Routing blocks' counters are left as they were.
        Returns the seconds it took (0 where nothing is compiled or captured)."""
        if not (self.compiled or self.graphs):
            return 0.0
        t0 = time.perf_counter()
        counters = self._counters()
        cache = self._cache_for(batch, prompt_tokens + max_new_tokens)
        ids = torch.full((batch, prompt_tokens), 3, dtype=torch.long, device=self.device)
        with torch.no_grad():
            first = self.forward(ids, cache, last_only=True)[:, -1].argmax(-1)
        for _ in self.greedy_tokens(cache, first, min(2, max_new_tokens)):
            pass
        self._sync()
        self._restore(counters)
        cache.reset()
        return time.perf_counter() - t0

    def time_decode(self, batch: int, context: int, steps: int) -> float:
        """Seconds of ``steps`` greedy decode steps of ``batch`` sequences after ``context`` cached
        positions, on the cache an earlier :meth:`generate` of ``batch`` prompts of ``context`` tokens and
        ``steps`` new ones used: its slots from ``context`` on are rewound and written again, the ones
        before kept as they are (a step's time does not depend on the values it reads). What a benchmark
        repeats instead of a whole generation when only the decode is timed."""
        cache = self._cache_for(batch, context + steps)
        cache.valid[:, :context] = True
        cache.end = context
        first = torch.zeros(batch, dtype=torch.long, device=self.device)
        self._sync()
        t0 = time.perf_counter()
        if self.compiled or self.graphs:
            for _ in self.greedy_tokens(cache, first, steps):
                pass
        else:  # as generate's eager decode: the host reads each step's token before the next
            token = first
            for _ in range(steps - 1):
                token = self.decode(token, cache).argmax(-1)
                token.tolist()
        self._sync()
        return time.perf_counter() - t0

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
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and longest + max_new_tokens > limit:
            raise CompressKitError(
                f"runtime: a prompt of {longest} tokens and {max_new_tokens} new ones exceed the model's "
                f"{limit} positions"
            )
        cache = self._cache_for(b, longest + max_new_tokens)
        ids = torch.zeros(b, longest, dtype=torch.long, device=self.device)
        real = torch.zeros(b, longest, dtype=torch.bool, device=self.device)
        for row, p in enumerate(prompts):
            ids[row, longest - len(p) :] = torch.tensor(p, device=self.device)
            real[row, longest - len(p) :] = True
            cache.pad[row] = longest - len(p)
        cache.padded = any(len(p) < longest for p in prompts)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        out: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b

        def take(tokens: list[int]) -> bool:
            """Record one step's tokens; whether any sequence goes on."""
            for row, value in enumerate(tokens):
                if not done[row]:
                    out[row].append(value)
                    if on_token is not None:
                        on_token(row, value)
                    done[row] = value == eos_token_id
            return not all(done)

        self._sync()
        t0 = time.perf_counter()
        logits = self.forward(ids, cache, new_valid=real if cache.padded else None, last_only=True)[:, -1]
        self._sync()  # the GPU's work is done when the clock is read
        first = time.perf_counter()
        if temperature <= 0 and (self.compiled or self.graphs):  # the device feeds itself, the host reads behind
            steps = self.greedy_tokens(cache, logits.argmax(-1), max_new_tokens)
            for tokens in steps:
                if not take(tokens):
                    break
            steps.close()
        else:
            for step in range(max_new_tokens):
                token = _pick(logits, temperature, top_p, gen)  # [B]
                if not take(token.tolist()) or step == max_new_tokens - 1:  # one synchronisation a step
                    break
                logits = self.decode(token, cache)
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
