import math

import pytest

from compresskit.data import Article, DataModule
from compresskit.evaluate import evaluate, next_sentence_docs, piqa_docs, recovery, sentences
from compresskit.recipe import EvaluationSection


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
