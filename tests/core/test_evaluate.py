import math
from pathlib import Path

import pytest

from compresskit.data import Article, DataModule
from compresskit.evaluate import evaluate, recovery
from compresskit.recipe import EvaluationSection
from compresskit.tasks import next_sentence_docs, piqa_docs, sentences


def test_piqa_is_the_full_validation_split():
    docs = piqa_docs()
    assert len(docs) == 1838
    assert {d["label"] for d in docs} == {0, 1}
    assert docs[0]["goal"] == "How do I ready a guinea pig cage for it's new occupants?" and docs[0]["label"] == 0


def _articles(n=4):
    out = []
    for a in range(n):
        paras = []
        for p in range(3):
            paras.append(" ".join(f"Article {a} paragraph {p} says sentence {s} with words." for s in range(6)))
        out.append(Article(f"A{a}", a, "\n\n".join(paras)))
    return out


def test_next_sentence_items_are_deterministic_and_correct():
    arts = _articles()
    docs = next_sentence_docs(arts, 20, seed=0)
    assert docs == next_sentence_docs(arts, 20, seed=0)
    assert docs != next_sentence_docs(arts, 20, seed=1)
    assert len(docs) == 20
    for d in docs:
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4
        first, second = sentences(d["context"])
        # the answer is the sentence that follows the context in the same paragraph
        a, p, s = (int(x) for x in [first.split()[1], first.split()[3], first.split()[6]])
        assert d["choices"][d["label"]] == f"Article {a} paragraph {p} says sentence {s + 2} with words."
        others = [c for i, c in enumerate(d["choices"]) if i != d["label"]]
        assert sum(c.startswith(f"Article {a} ") for c in others) == 1  # one distractor from the same article
    assert len({d["label"] for d in docs}) > 1


def test_recovery_is_one_when_equal_and_below_when_worse():
    dense = {"piqa": {"acc": 0.6}, "perplexity": {"token_perplexity": 20.0}}
    comp = {"piqa": {"acc": 0.3}, "perplexity": {"token_perplexity": 40.0}}
    assert recovery(dense, dense) == {"piqa": {"acc": 1.0}, "perplexity": {"token_perplexity": 1.0}}
    assert recovery(comp, dense) == {"piqa": {"acc": 0.5}, "perplexity": {"token_perplexity": 0.5}}


def test_a_recovery_of_zero_is_reported_as_zero():
    """An accuracy of 0 recovers 0.000 of dense's, shown as such (not "-"); only a division by zero has none."""
    from compresskit.report import summary_rows

    dense = {"piqa": {"acc": 0.6}, "next_sentence": {"acc": 0.0}}
    got = recovery({"piqa": {"acc": 0.0}, "next_sentence": {"acc": 0.2}}, dense)
    assert got == {"piqa": {"acc": 0.0}}
    results = {"metrics": {"piqa": {"acc": 0.0}}, "dense": {"metrics": dense}, "recovery": got}
    results.update(model={"params_after": 1, "params_before": 1}, sparsity=None)
    row = next(r for r in summary_rows(results) if r[0].startswith("PIQA acc"))
    assert row[1:] == ("0.0000", "0.6000", "0.000")


def _scored(ppl, acc, *, dense_ppl=7.24, dense_acc=0.6, stages=()):
    return {
        "metrics": {"perplexity": {"token_perplexity": ppl, "word_perplexity": ppl * 1e6}, "piqa": {"acc": acc}},
        "zero_shot_average": acc,
        "dense": {
            "metrics": {"perplexity": {"token_perplexity": dense_ppl}, "piqa": {"acc": dense_acc}},
            "zero_shot_average": dense_acc,
        },  # fmt: skip
        "sparsity": {"macs": 0.446, "attention": 0.4, "ffn": 0.46, "dynamic": True},
        "training": [{"stage": s, "steps": 10, "tokens": t} for s, t in stages],
        "model": {"params_after": 1, "params_before": 1},
    }


def test_the_quality_alarm_names_what_fell_why_and_what_to_try():
    """Past 3x dense perplexity or under 0.8 zero-shot recovery: one line with the numbers, this run's likely
    causes and what to try; a model within both lines, or one with no dense reference, raises none."""
    from compresskit.report import quality_alarm

    broken = _scored(1899.0, 0.45, stages=[("router", 20480)])
    line = quality_alarm(broken)
    assert "\n" not in line and line.startswith("quality alarm: held-out ppl 1899.00 is 262x dense (7.24)")
    assert "zero-shot recovery 0.750" in line and "45% of the MACs skipped" in line
    assert "20,480 training tokens" in line and "no recovery stage" in line and "router-fit" in line
    assert quality_alarm(_scored(14.0, 0.5, stages=[("lora", 1)])) is None  # 1.9x, 0.83
    assert "recovery" in quality_alarm(_scored(8.0, 0.3))  # the perplexity within, the zero-shot not
    assert quality_alarm({**broken, "dense": None}) is None


def test_collapsed_perplexities_print_in_scientific_notation():
    from compresskit.report import summary_rows

    rows = {r[0]: r for r in summary_rows({**_scored(1899.0, 0.49), "recovery": {}})}
    assert rows["held-out ppl"][1] == "1899.00" and rows["word ppl"][1] == "1.90e+09"


def test_evaluate_tiny_model_with_lm_eval(tiny_model_dir):
    from compresskit.modeling import load_model

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    dm = DataModule(tok, articles=_articles(8), test_fraction=0.5)
    section = EvaluationSection(limit=5, perplexity_docs=1, next_sentence_items=5, batch_size=4, max_length=512)
    res = evaluate(model, tok, dm, section)
    assert set(res.tasks) == {"perplexity", "piqa", "next_sentence"}
    ppl = res.tasks["perplexity"].metrics
    assert set(ppl) == {"token_perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"}
    # a random-init model is about as perplexed as its vocabulary is large
    assert 50 < ppl["token_perplexity"] < 5 * len(tok)
    assert math.isclose(math.log2(ppl["byte_perplexity"]), ppl["bits_per_byte"], rel_tol=1e-6)
    for t in ("piqa", "next_sentence"):
        assert res.tasks[t].n_items == 5 and 0 <= res.tasks[t].metrics["acc"] <= 1
    assert res.meta["lm_eval_version"].startswith("0.4")
    assert res.zero_shot_average() == pytest.approx(
        (res.tasks["piqa"].metrics["acc"] + res.tasks["next_sentence"].metrics["acc"]) / 2
    )


def _close(a: dict, b: dict, rel: float) -> bool:
    return a.keys() == b.keys() and all(
        x.keys() == y.keys() and all(math.isclose(x[k], y[k], rel_tol=rel, abs_tol=1e-9) for k in x)
        for x, y in zip(a.values(), b.values(), strict=True)
    )


def test_the_runtime_engine_scores_what_transformers_scores(tiny_model_dir, tmp_path):
    """``evaluation.engine: runtime``: lm-eval's logits come from the inference runtime (one prefill a batch,
    lm-eval's right padding marked), the same metrics as the model's own modules up to rounding;
    results say which engine ran, and ``auto`` takes transformers on a CPU. A model type the runtime
    does not run is one error naming the field."""
    from compresskit.errors import RecipeError
    from compresskit.evaluate import resolve_engine
    from compresskit.modeling import load_model

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    dm = DataModule(tok, articles=_articles(8), test_fraction=0.5)
    common = dict(limit=6, perplexity_docs=2, next_sentence_items=6, batch_size=4, max_length=512)
    ref = evaluate(model, tok, dm, EvaluationSection(**common, engine="transformers"))
    run = evaluate(model, tok, dm, EvaluationSection(**common, engine="runtime"))
    assert ref.meta["engine"] == "transformers" and run.meta["engine"] == "runtime (eager)"
    assert _close(run.metrics(), ref.metrics(), 1e-4) and run.metrics() != {}
    assert resolve_engine(model, EvaluationSection()) == "transformers"  # auto, on a CPU
    model.config.model_type = "gpt2"
    with pytest.raises(RecipeError, match="evaluation.engine: runtime does not run model type 'gpt2'"):
        resolve_engine(model, EvaluationSection(engine="runtime"))
    assert resolve_engine(model, EvaluationSection(engine="auto")) == "transformers"


def test_logits_budget_lowers_the_batch_and_leaves_the_numbers(tiny_model_dir):
    """A batch's full-vocabulary log-probabilities must fit the budget: the tiny model's 512-token
    windows take 512 * vocab * 8 bytes a row, so a budget of two rows runs batches of two; the
    metrics are those of the unbounded run."""
    from compresskit.modeling import load_model

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    dm = DataModule(tok, articles=_articles(8), test_fraction=0.5)
    vocab = model.get_output_embeddings().weight.shape[0]
    two_rows_mb = -(-2 * 512 * vocab * 8 // 2**20)
    common = {"tasks": ["perplexity", "piqa"], "limit": 6, "max_length": 512, "batch_size": 16}
    big = evaluate(model, tok, dm, EvaluationSection(**common))
    small = evaluate(model, tok, dm, EvaluationSection(**common, logits_budget_mb=max(16, two_rows_mb)))
    rows = max(1, max(16, two_rows_mb) * 2**20 // (512 * vocab * 8))
    assert small.tasks["perplexity"].batch_size == min(16, rows) < big.tasks["perplexity"].batch_size == 16
    for task in ("perplexity", "piqa"):
        for metric, value in big.tasks[task].metrics.items():
            assert small.tasks[task].metrics[metric] == pytest.approx(value, rel=1e-5), (task, metric)


def test_lm_eval_padding_reaches_the_token_mask(tiny_model_dir, monkeypatch):
    """lm-eval right-pads each batch and passes no attention mask; the evaluator records the true
    lengths where lm-eval pads (the one place it reaches inside lm-eval). This fails when lm-eval stops
    padding through ``lm_eval.models.huggingface.pad_and_concat``."""
    import compresskit.evaluate as ev
    from compresskit.modeling import load_model

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    seen = []
    original = ev.token_mask

    def spy(valid):
        seen.append(None if valid is None else valid.sum(dim=1).tolist())
        return original(valid)

    monkeypatch.setattr(ev, "token_mask", spy)
    dm = DataModule(tok, articles=_articles(8), test_fraction=0.5)
    evaluate(model, tok, dm, EvaluationSection(tasks=["piqa"], limit=3, batch_size=8, max_length=512))
    assert seen and all(lengths is not None for lengths in seen)
    assert any(len(set(lengths)) > 1 for lengths in seen)  # rows of different true lengths in one batch


def test_one_registry_decides_the_tasks_of_recipes_the_evaluator_and_the_tables(tiny_model_dir, monkeypatch):
    """A task added to ``compresskit.tasks.REGISTRY`` is accepted by recipes, run by the evaluator and
    shown by the reports, with no other list to edit."""
    import dataclasses

    from compresskit import tasks
    from compresskit.modeling import load_model
    from compresskit.report import compare_rows

    piqa = tasks.REGISTRY["piqa"]

    def build(data, tokenizer, section):
        return {**piqa.build(data, tokenizer, section), "task": "ck_piqa_again"}

    extra = dataclasses.replace(piqa, name="piqa_again", columns=(tasks.Column("PIQA again", "acc", "{:.4f}"),))
    monkeypatch.setitem(tasks.REGISTRY, "piqa_again", dataclasses.replace(extra, build=build))
    section = EvaluationSection(tasks=["piqa_again"], limit=3, batch_size=4, max_length=512)
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    res = evaluate(model, tok, DataModule(tok, articles=_articles(8), test_fraction=0.5), section)
    assert res.tasks["piqa_again"].n_items == 3
    run = {"name": "r", "metrics": res.metrics(), "sparsity": None, "model": {"params_after": 1}}
    header, rows = compare_rows([run])
    assert rows[0][header.index("PIQA again")] == f"{res.tasks['piqa_again'].metrics['acc']:.4f}"
    monkeypatch.delitem(tasks.REGISTRY, "piqa_again")
    # no longer built in: an lm-eval name to resolve, and lm-eval has no such task either
    with pytest.raises(tasks.RecipeError, match=r"unknown task 'piqa_again'\. Did you mean: .*piqa"):
        tasks.check_lm_eval_tasks(EvaluationSection(tasks=["piqa_again"]))


@pytest.mark.slow
def test_the_domain_perplexity_tasks_read_the_shipped_text(tiny_model_dir):
    """``code_perplexity`` and ``legal_perplexity``: rolling perplexity over the shipped documents of
    a domain (every document, whatever the held-out split), reported under their own names; the
    comparison table shows their columns only where a run reported them."""
    from compresskit import tasks
    from compresskit.modeling import load_model
    from compresskit.report import compare_rows

    code, legal = tasks.domain_docs("code"), tasks.domain_docs("legal")
    assert len(code) == 11 and code[0]["title"] == "Lib/heapq.py" and "def heappush" in code[0]["text"]
    assert [d["title"] for d in legal] == ["GPL-3", "LGPL-2.1", "MPL-2.0", "Apache-2.0", "GFDL-1.3", "Artistic"]
    assert "code_perplexity" not in EvaluationSection().tasks  # not run unless asked
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    dm = DataModule(tok, articles=_articles(8), test_fraction=0.5)
    section = EvaluationSection(tasks=["code_perplexity", "legal_perplexity"], batch_size=8, max_length=512)
    res = evaluate(model, tok, dm, section)
    for name, docs in (("code_perplexity", code), ("legal_perplexity", legal)):
        assert res.tasks[name].n_items == len(docs)
        ppl = res.tasks[name].metrics
        assert 50 < ppl["token_perplexity"] < 5 * len(tok)  # a random-init model: about its vocabulary's size
        assert math.isclose(math.log2(ppl["byte_perplexity"]), ppl["bits_per_byte"], rel_tol=1e-6)
    assert res.tasks["code_perplexity"].metrics != res.tasks["legal_perplexity"].metrics
    run = {"name": "r", "metrics": res.metrics(), "sparsity": None, "model": {"params_after": 1}}
    plain = {"name": "p", "metrics": {"piqa": {"acc": 0.5}}, "sparsity": None, "model": {"params_after": 1}}
    header, rows = compare_rows([run, plain])
    assert rows[0][header.index("code ppl")] == f"{res.tasks['code_perplexity'].metrics['token_perplexity']:.2f}"
    assert rows[1][header.index("legal ppl")] == "-"
    assert "code ppl" not in compare_rows([plain])[0] and "held-out ppl" in compare_rows([plain])[0]


def test_held_out_text_of_several_sources_gets_a_perplexity_each(tiny_model_dir, tmp_path, monkeypatch):
    """Held-out documents from two sources: ``perplexity`` reports the whole held-out text's token
    perplexity and each source's (``token_perplexity:<label>``, whose tokens add up to the whole),
    the reports show a column for each, and recovery reads them as lower-is-better."""
    import json

    from compresskit import tasks
    from compresskit.data import load_documents
    from compresskit.modeling import load_model
    from compresskit.recipe import DataSection
    from compresskit.report import compare_rows, summary_rows

    for name in ("a", "b"):
        docs = [{"text": f"{name.upper()} file document {i}. " + "Some words here. " * (20 + i)} for i in range(8)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    monkeypatch.chdir(tmp_path)
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    section = DataSection(source=[{"source": {"files": ["a.jsonl"]}}, {"source": {"files": ["b.jsonl"]}}])
    dm = DataModule.from_section(tok, section, load_documents(section))
    assert dm.test_sources == ["files1"] * 2 + ["files2"] * 2
    assert [s["label"] for s in dm.split_info()["sources"]] == ["files1", "files2"]
    res = evaluate(model, tok, dm, EvaluationSection(tasks=["perplexity"], max_length=128, batch_size=4))
    ppl = res.tasks["perplexity"].metrics
    assert {"token_perplexity:files1", "token_perplexity:files2"} <= set(ppl)
    n = [sum(len(tok(a.text, add_special_tokens=False)["input_ids"]) for a in dm.test[i : i + 2]) for i in (0, 2)]
    whole = (n[0] * math.log(ppl["token_perplexity:files1"]) + n[1] * math.log(ppl["token_perplexity:files2"])) / sum(n)
    assert math.log(ppl["token_perplexity"]) == pytest.approx(whole, rel=1e-6)
    worse = {"perplexity": {k: 2 * v for k, v in ppl.items()}}
    assert recovery(worse, res.metrics())["perplexity"]["token_perplexity:files1"] == pytest.approx(0.5)
    run = {"name": "r", "metrics": res.metrics(), "sparsity": None, "model": {"params_after": 1}}
    header, rows = compare_rows([run])
    assert rows[0][header.index("held-out ppl (files2)")] == f"{ppl['token_perplexity:files2']:.2f}"
    shown = [r[0] for r in summary_rows({**run, "model": {"params_before": 1, "params_after": 1}})]
    assert shown[:2] == ["held-out ppl", "word ppl"] and "held-out ppl (files1)" in shown
    single = DataModule.from_section(tok, DataSection(source={"files": ["a.jsonl"]}))
    one = evaluate(model, tok, single, EvaluationSection(tasks=["perplexity"], max_length=128, batch_size=4))
    assert not any(":" in m for m in one.tasks["perplexity"].metrics)  # one source: nothing more
    assert tasks.metric_kind("token_perplexity:files1") == "token_perplexity"


def test_lm_eval_says_nothing_of_git_outside_a_checkout(tiny_model_dir, tmp_path, monkeypatch, capfd):
    """Outside a git checkout lm-eval's own commit lookup printed "fatal: not a git repository" once per task."""
    from compresskit.modeling import load_model

    monkeypatch.chdir(tmp_path)
    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    dm = DataModule(tok, articles=_articles(8), test_fraction=0.5)
    evaluate(model, tok, dm, EvaluationSection(tasks=["piqa"], limit=2, batch_size=2, max_length=512))
    assert "not a git repository" not in capfd.readouterr().err


@pytest.mark.slow
def test_the_dense_reference_is_reused_when_only_training_settings_change(tiny_model_dir, tmp_path, monkeypatch):
    """Its cache key holds what decides its numbers: a run with other calibration settings reuses it, one
    scored on other items computes its own."""
    import compresskit.api as api
    from compresskit.recipe import load_raw

    computed = []
    real = api.evaluate

    def counting(model, *args, **kwargs):
        if kwargs.get("pruner") is None:  # the dense reference's pass
            computed.append(1)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(api, "evaluate", counting)
    recipe = load_raw(Path(__file__).parents[1] / "recipes" / "tiny-toy.yaml")
    base = {"model.name_or_path": str(tiny_model_dir), "evaluation.tasks": ["perplexity"]}
    runs = [
        {"data.calibration.n_samples": 4, "output.dir": str(tmp_path / "a")},
        {"data.calibration.n_samples": 2, "output.dir": str(tmp_path / "b")},  # training text only: reused
        {"evaluation.perplexity_docs": 2, "output.dir": str(tmp_path / "c")},  # other items: its own
    ]
    for overrides in runs:
        api.apply(recipe, overrides={**base, **overrides})
    assert len(computed) == 2
