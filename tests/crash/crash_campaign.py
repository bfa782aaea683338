"""The crash campaign: ``compresskit apply`` killed with SIGKILL at each of its crash points and at random
moments, then the same command run again; what every kill leaves, and what every rerun ends with, checked.

    .venv/bin/python tests/crash/crash_campaign.py                       # the full campaign (make crash-campaign)
    .venv/bin/python tests/crash/crash_campaign.py --points 10 --random 4 --overwrite 2 --double 2
    .venv/bin/python tests/crash/crash_campaign.py --recipe recipes/wide-smollm2-50-quick.yaml \\
        --set training.0.config.steps=4 --set training.1.config.steps=4 --points 12 --random 0

A case, in a fresh folder with a cache of its own (its converted model, data and dense reference start cold):

1. ``fresh`` cases start from nothing; ``overwrite`` cases from an output folder that holds a finished run of
   another recipe (the seed changed), replaced with ``--overwrite``;
2. the command runs with ``COMPRESSKIT_CRASH_AT=k`` (``compresskit.crashpoints``: it kills itself with SIGKILL
   at its k-th crash point) or is killed with SIGKILL after a random number of seconds;
3. what it left is checked: the output folder is absent, or holds a whole run (the old one, or the new one
   equal to an uninterrupted run's); a model folder, in the output or the staging folder, is whole wherever it
   is (its files load; no later command can load half a model); every cache file that is not a temporary
   reads;
4. the same command runs again (in ``double`` cases it is killed again first, at a random point of its own):
   it exits 0 with the output equal to an uninterrupted run's (the same tensors saved, bit for bit; the same
   metrics, sparsity and training losses), printing the paths it wrote; no staging folder, temporary or owner
   record is left beside or inside the output.

Two uninterrupted runs are compared first: equality is checked only where the run is deterministic (it is,
on the CPU), and the campaign says so when it is not. Prints one table row a case and a summary; exits 1
when a case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from compresskit.files import TMP_MARK
from compresskit.testing import TINY_EVALUATION

# The default run: WIDE on a tiny random model, shaped as recipes/wide-smollm2-50-quick.yaml is (calibration, a
# router stage, a LoRA stage distilling cached teacher logits, three evaluation tasks), in seconds.
TINY_RECIPE = {
    "name": "crash-tiny",
    "seed": 0,
    "model": {"name_or_path": "set-by-the-campaign", "dtype": "float32", "device": "cpu"},
    "data": {"calibration": {"n_samples": 4, "seq_len": 32, "batch_size": 2}},
    "pruner": {"name": "wide", "config": {"target_sparsity": 0.5, "ffn_group_size": 16, "router_rank": 8}},
    "training": [
        {"name": "router", "config": {"steps": 12, "batch_size": 2, "seq_len": 64, "lr": 5e-3, "checkpoint_every": 4}},
        {
            "name": "lora",
            "config": {
                "steps": 8,
                "batch_size": 2,
                "seq_len": 64,
                "r": 4,
                "alpha": 8,
                "checkpoint_every": 4,
                "distill": {"weight": 0.5, "top_k": 16, "cache": True},
            },
        },
    ],
    "evaluation": TINY_EVALUATION,
    "output": {"dir": "set-by-the-campaign"},
}


@dataclass
class Case:
    scenario: str  # "fresh" | "overwrite"
    at: int | None = None  # the crash point to die at (1-based), or None
    after_s: float | None = None  # or the seconds after which it is killed
    again_at: int | None = None  # "double": the rerun dies at its own crash point, then a last run
    label: str = ""
    left: str = ""  # what the kill left
    rerun: str = ""  # what the rerun said it did
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class Setup:
    root: Path
    recipe: Path
    sets: list[str]
    env: dict[str, str]
    reference: dict | None = None  # the uninterrupted run's fingerprint
    old: dict | None = None  # the other recipe's (overwrite cases)
    old_run: Path | None = None  # its finished run, copied into each overwrite case
    points: dict[str, list[str]] = field(default_factory=dict)  # crash points of an uninterrupted run, by scenario
    seconds: float = 0.0  # an uninterrupted run's wall time
    deterministic: bool = True


# ---------------------------------------------------------------------------------------------
# running the command


def command(setup: Setup, out: Path, scenario: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "compresskit",
        "apply",
        str(setup.recipe),
        *[a for s in setup.sets for a in ("--set", s)],
    ]
    cmd += ["--set", f"output.dir={out}"]
    return cmd + (["--overwrite"] if scenario == "overwrite" else [])


def run(setup: Setup, case_dir: Path, scenario: str, *, at=None, after_s=None, trace=None, extra_sets=()):
    """Run the command in ``case_dir`` (its output ``case_dir/runs/run``, its cache ``case_dir/cache``):
    ``(returncode, stdout, stderr)``; -9 where it was killed."""
    env = dict(setup.env, COMPRESSKIT_CACHE=str(case_dir / "cache"))
    if at is not None:
        env["COMPRESSKIT_CRASH_AT"] = str(at)
    if trace is not None:
        env["COMPRESSKIT_CRASH_TRACE"] = str(trace)
    cmd = command(setup, case_dir / "runs" / "run", scenario) + [a for s in extra_sets for a in ("--set", s)]
    proc = subprocess.Popen(cmd, cwd=case_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if after_s is None:
        out, err = proc.communicate()
    else:
        try:
            out, err = proc.communicate(timeout=after_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            out, err = proc.communicate()
    return proc.returncode, out, err


# ---------------------------------------------------------------------------------------------
# what a folder holds


def tensors(model_dir: Path) -> dict[str, dict]:
    """Every safetensors file of a saved model folder, loaded (a half-written one raises)."""
    from safetensors.torch import load_file

    return {p.name: load_file(str(p)) for p in sorted(model_dir.glob("*.safetensors"))}


def fingerprint(run_dir: Path) -> dict:
    """What an equal rerun must reproduce: the results that do not measure time, the model's manifest (less
    the versions) and its tensors. Raises where the folder does not hold a whole run."""
    results = json.loads((run_dir / "results.json").read_text())
    manifest = json.loads((run_dir / "model" / "compresskit.json").read_text())
    manifest.pop("versions", None)
    manifest["recipe"].pop("output", None)  # (where the run was written)
    return {
        "recipe_hash": results["recipe_hash"],
        "metrics": results["metrics"],
        "sparsity": results["sparsity"],
        "recovery": results["recovery"],
        "training": [(t["stage"], t["steps"], t["tokens"], t["final_loss"]) for t in results["training"]],
        "manifest": manifest,
        "tensors": tensors(run_dir / "model"),
    }


def same(a: dict, b: dict) -> bool:
    import torch

    if {k: v for k, v in a.items() if k != "tensors"} != {k: v for k, v in b.items() if k != "tensors"}:
        return False
    if a["tensors"].keys() != b["tensors"].keys():
        return False
    for name, ta in a["tensors"].items():
        tb = b["tensors"][name]
        if ta.keys() != tb.keys() or not all(torch.equal(ta[k], tb[k]) for k in ta):
            return False
    return True


def temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(f".*{TMP_MARK}*")] if folder.is_dir() else []


def check_left(setup: Setup, case: Case, case_dir: Path) -> None:
    """What a kill left (step 3 of the module docstring): problems go to ``case.problems``."""
    runs = case_dir / "runs"
    out, staging = runs / "run", runs / "run.partial"
    left = []
    if out.exists():
        try:
            found = fingerprint(out)
        except Exception as exc:  # noqa: BLE001 - any failure to read is a damaged folder
            case.problems.append(f"the output folder is not a whole run after the kill ({type(exc).__name__}: {exc})")
        else:
            if found["recipe_hash"] == setup.reference["recipe_hash"] and (
                not setup.deterministic or same(found, setup.reference)
            ):
                left.append("the new run")
            elif case.scenario == "overwrite" and same(found, setup.old):
                left.append("the old run")
            else:
                case.problems.append("the output folder holds a run equal to neither the old nor an uninterrupted one")
    if staging.exists():
        left.append("staging" + (" with a model" if (staging / "model").exists() else ""))
        if (staging / "model").exists():
            try:
                tensors(staging / "model")
                json.loads((staging / "model" / "compresskit.json").read_text())
            except Exception as exc:  # noqa: BLE001
                case.problems.append(f"a half-written model in the staging folder ({type(exc).__name__}: {exc})")
    for path in (case_dir / "cache").rglob("*"):
        if path.is_file() and TMP_MARK not in path.name and not path.name.endswith(".lock"):
            try:
                if path.suffix == ".json":
                    json.loads(path.read_text())
                elif path.suffix == ".safetensors":
                    from safetensors.torch import load_file

                    load_file(str(path))
            except Exception as exc:  # noqa: BLE001
                case.problems.append(f"a cache file does not read: {path.relative_to(case_dir)} ({exc})")
    case.left = ", ".join(left) or "nothing"


def check_rerun(setup: Setup, case: Case, case_dir: Path, rc: int, out: str, err: str) -> None:
    """What the rerun ended with (step 4 of the module docstring)."""
    runs = case_dir / "runs"
    said = [
        ("moved into place", "had finished; moving"),
        ("took over the lock", "is gone; taking over"),
        ("resumed", "resuming the interrupted run"),
        ("reused", "already done"),
    ]
    case.rerun = ", ".join(what for what, text in said if text in err) or "ran from the start"
    if rc != 0:
        tail = err.strip().splitlines()[-1:] if err.strip() else []
        case.problems.append(f"the rerun exited {rc}: {' '.join(tail)}")
        return
    try:
        found = fingerprint(runs / "run")
    except Exception as exc:  # noqa: BLE001
        case.problems.append(f"the rerun's output is not a whole run ({type(exc).__name__}: {exc})")
        return
    if setup.deterministic and not same(found, setup.reference):
        case.problems.append("the rerun's output differs from an uninterrupted run's")
    if f"model: {runs / 'run' / 'model'}" not in out or f"results: {runs / 'run' / 'results.json'}" not in out:
        case.problems.append("the rerun did not print the paths of its results and model")
    if (runs / "run.partial").exists():
        case.problems.append("the staging folder is left after the rerun")
    if leftover := temporaries(runs):
        case.problems.append(f"temporaries left: {', '.join(str(p.relative_to(runs)) for p in leftover[:3])}")
    if (runs / ".run.lock.json").exists():
        case.problems.append("the owner record is left after the rerun")


def run_case(setup: Setup, case: Case, index: int) -> Case:
    case_dir = setup.root / "cases" / f"{index:04d}"
    shutil.rmtree(case_dir, ignore_errors=True)
    (case_dir / "runs").mkdir(parents=True)
    if case.scenario == "overwrite":
        shutil.copytree(setup.old_run, case_dir / "runs" / "run")
    rc, _, err = run(setup, case_dir, case.scenario, at=case.at, after_s=case.after_s)
    if rc not in (-signal.SIGKILL, 0):
        case.problems.append(f"the killed run exited {rc} instead of dying: {err.strip().splitlines()[-1:]}")
    check_left(setup, case, case_dir)
    if case.again_at is not None:  # killed again while it recovers
        rc, _, err = run(setup, case_dir, case.scenario, at=case.again_at)
        if rc not in (-signal.SIGKILL, 0):
            case.problems.append(f"the second killed run exited {rc}: {err.strip().splitlines()[-1:]}")
        check_left(setup, case, case_dir)
    rc, out, err = run(setup, case_dir, case.scenario)
    check_rerun(setup, case, case_dir, rc, out, err)
    if case.ok:
        shutil.rmtree(case_dir, ignore_errors=True)
    return case


# ---------------------------------------------------------------------------------------------
# the campaign


def prepare(root: Path, recipe: Path | None, sets: list[str]) -> Setup:
    """The run to crash, two uninterrupted runs of it (the reference, and whether it is deterministic), its
    crash points in both scenarios, and the other recipe's finished run for the overwrite cases."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        XDG_CACHE_HOME=str(root / "xdg"),
        HF_HOME=str(root / "xdg" / "huggingface"),
        TRITON_CACHE_DIR=str(root / "triton"),
    )
    env.pop("COMPRESSKIT_CRASH_AT", None)
    env.pop("COMPRESSKIT_CRASH_TRACE", None)
    if recipe is None:
        from compresskit.testing import save_tiny_model

        model = save_tiny_model(root / "tiny-llama")
        recipe = root / "crash-tiny.yaml"
        recipe.write_text(
            yaml.safe_dump({**TINY_RECIPE, "model": {**TINY_RECIPE["model"], "name_or_path": str(model)}})
        )
    else:  # a recipe of the repository: relative paths in it (and the embedded model's cache) stay as they are
        recipe = Path(recipe).resolve()
    setup = Setup(root=root, recipe=recipe, sets=list(sets), env=env)
    prints = []
    for i in range(2):
        ref = root / f"reference{i}"
        ref.mkdir()
        t0 = time.perf_counter()
        rc, _, err = run(setup, ref, "fresh", trace=ref / "trace.txt")
        if rc != 0:
            raise SystemExit(f"the uninterrupted run failed (exit {rc}):\n{err[-3000:]}")
        setup.seconds = max(setup.seconds, time.perf_counter() - t0)
        setup.points["fresh"] = (ref / "trace.txt").read_text().splitlines()
        prints.append(fingerprint(ref / "runs" / "run"))
    setup.reference = prints[0]
    setup.deterministic = same(prints[0], prints[1])
    old = root / "old"
    old.mkdir()
    rc, _, err = run(setup, old, "fresh", extra_sets=["seed=1"])
    if rc != 0:
        raise SystemExit(f"the other recipe's run failed (exit {rc}):\n{err[-3000:]}")
    setup.old_run, setup.old = old / "runs" / "run", fingerprint(old / "runs" / "run")
    over = root / "overwrite-trace"
    (over / "runs").mkdir(parents=True)
    shutil.copytree(setup.old_run, over / "runs" / "run")
    rc, _, err = run(setup, over, "overwrite", trace=over / "trace.txt")
    if rc != 0:
        raise SystemExit(f"the overwriting run failed (exit {rc}):\n{err[-3000:]}")
    setup.points["overwrite"] = (over / "trace.txt").read_text().splitlines()
    return setup


def evenly(n_items: int, k: int) -> list[int]:
    """``k`` of ``1..n_items`` spread evenly (all of them when ``k`` is None or at least ``n_items``)."""
    if k is None or k >= n_items:
        return list(range(1, n_items + 1))
    return sorted({round(1 + i * (n_items - 1) / max(1, k - 1)) for i in range(k)})


def plan(setup: Setup, points, n_random: int, n_overwrite: int, n_double: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    fresh, over = setup.points["fresh"], setup.points["overwrite"]
    cases = [Case("fresh", at=k, label=f"point {k}: {fresh[k - 1]}") for k in evenly(len(fresh), points)]
    # the overwrite cases: spread over the run's last third (the save, the evaluation, the move) and the move itself
    late = [k for k in range(1, len(over) + 1) if k > 2 * len(over) // 3]
    chosen = set(rng.sample(late, min(n_overwrite, len(late)))) if n_overwrite else set()
    if n_overwrite:  # and always between the two renames that replace the old run
        chosen |= {k for k in late if over[k - 1].startswith("replace run:")}
    cases += [Case("overwrite", at=k, label=f"point {k}: {over[k - 1]}") for k in sorted(chosen)]
    for _ in range(n_random):
        t = round(rng.uniform(0.5, setup.seconds), 1)
        cases.append(Case("fresh", after_s=t, label=f"after {t:.1f} s"))
    for _ in range(n_double):
        k, j = rng.randint(1, len(fresh)), rng.randint(1, len(fresh))
        cases.append(Case("fresh", at=k, again_at=j, label=f"point {k}: {fresh[k - 1]}; the rerun at its point {j}"))
    return cases


def campaign(setup: Setup, cases: list[Case], jobs: int = 1, report=print) -> list[Case]:
    done: list[Case] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for case in pool.map(lambda ic: run_case(setup, ic[1], ic[0]), enumerate(cases)):
            done.append(case)
            status = "ok" if case.ok else "FAILED: " + "; ".join(case.problems)
            report(f"| {len(done)} | {case.scenario} | {case.label} | {case.left} | {case.rerun} | {status} |")
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", help="the recipe to crash (default: WIDE on a tiny random model)")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE for the recipe, as compresskit apply takes")
    p.add_argument("--points", type=int, default=None, help="kill at this many crash points, spread (default: all)")
    p.add_argument("--random", type=int, default=30, help="kills at random moments (default 30)")
    p.add_argument("--overwrite", type=int, default=18, help="kills of an --overwrite run (default 18)")
    p.add_argument("--double", type=int, default=10, help="kills whose rerun is killed again (default 10)")
    p.add_argument("--jobs", type=int, default=2, help="cases at once (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random choices (default 0)")
    p.add_argument("--keep", help="work in this folder and keep it (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    root = Path(args.keep or tempfile.mkdtemp(prefix="compresskit-crash-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        setup = prepare(root, args.recipe, args.set)
        print(
            f"{len(setup.points['fresh'])} crash points in an uninterrupted run "
            f"({len(setup.points['overwrite'])} with --overwrite over another run), {setup.seconds:.1f} s a run; "
            f"two uninterrupted runs {'equal' if setup.deterministic else 'DIFFER: equality is not checked'}",
            flush=True,
        )
        cases = plan(setup, args.points, args.random, args.overwrite, args.double, args.seed)
        print("\n| # | scenario | killed at | left | the rerun | result |\n|---|---|---|---|---|---|", flush=True)
        done = campaign(setup, cases, args.jobs, report=lambda line: print(line, flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    failed = [c for c in done if not c.ok]
    kills = sum(1 + (c.again_at is not None) for c in done)
    print(
        f"\n{len(done)} cases, {kills} kills: {len(done) - len(failed)} reruns ended whole and equal to an "
        f"uninterrupted run, {len(failed)} failed; {time.perf_counter() - t0:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
