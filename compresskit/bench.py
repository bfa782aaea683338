"""Time to first token (TTFT) and time per output token (TPOT) of a model on the runtime, beside its
dense base on the same runtime and the dense base through transformers' ``generate``, side by side in
one process: medians over repeats, for every batch size and prompt length asked for, with the
realised sparsity of each measured run."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from compresskit import plugins
from compresskit.errors import CompressKitError
from compresskit.interfaces import RunContext
from compresskit.memory import meta_model, size
from compresskit.modeling import device_name
from compresskit.routing import RoutedPruner, RouterTap, dense_view, measured_sparsity
from compresskit.runtime import Runtime, runtime_for
from compresskit.runtime.blocks import is_routed

# Imported inside the functions that use them: psutil and transformers; so importing this module, and running the
# commands that do not need them (`--help` and `validate` first), stays fast.


@dataclass
class Row:
    model: str  # "compressed", "dense", "ideal half-width", "dense (transformers[, static cache])"
    batch: int
    prompt: int
    ttft_ms: float
    tpot_ms: float
    sparsity: float | None = None  # realised fraction of projection MACs skipped, where counted
    extra: dict[str, Any] = field(default_factory=dict)


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


# --shape: known configurations, built with random weights for speed-only runs
SHAPES = {
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        num_hidden_layers=32, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        num_hidden_layers=16, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
    ),
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        num_hidden_layers=30, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=2, vocab_size=512, rope_theta=10000.0, max_position_embeddings=4096,
    ),
}  # fmt: skip


HALVES = {True: "ideal half-width", "kv": "ideal half-width, half K/V"}  # shape_model's half -> the row's name


def shape_config(name: str, *, half: bool | str = False):
    """The ``LlamaConfig`` of the known configuration ``name``; ``half``: the ideal half-width model's
    (half the query heads and FFN channels, K/V heads kept; a ValueError where the heads do not halve);
    ``half="kv"``: that with half the K/V heads too (the bound where attention skips K/V reads)."""
    from transformers import LlamaConfig

    shape = dict(SHAPES[name])
    if half:
        heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
        kv_half = kv // 2 if half == "kv" else kv
        if heads % 2 or (half == "kv" and kv % 2) or (heads // 2) % kv_half:
            raise ValueError(f"--shape {name}: {heads} query heads over {kv} KV heads have no {HALVES[half]} model")
        shape["num_attention_heads"] = heads // 2
        shape["num_key_value_heads"] = kv_half
        shape["intermediate_size"] = shape["intermediate_size"] // 2
    return LlamaConfig(tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, **shape)


def shape_model(name: str, *, device, dtype, half: bool | str = False, seed: int = 0):
    """A Llama model of the known configuration ``name`` with random weights; ``half``: the ideal
    half-width model, the bound of width pruning at 50% on the same runtime."""
    from transformers import AutoModelForCausalLM

    config = shape_config(name, half=half)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def shape_weight_bytes(name: str, dtype: torch.dtype, *, transformers: str | None = None) -> tuple[int, list[str]]:
    """What ``shape_members`` holds in weights for the configuration ``name`` in ``dtype``: ``(bytes,
    the models that make it up)``: the model (a routing pruner's routers add well under 1%), the ideal half-width
    models where the shape has them, and with ``transformers="static"`` a dense copy of the model."""

    def params(config) -> int:
        return sum(p.numel() for p in meta_model(config).parameters())

    full = params(shape_config(name))
    total, models = full, ["the model"]
    for half, row in HALVES.items():
        try:
            total += params(shape_config(name, half=half))
            models.append(f"the {row} model")
        except ValueError:
            pass
    if transformers == "static":
        total += full
        models.append("a dense copy for transformers")
    return total * dtype.itemsize, models


SHAPE_MEMORY_SHARE = 0.8  # of the free memory, what a --shape run's weights may take: caches, activations, compiling


def available_bytes(device: torch.device) -> int:
    """Memory free for new tensors on ``device``: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def shape_memory_error(name: str, dtype: torch.dtype, device: torch.device, *, transformers: str | None = None):
    """Why the configuration ``name``'s members in ``dtype`` would not fit ``device``'s free memory (their
    weights above ``SHAPE_MEMORY_SHARE`` of it), naming what would fit; None where they fit."""
    free = available_bytes(device)
    need, models = shape_weight_bytes(name, dtype, transformers=transformers)
    if need <= SHAPE_MEMORY_SHARE * free:
        return None
    fits = lambda shape, dt: shape_weight_bytes(shape, dt)[0] <= SHAPE_MEMORY_SHARE * free  # noqa: E731
    smaller = [s for s in SHAPES if fits(s, dtype)]
    options = [f"a smaller --shape ({', '.join(smaller)})"] if smaller else ["more free memory"]
    if dtype.itemsize > 2 and fits(name, torch.bfloat16):
        options.insert(0, "--dtype bfloat16")
    return (
        f"--shape {name}: its weights take {size(need)} in {str(dtype).removeprefix('torch.')} ({', '.join(models)}) "
        f"and this {'GPU' if device.type == 'cuda' else 'machine'} has {size(free)} free; give " + " or ".join(options)
    )


def routed_pruner(method: str):
    """The pruner class registered as ``method`` (through the plugin registry), where it routes per token
    (``compresskit.routing.RoutedPruner``: what ``--shape`` builds with untrained routers); a
    ``CompressKitError`` naming the routed pruners otherwise."""

    def routes(name: str) -> bool:
        try:
            return issubclass(plugins.load("pruner", name), RoutedPruner)
        except CompressKitError:  # a plugin that does not load is no candidate
            return False

    try:
        cls = plugins.load("pruner", method)
    except CompressKitError as exc:
        raise CompressKitError(f"--method: {exc}") from None
    if not issubclass(cls, RoutedPruner):
        routed = [n for n in plugins.names("pruner") if routes(n)]
        raise CompressKitError(
            f"--method {method}: --shape builds models whose routers are calibrated, so it takes a routing "
            f"pruner ({', '.join(routed)}); time a saved run of {method} with compresskit bench MODEL"
        )
    return cls


def shape_members(
    shape: str,
    *,
    method: str,
    sparsity: float,
    device,
    dtype,
    transformers: str | None = None,
    consensus: list = (),
    **options,
) -> list:
    """The bench's members for a known ``shape`` (random weights): the routing pruner ``method`` (a
    plugin name) applied with untrained routers calibrated to skip ``sparsity`` of each router's groups
    ("compressed"), the same model under each ``consensus`` rule (:func:`consensus_members`), the same
    weights dense, the ideal half-width models where the shape has them (:data:`HALVES`), and
    with ``transformers`` ("dynamic" or "static", its cache) the dense model through transformers'
    ``generate`` (with the dynamic cache the routed model seen dense, no copy; with the static cache,
    which ``generate`` compiles on a GPU, a dense copy of the same weights, so that nothing routed is
    traced). ``options`` go to the runtimes (``compile``, ``graphs``)."""
    cls = routed_pruner(method)
    model = shape_model(shape, device=device, dtype=dtype)
    pruner = cls(cls.Config(**({"target_sparsity": sparsity} if "target_sparsity" in cls.Config.model_fields else {})))
    pruner.prepare(model, RunContext(model_config=model.config, device=device, dtype=dtype))
    model = pruner.finalize(model)
    calibrate_routers(model, sparsity)
    members = [Member("compressed", model, runtime_for(model, pruner, **options), pruner)]
    members += consensus_members(model, pruner, consensus, **options)
    members.append(Member("dense", model, Runtime(model, dense=True, **options)))
    for half, row in HALVES.items():
        try:
            small = shape_model(shape, device=device, dtype=dtype, half=half)
            members.append(Member(row, small, Runtime(small, **options)))
        except ValueError:
            pass  # no such half-width model of this shape (odd heads per KV head)
    if transformers == "dynamic":
        members.append(Member("dense (transformers)", model, transformers="dynamic"))
    elif transformers == "static":
        dense = shape_model(shape, device=device, dtype=dtype)  # the same seed: the same weights
        members.append(Member("dense (transformers, static cache)", dense, transformers="static"))
    return members


def consensus_label(rule) -> str:
    """The bench row of a consensus rule (the settings it was given): ``consensus (quorum 0.5, budget 0.6)``."""
    given = rule.model_dump(exclude_unset=True, exclude={"schema_version"})
    return "consensus (" + ", ".join(f"{k} {v}" for k, v in given.items()) + ")"


def consensus_executor(pruner_cls):
    """The executor class whose runtime blocks route ``pruner_cls``'s models by batch consensus (its
    ``runtime_executor``, where that takes a ``consensus`` rule); a ``CompressKitError`` otherwise."""
    name = getattr(pruner_cls, "runtime_executor", None)
    cls = plugins.load("executor", name) if name else None
    if cls is None or "consensus" not in cls.Config.model_fields:
        raise CompressKitError(
            f"--consensus: {pruner_cls.__name__} has no batch-consensus routing on the runtime (its executor "
            f"{name or '(none)'} takes no consensus rule; the wide pruner's does)"
        )
    return cls


def consensus_members(model, pruner, specs: list, **options) -> list:
    """A member per batch-consensus rule in ``specs`` (``compresskit.routing.Consensus``): the routed
    ``model`` on the runtime blocks of its pruner's executor configured with that rule. A
    ``CompressKitError`` where the pruner's executor has no such option."""
    if not specs:
        return []
    cls = consensus_executor(type(pruner))
    members = []
    for spec in specs:
        executor = cls(cls.Config(consensus=spec))
        members.append(
            Member(consensus_label(spec), model, runtime_for(model, pruner, executor=executor, **options), pruner)
        )
    return members


CELL_SLACK = 1 << 30  # bytes a cell needs beyond its cache and activations: workspaces, compilation, graph bookkeeping


def cell_bytes(config, batch: int, prompt: int, new_tokens: int, dtype: torch.dtype) -> dict[str, int]:
    """An estimate of what one bench cell needs on top of the weights: the KV cache (slots rounded up to
    256, as the runtime allocates them) and the prefill's largest activations (the residual, q/k/v, the
    FFN's gate, up and product for every prompt token: what a captured prefill graph's pool holds), plus
    the last position's fp32 logits and ``CELL_SLACK``."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    slots = -(-(prompt + new_tokens) // 256) * 256
    item = dtype.itemsize
    kv = 2 * config.num_hidden_layers * batch * kv_heads * slots * head_dim * item
    per_token = 3 * config.hidden_size + (heads + 2 * kv_heads) * head_dim + 3 * config.intermediate_size
    act = batch * prompt * per_token * item + batch * config.vocab_size * 4
    return {"kv": kv, "activations": act, "total": kv + act + CELL_SLACK}


@torch.inference_mode()
def calibrate_routers(model, sparsity: float, *, tokens: int = 256, seed: int = 0) -> None:
    """Give every router of a routed ``model`` the skip-logit biases with which each group is skipped on
    a ``sparsity`` fraction of the tokens of a random prompt (for speed runs of untrained routers:
    each router reads its real input, the residual stream, and its decisions vary by token)."""
    taps = [m for m in model.modules() if isinstance(m, RouterTap)]
    seen: dict[int, torch.Tensor] = {}
    hooks = [t.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0])) for i, t in enumerate(taps)]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=gen).to(next(model.parameters()).device)
    try:
        with dense_view():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    for i, tap in enumerate(taps):
        router = tap.target.router
        logits = router(seen[i]).reshape(-1, router.groups, 2).float()  # [tokens, G, 2]
        margin = logits[..., 1] - logits[..., 0]  # skip iff > 0
        shift = -torch.quantile(margin, 1.0 - sparsity, dim=0)  # [G]: P(margin + shift > 0) = sparsity
        router.up.bias.data.view(router.groups, 2)[:, 1] += shift.to(router.up.bias.dtype)


def realised_sparsity(runtime, model, pruner) -> float | None:
    """The realised fraction of projection MACs skipped since the last reset: from the runtime's
    counting blocks (None where they do not count), else the pruner's own count (a routed model's
    modules)."""
    blocks = runtime.stat_blocks()
    if blocks:
        return measured_sparsity(blocks, model.config).macs if all(b.counting for b in blocks) else None
    if pruner is not None:
        return pruner.sparsity(model).macs
    return None


def reset_counts(runtime, model, pruner) -> None:
    """Start the realised sparsity's count afresh (the runtime's counting blocks and the pruner's)."""
    for b in runtime.stat_blocks():
        b.reset_stats()
    if pruner is not None:
        pruner.reset_sparsity(model)


def time_runtime(runtime, batch: int, prompt: int, new_tokens: int, repeats: int, seed: int = 0):
    """Median TTFT and TPOT (ms) of greedy generation on ``runtime`` (one warm-up first: compilation,
    graph capture, autotuning)."""
    prompts = _prompts(batch, prompt, runtime.config.vocab_size, seed)
    runtime.generate(prompts, max_new_tokens=new_tokens)
    ttft, tpot = [], []
    for _ in range(repeats):
        res = runtime.generate(prompts, max_new_tokens=new_tokens)
        ttft.append(res.prefill_seconds * 1e3)
        steps = max(1, len(res.tokens[0]) - 1)
        tpot.append(res.decode_seconds * 1e3 / steps)
    return statistics.median(ttft), statistics.median(tpot)


def time_transformers(model, batch: int, prompt: int, new_tokens: int, repeats: int, seed: int = 0, cache="dynamic"):
    """The same through transformers' ``generate`` (greedy), of the dense model (a routed one seen
    dense), both from one call: TTFT until its first new token reaches a streamer (on the host, so
    the GPU's work is done), TPOT the rest per token. ``cache``: "dynamic" (its default cache, eager)
    or "static" (a static cache, with which ``generate`` compiles the forward on a GPU: what users of
    transformers call its fast path)."""
    from transformers.generation.streamers import BaseStreamer

    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    ids = torch.tensor(_prompts(batch, prompt, model.config.vocab_size, seed), device=next(model.parameters()).device)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)

    class Clock(BaseStreamer):
        """The time of each ``put``: the prompt's first, then each new token's (copied to the host)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run(n: int) -> tuple[float, float]:
        clock = Clock()
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode(), dense_view():  # a routed model runs its base computation
            model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, streamer=clock, **kwargs
            )
        sync()
        end, first = time.perf_counter(), clock.times[1]
        return (first - t0) * 1e3, (end - first) * 1e3 / max(1, n - 1)

    run(2)  # warm-up
    times = [run(new_tokens) for _ in range(repeats)]
    return statistics.median(t for t, _ in times), statistics.median(p for _, p in times)


@dataclass
class Member:
    """One row kind of the bench: ``runtime`` times the model, ``model`` / ``pruner`` count its sparsity;
    ``transformers`` ("dynamic" or "static", the cache): time ``model`` through transformers'
    ``generate`` instead."""

    name: str
    model: Any
    runtime: Any = None
    pruner: Any = None
    transformers: str | None = None


def bench(
    members: list[Member],
    *,
    batches: list[int],
    prompts: list[int],
    new_tokens: int,
    repeats: int,
    progress=None,
    skipped=None,
) -> list[Row]:
    """A row per member for each batch and prompt, the members timed one after another per case, each
    runtime's caches and graphs released before the next member runs (one model's working memory on the
    device at a time). A case whose estimate (:func:`cell_bytes`) exceeds the free memory is skipped with
    one line to ``skipped`` (a callable taking it), the others run."""
    rows = []
    cases = [(b, p) for b in batches for p in prompts]
    param = next(members[0].model.parameters())
    task_cm = progress.task("benchmarking", total=len(cases) * len(members)) if progress else contextlib.nullcontext()
    with task_cm as task:
        for b, p in cases:
            need = cell_bytes(members[0].model.config, b, p, new_tokens, param.dtype)
            free = available_bytes(param.device)
            if need["total"] > free:
                if skipped is not None:
                    skipped(
                        f"batch {b} x prompt {p}: skipped, it needs about {size(need['total'])} (KV cache "
                        f"{size(need['kv'])}, activations {size(need['activations'])}) and {size(free)} is free"
                    )
                if task is not None:
                    task.advance(len(members))
                continue
            for m in members:
                if m.transformers:
                    ttft, tpot = time_transformers(m.model, b, p, new_tokens, repeats, cache=m.transformers)
                    sparsity = None
                else:
                    reset_counts(m.runtime, m.model, m.pruner)
                    ttft, tpot = time_runtime(m.runtime, b, p, new_tokens, repeats)
                    sparsity = realised_sparsity(m.runtime, m.model, m.pruner)
                    m.runtime.release()
                rows.append(
                    Row(
                        m.name,
                        b,
                        p,
                        ttft,
                        tpot,
                        sparsity,
                        {"mode": _transformers_mode(m) if m.transformers else m.runtime.mode},
                    )
                )
                if task is not None:
                    task.advance(1)
    return rows


def _transformers_mode(member) -> str:
    device = next(member.model.parameters()).device
    if member.transformers == "static":
        return "static cache, compiled" if device.type == "cuda" else "static cache, eager"
    return "eager"


def speedups(rows: list[Row]) -> list[dict[str, Any]]:
    """One record per row with its TTFT and TPOT speedup over the dense runtime row of its case."""
    dense = {(r.batch, r.prompt): r for r in rows if r.model == "dense"}
    out = []
    for r in rows:
        d = dense[(r.batch, r.prompt)]
        out.append(
            {
                "model": r.model,
                "batch": r.batch,
                "prompt": r.prompt,
                "ttft_ms": round(r.ttft_ms, 3),
                "tpot_ms": round(r.tpot_ms, 3),
                "ttft_speedup": round(d.ttft_ms / r.ttft_ms, 3),
                "tpot_speedup": round(d.tpot_ms / r.tpot_ms, 3),
                "sparsity_macs": None if r.sparsity is None else round(r.sparsity, 4),
                "mode": r.extra.get("mode"),
            }
        )
    return out


def markdown(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# compresskit bench",
        "",
        " ".join(f"{k}: {v};" for k, v in meta.items()),
        "",
        "| model | decode | batch | prompt | TTFT ms | TPOT ms | TTFT x dense | TPOT x dense | sparsity MACs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        sp = "-" if r["sparsity_macs"] is None else f"{r['sparsity_macs']:.3f}"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['batch']} | {r['prompt']} | {r['ttft_ms']:.2f} | {r['tpot_ms']:.2f} | "
            f"{r['ttft_speedup']:.2f}x | {r['tpot_speedup']:.2f}x | {sp} |"
        )
    return "\n".join(lines) + "\n"


def unmeasured_reason(cfg, device_type: str) -> str | None:
    """Why speed (``evaluation.speed``) is not measured for a model on ``device_type``, or None."""
    if cfg.measure is False:
        return "evaluation.speed.measure is false"
    if cfg.measure == "auto" and device_type != "cuda":
        return "no GPU: speed is measured on a GPU (evaluation.speed.measure: true measures it here, eagerly)"
    return None


_DENSE_TIMES: dict[tuple, tuple[float, float]] = {}  # (base, device, dtype, settings) -> (TTFT, TPOT) ms


def measure_speed(model, pruner, cfg, *, load_dense, base: str | None = None, progress=None) -> dict[str, Any]:
    """What a run reports as its speed (``evaluation.speed``, a ``SpeedSection``): TTFT and TPOT of
    ``model`` on the runtime (with its pruner's blocks) and of its dense base on the same runtime, in
    this process; or why it was not measured. The dense base is the same weights seen dense where the
    pruner only routes, else ``load_dense()``. ``base``: the dense base's name; once this process has
    timed it with the same settings on the same device (a comparison's earlier member, or its dense
    run), that timing is reused rather than measured again."""
    device = next(model.parameters()).device
    reason = unmeasured_reason(cfg, device.type)
    if reason is not None:
        return {"measured": False, "reason": reason}
    limit = getattr(model.config, "max_position_embeddings", None) or cfg.prompt + cfg.new_tokens
    prompt = max(1, min(cfg.prompt, limit - cfg.new_tokens))
    task_cm = progress.task("timing on the runtime", total=2) if progress else contextlib.nullcontext()
    with task_cm as task:
        rt = runtime_for(model, pruner)
        reset_counts(rt, model, pruner)
        ttft, tpot = time_runtime(rt, cfg.batch, prompt, cfg.new_tokens, cfg.repeats)
        sparsity = realised_sparsity(rt, model, pruner) if pruner is not None else 0.0
        if pruner is not None:
            pruner.reset_sparsity(model)  # what the evaluator counts next starts from zero
        if task is not None:
            task.advance(1)
        param = next(model.parameters())
        key = (base, str(device), str(param.dtype), cfg.batch, prompt, cfg.new_tokens, cfg.repeats)
        if pruner is None:
            dense_ttft, dense_tpot = ttft, tpot
        elif base is not None and key in _DENSE_TIMES:
            dense_ttft, dense_tpot = _DENSE_TIMES[key]
        else:
            routed_only = any(is_routed(m) for m in model.modules())
            dense = model if routed_only else load_dense()
            dense_ttft, dense_tpot = time_runtime(
                Runtime(dense, dense=routed_only), cfg.batch, prompt, cfg.new_tokens, cfg.repeats
            )
            del dense
        if base is not None:
            _DENSE_TIMES[key] = (dense_ttft, dense_tpot)
        if task is not None:
            task.advance(1)
    return {
        "measured": True,
        "device": device_name(device),
        "mode": rt.mode,
        **({"eager_reason": rt.eager_reason} if rt.eager_reason and device.type == "cuda" else {}),
        "batch": cfg.batch,
        "prompt": prompt,
        "new_tokens": cfg.new_tokens,
        "repeats": cfg.repeats,
        "ttft_ms": round(ttft, 3),
        "tpot_ms": round(tpot, 3),
        "dense_ttft_ms": round(dense_ttft, 3),
        "dense_tpot_ms": round(dense_tpot, 3),
        "ttft_speedup": round(dense_ttft / ttft, 3),
        "tpot_speedup": round(dense_tpot / tpot, 3),
        "sparsity_macs": None if sparsity is None else round(sparsity, 4),
    }
