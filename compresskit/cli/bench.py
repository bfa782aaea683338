"""``bench``: TTFT and TPOT on the runtime, beside the dense model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from compresskit import locking
from compresskit.cli.common import (
    EXIT_OK,
    MODEL_HELP,
    OPTION_HELP,
    _default,
    _float_list,
    _int_list,
    _load_for_runtime,
    _plain,
    _print_table,
    _progress,
    _version,
    with_placement,
)
from compresskit.errors import CompressKitError, did_you_mean

BENCH_FILES = ("bench.json", "bench.md", "bench.png", "bench-heatmap.png")  # what bench --output writes


def cmd_bench(args, out: Console, err: Console) -> int:
    from compresskit.bench import bench, speedups

    batches, prompts, sparsities = _checked_cases(args)
    sources, settings = _sources(args, sparsities)
    if args.output is not None:
        _claim_output(args)
    options = _runtime_options(args)
    members, base, config, device, dtype = _members(args, sources, settings, options, max(prompts), err)
    rows = bench(
        members,
        batches=batches,
        prompts=prompts,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        config=config,
        progress=_progress(err),
        skipped=lambda line: _plain(err, line),
        ttft_repeats=args.ttft_repeats,
        planned=(lambda line: _plain(err, line)) if len(batches) * len(prompts) > 1 else None,
    )
    if not rows:
        raise CompressKitError("compresskit bench: no case fits this device's free memory (the lines above say why)")
    records = speedups(rows)
    meta = _meta(args, base, device, dtype, sources, sparsities)
    _print_table(out, _table(records, meta, base, args.repeats))
    if args.output is not None:
        _write(Path(args.output), records, meta)
        _plain(out, f"results: {Path(args.output) / 'bench.json'}")
    return EXIT_OK


def _checked_cases(args) -> tuple[list[int], list[int], list[float]]:
    """``(batches, prompts, sparsities)`` from the flags, every flag that needs another checked first."""
    from compresskit.bench import SHAPES

    batches = _int_list(args.batch, "--batch")
    prompts = _int_list(args.prompt, "--prompt")
    if args.new_tokens < 2 or args.repeats < 1:
        raise CompressKitError(f"--new-tokens {args.new_tokens} / --repeats {args.repeats}: give 2 or more / 1 or more")
    if args.ttft_repeats is not None and not 1 <= args.ttft_repeats <= args.repeats:
        raise CompressKitError(
            f"--ttft-repeats {args.ttft_repeats}: give 1 to --repeats ({args.repeats}): how many of the repeats "
            "are whole generations (the rest time the decode alone)"
        )
    if args.shape is None and (args.runs or args.method):
        flag = "--run" if args.runs else "--method"
        raise CompressKitError(f"{flag}: builds a structure at a known configuration; give --shape NAME with it")
    if (args.model is None) == (args.shape is None):
        raise CompressKitError("compresskit bench: give a MODEL (a saved run, an HF directory or an alias) or --shape")
    if args.shape is not None and args.shape not in SHAPES:
        raise CompressKitError("--shape: " + did_you_mean(args.shape, SHAPES, what="configuration"))
    fractions = {"what": "fractions", "ok": lambda v: 0.0 <= v < 1.0, "rule": "; give fractions in [0, 1)"}
    sparsities = _float_list(args.sparsity, "--sparsity", **fractions, example="0.25,0.5", distinct=True)
    return batches, prompts, sparsities


def _sources(args, sparsities: list[float]) -> tuple[list, list[dict]]:
    """The structures ``--shape`` builds (``--method`` at each sparsity, each ``--run``) and the ``--option``
    settings, every name, run and setting checked before anything is built: one line each."""
    from compresskit.bench import method_source, run_source
    from compresskit.options import configured_executor, parse_option

    sources = []
    if args.shape is not None:
        if args.method or not args.runs:
            method = args.method or _default("bench", "method")
            sources += [method_source(method, s, named=len(sparsities) > 1) for s in sparsities]
        sources += [run_source(ref) for ref in args.runs]
    settings = [parse_option(text) for text in args.option]
    for src in sources:  # each setting fits each method's executor
        for setting in settings:
            configured_executor(src.pruner_cls, setting)
    return sources, settings


def _claim_output(args) -> None:
    """``--output``: creatable, holding nothing but an earlier bench's files, locked until the command returns."""
    from compresskit import files

    folder, field = Path(args.output), "output directory (--output)"
    files.check_creatable(folder, field)
    files.check_replaceable(folder, field, BENCH_FILES)
    args.held.enter_context(locking.hold(folder, field=field))
    files.sweep(folder)


def _runtime_options(args) -> dict[str, bool]:
    """The runtime's ``compile``, ``graphs`` and ``prefill_graphs`` from the flags (absent: auto)."""
    import torch

    options = {} if args.compile == "auto" else {"compile": args.compile == "on", "graphs": args.compile == "on"}
    if args.prefill_graphs == "on":
        if not torch.cuda.is_available() or args.device == "cpu" or args.compile == "off":
            raise CompressKitError("--prefill-graphs on: needs CUDA graphs, so a GPU and --compile auto or on")
        options["prefill_graphs"] = True
    elif args.prefill_graphs == "off":
        options["prefill_graphs"] = False
    return options


def _members(args, sources: list, settings: list[dict], options: dict, prompt: int, err: Console):
    """``(members, base, config, device, dtype)``: what is timed (each built when its turn comes, for
    ``--shape``), the dense model's name, the shape's config (None for a loaded model) and where they run."""
    from compresskit.bench import SHAPES, Member, setting_members, shape_config, shape_members, shape_memory_error
    from compresskit.modeling import load_model, resolve_device, resolve_dtype
    from compresskit.runtime import Runtime, runtime_for

    def check_positions(limit: int | None) -> None:
        if limit is not None and prompt + args.new_tokens > limit:
            raise CompressKitError(
                f"--prompt {prompt} + --new-tokens {args.new_tokens} exceed the model's {limit} positions"
            )

    if args.shape is not None:
        check_positions(SHAPES[args.shape]["max_position_embeddings"])  # before anything is built
        device = resolve_device(args.device, field="--device")
        dtype = resolve_dtype(args.dtype, device)
        too_large = shape_memory_error(args.shape, dtype, device)
        if too_large:
            raise CompressKitError(too_large)
        transformers = None if args.transformers == "off" else args.transformers
        where = {"device": device, "dtype": dtype, "transformers": transformers, "bounds": args.bounds == "on"}
        members = shape_members(args.shape, sources, settings=settings, **where, **options)
        return members, args.shape, shape_config(args.shape), device, dtype
    model, _, pruner, base = _load_for_runtime(args.model, args, err, "MODEL (compresskit bench's argument)")
    if settings and pruner is None:
        raise CompressKitError(f"--option: {args.model} is no saved run of a method, so it has no settings of one")
    dense = model if pruner is None else load_model(base, dtype=args.dtype, device=args.device)[0]
    members = [Member("compressed", model, runtime_for(model, pruner, **options), pruner)]
    members += setting_members(model, pruner, settings, **options)
    members.append(Member("dense", dense, Runtime(dense, **options)))
    if args.transformers != "off":
        name = "dense (transformers)" if args.transformers == "dynamic" else "dense (transformers, static cache)"
        members.append(Member(name, dense, transformers=args.transformers))
    check_positions(getattr(model.config, "max_position_embeddings", None))
    param = next(model.parameters())
    return members, base, None, param.device, param.dtype


def _meta(args, base: str, device, dtype, sources: list, sparsities: list[float]) -> dict[str, Any]:
    """The run's facts, as ``bench.json`` keeps them beside its rows."""
    import datetime

    import torch

    from compresskit.modeling import device_name

    meta = {
        "model": args.model or f"--shape {args.shape} (random weights)",
        "base": base,
        "device": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "ttft_repeats": args.repeats if args.ttft_repeats is None else args.ttft_repeats,
        "command": "compresskit " + " ".join(args.argv),
    }
    if args.shape is not None:
        meta["methods"] = {src.name: src.method for src in sources}
        fractions = f"{', '.join(map(str, sparsities))} of each router's groups (--sparsity), "
        runs = "each run's realised fraction per layer and block, at the same relative depth (--run); "
        meta["structures"] = (
            "random weights; routers untrained, their biases calibrated so that each group is skipped on a share "
            "of the tokens: "
            + (fractions if args.method or not args.runs else "")
            + (runs if args.runs else "")
            + "a static method's model pruned at that fraction of the MACs on random tokens"
        )
    return meta


def _table(records: list[dict], meta: dict, base: str, repeats: int):
    """The console's table of ``records``."""
    from rich.table import Table

    medians = f"medians of {repeats}"
    if meta["ttft_repeats"] != repeats:
        medians = f"TPOT medians of {repeats}, TTFT of {meta['ttft_repeats']}"
    table = Table(title=f"{meta['model']}: TTFT and TPOT against {base} ({medians})")
    cols = ("model", "decode", "batch", "prompt", "TTFT ms", "TPOT ms", "TTFT x dense", "TPOT x dense", "sparsity MACs")
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "decode") else "right")
    for r in records:
        sp = "-" if r["sparsity_macs"] is None else f"{r['sparsity_macs']:.3f}"
        times = (f"{r['ttft_ms']:.2f}", f"{r['tpot_ms']:.2f}", f"{r['ttft_speedup']:.2f}x", f"{r['tpot_speedup']:.2f}x")
        table.add_row(r["model"], r["mode"], str(r["batch"]), str(r["prompt"]), *times, sp)
    return table


def _write(folder: Path, records: list[dict], meta: dict) -> None:
    """``bench.json``, ``bench.md`` and the plots into ``folder``, whole or not at all."""
    from compresskit import files
    from compresskit.bench import markdown, matrix_markdown, model_matrix_markdown
    from compresskit.plot import speedup_heatmap, speedup_vs_batch

    with files.staged_dir(folder) as tmp:
        files.write_json(tmp / "bench.json", {"meta": meta, "results": records})
        parts = [matrix_markdown(records), matrix_markdown(records, "ttft")]
        parts += [model_matrix_markdown(records, "ttft"), model_matrix_markdown(records, "tpot")]
        files.write_text(tmp / "bench.md", "\n".join([markdown(records, meta), *filter(None, parts)]))
        speedup_vs_batch(records, tmp / "bench.png")
        if len({r["batch"] for r in records}) > 1 and len({r["prompt"] for r in records}) > 1:
            speedup_heatmap(records, tmp / "bench-heatmap.png")


def add_bench_parser(sub) -> None:
    """The ``bench`` command's arguments."""
    p = sub.add_parser("bench", help="TTFT and TPOT of a saved run beside its dense base, on the runtime")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--shape", help="instead of MODEL: a known configuration with random weights (speed only)")
    p.add_argument(
        "--sparsity",
        default="0.5",
        help="with --shape: the fraction of each router's groups the routers skip (a static method: of the MACs it "
        "removes); comma-separated for several, a row each (named 'compressed (S)') beside one dense model",
    )
    p.add_argument(
        "--method",
        help="with --shape: the method (a pruner plugin with a speed shape) whose structure to time, its routers "
        f"untrained and calibrated (default {_default('bench', 'method')}, where no --run is given)",
    )
    p.add_argument(
        "--run",
        action="append",
        default=[],
        dest="runs",
        metavar="RUN",
        help="with --shape: a saved run (its folder or results.json) whose method and realised sparsity, per layer "
        "at the same relative depth, to time at the shape (a row named after the run); repeatable",
    )
    p.add_argument(
        "--bounds",
        choices=["on", "off"],
        default="on",
        help="with --shape: also time the ideal half-width models (the bound of width pruning at 50%%)",
    )
    p.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="decode compiled and replayed as CUDA graphs (auto: on a GPU)",
    )
    p.add_argument(
        "--prefill-graphs",
        dest="prefill_graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="capture a prompt's prefill as a CUDA graph too, one per length rounded up to a multiple of 256 "
        "tokens (up to 128 tokens: to a power of two from 16; auto: wherever decode is graphed)",
    )
    p.add_argument(
        "--transformers",
        choices=["dynamic", "static", "off"],
        default="dynamic",
        help="also time the dense model through transformers' generate: with its dynamic cache (eager), with a "
        "static cache (generate compiles it on a GPU), or not",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help=f"also time the compressed model under {OPTION_HELP}; repeat for a row each",
    )
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--prompt", default="128", help="comma-separated prompt lengths in tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=32, dest="new_tokens", help="tokens each timed generation makes")
    p.add_argument("--repeats", type=int, default=3, help="timed generations a cell; the medians are reported")
    p.add_argument(
        "--ttft-repeats",
        type=int,
        dest="ttft_repeats",
        help="of the repeats, how many are whole generations (TTFT's median; default all); the rest time the "
        "decode alone from the prompt's cache, sparing long prefills where only TPOT needs more samples",
    )
    with_placement(p)
    p.add_argument("--output", help="directory for bench.json and bench.md")
    p.set_defaults(fn=cmd_bench)
