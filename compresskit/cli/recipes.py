"""``apply``, ``validate``, ``schema`` and ``plugins``: running and checking recipes, and the plugins they name."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from compresskit import distributed
from compresskit.cli.common import EXIT_INTERNAL, EXIT_OK, _plain, _print_results, _print_table, _progress, with_set
from compresskit.errors import CompressKitError, RecipeProblems, did_you_mean


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
            st.stage,
            "-" if st.steps is None else str(st.steps),
            f"{st.tokens_per_step:,}",
            f"{st.trainable_params:,}",
            size(st.weights),
            size(st.trainable_state),
            size(st.activations),
            size(st.logits),
            size(st.peak),
        )
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
        if resolved.pipeline:
            pruner = " -> ".join(step.pruner.name for step in resolved.steps)
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


def add_apply_parser(sub) -> None:
    """The ``apply`` command's arguments."""
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


def add_validate_parser(sub) -> None:
    """The ``validate`` command's arguments."""
    p = sub.add_parser("validate", help="check a recipe (both stages) without loading weights")
    p.add_argument("recipe", help="a recipe YAML file or a comparison spec (every member is checked)")
    with_set(p)
    p.add_argument("--print", action="store_true", help="print the resolved recipe as JSON")
    p.set_defaults(fn=cmd_validate)


def add_schema_parser(sub) -> None:
    """The ``schema`` command's arguments."""
    p = sub.add_parser(
        "schema",
        help="JSON schema of a plugin's config (or of 'recipe'); a pruner's also under training_options: what each "
        "training stage of a recipe with it also takes",
    )
    p.add_argument("name", help="a plugin's name (compresskit plugins lists them), or 'recipe'")
    p.add_argument("--kind", choices=["pruner", "trainer", "executor"], help="which kind, where two share the name")
    p.set_defaults(fn=cmd_schema)


def add_plugins_parser(sub) -> None:
    """The ``plugins`` command's arguments."""
    p = sub.add_parser("plugins", help="list installed plugins, or 'plugins check NAME' to run the contract")
    p.add_argument(
        "action", nargs="?", choices=["list", "check"], default="list", help="list (default), or check one pruner"
    )
    p.add_argument("name", nargs="?", help="with check: the pruner whose plugin contract to run")
    p.set_defaults(fn=cmd_plugins)
