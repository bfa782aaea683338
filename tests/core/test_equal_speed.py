"""Methods compared at equal measured speed: each method's structure rebuilt at a known shape from what a
run realised (``compresskit bench --shape NAME --run RUN``), and ``compresskit compare --speed`` reading
each method's quality at given speedups, interpolated between its budgets, with the Pareto front."""

import json
import math

import pytest
import torch

from compresskit.cli import main
from compresskit.comparison import Speed, at_speed, pareto_front, read_speed, speed_points
from compresskit.sparsity import SparsityProfile

# ---------------------------------------------------------------------------------------------
# the profile: a run's realised sparsity, carried to a model of another depth


def test_a_profile_reads_the_run_at_the_same_relative_depth():
    layers = ({"attention": 0.0, "ffn": 0.2}, {"attention": 0.4, "ffn": 0.6}, {"attention": 0.8, "ffn": 1.0})
    profile = SparsityProfile(0.5, layers)
    assert profile.at(1, 3, "ffn") == pytest.approx(0.6)  # the same depth: the run's own layer
    # 6 layers over the run's 3: layer centres at 0.25, 0.75, ... of a run layer
    assert [round(profile.at(i, 6, "attention"), 6) for i in range(6)] == [0.0, 0.1, 0.3, 0.5, 0.7, 0.8]
    assert profile.at(0, 1, "ffn") == pytest.approx(0.6)  # one layer: the middle of the run
    assert SparsityProfile(0.3).at(5, 32, "attention") == 0.3  # no per-layer record: the overall fraction
    doc = {"sparsity": {"macs": 0.25, "per_layer": [{"attention": 0.1, "ffn": 0.3}]}}
    assert SparsityProfile.from_results(doc).per_layer == ({"attention": 0.1, "ffn": 0.3},)
    with pytest.raises(ValueError, match="no realised sparsity"):
        SparsityProfile.from_results({"sparsity": None})


def test_routers_are_calibrated_to_the_runs_fraction_of_each_block():
    """WIDE at another shape: each router skips the share of its groups that realises the run's fraction of
    its block's MACs at the same relative depth, so the implied MACs skipped are the run's."""
    from compresskit import plugins
    from compresskit.bench import shape_model
    from compresskit.interfaces import RunContext
    from compresskit.routing import group_rates, routed_projections
    from compresskit.sparsity import layer_linear_macs

    layers = tuple({"attention": 0.1 * i, "ffn": 0.05 * i} for i in range(4))
    cls = plugins.load("pruner", "wide")
    model = shape_model("tiny", device="cpu", dtype=torch.float32)
    pruner = cls(cls.Config(ffn_group_size=64))
    pruner.prepare(model, RunContext(model_config=model.config))
    rate = group_rates(model, SparsityProfile(0.0, layers))
    macs = layer_linear_macs(model.config)
    totals = {"attention": sum(macs[p] for p in "qkvo"), "ffn": sum(macs[p] for p in ("gate", "up", "down"))}
    for _, proj in routed_projections(model):  # tiny: 2 layers over the run's 4, at 0.5 and 2.5 of them
        want = (0.05 if proj.layer_idx == 0 else 0.25) * (1 if proj.kind == "attention" else 0.5)
        assert rate(proj) * proj.groups * proj.macs_per_group == pytest.approx(want * totals[proj.kind])
    assert group_rates(model, SparsityProfile(0.5, groups=0.3))(proj) == 0.3  # --sparsity: the groups' share


# ---------------------------------------------------------------------------------------------
# every method's structure on the runtime, from its runs


def write_run(folder, name, method, config, macs, per_layer, metrics=None):
    folder.mkdir(parents=True)
    doc = {
        "name": name,
        "pruner": method,
        "metrics": metrics or {"perplexity": {"token_perplexity": 30.0}},
        "zero_shot_average": 0.5,
        "sparsity": {"attention": macs, "ffn": macs, "macs": macs, "per_layer": per_layer},
        "model": {"name_or_path": "smollm2-135m", "params_before": 100, "params_after": 90},
        "recipe": {"pruner": {"name": method, "config": config}},
    }
    (folder / "results.json").write_text(json.dumps(doc))
    return folder


def test_bench_builds_every_methods_structure_from_its_runs(tmp_path, capsys):
    """``--run``: static width the narrower model, static depth the model with fewer layers, dynamic depth
    and WIDE their routers calibrated to the run's per-layer fractions; a row per run, named after it, beside
    the dense model, each with the MACs it skipped at the shape and the run's."""
    uniform = [{"attention": 0.5, "ffn": 0.5}] * 4
    uneven = [{"attention": 0.3, "ffn": 0.45}]
    sw = {"target_sparsity": 0.5, "ffn_group_size": 64}
    sd = {"target_sparsity": 0.5, "keep_first": 0, "keep_last": 0}
    runs = [
        write_run(tmp_path / "sw", "sw-50", "static-width", sw, 0.5, uniform),
        write_run(tmp_path / "sd", "sd-50", "static-depth", sd, 0.5, uniform),
        write_run(tmp_path / "dd", "dd-40", "dynamic-depth", {"router_rank": 4}, 0.4, uneven),
        write_run(tmp_path / "w", "w-40", "wide", {"ffn_group_size": 64}, 0.4, uneven * 3),
    ]
    out = tmp_path / "bench"
    argv = ["bench", "--shape", "tiny", "--prompt", "64", "--new-tokens", "3", "--repeats", "1", "--batch", "1,2"]
    code = main([*argv, *[a for r in runs for a in ("--run", str(r))], "--transformers", "off", "--bounds", "off",
                 "--output", str(out)])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    data = json.loads((out / "bench.json").read_text())
    names = ["sw-50", "sd-50", "dd-40", "w-40", "dense"]
    assert [r["model"] for r in data["results"]] == names * 2  # bounds off: no half-width rows
    rows = {r["model"]: r for r in data["results"] if r["batch"] == 1}
    assert rows["sw-50"]["sparsity_macs"] == pytest.approx(0.5, abs=0.02)  # 4 of 8 heads, 2 of 4 FFN groups
    assert rows["sd-50"]["sparsity_macs"] == 0.5  # one of two layers
    assert abs(rows["w-40"]["sparsity_macs"] - 0.4) < 0.1  # untrained routers, calibrated on other tokens
    assert 0.2 < rows["dd-40"]["sparsity_macs"] < 0.6
    assert [rows[n]["method"] for n in names[:4]] == ["static-width", "static-depth", "dynamic-depth", "wide"]
    assert rows["w-40"]["run_sparsity_macs"] == 0.4 and rows["w-40"]["source"].endswith("w/results.json")
    assert data["meta"]["methods"] == {n: rows[n]["method"] for n in names[:4]}
    assert "each run's realised fraction per layer" in data["meta"]["structures"]


def test_bench_of_a_run_that_cannot_be_built_says_which_and_why(tmp_path, capsys):
    dense = write_run(tmp_path / "d", "dense-run", None, None, 0.0, [])
    none = write_run(tmp_path / "n", "n", "wide", {}, 0.4, [])
    doc = json.loads((none / "results.json").read_text())
    (none / "results.json").write_text(json.dumps({**doc, "sparsity": None}))
    magnitude = write_run(tmp_path / "m", "m", "toy-magnitude", {}, 0.4, [])
    sd = write_run(tmp_path / "sd", "sd-25", "static-depth", {"target_sparsity": 0.25}, 0.25, [])
    base = ["bench", "--shape", "tiny", "--prompt", "8", "--new-tokens", "3", "--transformers", "off"]
    cases = [
        (["--run", str(dense)], "a dense run has no structure to time"),
        (["--run", str(none)], "it records no realised sparsity (sparsity.macs)"),
        (["--run", str(magnitude)], "its method toy-magnitude: it has no speed shape"),
        (["--run", str(tmp_path / "missing")], "missing: results file (--run) not found"),
        (["--run", str(sd)], "sd-25 at --shape tiny: pruner.config: removing 0 of 2 layers is not possible"),
    ]
    for extra, said in cases:
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    assert main(["bench", "--run", str(sd)]) == 2
    assert "--run: builds a structure at a known configuration; give --shape NAME" in capsys.readouterr().err
    assert main([*base, "--method", "wide", "--sparsity", "1.5"]) == 2
    assert "--sparsity: '1.5'; give fractions in [0, 1)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# quality at equal speed


def test_quality_at_a_speedup_is_interpolated_between_the_budgets_that_bracket_it():
    points = [(1.0, 20.0), (1.3, 30.0), (1.7, 60.0)]
    value, interpolated = at_speed(points, 1.4, log=True)
    assert interpolated and value == pytest.approx(30.0 * 2**0.25)  # a quarter of the way, on a log scale
    assert at_speed(points, 1.4) == (pytest.approx(37.5), True)  # linearly
    assert at_speed(points, 1.3, log=True) == (30.0, False)  # measured there
    assert at_speed(points, 1.8, log=True) is None and at_speed(points, 0.9) is None  # out of range: no guess
    # a line that turns back (a larger budget, slower): every crossing counts, the best is kept
    back = [(1.0, 20.0), (1.5, 30.0), (1.3, 25.0)]
    crossing = math.exp(0.2 * math.log(20.0) + 0.8 * math.log(30.0))
    assert at_speed(back, 1.4, log=True)[0] == pytest.approx(min(crossing, math.sqrt(30.0 * 25.0)))
    assert at_speed([(1.0, 0.55), (1.5, 0.45)], 1.2, better=max) == (pytest.approx(0.51), True)


def test_the_pareto_front_keeps_what_nothing_is_faster_and_better_than():
    points = [(1.0, 20.0, "dense"), (1.2, 25.0, "a"), (1.2, 30.0, "b"), (1.5, 24.0, "c"), (1.6, 90.0, "d")]
    assert pareto_front(points) == {"dense", "c", "d"}  # a and b: c is faster and better
    assert pareto_front([(1.0, 0.5, "x"), (1.4, 0.5, "y")], better=max) == {"y"}


def quality_run(name, method, macs, ppl, zs):
    return {
        "name": name,
        "pruner": method,
        "metrics": {"perplexity": {"token_perplexity": ppl}},
        "zero_shot_average": zs,
        "sparsity": {"attention": macs, "ffn": macs, "macs": macs},
        "model": {"name_or_path": "smollm2-135m", "params_before": 100, "params_after": 100},
        "recipe": {"evaluation": {"tasks": ["perplexity"]}, "data": {}},
        "dense": {"key": "k", "metrics": {"perplexity": {"token_perplexity": 20.0}}, "zero_shot_average": 0.55},
    }


def bench_doc(speedups: dict[str, tuple[float, float]], shape="llama-3.1-8b"):
    results = [
        {"model": name, "batch": b, "prompt": 1024, "tpot_speedup": s[i], "ttft_speedup": s[i], "sparsity_macs": 0.3}
        for i, b in enumerate((1, 8))
        for name, s in {**speedups, "dense": (1.0, 1.0)}.items()
    ]
    return {"meta": {"base": shape, "device": "NVIDIA H200", "command": "compresskit bench ..."}, "results": results}


def test_each_methods_line_starts_at_dense_and_follows_its_budgets():
    runs = [quality_run("w-50", "wide", 0.5, 60.0, 0.47), quality_run("w-25", "wide", 0.25, 30.0, 0.51)]
    speed = read_speed([("b.json", bench_doc({"w-25": (1.2, 1.0), "w-50": (1.4, 1.01)}))])
    assert isinstance(speed, Speed) and speed.batches == [1, 8] and speed.prompt == 1024
    from compresskit.comparison import group_runs

    (group,) = group_runs(runs)  # led by the shared dense reference
    line = speed_points(group.runs, speed, 1)["wide"]
    assert [(b, s, r["name"]) for b, s, r in line] == [(0.0, 1.0, "dense"), (0.25, 1.2, "w-25"), (0.5, 1.4, "w-50")]
    # runs measured against dense references apart (e.g. on two evaluation engines): no shared dense row, so
    # the line starts at the reference of the first run
    apart = [runs[1], {**runs[0], "dense": {**runs[0]["dense"], "key": "k2"}}]
    (group,) = group_runs(apart)
    line = speed_points(group.runs, speed, 1)["wide"]
    assert line[0][:2] == (0.0, 1.0) and line[0][2]["name"] == "dense (the reference of w-25)"
    with pytest.raises(ValueError, match="not the bench.json of compresskit bench"):
        read_speed([("x.json", {"results": [{"model": "a"}]})])
    mixed = bench_doc({"w-25": (1.2, 1.0)})
    mixed["results"][0] = {**mixed["results"][0], "prompt": 512}
    with pytest.raises(ValueError, match=r"prompts of \[512, 1024\] tokens"):
        read_speed([("x.json", mixed)])


def test_compare_with_speed_writes_the_equal_speed_table_and_plot(tmp_path, capsys):
    runs = {
        "sd-25": ("static-depth", 0.25, 40.0, 0.50, (1.35, 1.35)),
        "sd-50": ("static-depth", 0.50, 85.0, 0.46, (1.9, 1.9)),
        "w-25": ("wide", 0.25, 29.0, 0.52, (1.17, 0.9)),
        "w-50": ("wide", 0.50, 64.0, 0.48, (1.45, 1.01)),
    }
    paths = []
    for name, (method, macs, ppl, zs, _) in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(quality_run(name, method, macs, ppl, zs)))
        paths.append(str(tmp_path / name))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(bench_doc({n: v[4] for n, v in runs.items()})))
    out = tmp_path / "cmp"
    assert main(["compare", *paths, "--speed", str(bench), "--output", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert (out / "quality_vs_speed.png").stat().st_size > 10_000
    assert "**The speed is measured at other shapes (llama-3.1-8b) than the quality's model.**" in md
    batch1 = md.split("### TPOT x dense at batch 1")[1].split("###")[0]
    # static depth at 1.2x: between dense (1.0, 20) and sd-25 (1.35, 40), on a log scale
    sd12 = math.exp(math.log(20.0) + (0.2 / 0.35) * (math.log(40.0) - math.log(20.0)))
    assert f"| static-depth | **{sd12:.2f} / " in batch1 and "(interpolated)" in batch1  # the best: bold
    assert "| wide | out of range | out of range | out of range |" not in batch1
    batch8 = md.split("### TPOT x dense at batch 8")[1].split("###")[0]
    assert "| wide | out of range | out of range | out of range |" in batch8  # never 1.2x at batch 8
    points = md.split("### Measured points")[1]
    assert "| sd-25 | static-depth | 0.250 | 0.300 | 1.35x | 1.35x |" in points
    assert "held-out ppl: batch 1, 8" in points.split("| sd-50 |")[1].splitlines()[0]
    written = json.loads((out / "compare.json").read_text())
    assert written[0]["speed"]["targets"] == [1.2, 1.4, 1.6]
    capsys.readouterr()
    assert main(["compare", *paths, "--speed", str(bench), "--at", "1.3"]) == 0
    assert "| method | 1.30x |" in capsys.readouterr().out


def test_compare_speed_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "results.json").write_text(json.dumps(quality_run("w-25", "wide", 0.25, 29.0, 0.52)))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(bench_doc({"someone-else": (1.2, 1.1)})))
    run = str(tmp_path / "r")
    cases = [
        (["--speed", str(tmp_path / "none.json")], "none.json"),
        (["--speed", str(other)], "--speed: the bench files time none of these runs (they time someone-else"),
        (["--at", "1.2"], "--at: reads quality at equal speed, so it needs --speed BENCH.json"),
        (["--speed", str(other), "--at", "fast"], "--at: 'fast' is not a comma-separated list of numbers"),
    ]
    for extra, said in cases:
        assert main(["compare", run, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
