"""``compresskit``: apply | eval | compare | generate | bench | plugins | validate | schema.

Exit codes: 0 ok, 2 bad input (one line naming the field, what was given and what is allowed),
1 internal error (add ``--debug`` for the traceback), 130 interrupted (SIGINT), 143 stopped by
SIGTERM; an interrupted ``apply`` resumes when run again.

Each command imports what it needs inside its function: ``--help``, ``--version`` and ``validate`` answer
without loading torch, transformers or lm-eval (``tests/core/test_cli.py`` checks that torch stays out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

from rich.console import Console

from compresskit import distributed, locking
from compresskit.errors import CompressKitError, RecipeError, RecipeProblems, did_you_mean
from compresskit.interrupts import Interrupted, handle_signals

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT = 0, 1, 2
BENCH_FILES = ("bench.json", "bench.md", "bench.png", "bench-heatmap.png")  # what bench --output writes


class _Parser(argparse.ArgumentParser):
    """argparse that exits with our bad-input code and one line."""

    def error(self, message: str):
        raise CompressKitError(f"{self.prog}: {message}{_settings_hint(message)}")


OPTION_HELP = (
    "one setting of the method's own inference options, KEY=VALUE[,KEY=VALUE...]: dotted keys into its runtime "
    "executor's config (`compresskit schema EXECUTOR` lists them), values in YAML"
)


def _settings_hint(message: str) -> str:
    """Where argparse found a flag it does not know given ``KEY=VALUE`` pairs (a method's setting under a flag of
    its own), the ``--option`` that gives them."""
    match = re.match(r"unrecognized arguments: .*?--([\w-]+)[ =]((?:[\w.-]+=[^,\s]+,?)+)", message)
    if not match:
        return ""
    name, pairs = match.groups()
    keys = ",".join(f"{name}.{pair}" for pair in pairs.strip(",").split(","))
    return f"; a method's own settings go through --option KEY=VALUE,... (bench, eval): --option {keys}"


def _consoles() -> tuple[Console, Console]:
    out = Console(soft_wrap=True)
    err = Console(stderr=True, soft_wrap=True)
    return out, err


def _progress(err: Console):
    from compresskit.progress import PlainProgress
    from compresskit.report import RichProgress

    return RichProgress(err) if err.is_terminal else PlainProgress()


def _quiet_libraries() -> None:
    """Our progress bars and tables replace the libraries' tqdm bars and INFO logs, through the
    settings those libraries document (each can be overridden from the environment): tqdm's
    ``TQDM_DISABLE`` (every tqdm bar of lm-eval, datasets, transformers), transformers' verbosity,
    the hub's progress bars, and the standard loggers of the others. Nothing is imported here."""
    import logging

    for key, value in (
        ("TOKENIZERS_PARALLELISM", "false"),
        ("TQDM_DISABLE", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
    ):
        os.environ.setdefault(key, value)
    for name in ("lm_eval", "lm-eval", "datasets", "huggingface_hub", "stevedore", "gensim", "smart_open"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _plain(out: Console, text: str) -> None:
    """Stable text for pipes and logs, written as is (no wrapping, no markup)."""
    out.file.write(text if text.endswith("\n") else text + "\n")
    out.file.flush()


def _print_table(out: Console, table) -> None:
    """A rich ``Table`` in a terminal; elsewhere (a pipe, a file, a log) the same table as Markdown, whole
    (a rich table in a pipe is cut to 80 columns)."""
    if out.is_terminal:
        out.print(table)
        return
    from rich.text import Text

    def plain(cell) -> str:
        text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
        return text.replace("|", "\\|")

    columns = [[plain(c) for c in col.cells] for col in table.columns]
    lines = [f"{table.title}", ""] if table.title else []
    lines.append("| " + " | ".join(plain(c.header) for c in table.columns) + " |")
    lines.append("|" + "---|" * len(table.columns))
    lines += ["| " + " | ".join(row) + " |" for row in zip(*columns, strict=True)]
    _plain(out, "\n".join(lines))


def _print_results(out: Console, results: dict[str, Any]) -> None:
    from compresskit.report import quality_alarm, results_markdown, results_table

    if out.is_terminal:
        out.print(results_table(results))
        alarm = quality_alarm(results)
        if alarm:  # (the Markdown below holds it too)
            out.print(alarm, style="bold red", markup=False, highlight=False)
    else:
        _plain(out, results_markdown(results))


# ---------------------------------------------------------------------------------------------
# commands


def cmd_apply(args, out: Console, err: Console) -> int:
    from compresskit.api import apply
    from compresskit.artifacts import MANIFEST
    from compresskit.recipe import load_recipe

    overrides = list(args.set or [])
    if args.overwrite:
        overrides.append("output.overwrite=true")
    resolved = load_recipe(args.recipe, overrides)
    if args.nproc is not None and args.nproc < 1:
        raise CompressKitError(f"--nproc: {args.nproc}; give 1 or more")
    if args.dry_run:
        return _dry_run(resolved, args, out)
    if args.nproc is not None and args.nproc > 1 and not distributed.launched():
        return _launch(args, err)
    result = apply(resolved, progress=_progress(err))
    if result.rank:  # another rank than 0: rank 0 reports the run
        return EXIT_OK
    if result.reused:
        what = "its speed timed again, nothing else redone" if result.retimed else "nothing to do"
        _plain(err, f"{result.output_dir}: already done (same recipe hash): {what}; --overwrite to redo")
    _print_results(out, result.results)
    model = result.output_dir / "model"  # (a reused folder may hold the results only)
    where = model if (model / MANIFEST).is_file() else "none in this folder (it holds the results only)"
    _plain(out, f"results: {result.output_dir / 'results.json'}  model: {where}")
    return EXIT_OK


def _launch(args, err: Console) -> int:
    """``apply --nproc N``: the same command on N ranks of this host under torchrun (FSDP2); its exit
    status. A failing rank stops the others, and its error is printed with its rank."""
    import subprocess

    argv = list(args.argv)
    i = next(i for i, a in enumerate(argv) if a == "--nproc" or a.startswith("--nproc="))
    del argv[i : i + (1 if "=" in argv[i] else 2)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    cmd += ["-m", "compresskit", *argv]
    _plain(err, f"launching {args.nproc} ranks: {' '.join(cmd[1:])}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = subprocess.run(cmd, env=env).returncode
    if code:
        _plain(err, f"error: the run on {args.nproc} ranks failed (exit {code}); each failing rank's error is above")
    return code


def _dry_run(resolved, args, out: Console) -> int:
    """Print what the recipe's training and evaluation need per GPU (or, where the run would use the CPU, for
    its process), for ``--nproc`` ranks, without loading weights."""
    import torch
    from rich.table import Table

    from compresskit.memory import CONTEXT_BYTES, HEAP_GROWTH_CPU, PROCESS_BYTES_CPU, plan, size
    from compresskit.modeling import load_config, resolve_dtype

    rec = resolved.recipe
    config = load_config(rec.model.name_or_path, allow_download=rec.model.allow_download)[0]
    world = args.nproc or int(os.environ.get("WORLD_SIZE", "1"))
    device = rec.model.device
    if device == "auto":  # the device the run would take here
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = "cuda" if device.startswith("cuda") else "cpu"
    dtype = resolve_dtype(rec.model.dtype, torch.device(device))
    p = plan(resolved, world=world, config=config, dtype=dtype, device=device)
    if device == "cuda":
        how = "sharded (FSDP2)" if p.sharded else "whole on each GPU"
        made = "compresskit/memory.py says how they are made"
        where = f"estimates per GPU ({made}; {size(CONTEXT_BYTES)} of it CUDA context)"
    else:
        how = "sharded (FSDP2)" if p.sharded else "whole in each process"
        where = (
            "on the CPU: estimates per process (compresskit/memory.py says how they are made; "
            f"{size(PROCESS_BYTES_CPU)} of it the process with its libraries, and the step's tensors count "
            f"{HEAP_GROWTH_CPU}x for the heap's growth)"
        )
    _plain(out, f"{p.model}: {p.params:,} parameters, computing in {p.dtype}, {world} rank(s), weights {how}; {where}")
    table = Table(title="compresskit apply --dry-run")
    cols = (
        "stage",
        "steps",
        "tokens/step",
        "trained params",
        "weights",
        "trained state",
        "activations",
        "logits",
        "peak/GPU" if device == "cuda" else "peak/process",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "stage" else "right")
    for st in p.stages:
        table.add_row(
            st.stage, "-" if st.steps is None else str(st.steps), f"{st.tokens_per_step:,}",
            f"{st.trainable_params:,}", size(st.weights), size(st.trainable_state), size(st.activations),
            size(st.logits), size(st.peak),
        )  # fmt: skip
    if len(p.stages) == 1:
        _plain(out, "no training stage: nothing is trained")
    _print_table(out, table)
    return EXIT_OK


def cmd_validate(args, out: Console, err: Console) -> int:
    from compresskit.recipe import is_comparison, load_comparison

    # a comparison spec: every member, each as a recipe of its own
    paths = load_comparison(args.recipe)[0] if is_comparison(args.recipe) else [args.recipe]
    problems: list[str] = []
    for path in paths:
        found = _recipe_problems(path, list(args.set or []))
        if isinstance(found, list):  # every problem of this member, each named after it in a comparison
            problems += [f"{path}: {p}" if len(paths) > 1 else p for p in found]
            continue
        resolved, rec = found, found.recipe
        if args.print:
            out.print_json(json.dumps(resolved.to_dict()))
        stages = ", ".join(s.name for s in resolved.training) or "none"
        pruner = resolved.pruner.name if resolved.pruner else "none (dense)"
        out.print(
            f"ok: {path}: model {rec.model.name_or_path}, pruner {pruner}, training [{stages}], "
            f"executor {resolved.executor.name}, output {rec.output.dir} (recipe hash {resolved.hash()})",
            markup=False,
        )
    if problems:
        raise RecipeProblems(problems)
    return EXIT_OK


def _recipe_problems(path, overrides: list[str]):
    """The resolved recipe at ``path``, or every problem found in it: its fields and plugin configs,
    then what each valid section names (model, data files, tasks, output folder), one line each."""
    from compresskit.data import check_source, held_out_documents, load_documents
    from compresskit.files import check_creatable
    from compresskit.modeling import resolve_model_source
    from compresskit.recipe import (
        DataSection,
        EvaluationSection,
        ModelSection,
        OutputSection,
        apply_overrides,
        load_raw,
        problems_of,
        valid_section,
        validate,
    )
    from compresskit.tasks import check_lm_eval_tasks, check_task_data

    try:
        raw = apply_overrides(load_raw(path), overrides)
    except CompressKitError as exc:  # not a readable recipe: nothing more to check
        return problems_of(exc)
    problems: list[str] = []
    resolved = None
    try:
        resolved = validate(raw, source=str(path), overrides=overrides)
        rec = resolved.recipe
        model, data, evaluation, output = rec.model, rec.data, rec.evaluation, rec.output
    except CompressKitError as exc:
        problems += problems_of(exc)
        model, data, evaluation, output = (
            valid_section(raw, key, kind)
            for key, kind in (
                ("model", ModelSection),
                ("data", DataSection),
                ("evaluation", EvaluationSection),
                ("output", OutputSection),
            )
        )
    download = bool(model and model.allow_download)

    def check(fn, *fn_args, **kwargs) -> tuple[bool, Any]:
        try:
            return True, fn(*fn_args, **kwargs)
        except CompressKitError as exc:
            problems.extend(problems_of(exc))
            return False, None

    if model is not None:
        check(resolve_model_source, model.name_or_path, allow_download=download)
    if data is not None and check(check_source, data)[0]:  # its files exist: read them
        read, documents = check(load_documents, data, allow_download=download)
        if read and evaluation is not None:
            check(check_task_data, evaluation, held_out_documents(data, documents), seed=data.split_seed)
    if evaluation is not None:
        check(check_lm_eval_tasks, evaluation, allow_download=download)
    if output is not None:
        check(check_creatable, Path(output.dir), "output.dir")
    return problems or resolved


def cmd_schema(args, out: Console, err: Console) -> int:
    from compresskit import plugins
    from compresskit.recipe import Recipe

    if args.name == "recipe":
        out.print_json(json.dumps(Recipe.model_json_schema()))
        return EXIT_OK
    kinds = [args.kind] if args.kind else list(plugins.KINDS)
    found = [k for k in kinds if args.name in plugins.names(k)]
    if not found:
        every = {n for k in plugins.KINDS for n in plugins.names(k)} | {"recipe"}
        raise CompressKitError(f"schema: {did_you_mean(args.name, every, what='plugin')}")
    if len(found) > 1:
        raise CompressKitError(f"schema: {args.name!r} is a {' and a '.join(found)}; pick one with --kind")
    cls = plugins.load(found[0], args.name)
    schema = cls.Config.model_json_schema()
    options = getattr(cls, "TrainingOptions", None)
    if options is not None:  # what each training stage of a recipe with this pruner also takes
        schema["training_options"] = options.model_json_schema()
    out.print_json(json.dumps(schema))
    return EXIT_OK


def cmd_plugins(args, out: Console, err: Console) -> int:
    from rich.table import Table

    from compresskit import plugins

    if args.action == "check":
        if not args.name:
            raise CompressKitError(
                f"plugins check: name the pruner to check (installed: {', '.join(plugins.names('pruner'))})"
            )
        from compresskit.testing import check_plugin_contract

        if args.name not in plugins.names("pruner"):
            raise CompressKitError(f"plugins check: {did_you_mean(args.name, plugins.names('pruner'), what='pruner')}")
        checks = check_plugin_contract(args.name)
        for c in checks:
            mark = "PASS" if c.ok else "FAIL"
            _plain(out, f"{mark}  {c.name}" + (f": {c.detail}" if c.detail else ""))
        ok = all(c.ok for c in checks)
        _plain(out, f"{args.name}: contract {'passed' if ok else 'FAILED'}")
        return EXIT_OK if ok else EXIT_INTERNAL
    infos = plugins.discover()
    if out.is_terminal:
        table = Table(title="compresskit plugins")
        for col in ("kind", "name", "status", "distribution", "target"):
            table.add_column(col)
        for i in infos:
            status = "[green]ok[/green]" if i.ok else f"[red]broken[/red]: {i.error}"
            table.add_row(i.kind, i.name, status, f"{i.distribution} {i.version}", i.target)
        out.print(table)
    else:
        for i in infos:
            status = "ok" if i.ok else f"broken: {i.error}"
            _plain(out, f"{i.kind}\t{i.name}\t{status}\t{i.distribution} {i.version}\t{i.target}")
    return EXIT_OK


def cmd_generate(args, out: Console, err: Console) -> int:
    import time

    from compresskit.runtime import runtime_for

    if args.max_new_tokens < 1:
        raise CompressKitError(f"--max-new-tokens: {args.max_new_tokens}; give 1 or more")
    model, tokenizer, pruner, _ = _load_for_runtime(args.model, args, err, "MODEL (compresskit generate's argument)")
    runtime = runtime_for(model, pruner, counting=False)  # (generation reports no sparsity: nothing to count)
    prompt = tokenizer(args.prompt, add_special_tokens=True)["input_ids"]
    written: list[int] = []
    shown = ""
    out.file.write(args.prompt)

    def stream(row: int, token: int) -> None:
        nonlocal shown
        written.append(token)
        text = tokenizer.decode(written, skip_special_tokens=True)
        out.file.write(text[len(shown) :])
        out.file.flush()
        shown = text

    warm = 0.0
    if runtime.compiled or runtime.graphs:
        with err.status("compiling the runtime for this shape (once a process) ..."):
            warm = runtime.warm_up(1, len(prompt), args.max_new_tokens)
    t0 = time.perf_counter()
    res = runtime.generate(
        [prompt],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        eos_token_id=tokenizer.eos_token_id,
        seed=args.seed,
        on_token=stream,
    )
    out.file.write("\n")
    err.print(
        f"{res.new_tokens} tokens in {time.perf_counter() - t0:.2f} s: first token after "
        f"{res.prefill_seconds * 1e3:.0f} ms, then {(res.new_tokens - 1) / max(res.decode_seconds, 1e-9):.1f} "
        f"tokens/s (compresskit runtime, {runtime.mode}, {runtime.device.type}"
        + (f"; compiled beforehand in {warm:.1f} s" if warm else "")
        + ")",
        markup=False,
        highlight=False,
    )
    return EXIT_OK


def _load_for_runtime(ref: str, args, err: Console, field: str):
    """(model, tokenizer, pruner or None, base model name) of a saved run, an HF directory or an alias."""
    from compresskit.runtime import load_for_runtime

    return load_for_runtime(ref, device=args.device, dtype=args.dtype, field=field, progress=_progress(err))


def cmd_bench(args, out: Console, err: Console) -> int:
    import datetime

    import torch
    from rich.table import Table

    from compresskit import files
    from compresskit.bench import (
        SHAPES,
        Member,
        bench,
        markdown,
        matrix_markdown,
        method_source,
        model_matrix_markdown,
        run_source,
        setting_members,
        shape_config,
        shape_members,
        shape_memory_error,
        speedups,
    )
    from compresskit.modeling import device_name, load_model, resolve_device, resolve_dtype
    from compresskit.options import configured_executor, parse_option
    from compresskit.plot import speedup_heatmap, speedup_vs_batch
    from compresskit.runtime import Runtime, runtime_for

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
    sparsities = _float_list(
        args.sparsity, "--sparsity", what="fractions", ok=lambda v: 0.0 <= v < 1.0, rule="; give fractions in [0, 1)",
        example="0.25,0.5", distinct=True,
    )  # fmt: skip
    sources = []
    if args.shape is not None:  # every name and run checked before anything is built: one line each
        if args.method or not args.runs:
            method = args.method or _default("bench", "method")
            sources += [method_source(method, s, named=len(sparsities) > 1) for s in sparsities]
        sources += [run_source(ref) for ref in args.runs]
    settings = [parse_option(text) for text in args.option]
    for src in sources:  # each setting fits each method's executor: checked before anything is built
        for setting in settings:
            configured_executor(src.pruner_cls, setting)
    if args.output is not None:
        files.check_creatable(Path(args.output), "output directory (--output)")
        files.check_replaceable(Path(args.output), "output directory (--output)", BENCH_FILES)
        args.held.enter_context(locking.hold(Path(args.output), field="output directory (--output)"))
        files.sweep(Path(args.output))
    options = {} if args.compile == "auto" else {"compile": args.compile == "on", "graphs": args.compile == "on"}
    if args.prefill_graphs == "on":
        if not torch.cuda.is_available() or args.device == "cpu" or args.compile == "off":
            raise CompressKitError("--prefill-graphs on: needs CUDA graphs, so a GPU and --compile auto or on")
        options["prefill_graphs"] = True
    elif args.prefill_graphs == "off":
        options["prefill_graphs"] = False

    def check_positions(limit: int | None) -> None:
        if limit is not None and max(prompts) + args.new_tokens > limit:
            raise CompressKitError(
                f"--prompt {max(prompts)} + --new-tokens {args.new_tokens} exceed the model's {limit} positions"
            )

    config = None
    if args.shape is not None:
        check_positions(SHAPES[args.shape]["max_position_embeddings"])  # before anything is built
        device = resolve_device(args.device, field="--device")
        dtype = resolve_dtype(args.dtype, device)
        too_large = shape_memory_error(args.shape, dtype, device)
        if too_large:
            raise CompressKitError(too_large)
        members = shape_members(
            args.shape,
            sources,
            device=device,
            dtype=dtype,
            transformers=None if args.transformers == "off" else args.transformers,
            settings=settings,
            bounds=args.bounds == "on",
            **options,
        )
        base, config = args.shape, shape_config(args.shape)
    else:
        field = "MODEL (compresskit bench's argument)"
        model, _, pruner, base = _load_for_runtime(args.model, args, err, field)
        dense = model if pruner is None else load_model(base, dtype=args.dtype, device=args.device)[0]
        members = [Member("compressed", model, runtime_for(model, pruner, **options), pruner)]
        if settings and pruner is None:
            raise CompressKitError(f"--option: {args.model} is no saved run of a method, so it has no settings of one")
        members += setting_members(model, pruner, settings, **options)
        members.append(Member("dense", dense, Runtime(dense, **options)))
        if args.transformers != "off":
            name = "dense (transformers)" if args.transformers == "dynamic" else "dense (transformers, static cache)"
            members.append(Member(name, dense, transformers=args.transformers))
        check_positions(getattr(model.config, "max_position_embeddings", None))
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
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
        meta["structures"] = (
            "random weights; routers untrained, their biases calibrated so that each group is skipped on a share "
            "of the tokens: "
            + (
                f"{', '.join(map(str, sparsities))} of each router's groups (--sparsity), "
                if args.method or not args.runs
                else ""
            )
            + (
                "each run's realised fraction per layer and block, at the same relative depth (--run); "
                if args.runs
                else ""
            )
            + "a static method's model pruned at that fraction of the MACs on random tokens"
        )
    medians = f"medians of {args.repeats}"
    if meta["ttft_repeats"] != args.repeats:
        medians = f"TPOT medians of {args.repeats}, TTFT of {meta['ttft_repeats']}"
    table = Table(title=f"{meta['model']}: TTFT and TPOT against {base} ({medians})")
    cols = ("model", "decode", "batch", "prompt", "TTFT ms", "TPOT ms", "TTFT x dense", "TPOT x dense", "sparsity MACs")
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "decode") else "right")
    for r in records:
        sp = "-" if r["sparsity_macs"] is None else f"{r['sparsity_macs']:.3f}"
        table.add_row(
            r["model"], r["mode"], str(r["batch"]), str(r["prompt"]), f"{r['ttft_ms']:.2f}", f"{r['tpot_ms']:.2f}",
            f"{r['ttft_speedup']:.2f}x", f"{r['tpot_speedup']:.2f}x", sp,
        )  # fmt: skip
    _print_table(out, table)
    if args.output is not None:
        with files.staged_dir(Path(args.output)) as tmp:
            files.write_json(tmp / "bench.json", {"meta": meta, "results": records})
            parts = [matrix_markdown(records), matrix_markdown(records, "ttft")]
            parts += [model_matrix_markdown(records, "ttft"), model_matrix_markdown(records, "tpot")]
            files.write_text(tmp / "bench.md", "\n".join([markdown(records, meta), *filter(None, parts)]))
            speedup_vs_batch(records, tmp / "bench.png")
            if len({r["batch"] for r in records}) > 1 and len({r["prompt"] for r in records}) > 1:
                speedup_heatmap(records, tmp / "bench-heatmap.png")
        _plain(out, f"results: {Path(args.output) / 'bench.json'}")
    return EXIT_OK


def _default(*keys: str) -> Any:
    """A product default that names a plugin (``compresskit/resources/defaults.json``)."""
    from importlib.resources import files as resource_files

    node = json.loads(resource_files("compresskit").joinpath("resources/defaults.json").read_text())
    for key in keys:
        node = node[key]
    return node


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cmd_eval(args, out: Console, err: Console) -> int:
    from pydantic import ValidationError

    from compresskit.api import eval_model
    from compresskit.options import parse_option
    from compresskit.recipe import DataSection, EvaluationSection, format_validation_error

    fields: dict[str, Any] = {}
    if args.tasks:
        fields["tasks"] = args.tasks.split(",")
    for key in (
        "limit",
        "batch_size",
        "perplexity_docs",
        "max_length",
        "next_sentence_items",
        "num_fewshot",
        "task_paths",
        "engine",
        "logits_budget_mb",
    ):
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    try:
        evaluation = EvaluationSection(**fields)
    except ValidationError as exc:
        flags = {key: "--" + key.replace("_", "-").removesuffix("s" if key == "task_paths" else "") for key in fields}
        raise RecipeError(format_validation_error(exc, EvaluationSection, names=flags)) from None
    data = DataSection()
    if args.data:  # your own text, as a recipe's data.source.files takes it
        try:
            split = {} if args.test_fraction is None else {"test_fraction": args.test_fraction}
            data = DataSection(source={"files": args.data}, **split)
        except ValidationError as exc:
            names = {"source": "--data", "test_fraction": "--test-fraction"}
            raise RecipeError(format_validation_error(exc, DataSection, names=names)) from None
    elif args.test_fraction is not None:
        raise CompressKitError("--test-fraction: it splits your own text; give --data FILE... too")
    results = eval_model(
        args.model,
        options=None if args.option is None else parse_option(args.option),
        allow_download=args.allow_download,
        data_field="--data",
        evaluation=evaluation,
        data=data,
        dtype=args.dtype,
        device=args.device,
        output_dir=args.output,
        progress=_progress(err),
        field="MODEL (compresskit eval's argument)",
    )
    _print_results(out, results)
    if args.output:
        _plain(out, f"results: {Path(args.output) / 'results.json'}")
    return EXIT_OK


def _load_run(ref: str, overrides: list[str], progress, err: Console) -> dict[str, Any]:
    """A results document from a recipe (run, or reused when its results are current), a
    results.json file, a run directory or its model/ directory."""
    from compresskit import files
    from compresskit.api import apply
    from compresskit.recipe import load_recipe

    path = Path(ref)
    if path.suffix in (".yaml", ".yml"):
        result = apply(load_recipe(path, overrides), progress=progress)
        if result.reused:
            progress.log(f"{ref}: reusing {result.output_dir / 'results.json'}")
        return result.results
    if path.is_dir():  # a run folder, or its model/ (what generate and eval take too)
        inside = path / "results.json"
        path = inside if inside.is_file() or path.name != "model" else path.parent / "results.json"
    data = files.read_json(path, what="results file")
    if not isinstance(data, dict) or "metrics" not in data or "sparsity" not in data:
        raise CompressKitError(f"{path}: not a compresskit results.json (no metrics/sparsity)")
    return data


def _name_apart(runs: list[dict[str, Any]], inputs: list[str]) -> None:
    """Rows that would share a name (two runs of one recipe: on the shipped text and on one's own) get their
    input's folder beside it, ``my-recipe (runs/mine)``."""
    names = [r["name"] for r in runs]
    for i, (run, ref) in enumerate(zip(runs, inputs, strict=True)):
        if names.count(run["name"]) > 1:
            where = Path(ref).parent if Path(ref).suffix in (".json", ".yaml", ".yml") else Path(ref)
            runs[i] = {**run, "name": f"{run['name']} ({where})"}


def _float_list(
    text: str,
    flag: str,
    *,
    what: str = "numbers",
    ok=lambda v: v > 0,
    rule: str = ": give positive speedups",
    example: str = "1.2,1.4",
    distinct: bool = False,
) -> tuple[float, ...]:
    """A comma-separated list of numbers each ``ok`` (``rule`` says which; ``distinct``: none twice), or one
    line naming ``flag``."""
    try:
        values = tuple(float(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise CompressKitError(f"{flag}: {text!r} is not a comma-separated list of {what}, e.g. {example}") from None
    if not values or not all(ok(v) for v in values):
        raise CompressKitError(f"{flag}: {text!r}{rule}, e.g. {example}")
    if distinct and len(set(values)) < len(values):
        raise CompressKitError(f"{flag}: {text!r} names a {what.removesuffix('s')} twice")
    return values


def _int_list(text: str, flag: str, minimum: int | None = 1) -> list[int]:
    """A comma-separated list of integers (each at least ``minimum``), or one line naming ``flag``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CompressKitError(f"{flag}: {text!r} is not a comma-separated list of integers, e.g. 1,2") from None
    if not values:
        raise CompressKitError(f"{flag}: {text!r}: give at least one integer, e.g. 1,2")
    if minimum is not None and min(values) < minimum:
        raise CompressKitError(f"{flag}: {text!r}: give integers of {minimum} or more, e.g. 1,2")
    return values


def _parse_seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    seeds = _int_list(text, "--seeds", minimum=None)
    if len(set(seeds)) != len(seeds):
        raise CompressKitError(f"--seeds: {text!r}: give distinct integers, e.g. 0,1,2")
    return seeds


def _seed_overrides(ref: str, overrides: list[str], seed: int) -> list[str]:
    """The overrides that run recipe ``ref`` with ``seed``, into ``<its output.dir>-seed<seed>``."""
    from compresskit.recipe import load_recipe

    out_dir = load_recipe(ref, overrides).recipe.output.dir.rstrip("/")
    return [*overrides, f"seed={seed}", f"output.dir={out_dir}-seed{seed}"]


def cmd_compare(args, out: Console, err: Console) -> int:
    from compresskit import files
    from compresskit.comparison import SPEED_TARGETS, aggregate_seeds, group_runs
    from compresskit.recipe import is_comparison, load_comparison, load_recipe
    from compresskit.report import compare_csv, compare_markdown, compare_tables, equal_speed_markdown

    # The flags first, then expand comparison specs and validate every recipe before running any of them.
    targets = _float_list(args.at, "--at") if args.at else SPEED_TARGETS
    if args.at and not args.speed:
        raise CompressKitError("--at: reads quality at equal speed, so it needs --speed BENCH.json")
    speed = _read_speed(args.speed) if args.speed else None
    seeds = _parse_seeds(args.seeds)
    inputs: list[str] = []
    for ref in args.inputs:
        if is_comparison(ref):
            members, spec_out, spec_seeds = load_comparison(ref)
            inputs += [str(m) for m in members]
            args.output = args.output or str(spec_out)
            seeds = seeds or spec_seeds
        else:
            inputs.append(ref)
    overrides = list(args.set or [])
    for ref in inputs:
        if Path(ref).suffix in (".yaml", ".yml"):
            load_recipe(ref, overrides)
        elif not Path(ref).exists():
            raise CompressKitError(
                f"compare: {ref!r} is neither a recipe (.yaml) nor an existing results file or run directory"
            )
        elif seeds:
            raise CompressKitError(f"compare --seeds: {ref!r} is a finished run; seeds apply to recipes only")
    progress = _progress(err)
    runs = []
    for ref in inputs:
        if seeds and Path(ref).suffix in (".yaml", ".yml"):
            per_seed = [_load_run(ref, _seed_overrides(ref, overrides, s), progress, err) for s in seeds]
            runs.append(aggregate_seeds(per_seed))
        else:
            runs.append(_load_run(ref, overrides, progress, err))
    _name_apart(runs, inputs)
    groups = group_runs(runs)
    if speed is not None:
        _check_speed_runs(speed, runs)
    if len(groups) > 1:
        _plain(
            err,
            f"warning: these runs were evaluated under {len(groups)} different settings; each group is shown "
            "apart, with its own dense reference: compare numbers only within a group",
        )
    sections = {g.label: equal_speed_markdown(g.runs, speed, targets) for g in groups} if speed else {}
    markdown = "\n".join(
        [compare_markdown(groups)] + [(f"### {label}\n\n" if label else "") + text for label, text in sections.items()]
    )
    if out.is_terminal:
        for table in compare_tables(groups):
            out.print(table)
        for text in sections.values():
            _plain(out, text)
    else:
        _plain(out, markdown)
    if args.output:
        target = Path(args.output)
        args.held.enter_context(locking.hold(target, field="compare's output folder", progress=progress))
        with files.staged_files(target) as tmp:  # the folder may hold the inputs: keep them
            files.write_text(tmp / "compare.md", markdown)
            files.write_text(tmp / "compare.csv", compare_csv(groups))
            files.write_json(
                tmp / "compare.json",
                [
                    {
                        "group": g.label or "1",
                        "settings": g.settings,
                        "runs": g.runs,
                        **({"speed": {"bench": speed.meta, "targets": list(targets)}} if speed else {}),
                    }
                    for g in groups
                ],
            )
            from compresskit.plot import quality_vs_sparsity, quality_vs_speed

            quality_vs_sparsity([r for g in groups for r in g.runs], tmp / "compare.png")
            written = ["compare.csv", "compare.json", "compare.png"]
            if speed:
                for i, g in enumerate(groups):
                    name = "quality_vs_speed.png" if len(groups) == 1 else f"quality_vs_speed-{i + 1}.png"
                    quality_vs_speed(g.runs, speed, tmp / name)
                    written.append(name)
        _plain(out, f"written: {target / 'compare.md'}, " + ", ".join(written))
    return EXIT_OK


def _read_speed(paths: list[str]):
    """``--speed``: the bench files' records (``compresskit.comparison.Speed``)."""
    from compresskit import files
    from compresskit.comparison import read_speed

    docs = []
    for ref in paths:
        path = Path(ref)
        if path.is_dir():
            path = path / "bench.json"
        docs.append((path, files.read_json(path, what="bench file (--speed)")))
    try:
        speed = read_speed(docs)
    except ValueError as exc:
        raise CompressKitError(f"--speed: {exc}") from None
    return speed


def _check_speed_runs(speed, runs: list[dict]) -> None:
    """The bench files must time some of ``runs`` (``compresskit bench --shape NAME --run RUN``)."""
    names = {r["name"] for r in runs if r.get("pruner")}
    timed = {name for name, _ in speed.records} - {"dense"}
    if not names & timed:
        raise CompressKitError(
            f"--speed: the bench files time none of these runs (they time {', '.join(sorted(timed)) or 'no run'}; "
            f"the runs are {', '.join(sorted(names))}): bench them with compresskit bench --shape NAME --run RUN"
        )


# ---------------------------------------------------------------------------------------------


MODEL_HELP = "a run folder (what apply prints), its model/ directory, an HF model directory or an alias"


def build_parser() -> argparse.ArgumentParser:
    from compresskit import tasks

    parser = _Parser(
        prog="compresskit",
        description="Compress an LLM with pluggable pruners; evaluate every method with one evaluator.",
        epilog="Exit codes: 0 ok, 2 bad input (one line naming what was wrong), 1 internal error "
        "(--debug shows the traceback), 130 interrupted (Ctrl-C), 143 stopped by SIGTERM; "
        "an interrupted apply resumes when run again.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    def with_placement(p):
        p.add_argument(
            "--dtype",
            default="auto",
            choices=["auto", "float32", "bfloat16", "float16"],
            help="weights' dtype (auto: bfloat16 on a GPU, float32 on the CPU)",
        )
        p.add_argument(
            "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: a GPU where there is one"
        )

    def with_set(p):
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe value (repeatable)")

    p = sub.add_parser("apply", help="run a recipe: load, prune, train, finalize, convert, evaluate, save")
    p.add_argument("recipe", help="a recipe YAML file (recipes/ has examples) or a comparison spec")
    with_set(p)
    p.add_argument("--overwrite", action="store_true", help="replace output.dir even if it holds another run")
    p.add_argument(
        "--dry-run",
        action="store_true",
        dest="dry_run",
        help="print each training stage's and the evaluation's steps, tokens and expected peak memory per GPU "
        "(per process on the CPU); load nothing",
    )
    p.add_argument(
        "--nproc", type=int, help="ranks (GPUs of this host) to train on: launches the run under torchrun (FSDP2)"
    )
    p.set_defaults(fn=cmd_apply)

    p = sub.add_parser("validate", help="check a recipe (both stages) without loading weights")
    p.add_argument("recipe", help="a recipe YAML file or a comparison spec (every member is checked)")
    with_set(p)
    p.add_argument("--print", action="store_true", help="print the resolved recipe as JSON")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser(
        "schema",
        help="JSON schema of a plugin's config (or of 'recipe'); a pruner's also under training_options: what each "
        "training stage of a recipe with it also takes",
    )
    p.add_argument("name", help="a plugin's name (compresskit plugins lists them), or 'recipe'")
    p.add_argument("--kind", choices=["pruner", "trainer", "executor"], help="which kind, where two share the name")
    p.set_defaults(fn=cmd_schema)

    p = sub.add_parser("plugins", help="list installed plugins, or 'plugins check NAME' to run the contract")
    p.add_argument(
        "action", nargs="?", choices=["list", "check"], default="list", help="list (default), or check one pruner"
    )
    p.add_argument("name", nargs="?", help="with check: the pruner whose plugin contract to run")
    p.set_defaults(fn=cmd_plugins)

    p = sub.add_parser("generate", help="stream text from a saved run, an HF directory or an alias (the runtime)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, dest="max_new_tokens", help="tokens to generate (64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, dest="top_p", help="nucleus sampling's share (1.0: off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (with --temperature above 0)")
    with_placement(p)
    p.set_defaults(fn=cmd_generate)

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

    p = sub.add_parser("eval", help="evaluate a run, a saved model directory, an HF directory or an alias")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--tasks", help=f"comma-separated: built in ({','.join(tasks.names())}) or lm-eval task and group names"
    )
    p.add_argument("--num-fewshot", type=int, dest="num_fewshot", help="few-shot examples for the lm-eval tasks")
    p.add_argument("--task-path", action="append", dest="task_paths", help="a folder of lm-eval task YAML files")
    p.add_argument(
        "--engine",
        choices=["auto", "transformers", "runtime"],
        help="what computes the logits: the runtime with the method's blocks, transformers' modules, or auto (the "
        "runtime on a GPU where it runs the architecture)",
    )
    p.add_argument("--limit", type=int, help="items per zero-shot task")
    p.add_argument(
        "--perplexity-docs",
        type=int,
        dest="perplexity_docs",
        help="held-out documents the perplexity task reads (default: all of them)",
    )
    p.add_argument(
        "--next-sentence-items", type=int, dest="next_sentence_items", help="items of the next_sentence task (500)"
    )
    p.add_argument("--batch-size", type=int, dest="batch_size", help="sequences a forward pass (16)")
    p.add_argument(
        "--max-length", type=int, dest="max_length", help="context in tokens; perplexity reads windows this long (1024)"
    )
    p.add_argument(
        "--logits-budget-mb",
        type=int,
        dest="logits_budget_mb",
        help="memory for one batch's log-probabilities; a batch that would need more is made smaller",
    )
    p.add_argument(
        "--data",
        nargs="+",
        metavar="FILE",
        help="your own text instead of the shipped Wikipedia excerpt: paths or globs of .txt, .jsonl, .json or "
        ".parquet files, as a recipe's data.source.files; the held-out share (--test-fraction) is what "
        "perplexity and next_sentence read",
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        dest="test_fraction",
        help="with --data: the share of your documents held out for evaluation (default 0.25, as in a recipe)",
    )
    p.add_argument(
        "--allow-download",
        action="store_true",
        dest="allow_download",
        help="a hub model or an lm-eval task's data not in the local caches may be downloaded",
    )
    p.add_argument(
        "--option",
        metavar="KEY=VALUE,...",
        help=f"score a saved run under {OPTION_HELP}; the reference path decides as the runtime's blocks would",
    )
    with_placement(p)
    p.add_argument("--output", help="directory for results.json and results.md")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("compare", help="one table from several recipes (run or reused) and/or results files")
    p.add_argument(
        "inputs",
        nargs="+",
        help="recipes (run, or reused where their output.dir holds the run), a comparison spec, run folders or "
        "results.json files",
    )
    with_set(p)
    p.add_argument(
        "--seeds",
        metavar="S1,S2,...",
        help="run every recipe once per seed (into <output.dir>-seed<S>) and show mean ± standard deviation",
    )
    p.add_argument("--output", help="directory for compare.md, compare.csv and compare.json")
    p.add_argument(
        "--speed",
        action="append",
        default=[],
        metavar="BENCH",
        help="a bench.json of the runs' structures (compresskit bench --shape NAME --run RUN...): adds quality at "
        "equal speed, a table and a plot (repeatable)",
    )
    p.add_argument("--at", help="with --speed: comma-separated speedups to read each method's quality at (1.2,1.4,1.6)")
    p.set_defaults(fn=cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    out, err = _consoles()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    _quiet_libraries()
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv  # the command as given (recorded by bench)
        if args.version:
            from compresskit import __version__

            out.print(f"compresskit {__version__}")
            return EXIT_OK
        if not getattr(args, "fn", None):
            build_parser().print_help()
            return EXIT_BAD_INPUT
        with handle_signals(), contextlib.ExitStack() as held:
            args.held = held  # what a command holds until it returns (the lock of the folder it writes)
            return args.fn(args, out, err)
    except CompressKitError as exc:
        if debug:
            traceback.print_exc()
        for problem in getattr(exc, "problems", None) or [str(exc)]:
            msg = " ".join(problem.split())  # one line each
            err.print(f"{_rank_prefix()}error: {msg}", markup=False, highlight=False)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGINT through handle_signals
        why = f" ({exc})" if isinstance(exc, Interrupted) else ""
        err.print(f"interrupted{why}; run the same command again to resume", markup=False)
        return getattr(exc, "exit_code", 130)
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
        if debug:
            traceback.print_exc()
        err.print(
            f"{_rank_prefix()}internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
            markup=False,
            highlight=False,
        )
        return EXIT_INTERNAL


def _rank_prefix() -> str:
    """``rank R of N: `` in a process launched on several ranks, else nothing."""
    if not distributed.launched():
        return ""
    return f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE')}: "


if __name__ == "__main__":
    raise SystemExit(main())
