"""``tools/offline_gpu/device_wide_smollm2.sh wait`` on this machine: what comes back of a background job
still running on the GPU host (no GPU needed here: the step only packs files)."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "offline_gpu" / "device_wide_smollm2.sh"


def test_wait_returns_finished_runs_and_what_lets_the_others_resume(tmp_path):
    repo, out, bg = tmp_path / "repo", tmp_path / "out", tmp_path / "bg"
    (repo / "tools" / "offline_gpu").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "tools" / "offline_gpu")
    done = repo / "runs" / "study" / "done-seed0"
    done.mkdir(parents=True)
    (done / "results.json").write_text("{}")
    cut = repo / "runs" / "study" / "cut-seed0.partial"
    (cut / "work" / "stage0-router").mkdir(parents=True)
    (cut / "work" / "stage1-lora").mkdir(parents=True)
    (cut / "recipe.json").write_text('{"recipe_hash": "abc"}')
    (cut / "work" / "stage0-router" / "checkpoint.pt").write_bytes(b"\0" * 1000)
    with open(cut / "work" / "stage1-lora" / "checkpoint.pt", "wb") as f:
        f.truncate(20 * 2**20)  # over what a returned file may hold: left behind
    (bg / "out").mkdir(parents=True)
    (bg / "log").write_text("training\n")
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "BG": str(bg)}
    res = subprocess.run(["bash", "tools/offline_gpu/device_wide_smollm2.sh", "wait", "0"], cwd=repo, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 4 and "still running" in res.stdout  # 4: the job runs on
    with tarfile.open(out / "partial.tar.gz") as t:  # (with the logs of /tmp/logs, where the runs write them)
        names = t.getnames()
    assert "runs/study/done-seed0/results.json" in names and not any(n.endswith(".pt") for n in names)
    with tarfile.open(out / "resume-cut-seed0.tar.gz") as t:
        assert sorted(t.getnames()) == [
            "runs/study/cut-seed0.partial/recipe.json",
            "runs/study/cut-seed0.partial/work/stage0-router/checkpoint.pt",
        ]
    assert (out / "background.log").read_text() == "training\n"
    (bg / "rc").write_text("0\n")
    res = subprocess.run(["bash", "tools/offline_gpu/device_wide_smollm2.sh", "wait", "0"], cwd=repo, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0 and "ended: exit 0" in res.stdout


@pytest.mark.slow
def test_serving_matrix_wait_merges_the_prompts_done_into_few_files(tmp_path):
    """``tools/offline_gpu/device_serving_matrix.sh wait``: the prompts finished so far merged into one matrix
    there, each prompt's own files packed in one archive (a few files to copy back)."""
    import json

    repo, out, sm = tmp_path / "repo", tmp_path / "out", tmp_path / "sm"
    (repo / "tools" / "offline_gpu").mkdir(parents=True)
    (repo / "benchmarks").mkdir()
    shutil.copy(SCRIPT.with_name("device_serving_matrix.sh"), repo / "tools" / "offline_gpu")
    shutil.copy(ROOT / "benchmarks" / "merge_bench.py", repo / "benchmarks")
    merged = json.loads((ROOT / "docs" / "results" / "prefill-h200" / "ttft-matrix.json").read_text())
    for prompt in (128, 512):
        part = sm / "out" / f"p{prompt}"
        part.mkdir(parents=True)
        meta = next(m for m in merged["meta"]["parts"] if f"--prompt {prompt} " in m["command"])
        rows = [r for r in merged["results"] if r["prompt"] == prompt]
        (part / "bench.json").write_text(json.dumps({"meta": meta, "results": rows}))
        (part / "bench.md").write_text("table\n")
    (sm / "log").write_text("benchmarking\n")
    (sm / "rc").write_text("0\n")
    out.mkdir()
    # the script's python3 (the GPU host's) is this interpreter here, with compresskit importable
    env = {**os.environ, "OUT": str(out), "SM": str(sm), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", "tools/offline_gpu/device_serving_matrix.sh", "wait", "0"], cwd=repo, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0 and "matrix ended" in res.stdout, res.stdout + res.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench-heatmap.png", "bench.json", "bench.md", "log", "parts.tar.gz"]
    assert {r["prompt"] for r in json.loads((out / "bench.json").read_text())["results"]} == {128, 512}
    with tarfile.open(out / "parts.tar.gz") as t:
        assert {"./p128/bench.md", "./p512/bench.json"} <= set(t.getnames())


def test_a_study_job_trains_its_runs_side_by_side_and_scores_them_all(tmp_path):
    """``tools/offline_gpu/device_consensus.sh study-start`` (DRY_RUN: its job printed, not started): run here with a
    stand-in ``python3`` that records each call and writes what ``compresskit apply`` would, the job trains the
    per-token run and the three study recipes at once, keeps each run's results, then scores all four in one
    ``consensus_quality.py`` call with each run's rules."""
    import json

    cq, bin_ = tmp_path / "cq", tmp_path / "bin"
    bin_.mkdir()
    calls = tmp_path / "calls.jsonl"
    stub = bin_ / "python3"
    stub.write_text(
        f"""#!{sys.executable}
import json, pathlib, sys
args = sys.argv[1:]
with open({str(calls)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:3] == ["-m", "compresskit", "apply"]:
    out = pathlib.Path(args[args.index("--set") + 1].split("=", 1)[1])
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps({{"recipe": args[3]}}))
"""
    )
    stub.chmod(0o755)
    env = {**os.environ, "DRY_RUN": "1", "CQ": str(cq)}
    script = SCRIPT.with_name("device_consensus.sh")
    res = subprocess.run(["bash", str(script), "study-start"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    (cq / "out").mkdir(parents=True)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", "-c", res.stdout], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    applied = sorted(c[3] for c in made if c[:3] == ["-m", "compresskit", "apply"])
    assert applied == [
        "recipes/study/wide-smollm2-50-stage1-consensus8-setgrad.yaml",
        "recipes/study/wide-smollm2-50-stage1-follow8.yaml",
        "recipes/study/wide-smollm2-50-stage1-tile64-follow.yaml",
        "recipes/wide-smollm2-50-stage1.yaml",
    ]
    assert all((ROOT / recipe).is_file() for recipe in applied)
    kept = sorted(p.name for p in (cq / "out").iterdir())
    assert kept == [f"{n}.results.json" for n in ("follow8", "per-token", "setgrad", "tile64f")]
    (score,) = [c for c in made if c and c[0] == "benchmarks/consensus_quality.py"]
    runs = [score[i + 1] for i, a in enumerate(score) if a == "--run"]
    assert runs == [f"{label}={cq}/{name}/model" for label, name in (
        ("per-token", "per-token"), ("follow-trained", "follow8"), ("set-gradient", "setgrad"),
        ("tile-follow-trained", "tile64f"),
    )]  # fmt: skip
    only = [score[i + 1] for i, a in enumerate(score) if a == "--only"]
    assert {o.split("=")[0] for o in only} == {"per-token", "follow-trained", "set-gradient", "tile-follow-trained"}
    assert score[score.index("--out") + 1] == f"{cq}/out"
    # rules-start is the same job with no recipe: the per-token run alone, scored under the given rules
    env = {**os.environ, "DRY_RUN": "1", "CQ": str(cq), "RULES": "--rule f=quorum=0,follow=1.1", "BATCHES": "8"}
    job = subprocess.run(["bash", str(script), "rules-start"], env=env, capture_output=True, text=True).stdout
    assert job.count("compresskit apply") == 1 and "recipes/wide-smollm2-50-stage1.yaml" in job
    assert f"--run per-token={cq}/per-token/model \\\n  --rule f=quorum=0,follow=1.1 --batches 8 --workers 4" in job
    # lora-start: the per-token run is the two-stage recipe, beside the two with the rule in the LoRA stage and
    # the one with it in both stages
    env = {**os.environ, "DRY_RUN": "1", "CQ": str(cq)}

    def two_stage_job(step: str, runs: list[tuple[str, str]]) -> str:
        """The step's job, after checking that it trains the per-token two-stage run and ``runs`` (recipe
        under recipes/study/, folder) side by side, each recipe in the repo."""
        job = subprocess.run(["bash", str(script), step], env=env, capture_output=True, text=True).stdout
        applied = re.findall(r"compresskit apply (\S+) --set output.dir=\S+/(\S+) ", job)
        runs = [("recipes/wide-smollm2-50.yaml", "per-token")] + [(f"recipes/study/{r}", n) for r, n in runs]
        assert applied == runs, step
        assert all((ROOT / recipe).is_file() for recipe, _ in applied)
        return job

    job = two_stage_job(
        "lora-start",
        [("wide-smollm2-50-lora-follow8.yaml", "lorafollow8"), ("wide-smollm2-50-lora-majority8.yaml", "loramajority8"),
         ("wide-smollm2-50-follow8.yaml", "follow8")],
    )  # fmt: skip
    assert f"--run lora-follow-trained={cq}/lorafollow8/model" in job and "--only lora-majority-trained=majority" in job
    assert f"--run follow-trained={cq}/follow8/model" in job and "--only follow-trained=follow125" in job
    # caps-start: for each cap of CAPS, the rule in the LoRA stage's loop and in both stages', each trained run
    # scored under its own rule at BATCHES, the per-token run under each cap's
    env["CAPS"], env["BATCHES"] = "100 110", "4,8"
    job = two_stage_job(
        "caps-start",
        [(f"wide-smollm2-50-{stages}follow8-{cap}.yaml", f"{stages}follow{cap}")
         for cap in (100, 110) for stages in ("lora-", "")],
    )  # fmt: skip
    only = dict(o.split("=") for o in re.findall(r"--only (\S+)", job))
    assert only == {"per-token": "follow100,follow110", "lora-follow100-trained": "follow100",
                    "follow100-trained": "follow100", "lora-follow110-trained": "follow110",
                    "follow110-trained": "follow110"}  # fmt: skip
    rules = dict(r.split("=", 1) for r in re.findall(r"--rule (\S+)", job))
    assert rules == {"follow100": "quorum=0,follow=1.00", "follow110": "quorum=0,follow=1.10"}
    assert "--batches 4,8 " in job and "--limit" not in job
    # STAGES=lora: the LoRA-stage run alone; LIMIT: a pilot's item count
    env["CAPS"], env["STAGES"], env["LIMIT"] = "100", "lora", "300"
    job = two_stage_job("caps-start", [("wide-smollm2-50-lora-follow8-100.yaml", "lora-follow100")])
    assert "--limit 300 " in job
    del env["STAGES"], env["LIMIT"]
    # a cap with no recipe: one line, exit 2
    caps = {**env, "CAPS": "105"}
    res = subprocess.run(["bash", str(script), "caps-start"], env=caps, capture_output=True, text=True)
    assert (res.returncode, res.stdout.strip()) == (
        2,
        "CAPS: no recipe for the cap 105 (recipes/study/wide-smollm2-50-lora-follow8-105.yaml)",
    )


def test_policy_trial_refuses_a_change_it_cannot_make_before_it_installs_anything(tmp_path):
    """``tools/offline_gpu/device_policy_trial.sh`` on this machine: neither OP nor SET, or both, is one line and
    exit 2; a SET that is no setting of the policy, or an OP that is not unmeasured (``router``: measured), stops at the
    edit of the "after" copy, exit 2, before the step that installs the trees (``device_env.sh``, which would
    print the GPU's name) and with this checkout untouched."""
    root = ROOT
    policy = root / "plugins/wide/compresskit_wide/kernels/policy.py"
    before = policy.read_text()
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for extra in ({}, {"OP": "router", "SET": "PDL_KERNELS=()"}):
        res = subprocess.run(["bash", "tools/offline_gpu/device_policy_trial.sh"], cwd=root, env={**env, **extra},
                             capture_output=True, text=True)  # fmt: skip
        assert res.returncode == 2 and res.stderr.strip() == (
            "give OP=NAME (an op of policy.UNMEASURED) or SET=NAME=VALUE (a setting of the policy), one of them"
        )
    res = subprocess.run(["bash", "tools/offline_gpu/device_policy_trial.sh"], cwd=root, capture_output=True, text=True,
                         env={**env, "SET": "NOT_A_SETTING=1", "STEPS": "e2e"})  # fmt: skip
    assert res.returncode == 2 and "'NOT_A_SETTING' is not a one-line setting of the policy" in res.stderr
    assert "nvidia-smi" not in res.stdout + res.stderr and policy.read_text() == before
    res = subprocess.run(["bash", "tools/offline_gpu/device_policy_trial.sh"], cwd=root, capture_output=True, text=True,
                         env={**env, "OP": "router", "STEPS": "e2e"})  # fmt: skip
    assert res.returncode == 2 and "'router' is not in UNMEASURED" in res.stderr
    assert "nvidia-smi" not in res.stdout + res.stderr and policy.read_text() == before
    shutil.rmtree("/tmp/policy-trial-before", ignore_errors=True)
    shutil.rmtree("/tmp/policy-trial-after", ignore_errors=True)


def test_the_gpu_suite_says_in_one_line_what_it_cannot_run(tmp_path):
    """``benchmarks/gpu_suite.sh``: an unknown step is its usage and exit 2; on a machine without an NVIDIA GPU
    (no ``nvidia-smi``) one line and exit 2, before any test or bench starts."""
    script = ROOT / "benchmarks" / "gpu_suite.sh"
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin"}
    bad = subprocess.run(["bash", str(script), "everything"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "usage: gpu_suite.sh [tests|speed|all]" in bad.stderr
    if shutil.which("nvidia-smi", path=env["PATH"]) is None:
        none = subprocess.run(["bash", str(script), "tests"], env=env, capture_output=True, text=True, cwd=ROOT)
        assert none.returncode == 2 and "gpu_suite.sh: no NVIDIA GPU here" in none.stderr
        assert not (tmp_path / "out" / "gpu-tests.log").exists()
