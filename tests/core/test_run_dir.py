"""A run folder nothing can corrupt: the lock a writer holds on its output folder (``compresskit.locking``),
the temporaries a killed process leaves and who removes them, the checks that keep a user's files, and a
disk that fills up (``compresskit.files``). Killing runs at their crash points is ``tests/crash``'s."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compresskit import files, locking
from compresskit.cli import main
from compresskit.errors import DiskFullError, OutputLockedError, RecipeError

TESTS = Path(__file__).parents[1]

HOLDER = """
import sys, time
from pathlib import Path
from compresskit import locking
kind, path = sys.argv[1], Path(sys.argv[2])
lock = locking.hold(path, field="x") if kind == "hold" else locking.waiting(path, "testing")
with lock:
    print("held", flush=True)
    if kind == "hold":
        sys.stdin.read()
    else:
        time.sleep(float(sys.argv[3]))
"""


def holder(kind: str, path: Path, *extra: str) -> subprocess.Popen:
    """Another process holding ``path``'s lock (``hold``: until its stdin closes or it is killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, kind, str(path), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS.parent,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


class Log:
    def __init__(self):
        self.lines = []

    def log(self, message):
        self.lines.append(message)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# the lock


def test_a_folder_another_process_holds_is_refused_naming_that_process(tmp_path):
    proc = holder("hold", tmp_path / "run")
    try:
        with pytest.raises(OutputLockedError) as info, locking.hold(tmp_path / "run", field="output.dir"):
            pass
        msg = str(info.value)
        assert msg.startswith(f"output.dir: {tmp_path / 'run'} is being written by another compresskit process")
        assert f"pid {proc.pid} on host " in msg and "started 20" in msg and "choose another folder" in msg
    finally:
        proc.communicate("")
    with locking.hold(tmp_path / "run", field="output.dir") as stale:  # let go: free again, and no one died
        assert stale is None


def test_the_lock_of_a_killed_process_is_taken_over_and_said(tmp_path):
    proc = holder("hold", tmp_path / "run")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lock_file, owner_file = locking.lock_files(tmp_path / "run")
    assert json.loads(owner_file.read_text())["pid"] == proc.pid  # (what the killed process left)
    log = Log()
    with locking.hold(tmp_path / "run", field="output.dir", progress=log) as stale:
        assert stale["pid"] == proc.pid
        assert json.loads(owner_file.read_text())["pid"] == os.getpid()
    assert log.lines == [
        f"output.dir: the process that held {tmp_path / 'run'} ({locking.describe(stale)}) is gone; taking over"
    ]
    assert not owner_file.exists() and lock_file.is_file()


def test_two_spellings_of_one_folder_share_one_lock(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert locking.lock_files(tmp_path / "link" / "run") == locking.lock_files(tmp_path / "real" / "x" / ".." / "run")
    proc = holder("hold", tmp_path / "real" / "run")
    try:
        with pytest.raises(OutputLockedError), locking.hold(tmp_path / "link" / "run", field="f"):
            pass
    finally:
        proc.communicate("")


def test_a_cache_lock_waits_for_the_process_that_holds_it(tmp_path):
    proc = holder("wait", tmp_path / "model", "1.0")
    log, t0 = Log(), time.perf_counter()
    with locking.waiting(tmp_path / "model", "converting it", log):
        waited = time.perf_counter() - t0
    proc.wait()
    assert log.lines == ["waiting for another process converting it"] and waited > 0.3
    with locking.waiting(tmp_path / "model", "converting it", log):  # free: no line
        pass
    assert len(log.lines) == 1


# ---------------------------------------------------------------------------------------------
# temporaries, and what is the user's


def test_sweep_removes_the_temporaries_in_and_beside_a_folder_and_nothing_else(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "model" / ".stage1.safetensors.tmp-abc").mkdir(parents=True)
    (run_dir / "model" / ".stage1.safetensors.tmp-abc" / "x").write_text("half")
    (run_dir / ".results.json.tmp-1").write_text("half")
    (tmp_path / ".run.tmp-old-123").mkdir()
    keep = [
        run_dir / ".hidden",  # a user's hidden file
        run_dir / "notes.tmp-1",  # not hidden
        tmp_path / ".other.tmp-1",  # another folder's temporary
        tmp_path / ".run.lock",  # the lock
    ]
    for path in keep:
        path.write_text("mine")
    removed = files.sweep(run_dir)
    assert sorted(p.name for p in removed) == [".results.json.tmp-1", ".run.tmp-old-123", ".stage1.safetensors.tmp-abc"]
    assert all(p.exists() for p in keep)
    assert not (tmp_path / ".run.tmp-old-123").exists() and (run_dir / "model").is_dir()


def test_an_output_folder_holding_other_files_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")
    files.check_replaceable(out, "--output", ("results.json", "results.md"))  # only ours: fine
    files.check_replaceable(tmp_path / "new", "--output", ("results.json",))  # (not there yet)
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(RecipeError, match=r"--output: .* holds other files than this command writes \(thesis.tex\)"):
        files.check_replaceable(out, "--output", ("results.json", "results.md"))


def test_eval_output_is_refused_while_held_or_holding_other_files(capsys, tiny_model_dir, tmp_path):
    out = tmp_path / "eval"
    common = ["eval", str(tiny_model_dir), "--dtype", "float32", "--tasks", "perplexity", "--output", str(out)]
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run(capsys, *common)
    assert code == 2 and "holds other files than this command writes (notes.txt)" in one_line_error(err)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    proc = holder("hold", out)
    try:
        code, _, err = run(capsys, *common)
        assert code == 2 and f"pid {proc.pid}" in one_line_error(err)
    finally:
        proc.communicate("")
    (tmp_path / ".eval.tmp-old-1").mkdir()  # what a killed eval left between its two renames
    code, _, err = run(capsys, *common)
    assert code == 0, err
    assert json.loads((out / "results.json").read_text())["metrics"]["perplexity"]
    assert not (tmp_path / ".eval.tmp-old-1").exists() and not locking.lock_files(out)[1].exists()


def test_bench_output_holding_other_files_is_refused_before_anything_is_built(capsys, tiny_model_dir, tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.csv").write_text("mine")
    code, _, err = run(capsys, "bench", str(tiny_model_dir), "--output", str(tmp_path / "b"))
    assert code == 2 and "holds other files than this command writes (keep.csv)" in one_line_error(err)


# ---------------------------------------------------------------------------------------------
# a full disk


def test_a_write_that_fills_the_disk_says_so_with_the_path_and_the_space(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    with pytest.raises(DiskFullError) as info, files.disk_space(tmp_path, 1 << 20, "saving the model"):
        raise OSError(errno.ENOSPC, "No space left on device")
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path}: not enough disk space for saving the model: it needs about 1.0 MiB, ")
    assert msg.endswith("free there; free some space and run the same command again")
    with pytest.raises(DiskFullError), files.disk_space(tmp_path, 1, "x"):  # safetensors' own words
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    with pytest.raises(ValueError, match="unrelated"), files.disk_space(tmp_path, 1, "x"):
        raise ValueError("unrelated")
    monkeypatch.setattr(files, "free_bytes", lambda path: 1 << 10)  # torch's writer says only where it stopped
    with pytest.raises(DiskFullError), files.disk_space(tmp_path, 1, "x"):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    ran = []
    with pytest.raises(DiskFullError, match="it needs about 2.00 GiB, 0.0 MiB free there"):
        with files.disk_space(tmp_path, 2 << 30, "x"):  # too little free: said before anything is written
            ran.append(True)
    assert ran == []


def _wide_tiny_recipe(model_dir: Path, out: Path) -> dict:
    return {
        "name": "wide-tiny",
        "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "pruner": {"name": "toy-router", "config": {"groups": 6, "rank": 4}},
        "training": [{"name": "router", "config": {"steps": 3, "batch_size": 2, "seq_len": 32, "checkpoint_every": 1}}],
        "evaluation": {"tasks": ["perplexity"], "perplexity_docs": 1, "max_length": 512},
        "output": {"dir": str(out)},
    }


def test_a_full_disk_during_the_save_stops_in_one_line_and_the_run_resumes(
    capsys, tiny_model_dir, tmp_path, monkeypatch
):
    import yaml
    from safetensors import SafetensorError

    import compresskit.artifacts as artifacts

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_wide_tiny_recipe(tiny_model_dir, tmp_path / "run")))

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(artifacts, "save_file", full)
    code, out, err = run(capsys, "apply", str(recipe))
    assert code == 2
    assert f"error: {tmp_path}/run.partial: not enough disk space for saving the model: it needs about " in err
    assert not (tmp_path / "run").exists() and (tmp_path / "run.partial" / "work").is_dir()
    assert not [p for p in tmp_path.rglob(".*") if files.is_temporary(p)]  # the half model is gone
    monkeypatch.undo()
    code, out, err = run(capsys, "apply", str(recipe))
    assert code == 0, err
    assert "resuming the interrupted run" in err and "router: resuming at step 3 of 3" in err
    assert f"model: {tmp_path / 'run' / 'model'}" in out


def _can_mount_a_small_disk() -> bool:
    try:
        probe = subprocess.run(
            ["unshare", "-rm", "sh", "-c", "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d"],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_a_small_disk(), reason="needs unshare and a tmpfs mount in a user namespace")
def test_a_real_full_disk_stops_the_save_and_the_run_resumes_once_there_is_space(tiny_model_dir, tmp_path):
    """On a real 8 MiB disk (a tmpfs in a mount namespace of its own): the run trains, then stops before the
    model's save in one line, exit 2, its checkpoints kept; with the disk grown, the same command resumes."""
    import yaml

    disk = tmp_path / "disk"
    disk.mkdir()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_wide_tiny_recipe(tiny_model_dir, disk / "run")))
    apply = f"{sys.executable} -m compresskit apply {recipe}"
    script = f"""
set -u
mount -t tmpfs -o size=8m tmpfs {disk}
{apply} > {tmp_path}/first.out 2> {tmp_path}/first.err; echo $? > {tmp_path}/first.code
ls {disk}/run.partial/work > {tmp_path}/work.txt
mount -o remount,size=64m {disk}
{apply} > {tmp_path}/second.out 2> {tmp_path}/second.err; echo $? > {tmp_path}/second.code
cp {disk}/run/results.json {tmp_path}/results.json
"""
    subprocess.run(["unshare", "-rm", "sh", "-c", script], check=True, timeout=600, cwd=TESTS.parent)
    first_err = (tmp_path / "first.err").read_text()
    assert (tmp_path / "first.code").read_text().strip() == "2", first_err
    assert f"error: {disk}/run.partial: not enough disk space for saving the model: it needs about" in first_err
    assert "stage0-router" in (tmp_path / "work.txt").read_text()
    second_err = (tmp_path / "second.err").read_text()
    assert (tmp_path / "second.code").read_text().strip() == "0", second_err
    assert "router: resuming at step 3 of 3" in second_err
    assert json.loads((tmp_path / "results.json").read_text())["recipe_hash"]
