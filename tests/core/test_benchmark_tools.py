"""The benchmark helpers that run on the device machine, run here on stand-in inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SHARDS = Path(__file__).parents[2] / "benchmarks" / "pytest_shards.py"

TESTS = """
import pytest

@pytest.mark.parametrize("i", range(7))
def test_numbered(i):
    assert i != FAIL_AT

def test_deselected():
    raise AssertionError("selected by mistake")
"""


def _run(tmp_path: Path, fail_at: int, shards: int) -> tuple[subprocess.CompletedProcess, str]:
    (tmp_path / "test_stand_in.py").write_text(TESTS.replace("FAIL_AT", str(fail_at)))
    log = tmp_path / "tests.log"
    cmd = [sys.executable, str(SHARDS), "--shards", str(shards), "--log", str(log), "--"]
    cmd += ["test_stand_in.py", "-k", "numbered"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    return proc, log.read_text() if log.exists() else ""


def test_pytest_shards_runs_every_selected_test_once(tmp_path):
    proc, log = _run(tmp_path, fail_at=-1, shards=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert log.startswith("7 tests in 3 shards\n")
    passed = sum(int(line.split(": ")[1].split(" passed")[0]) for line in log.splitlines()[1:4])
    assert passed == 7 and "deselected" not in log.split("=====")[0]
    assert "selected by mistake" not in log


def test_pytest_shards_fails_when_one_shard_fails(tmp_path):
    proc, log = _run(tmp_path, fail_at=4, shards=2)
    assert proc.returncode == 1
    assert "1 failed" in log and "test_numbered[4]" in log


def test_pytest_shards_rejects_an_empty_selection(tmp_path):
    (tmp_path / "test_stand_in.py").write_text(TESTS.replace("FAIL_AT", "-1"))
    cmd = [sys.executable, str(SHARDS), "--log", str(tmp_path / "x.log"), "--", "test_stand_in.py", "-k", "nothing"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode != 0 and "collected nothing" in proc.stderr
