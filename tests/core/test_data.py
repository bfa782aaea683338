import torch

from compresskit.data import Article, DataModule, clean_wiki_text, load_wiki_articles, split_articles
from compresskit.testing import tiny_tokenizer


def test_clean_wiki_text_keeps_prose_only():
    raw = (
        "== History ==\n'''Albedo''' is the fraction of light that a surface reflects back.\n"
        "* [[a]]\n| table | cell |\n"
    )
    assert clean_wiki_text(raw) == "Albedo is the fraction of light that a surface reflects back."


def test_embedded_articles_are_real_and_split_is_deterministic_and_disjoint():
    arts = load_wiki_articles()
    assert 80 <= len(arts) <= 110
    assert sum(len(a.text) for a in arts) > 2_000_000
    train, test = split_articles(arts, 0.25, 0)
    train2, test2 = split_articles(list(reversed(arts)), 0.25, 0)
    assert [a.title for a in test] == [a.title for a in test2] and [a.title for a in train] == [a.title for a in train2]
    assert not {a.title for a in train} & {a.title for a in test}
    assert len(test) == round(0.25 * len(arts))
    _, other = split_articles(arts, 0.25, 1)
    assert [a.title for a in other] != [a.title for a in test]


def _module():
    arts = [Article(f"t{i}", i, (f"Sentence number {i} is here. ") * 200) for i in range(8)]
    return DataModule(tiny_tokenizer(), test_fraction=0.25, split_seed=0, articles=arts)


def test_calibration_batches_shapes_and_determinism():
    dm = _module()
    a = dm.calibration_batches(5, 16, 2, seed=3)
    b = dm.calibration_batches(5, 16, 2, seed=3)
    assert [x.input_ids.shape for x in a] == [torch.Size([2, 16]), torch.Size([2, 16]), torch.Size([1, 16])]
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b, strict=True))
    test_titles = {t.title for t in dm.test}
    assert dm.split_info()["test_titles"] == sorted(test_titles, key=lambda t: int(t[1:]))


def test_training_batches_resume_sees_the_same_stream():
    dm = _module()
    stream = dm.training_batches(16, 2, seed=0)
    full = [next(stream).input_ids for _ in range(40)]
    resumed = dm.training_batches(16, 2, seed=0, start_step=23)
    assert all(torch.equal(next(resumed).input_ids, full[i]) for i in range(23, 40))
