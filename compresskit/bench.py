"""Time to first token (TTFT) and time per output token (TPOT) of a model on the runtime, beside its
dense base on the same runtime and the dense base through transformers' ``generate``, side by side in
one process: medians over repeats, for every batch size and prompt length asked for, with the
realised sparsity of each measured run."""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compresskit import plugins
from compresskit.errors import CompressKitError, RuntimeUnsupportedError
from compresskit.interfaces import RunContext
from compresskit.memory import meta_model, size
from compresskit.modeling import device_name, lora_merged
from compresskit.options import configured_executor, option_label
from compresskit.pipeline import NAME as PIPELINE
from compresskit.pipeline import Pipeline, PipelineConfig
from compresskit.routing import dense_view
from compresskit.runtime import Runtime, runtime_for
from compresskit.runtime.blocks import is_routed
from compresskit.sparsity import SparsityProfile

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


def shape_weight_bytes(name: str, dtype: torch.dtype) -> int:
    """What a ``--shape`` bench holds in weights for the configuration ``name`` in ``dtype``: its members
    are built one at a time, so the largest of them, the dense model (a routing pruner's routers add well
    under 1%)."""
    return sum(p.numel() for p in meta_model(shape_config(name)).parameters()) * dtype.itemsize


SHAPE_MEMORY_SHARE = 0.8  # of the free memory, what a --shape run's weights may take: caches, activations, compiling


def available_bytes(device: torch.device) -> int:
    """Memory free for new tensors on ``device``: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def shape_memory_error(name: str, dtype: torch.dtype, device: torch.device):
    """Why the configuration ``name``'s models in ``dtype`` would not fit ``device``'s free memory (one
    model's weights above ``SHAPE_MEMORY_SHARE`` of it), naming what would fit; None where they fit."""
    free = available_bytes(device)
    need = shape_weight_bytes(name, dtype)
    if need <= SHAPE_MEMORY_SHARE * free:
        return None
    fits = lambda shape, dt: shape_weight_bytes(shape, dt) <= SHAPE_MEMORY_SHARE * free  # noqa: E731
    smaller = [s for s in SHAPES if fits(s, dtype)]
    options = [f"a smaller --shape ({', '.join(smaller)})"] if smaller else ["more free memory"]
    if dtype.itemsize > 2 and fits(name, torch.bfloat16):
        options.insert(0, "--dtype bfloat16")
    return (
        f"--shape {name}: one model's weights take {size(need)} in {str(dtype).removeprefix('torch.')} and this "
        f"{'GPU' if device.type == 'cuda' else 'machine'} has {size(free)} free; give " + " or ".join(options)
    )


def speed_method(method: str, field: str = "--method"):
    """The pruner class registered as ``method`` (through the plugin registry), where it has a speed
    shape (``Pruner.speed_shape``: what ``--shape`` builds on random weights); a ``CompressKitError``
    naming the methods that have one otherwise."""

    def shaped(name: str) -> bool:
        try:
            return plugins.load("pruner", name).has_speed_shape()
        except CompressKitError:  # a plugin that does not load is no candidate
            return False

    try:
        cls = plugins.load("pruner", method)
    except CompressKitError as exc:
        raise CompressKitError(f"{field}: {exc}") from None
    if not cls.has_speed_shape():
        shaped_names = [n for n in plugins.names("pruner") if shaped(n)]
        raise CompressKitError(
            f"{field} {method}: it has no speed shape (Pruner.speed_shape), so --shape cannot build its structure; "
            f"methods with one: {', '.join(shaped_names)}; time a saved run of {method} with compresskit bench MODEL"
        )
    return cls


@dataclass
class Source:
    """A compressed member of a ``--shape`` bench: a method (its pruner class and config) and what a run
    of it skipped (``compresskit.sparsity.SparsityProfile``), named ``name``."""

    name: str
    method: str
    pruner_cls: Any
    config: dict[str, Any]
    profile: SparsityProfile

    def build(self, shape: str, *, device, dtype, executor=None, **options):
        """``(model, runtime, pruner)``: random weights of ``shape`` given this source's structure."""
        model = shape_model(shape, device=device, dtype=dtype)
        pruner = self.pruner_cls(self.pruner_cls.Config(**self.config))
        ctx = RunContext(model_config=model.config, device=device, dtype=dtype)
        try:
            model = pruner.speed_shape(model, ctx, self.profile)
        except CompressKitError as exc:  # e.g. a structure this shape's granularity cannot take
            raise CompressKitError(f"{self.name} at --shape {shape}: {exc}") from None
        return model, runtime_for(model, pruner, executor=executor, **options), pruner

    def info(self) -> dict[str, Any]:
        """What each of its bench rows records beside the times."""
        return {"method": self.method, "run_sparsity_macs": round(self.profile.macs, 4), "source": self.profile.source}


def method_source(method: str, sparsity: float, named: bool = False) -> Source:
    """``--method M --sparsity S``: the method's default config (aimed at ``S``) with ``S`` of each
    router's groups skipped (a static method: of the MACs removed), named "compressed" (``named``: one
    of several sparsities, "compressed (S)")."""
    cls = speed_method(method)
    config = {"target_sparsity": sparsity} if "target_sparsity" in cls.Config.model_fields else {}
    name = f"compressed ({sparsity:g})" if named else "compressed"
    return Source(name, method, cls, config, SparsityProfile(sparsity, groups=sparsity, source="--sparsity"))


def run_source(ref: str) -> Source:
    """``--run RUN``: a saved run's method, config and realised sparsity (per layer) from its
    ``results.json`` (``ref``: the file or the run's folder), named after the run; a
    ``CompressKitError`` naming the file where it is no such run."""
    from compresskit import files

    path = Path(ref)
    if path.is_dir():
        path = path / "results.json"
    doc = files.read_json(path, what="results file (--run)")
    if not isinstance(doc, dict) or "metrics" not in doc:
        raise CompressKitError(f"--run {path}: not a compresskit results.json (no metrics)")
    recipe = doc.get("recipe") or {}
    pruner = recipe.get("pruner") or None
    if doc.get("pruner") == PIPELINE and recipe.get("steps"):  # a pipeline: its steps, each with its config
        pruner = {"config": PipelineConfig.of_recipe(recipe).model_dump(mode="json")}
    if not doc.get("pruner") or pruner is None:
        raise CompressKitError(f"--run {path}: a dense run has no structure to time (the dense model is always timed)")
    cls = Pipeline if doc["pruner"] == PIPELINE else speed_method(doc["pruner"], field=f"--run {path}: its method")
    try:
        profile = SparsityProfile.from_results(doc, source=str(path))
    except ValueError as exc:
        raise CompressKitError(f"--run {path}: {exc}") from None
    return Source(doc.get("name") or path.parent.name, doc["pruner"], cls, dict(pruner.get("config") or {}), profile)


def shape_members(
    shape: str,
    sources: list[Source],
    *,
    device,
    dtype,
    transformers: str | None = None,
    settings: list[dict] = (),
    bounds: bool = True,
    **options,
) -> list:
    """The bench's members for a known ``shape`` (random weights), each built when its turn comes and
    freed after it (one model on the device at a time): each of ``sources`` (a method's structure, its
    routers untrained and calibrated), each source under each of ``settings`` (``--option``: its runtime
    executor configured so, :mod:`compresskit.options`), the dense model (the same weights: the same seed),
    with ``bounds`` the ideal half-width models where the shape has them (:data:`HALVES`), and with
    ``transformers`` ("dynamic" or "static", its cache) the dense model through transformers'
    ``generate``. ``options`` go to the runtimes (``compile``, ``graphs``)."""
    where = {"device": device, "dtype": dtype}
    members = []
    for src in sources:
        build = functools.partial(src.build, shape, **where, **options)
        members.append(Member(src.name, build=build, info=src.info()))
        for setting in settings:
            executor = configured_executor(src.pruner_cls, setting)
            label = option_label(setting, executor.config)
            label = label if src.name == "compressed" else f"{src.name}, {label}"
            build = functools.partial(src.build, shape, executor=executor, **where, **options)
            members.append(Member(label, build=build, info=src.info()))

    def plain(half: bool | str = False, runtime: bool = True):
        model = shape_model(shape, half=half, **where)
        return model, Runtime(model, **options) if runtime else None, None

    members.append(Member("dense", build=plain))
    for half, row in HALVES.items():
        try:
            shape_config(shape, half=half)
        except ValueError:
            continue  # no such half-width model of this shape (odd heads per KV head)
        if bounds:
            members.append(Member(row, build=functools.partial(plain, half)))
    if transformers is not None:
        name = "dense (transformers)" if transformers == "dynamic" else "dense (transformers, static cache)"
        members.append(Member(name, build=functools.partial(plain, runtime=False), transformers=transformers))
    return members


def setting_members(model, pruner, settings: list[dict], **options) -> list:
    """A member per setting of ``settings`` (``--option``, :mod:`compresskit.options`): the compressed ``model``
    on the runtime blocks of its pruner's executor configured so. A ``CompressKitError`` where a setting does
    not fit that executor's config."""
    members = []
    for setting in settings:
        executor = configured_executor(type(pruner), setting)
        runtime = runtime_for(model, pruner, executor=executor, **options)
        members.append(Member(option_label(setting, executor.config), model, runtime, pruner))
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


def plan_line(config, batches, prompts, new_tokens: int, dtype: torch.dtype, free: int, members: int) -> str:
    """The bench's estimate before it starts, one line: the cells (batch x prompt) and members, each cell's
    :func:`cell_bytes` against ``free`` (the memory free once a model's weights are on the device), the
    largest cell that fits and every cell that will be skipped (the case's own check, when it comes, measures
    the memory then free and has the last word)."""
    cells = [(b, p, cell_bytes(config, b, p, new_tokens, dtype)["total"]) for b in batches for p in prompts]
    fit = [c for c in cells if c[2] <= free]
    out = [c for c in cells if c[2] > free]
    span = lambda values: f"{min(values)}-{max(values)}" if len(set(values)) > 1 else f"{values[0]}"  # noqa: E731
    line = (
        f"plan: {len(cells)} cell(s) (batch {span(batches)} x prompt {span(prompts)}) x {members} member(s); each "
        f"cell's estimate (KV cache, prefill activations) against {size(free)} free once a model's weights are "
        f"loaded: {len(fit)} fit"
    )
    if fit:
        b, p, need = max(fit, key=lambda c: c[2])
        line += f" (the largest, batch {b} x prompt {p}: about {size(need)})"
    if out:
        line += f"; {len(out)} will be skipped: " + ", ".join(f"batch {b} x prompt {p} ({size(n)})" for b, p, n in out)
    return line


def time_runtime(
    runtime, batch: int, prompt: int, new_tokens: int, repeats: int, seed: int = 0, ttft_repeats: int | None = None
):
    """Median TTFT and TPOT (ms) of greedy generation on ``runtime`` (one warm-up first: compilation,
    graph capture, autotuning). ``ttft_repeats`` (default ``repeats``) of the ``repeats`` are whole
    generations; the rest time the decode alone from the prompt's cache (:meth:`Runtime.time_decode`),
    which spares a long prompt's prefill where only TPOT needs more samples."""
    prompts = _prompts(batch, prompt, runtime.config.vocab_size, seed)
    runtime.generate(prompts, max_new_tokens=new_tokens)
    ttft, tpot = [], []
    whole = repeats if ttft_repeats is None else ttft_repeats
    for i in range(repeats):
        if i < whole:
            res = runtime.generate(prompts, max_new_tokens=new_tokens)
            ttft.append(res.prefill_seconds * 1e3)
            steps = max(1, len(res.tokens[0]) - 1)
            tpot.append(res.decode_seconds * 1e3 / steps)
        else:  # the first token's step is in TTFT: time the steps after it, as generate's decode does
            tpot.append(runtime.time_decode(batch, prompt, new_tokens) * 1e3 / max(1, new_tokens - 1))
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
    ``generate`` instead. ``build``: where the member is made when its turn comes (and freed after it),
    a callable returning ``(model, runtime, pruner)``. ``info``: recorded with each of its rows."""

    name: str
    model: Any = None
    runtime: Any = None
    pruner: Any = None
    transformers: str | None = None
    build: Callable[[], tuple[Any, Any, Any]] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def free_device_memory(device: torch.device) -> None:
    """Return what freed tensors hold to the device: a built member's model before the next is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench(
    members: list[Member],
    *,
    batches: list[int],
    prompts: list[int],
    new_tokens: int,
    repeats: int,
    config=None,
    progress=None,
    skipped=None,
    ttft_repeats: int | None = None,
    planned=None,
) -> list[Row]:
    """A row per member for each batch and prompt, in order of case and member. The members are timed
    one after another, each over every case; a member with a ``build`` is made when its turn comes and
    freed after it, and each runtime's caches and graphs are released after each case (one model's
    working memory on the device at a time). A case whose estimate (:func:`cell_bytes` of ``config``,
    by default the first member's model's) exceeds the memory free when the first member runs it is
    skipped for every member with one line to ``skipped`` (a callable taking it), the others run.
    ``ttft_repeats``: of the runtime members' ``repeats``, how many are whole generations (:func:`time_runtime`).
    ``planned`` (a callable taking one line): the estimate of every case (:func:`plan_line`), once the first
    member is on the device and before its first case."""
    rows: list[tuple[int, int, Row]] = []
    cases = [(b, p) for b in batches for p in prompts]
    fits: dict[tuple[int, int], bool] = {}
    task_cm = progress.task("benchmarking", total=len(cases) * len(members)) if progress else contextlib.nullcontext()
    with task_cm as task:
        for index, m in enumerate(members):
            live = m
            if m.build is not None:
                model, runtime, pruner = m.build()
                live = Member(m.name, model, runtime, pruner, m.transformers, info=m.info)
            param = next(live.model.parameters())
            if index == 0 and planned is not None:
                free = available_bytes(param.device)
                planned(
                    plan_line(
                        config or live.model.config, batches, prompts, new_tokens, param.dtype, free, len(members)
                    )
                )
            for case, (b, p) in enumerate(cases):
                if (b, p) not in fits:
                    need = cell_bytes(config or live.model.config, b, p, new_tokens, param.dtype)
                    free = available_bytes(param.device)
                    fits[(b, p)] = need["total"] <= free
                    if not fits[(b, p)] and skipped is not None:
                        skipped(
                            f"batch {b} x prompt {p}: skipped, it needs about {size(need['total'])} (KV cache "
                            f"{size(need['kv'])}, activations {size(need['activations'])}) and {size(free)} is free"
                        )
                if fits[(b, p)]:
                    rows.append((case, index, _time_member(live, b, p, new_tokens, repeats, ttft_repeats)))
                if task is not None:
                    task.advance(1)
            if m.build is not None:
                device = param.device
                del live, model, runtime, pruner, param
                free_device_memory(device)
    return [row for _, _, row in sorted(rows, key=lambda r: r[:2])]


def _time_member(m: Member, batch: int, prompt: int, new_tokens: int, repeats: int, ttft_repeats=None) -> Row:
    if m.transformers:
        ttft, tpot = time_transformers(m.model, batch, prompt, new_tokens, repeats, cache=m.transformers)
        sparsity, mode = None, _transformers_mode(m)
    else:
        m.runtime.reset_counts(m.pruner)
        ttft, tpot = time_runtime(m.runtime, batch, prompt, new_tokens, repeats, ttft_repeats=ttft_repeats)
        counted = m.runtime.counted_sparsity(m.pruner)
        sparsity, mode = None if counted is None else counted.macs, m.runtime.mode
        m.runtime.release()
    return Row(m.name, batch, prompt, ttft, tpot, sparsity, {"mode": mode, **m.info})


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
                **r.extra,
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


def _speedup_table(title: str, label: str, rows: list, prompts: list, cells: dict, missing: str) -> list[str]:
    """A Markdown table of ``cells`` ((row, prompt) -> speedup), a row per ``rows`` and a column per prompt."""
    lines = [title, "", f"| {label} | " + " | ".join(str(p) for p in prompts) + " |", "|---|" + "---|" * len(prompts)]
    for key in rows:
        lines.append(
            f"| {key} | "
            + " | ".join(f"{cells[(key, p)]:.2f}x" if (key, p) in cells else missing for p in prompts)
            + " |"
        )
    return lines


def matrix_markdown(records: list[dict[str, Any]], measure: str = "tpot", missing: str = "skipped") -> str:
    """For each model row but dense, its ``measure`` speedup over dense as a batch x prompt table, with its
    worst and best cells named; "" where the bench has a single case (the main table says it all).
    ``missing``: what a cell without a record says (in one bench, a case that did not fit was skipped)."""
    batches = sorted({r["batch"] for r in records})
    prompts = sorted({r["prompt"] for r in records})
    if len(batches) * len(prompts) < 2:
        return ""
    lines = []
    for model in dict.fromkeys(r["model"] for r in records if r["model"] != "dense"):
        cells = {(r["batch"], r["prompt"]): r[f"{measure}_speedup"] for r in records if r["model"] == model}
        worst, best = min(cells, key=cells.get), max(cells, key=cells.get)
        title = f"## {model}: {measure.upper()} x dense, batch x prompt"
        lines += _speedup_table(title, "batch", batches, prompts, cells, missing)
        lines += [
            "",
            f"Worst cell: batch {worst[0]} x prompt {worst[1]}, {cells[worst]:.2f}x; best: batch {best[0]} x prompt "
            f"{best[1]}, {cells[best]:.2f}x.",
            "",
        ]
    return "\n".join(lines)


def model_matrix_markdown(records: list[dict[str, Any]], measure: str = "ttft", missing: str = "skipped") -> str:
    """At each batch size, the ``measure`` speedup over dense of every model row but dense as a model x prompt
    table (with several ``--sparsity`` values: prompt x sparsity), its worst cell named; "" unless the bench
    has two such models and two prompts."""
    models = list(dict.fromkeys(r["model"] for r in records if r["model"] != "dense"))
    prompts = sorted({r["prompt"] for r in records})
    if len(models) < 2 or len(prompts) < 2:
        return ""
    lines = []
    for b in sorted({r["batch"] for r in records}):
        at_b = [r for r in records if r["batch"] == b and r["model"] != "dense"]
        cells = {(r["model"], r["prompt"]): r[f"{measure}_speedup"] for r in at_b}
        if not cells:
            continue
        worst = min(cells, key=cells.get)
        title = f"## {measure.upper()} x dense at batch {b}, model x prompt"
        lines += _speedup_table(title, "model", models, prompts, cells, missing)
        lines += ["", f"Worst cell: {worst[0]} at prompt {worst[1]}, {cells[worst]:.2f}x.", ""]
    return "\n".join(lines)


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
    # LoRA adapters kept apart are timed merged, as a served model would run (the model is left as it was)
    with task_cm as task, lora_merged(model):
        try:
            rt = runtime_for(model, pruner)
        except RuntimeUnsupportedError as exc:  # (its method gives the runtime no blocks for it)
            return {"measured": False, "reason": str(exc)}
        rt.reset_counts(pruner)
        ttft, tpot = time_runtime(rt, cfg.batch, prompt, cfg.new_tokens, cfg.repeats)
        counted = rt.counted_sparsity(pruner)
        sparsity = 0.0 if pruner is None else None if counted is None else counted.macs  # None: not measured
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
