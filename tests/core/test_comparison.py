"""Runs evaluated on different items are never put side by side without a word."""

import pytest

from compresskit.comparison import group_runs
from compresskit.report import compare_markdown


def run(name, limit, *, pruner="wide", dense_key="k1", batch_size=16):
    dense = {"key": {"evaluation": {"limit": limit}, "tag": dense_key}, "metrics": {"piqa": {"acc": 0.6}}}
    return {
        "name": name,
        "pruner": pruner,
        "metrics": {"piqa": {"acc": 0.5}},
        "zero_shot_average": 0.5,
        "sparsity": {"attention": 0.1, "ffn": 0.2, "macs": 0.15},
        "model": {"name_or_path": "smollm2-135m", "params_before": 100, "params_after": 100},
        "recipe": {
            "evaluation": {"tasks": ["piqa"], "limit": limit, "batch_size": batch_size, "compare_dense": True},
            "data": {"test_fraction": 0.25, "split_seed": 0},
        },
        "dense": dense if pruner else None,
    }


def test_runs_on_different_subsets_form_groups_each_with_its_dense_reference():
    quick, full, other = run("quick", 100), run("full", 200), run("full-b", 200, batch_size=4)
    groups = group_runs([quick, full, other])
    assert [[r["name"] for r in g.runs] for g in groups] == [["dense", "quick"], ["dense", "full", "full-b"]]
    assert [g.label for g in groups] == ["group 1: limit=100", "group 2: limit=200"]
    assert groups[0].runs[0]["dense"]["key"]["evaluation"]["limit"] == 100  # each group's own dense run
    md = compare_markdown(groups)
    assert md.count("| run |") == 2 and "### Evaluation group 2: limit=200" in md


def test_runs_on_different_files_are_different_groups():
    a, b, c = run("a", 100), run("b", 100), run("c", 100)
    a["data"] = {"source": "files", "files": [{"path": "x.txt", "sha256": "1" * 64}]}
    b["data"] = {"source": "files", "files": [{"path": "x.txt", "sha256": "2" * 64}]}  # the same name, edited
    assert [[r["name"] for r in g.runs] for g in group_runs([a, b, c])] == [
        ["dense", "a"],
        ["dense", "b"],
        ["dense", "c"],
    ]


def test_one_group_keeps_one_table_and_no_dense_row_is_invented():
    groups = group_runs([run("a", 100), run("b", 100, dense_key="other")])
    assert len(groups) == 1 and groups[0].label == ""
    assert [r["name"] for r in groups[0].runs] == ["a", "b"]  # two different dense references: none shown
    assert "###" not in compare_markdown(groups)


def test_seeds_average_into_one_row_with_the_sample_spread():
    from compresskit.comparison import aggregate_seeds
    from compresskit.report import compare_rows

    runs = []
    for seed, acc in ((0, 0.5), (1, 0.7), (2, 0.6)):
        r = run(f"s{seed}", 100)
        r["metrics"] = {"piqa": {"acc": acc}}
        r["zero_shot_average"] = acc
        r["seeds"] = {"recipe": seed}
        runs.append(r)
    runs[2]["sparsity"] = None  # one run did not measure it: the mean would be a guess
    row = aggregate_seeds(runs)
    assert row["metrics"]["piqa"]["acc"] == pytest.approx(0.6) and row["spread"]["piqa"]["acc"] == pytest.approx(0.1)
    assert row["seeds"] == [0, 1, 2] and row["sparsity"] is None
    header, rows = compare_rows([row])
    assert rows[0][header.index("PIQA acc")] == "0.6000 ± 0.1000" and rows[0][header.index("seeds")] == "0,1,2"
    assert rows[0][header.index("sparsity MACs")] == "not measured"


def test_the_dense_row_is_the_speed_reference_once_runs_were_timed():
    from compresskit.report import compare_rows

    timed, untimed = run("timed", 100), run("untimed", 100)
    timed["speed"] = {"measured": True, "ttft_speedup": 0.5, "tpot_speedup": 1.25}
    untimed["speed"] = {"measured": False, "reason": "no GPU"}
    for runs, dense_cells in (([timed, untimed], ["1.00x", "1.00x"]), ([untimed], ["not measured"] * 2)):
        (group,) = group_runs(runs)
        header, rows = compare_rows(group.runs)
        cells = {r[0]: r[header.index("TTFT x dense") : header.index("TPOT x dense") + 1] for r in rows}
        assert cells["dense"] == dense_cells
    assert cells["untimed"] == ["not measured"] * 2
    header, rows = compare_rows(group_runs([timed])[0].runs)
    assert rows[1][header.index("TPOT x dense")] == "1.25x"


def test_each_perplexity_is_shown_against_the_dense_models_in_one_column():
    """Held-out and out-of-domain perplexity over the dense model's, side by side: how much more a
    pruned model loses outside its training text."""
    from compresskit.report import compare_rows

    a, b = run("a", 100), run("b", 100)
    for r, (held, code) in ((a, (30.0, 70.0)), (b, (45.0, None))):
        r["metrics"] = {"piqa": {"acc": 0.5}, "perplexity": {"token_perplexity": held}}
        if code is not None:
            r["metrics"]["code_perplexity"] = {"token_perplexity": code}
        r["dense"]["metrics"] = {
            "piqa": {"acc": 0.6},
            "perplexity": {"token_perplexity": 15.0},
            "code_perplexity": {"token_perplexity": 7.0},
        }
    (group,) = group_runs([a, b])
    header, rows = compare_rows(group.runs)
    col = header.index("ppl x dense (held-out, code)")
    assert [r[col] for r in rows] == ["1.0x, 1.0x", "2.0x, 10.0x", "3.0x, -"]
    assert header.index("recovery (zero-shot)") < col < header.index("TTFT x dense")
    header, rows = compare_rows([run("no-ppl", 100)])  # held-out perplexity is a default column: not measured
    assert rows[0][header.index("ppl x dense (held-out)")] == "-"


def test_the_speed_columns_say_how_they_were_measured_and_warn_when_timed_differently():
    from compresskit.report import speed_footnote

    def timed(name, prompt=512, device="NVIDIA H200"):
        r = run(name, 100)
        r["speed"] = {
            "measured": True,
            "device": device,
            "mode": "compiled + CUDA graphs",
            "batch": 1,
            "prompt": prompt,
            "new_tokens": 32,
            "repeats": 3,
            "ttft_speedup": 1.5,
            "tpot_speedup": 1.2,
        }
        return r

    untimed = run("untimed", 100)
    untimed["speed"] = {"measured": False, "reason": "no GPU"}
    assert speed_footnote([untimed]) is None
    assert "Speed:" not in compare_markdown(group_runs([untimed]))
    one = speed_footnote([timed("a"), timed("b"), untimed])
    assert one.startswith("Speed: TTFT and TPOT of each run over its dense base") and "warning" not in one
    assert "NVIDIA H200, compiled + CUDA graphs, batch 1, a 512-token prompt, 32 new tokens, medians of 3" in one
    two = speed_footnote([timed("a"), timed("b", prompt=2048), timed("c")])
    assert "warning, the runs were timed under 2 different settings" in two
    assert "a, c: NVIDIA H200, compiled + CUDA graphs, batch 1, a 512-token prompt" in two and "b: NVIDIA H200" in two
    assert two in compare_markdown(group_runs([timed("a"), timed("b", prompt=2048), timed("c")]))


def _evaluated(name, pruner, tasks, metrics, **evaluation):
    """A results document as ``compresskit eval`` writes it: no dense reference of its own."""
    return {
        "name": name,
        "pruner": pruner,
        "metrics": metrics,
        "zero_shot_average": metrics.get("piqa", {}).get("acc"),
        "sparsity": {"attention": 0.1, "ffn": 0.2, "macs": 0.15} if pruner else None,
        "model": {"name_or_path": name, "base_model": "smollm2-135m", "params_before": 100, "params_after": 100},
        "recipe": {
            "eval": name,
            "evaluation": {"tasks": tasks, "limit": 200, "next_sentence_items": 500, "seed": 1234, **evaluation},
            "data": {"source": "wiki", "test_fraction": 0.25, "split_seed": 0},
        },
        "dense": None,
    }


def test_runs_scored_on_the_same_held_out_text_share_a_group_and_the_tasks_they_share():
    """A perplexity-only evaluation of a saved run and the dense model's fuller one, on the same 10 held-out
    documents: one group, the run's perplexity over the dense run's, its PIQA cell empty; a third run that read
    other documents for perplexity is a group of its own, named by what differs."""
    from compresskit.report import compare_rows

    ppl = {"perplexity": {"token_perplexity": 30.0}}
    run = _evaluated("wide-run", "wide", ["perplexity"], ppl, perplexity_docs=10, next_sentence_items=50)
    dense = _evaluated(
        "smollm2-135m", None, ["perplexity", "piqa"],
        {"perplexity": {"token_perplexity": 20.0}, "piqa": {"acc": 0.6}}, perplexity_docs=10,
    )  # fmt: skip
    apart = _evaluated("other", "wide", ["perplexity"], ppl, perplexity_docs=3)
    groups = group_runs([run, dense, apart])
    assert [[r["name"] for r in g.runs] for g in groups] == [["wide-run", "smollm2-135m"], ["other"]]
    assert [g.label for g in groups] == ["group 1: perplexity_docs=10", "group 2: perplexity_docs=3"]
    header, rows = compare_rows(groups[0].runs)
    cells = dict(zip(header, rows[0], strict=True))
    assert cells["ppl x dense (held-out)"] == "1.5x" and cells["PIQA acc"] == "-"
    assert cells["recovery (zero-shot)"] == "-"  # different zero-shot tasks: no ratio of their averages
    assert run["dense"] is None  # the input is left as it was


def test_labels_of_points_close_together_do_not_overlap():
    """Two runs at one spot (the dense model and an eval of it), and a third far away: the first two labels
    get different lines, the third keeps the first line; each quality plot draws through it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from compresskit.plot import label_points

    fig, ax = plt.subplots()
    ax.plot([0.0, 0.0, 0.5], [21.4, 21.41, 60.0], "o")
    offsets = label_points(ax, [(0.0, 21.4, "dense"), (0.0, 21.41, "smollm2-135m"), (0.5, 60.0, "wide-50")])
    plt.close(fig)
    assert offsets[0] != offsets[1] and offsets[2] == offsets[0]
    assert len({round(o) for o in offsets[:2]}) == 2


def test_the_quality_plot_labels_every_run(tmp_path):
    from compresskit.plot import quality_vs_sparsity

    runs = [run(name, 100) for name in ("a", "b", "c")]
    path = quality_vs_sparsity(runs, tmp_path / "q.png")
    assert path.is_file() and path.stat().st_size > 1000
