"""``benchmarks/device_wide_smollm2.sh wait`` on this machine: what comes back of a background job
still running on the device (no GPU and no device needed: the step only packs files)."""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device_wide_smollm2.sh"


def test_wait_returns_finished_runs_and_what_lets_the_others_resume(tmp_path):
    repo, out, bg = tmp_path / "repo", tmp_path / "out", tmp_path / "bg"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "benchmarks")
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
    res = subprocess.run(["bash", "benchmarks/device_wide_smollm2.sh", "wait", "0"], cwd=repo, env=env,
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
    res = subprocess.run(["bash", "benchmarks/device_wide_smollm2.sh", "wait", "0"], cwd=repo, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0 and "ended: exit 0" in res.stdout


def test_serving_matrix_wait_merges_the_prompts_done_into_few_files(tmp_path):
    """``benchmarks/device_serving_matrix.sh wait``: the prompts finished so far merged into one matrix
    there, each prompt's own files packed in one archive (a device call brings back 8 files)."""
    import json

    repo, out, sm = tmp_path / "repo", tmp_path / "out", tmp_path / "sm"
    (repo / "benchmarks").mkdir(parents=True)
    for name in ("device_serving_matrix.sh", "merge_bench.py"):
        shutil.copy(SCRIPT.with_name(name), repo / "benchmarks")
    merged = json.loads((SCRIPT.parents[1] / "docs" / "results" / "prefill-h200" / "ttft-matrix.json").read_text())
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
    # the script's python3 (the device's) is this interpreter here, with compresskit importable
    env = {**os.environ, "OUT": str(out), "SM": str(sm), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", "benchmarks/device_serving_matrix.sh", "wait", "0"], cwd=repo, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0 and "matrix ended" in res.stdout, res.stdout + res.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench-heatmap.png", "bench.json", "bench.md", "log", "parts.tar.gz"]
    assert {r["prompt"] for r in json.loads((out / "bench.json").read_text())["results"]} == {128, 512}
    with tarfile.open(out / "parts.tar.gz") as t:
        assert {"./p128/bench.md", "./p512/bench.json"} <= set(t.getnames())
