"""The benchmark scripts run: on tiny shapes in the CPU interpreter without a GPU (natively on one),
and the Hopper code-generation check, which needs no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BENCHMARKS = Path(__file__).parents[3] / "benchmarks"
# the kernels in the interpreter on the CPU; on a GPU as they are
KERNEL_ENV = {**os.environ, "TRITON_INTERPRET": "1"} if DEVICE == "cpu" else dict(os.environ)
# Triton's compiler, not the interpreter (the code-generation checks need no GPU)
COMPILER_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def run_script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``benchmarks/<name> args...`` in a fresh interpreter, its output captured."""
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True, env=env)


@pytest.mark.slow
def test_benchmark_script_smoke(tmp_path):
    """The H200 benchmark script runs end to end on tiny shapes and checks every case; a case run
    alone draws what it draws among the others."""

    proc = run_script("bench_wide_kernels.py", "--smoke", "--out", str(tmp_path), env=KERNEL_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["results"] and all(r["correct"] for r in data["results"])
    assert (tmp_path / "bench.md").read_text().startswith("# WIDE kernels benchmark")
    # a case alone (--only) draws the same masks and inputs as among all the others (seeded by its
    # label): the same bound (the mask's) and, in the interpreter's fixed tiles, the same error (on a
    # GPU the two processes may autotune other tiles, which round differently)
    alone = tmp_path / "alone"
    proc = run_script(
        "bench_wide_kernels.py", "--smoke", "--out", str(alone), "--only", r"^(q|gate\+up) M=3 iid", env=KERNEL_ENV
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    key = lambda r: (r["op"], r["M"], r["mask"])  # noqa: E731
    fields = ("bound", "max_abs_err") if DEVICE == "cpu" else ("bound",)
    full = {key(r): [r[f] for f in fields] for r in data["results"]}
    rows = json.loads((alone / "bench.json").read_text())["results"]
    assert rows and all(full[key(r)] == [r[f] for f in fields] for r in rows)


@pytest.mark.slow
def test_packed_reduction_pruner_keeps_tiles_that_compile_within_shared_memory(tmp_path):
    """The listed packed reduction unrolls a group's K steps, each with its own buffers: every tile
    its autotuner hook keeps (bf16, 4 groups a step) compiles for sm_90 within the H200's shared
    memory at o_proj's 512 inputs a group and at down's 128, at 4 and 16 tokens (a tile of 256 KB
    got through at o's width and 16 tokens before the hook counted the steps), and at down's
    width with 4 tokens the whole table is kept (the tiles measured there). The direct variant's
    flat loop keeps its whole table at both widths. (``hopper_codegen.py --reduce-tiles``.)"""

    out = tmp_path / "tiles.json"
    proc = run_script("hopper_codegen.py", "--reduce-tiles", "--json", str(out), env=COMPILER_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    cases = {(r["variant"], r["group_width"], r["tokens"]) for r in rows}
    assert cases == {(v, gw, m) for v in ("listed", "direct") for gw in (512, 128) for m in (4, 16)}
    kept = [r for r in rows if r["kept"]]
    assert {(r["variant"], r["group_width"], r["tokens"]) for r in kept} == cases  # something kept everywhere
    assert all(r["shared"] <= 232448 for r in kept)
    assert all(r["kept"] for r in rows if (r["variant"], r["group_width"], r["tokens"]) == ("listed", 128, 4))
    assert all(r["kept"] for r in rows if r["variant"] == "direct")


@pytest.mark.slow
def test_persistent_prefill_pruner_keeps_tiles_that_compile_within_shared_memory(tmp_path):
    """Every tile the persistent prefill product's hook keeps, q alone and gate+up fused, compiles for sm_90
    within the H200's shared memory at groups of 512, 128 and 32 channels; the hook's estimate is the
    compiled size within a few hundred bytes; groups narrower than every tile get tiles narrowed to them
    (with groups of 32 the first tile of the table once ran, 240 KB, and failed to launch on the H200).
    (``hopper_codegen.py --out-tiles``.)"""

    out = tmp_path / "tiles.json"
    proc = run_script("hopper_codegen.py", "--out-tiles", "--json", str(out), env=COMPILER_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    cases = {(p, gw) for p in ("q", "gate+up") for gw in (512, 128, 32)}
    assert {(r["product"], r["group_width"]) for r in rows} == cases
    kept = [r for r in rows if r["kept"]]
    assert {(r["product"], r["group_width"]) for r in kept} == cases
    assert all(r["shared"] <= 232448 for r in kept)
    assert all(0 <= r["shared"] - r["estimate"] <= 512 for r in rows)
    assert all(r["tile"]["BLOCK_N"] == 32 for r in kept if r["group_width"] == 32)
    assert any(r["shared"] > 232448 for r in rows)  # the table holds tiles the hook must prune for gate+up


@pytest.mark.slow
def test_decode_kernels_compile_for_hopper(tmp_path):
    """benchmarks/hopper_codegen.py, on any machine: the decode defaults (q and down packed, gate+up, both
    also with the router's decision, the add and the norm in their prologue, as their wrappers launch them;
    down fused, o with its group list and without) compiled for sm_90 at Llama-3.1-8B's shapes and
    the H200's tiles use the warp-group MMA (the decode attention's split kernel the older one; the
    reductions also with the next router's shares in their epilogue; the tile reduction for a shared
    set of 64 tokens, down and o, and for a 4k prefill in tiles of 64; the persistent prefill q and
    gate+up, their weights through TMA), stream their operands through a software pipeline, fit the
    H200's shared memory and spill no registers; the routers' deciding launches and the consensus kernel (with
    the arguments its wrapper passes: an int 1 becomes a constant, which a CPU run in the interpreter never
    sees) run on the CUDA cores, unpipelined, without spills; with ``--pdl`` every one of them waits for the
    kernel before it and lets the next launch.
    The check sees an unpipelined product (one stage) as one."""

    out = tmp_path / "codegen.json"
    proc = run_script("hopper_codegen.py", "--json", str(out), env=COMPILER_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [r["mma"] for r in rows] == ["wgmma"] * 14 + ["mma"] + ["none"] * 4
    assert all(not r["problems"] for r in rows)
    assert all(r["async_copies"] > 0 for r in rows if r["mma"] != "none")
    assert all(r["spill_bytes"] == 0 and 0 < r["registers"] <= 255 for r in rows)
    assert not any(r["pdl"] for r in rows)  # (without --pdl, whatever policy.PDL_KERNELS holds)
    proc = run_script("hopper_codegen.py", "--pdl", "--json", str(out), env=COMPILER_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(r["pdl"] and not r["problems"] for r in json.loads(out.read_text()))
    one_stage = (
        "import runpy, sys; g = runpy.run_path(sys.argv[1]); name, k, a, c, w, s, mma = g['cases']()[0]; "
        "print(g['compile_for_hopper'](k, a, c, w, 1)['async_copies'])"
    )
    script = str(BENCHMARKS / "hopper_codegen.py")
    proc = subprocess.run([sys.executable, "-c", one_stage, script], capture_output=True, text=True, env=COMPILER_ENV)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "0", proc.stdout + proc.stderr
    proc = run_script("hopper_codegen.py", env={**COMPILER_ENV, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 2 and "replaces Triton's compiler" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU interpreter's smoke (on a GPU the scripts time their kernels)")
def test_serving_benchmarks_check_their_kernels_on_tiny_shapes(tmp_path):
    """``bench_attention_matrix.py --smoke`` (the routed decode attention against the runtime's attention, every
    cell, at Llama-3.1-8B's and SmolLM2's attention shapes), ``bench_out_prefill.py --smoke --tiles`` (the
    prefill out-width products, autotuned and each tile; and with whole items and a split tail) and
    ``bench_shared_set.py --smoke`` with the tile reduction at prefill: each checks its kernels against their
    references before it would time them. Their smoke runs on the CPU in the interpreter (the GPU host's Triton 3.6
    interpreter cannot take a program id as a loop bound under NumPy 2.4: a GPU machine skips this)."""
    interpreted = {**os.environ, "TRITON_INTERPRET": "1"}
    for shape in ("llama-3.1-8b", "smollm2-135m"):
        proc = run_script("bench_attention_matrix.py", "--smoke", "--shape", shape, env=interpreted)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "matches the runtime's attention in every cell" in proc.stdout
    proc = run_script("bench_out_prefill.py", "--smoke", "--tiles", "--out", str(tmp_path), env=interpreted)
    assert proc.returncode == 0 and "every kernel matches the reference" in proc.stdout, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "bench-out-prefill.json").read_text())["rows"]
    timed = {(r["product"], r["mask"]) for r in rows if "kernel_us" in r}
    assert len(timed) == 8 and sum(r.get("ok") is True for r in rows) == 2  # 2 products x 4 masks; a tile each
    assert [r["tail_split"] for r in rows if "kernel_us" in r] == [1] * 4 + [2] * 4  # (each product's in the policy)
    args = ("--smoke", "--out", str(tmp_path), "--tail-split", "1,2", "--masks", "keep60")
    proc = run_script("bench_out_prefill.py", *args, env=interpreted)
    assert proc.returncode == 0 and "every kernel matches the reference" in proc.stdout, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "bench-out-prefill.json").read_text())["rows"]
    assert [(r["tail_split"], sorted(k for k in r if k.startswith("split"))) for r in rows] == [(1, ["split2_us"])] * 2
    args = ("--smoke", "--out", str(tmp_path), "--m", "3,20", "--prefill", "40", "--tile", "16")
    proc = run_script("bench_shared_set.py", *args, env=KERNEL_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ops = {r["op"] for r in json.loads((tmp_path / "shared_set.json").read_text())["rows"]}
    assert {"down, split K", "o, split K", "down, tiles of 16", "o, tiles of 16"} <= ops


def test_policy_range_gives_an_unmeasured_op_its_range_in_a_copy(tmp_path, monkeypatch):
    """``benchmarks/policy_range.py`` (``device_policy_trial.sh``'s "after" tree): on a copy of ``policy.py`` whose
    ``UNMEASURED`` holds an op (a new kernel's, as its commit lists it), the op leaves ``UNMEASURED`` and ``auto``
    takes its kernel up to the given token count, the rest of the policy as it was; asked again (nothing left to
    edit), one line and exit 2."""
    import importlib.util

    from compresskit_wide.kernels import policy

    def load(name):
        spec = importlib.util.spec_from_file_location(name, copy)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclass looks its module up)
        spec.loader.exec_module(module)
        return module

    copy = tmp_path / "policy.py"
    text = Path(policy.__file__).read_text()
    unmeasured = "UNMEASURED: tuple[str, ...] = ("
    assert text.count(unmeasured) == 1 and text.count("OPS = (\n") == 1
    text = text.replace(unmeasured, unmeasured + '"new_op", ')
    copy.write_text(text.replace("OPS = (\n", 'OPS = (\n    "new_op",\n'))
    before = load("policy_before_range")
    assert before.UNMEASURED == ("new_op", *policy.UNMEASURED) and not before.use_kernel("new_op", 1)
    proc = run_script("policy_range.py", str(copy), "new_op", "--max-m", "64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    edited = load("policy_with_range")
    assert edited.UNMEASURED == policy.UNMEASURED and set(edited.OPS) == set(policy.OPS) | {"new_op"}
    assert edited.use_kernel("new_op", 64) and not edited.use_kernel("new_op", 65)
    kept = [repr(r) for r in edited.KERNEL_RANGES if r.op != "new_op"]
    assert kept == [repr(r) for r in policy.KERNEL_RANGES]
    proc = run_script("policy_range.py", str(copy), "new_op", "--max-m", "64")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "'new_op' is not in UNMEASURED" in proc.stderr


def test_policy_range_sets_a_launch_setting_in_a_copy(tmp_path, monkeypatch):
    """``policy_range.py --set NAME=VALUE`` (``device_policy_trial.sh SET=...``): on a copy of ``policy.py`` the
    setting takes the value, the rest of the policy as it was, and the copy can be set again; a name that is no
    setting, a value of another type or no literal: one line and exit 2, the copy untouched."""
    import importlib.util

    from compresskit_wide.kernels import policy

    copy = tmp_path / "policy.py"
    copy.write_text(Path(policy.__file__).read_text())
    splits = ('OUT_TAIL_SPLIT={"plain": 2, "swiglu": 1}', 'OUT_TAIL_SPLIT={"plain": 2, "swiglu": 2}')
    for setting in (splits[0], "PDL_KERNELS=()", splits[1]):
        proc = run_script("policy_range.py", str(copy), "--set", setting)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    spec = importlib.util.spec_from_file_location("policy_with_setting", copy)
    edited = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, edited)
    spec.loader.exec_module(edited)
    assert edited.OUT_TAIL_SPLIT == {"plain": 2, "swiglu": 2} and edited.PDL_KERNELS == ()
    assert policy.OUT_TAIL_SPLIT == {"plain": 1, "swiglu": 2} and policy.PDL_KERNELS == ("*",)
    assert edited.SHARED_REDUCE_TILE == policy.SHARED_REDUCE_TILE and edited.UNMEASURED == policy.UNMEASURED
    # a setting with no comment after it: the lines after it stay (the comment is looked for on its line only)
    text = copy.read_text()
    proc = run_script("policy_range.py", str(copy), "--set", "ROUTER_SHARE_COLUMNS=64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = [line for line in text.splitlines() if not line.startswith("ROUTER_SHARE_COLUMNS =")]
    assert [line for line in copy.read_text().splitlines() if not line.startswith("ROUTER_SHARE_COLUMNS =")] == kept
    copy.write_text(text)
    before = copy.read_text()
    for bad, says in (
        ("NOT_A_SETTING=2", "'NOT_A_SETTING' is not a one-line setting"),
        ("ROUTER_TOKEN_FINISH_MAX_M=2.0", "'2.0' is a float, the policy's a int"),
        ("OUT_TAIL_SPLIT=2", "'2' is a int, the policy's a dict"),
        ('OUT_TAIL_SPLIT={"q": 2, "swiglu": 2}', "keys ['q', 'swiglu'], the policy's ['plain', 'swiglu']"),
        ("ROUTER_TOKEN_FINISH_MAX_M=two", "is not a literal"),
    ):
        proc = run_script("policy_range.py", str(copy), "--set", bad)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and says in proc.stderr, proc.stderr
    assert copy.read_text() == before


def test_out_prefill_rounds_of_a_committed_run():
    """``bench_out_prefill.py --rounds RAW`` (no GPU): the short-prompt run's masks drawn again on the CPU give the
    items and rounds its kernel ran; gate+up at 512 tokens: every group on, 448 items in 4 rounds; a quarter off,
    396 items in 3 (the docs' "Rounds" table); every row's time is its rounds of about equal time."""
    raw = BENCHMARKS.parent / "docs/results/wide-kernels/bench-out-prefill-short-h200-2026-12-04.json"
    proc = run_script("bench_out_prefill.py", "--rounds", str(raw))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()[2:]]
    assert len(rows) == 30
    by = {(r[0], r[1], r[2]): r for r in rows}
    assert by["gate+up (SwiGLU)", "512", "all"][4:6] == ["448", "4"]
    assert by["gate+up (SwiGLU)", "512", "iid25"][4:6] == ["396", "3"]
    per_round = [float(r[7]) for r in rows if r[0].startswith("gate") and int(r[1]) >= 512]
    assert max(per_round) / min(per_round) < 1.05


def test_gpu_times_tell_the_interleaved_calls_apart(monkeypatch):
    """``bench_wide_kernels.calls_of_profile`` (how ``gpu_times`` reads its profile): each flush opens a call, the
    kernels after it are that call's, and each label's median is over its own calls wherever it ran in a round; a
    short bitwise-not is a call's own kernel, not a flush; flushes that do not match the calls give no number."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_wide_kernels import calls_of_profile

    flush = ("at::native::bitwise_not_kernel(...)", 300.0)
    order = ["a", "b", "b", "a", "a", "b"]  # three rounds, the start rotated
    a, b = [10.0, 12.0, 30.0], [5.0, 7.0, 6.0]
    profile = [
        ("stray before the first flush", 99.0),
        flush, ("ka(int)", a[0]),
        flush, ("kb", b[0] - 1.0), ("bitwise_not small mask", 1.0),
        flush, ("kb", b[1]),
        flush, ("ka(int)", a[1]),
        flush, ("ka(int)", a[2]),
        flush, ("kb", b[2]),
    ]  # fmt: skip
    got = calls_of_profile(order, profile)
    assert list(got) == ["a", "b"]
    assert got["a"][0] == pytest.approx(12.0 / 1e3) and got["b"][0] == pytest.approx(6.0 / 1e3)
    assert got["a"][1] == {"ka": round(52.0 / 3, 2)}
    assert got["b"][1]["bitwise_not small mask"] == round(1.0 / 3, 2)
    lost = calls_of_profile(order, profile[:-2])  # a flush missing: the calls cannot be told apart
    assert all(ms != ms and parts == {} for ms, parts in lost.values())


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        ("bench_out_prefill.py", ("--tail-split", "x"), "argument --tail-split: 'x' is not a comma-separated list"),
        ("bench_out_prefill.py", ("--tokens", "512,0"), "argument --tokens: '512,0': give integers of 1 or more"),
        ("bench_attention_matrix.py", ("--batches", "1,b"), "argument --batches: '1,b' is not a comma-separated"),
    ],
)
def test_benchmark_lists_of_integers_are_checked(script, args, says):
    """A bench's list of integers (``benchmark_report.int_list``, the CLI's reading): a bad one is argparse's
    error naming the flag and the value, and exit 2, before anything runs."""
    proc = run_script(script, *args)
    assert proc.returncode == 2 and says in proc.stderr.strip().splitlines()[-1], proc.stderr[-1000:]
