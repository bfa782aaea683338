"""benchmarks/analyze_prefill_masks.py: the tile-union measures on masks whose answer is known, and its
smoke path on a tiny WIDE model."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "analyze_prefill_masks.py"


def _module():
    spec = importlib.util.spec_from_file_location("analyze_prefill_masks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_union_of_alternating_masks_halves_once_sorted():
    mod = _module()
    # tokens alternate between two disjoint halves of 4 groups: every 2-token tile needs all groups,
    # sorted, each tile needs half of them
    a, b = [True, True, False, False], [False, False, True, True]
    mask = torch.tensor([a, b] * 8)
    assert mod.union_fraction(mask, 2) == 1.0
    assert mod.union_fraction(mod.sorted_by_mask(mask), 2) == 0.5
    assert sorted(map(tuple, mod.sorted_by_mask(mask).tolist())) == sorted(map(tuple, mask.tolist()))  # a permutation
    assert mod.union_fraction(torch.zeros(5, 3, dtype=torch.bool), 4) == 0.0  # a ragged last tile, all off
    assert abs(mod.independent_union(mask, 2) - 0.75) < 1e-6  # every group at 1/2: 1 - (1/2)^2


@pytest.mark.slow
def test_smoke_path_writes_its_table(tmp_path):
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "prefill_masks.json").read_text())["rows"]
    assert set(rows) == {"attention", "mlp"}
    for r in rows.values():
        assert 0 < r["density"] < 1 and all(r[f"union_{t}"] >= r["density"] - 1e-9 for t in (16, 32, 64, 128))
