import pytest
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


# -- local files --------------------------------------------------------------------------------


def _corpus(root):
    """Two .txt files, a .jsonl, a .json and a .parquet file: 2 + 3 + 2 + 2 documents."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "txt").mkdir(parents=True)
    for i in range(2):
        (root / "txt" / f"doc{i}.txt").write_text(f"Text file {i}. " * 50)
    (root / "lines.jsonl").write_text(
        "\n".join(json.dumps({"body": f"Json line {i}. " * 40, "id": i}) for i in range(3)) + "\n\n"
    )
    (root / "array.json").write_text(json.dumps([{"body": f"Array item {i}. " * 40} for i in range(2)]))
    pq.write_table(pa.table({"body": [f"Parquet row {i}. " * 40 for i in range(2)], "n": [1, 2]}), root / "t.parquet")
    return root


def _source(files, **kw):
    from compresskit.recipe import DataSection

    return DataSection(source={"files": files, **kw}, test_fraction=0.25, split_seed=0)


def test_every_file_kind_is_read_and_split_deterministically_by_document(tmp_path, monkeypatch):
    _corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    section = _source(["txt/*.txt", "lines.jsonl", "array.json", "t.parquet"], text_field="body")
    dm = DataModule.from_section(tiny_tokenizer(), section)
    assert len(dm.articles) == 9 and len(dm.test) == 2 and len(dm.train) == 7
    assert {a.title.split("#")[0] for a in dm.articles} == {
        "txt/doc0.txt", "txt/doc1.txt", "lines.jsonl", "array.json", "t.parquet"
    }  # fmt: skip
    assert dm.articles[2].text.startswith("Json line 0.") and dm.articles[-1].text.startswith("Parquet row 1.")
    again = DataModule.from_section(tiny_tokenizer(), section)
    assert [a.title for a in again.test] == [a.title for a in dm.test]
    info = dm.split_info()
    assert info["source"] == "files" and [f["documents"] for f in info["files"]] == [1, 1, 3, 2, 2]
    assert all(len(f["sha256"]) == 64 for f in info["files"])
    assert dm.calibration_batches(2, 16, 2, seed=0)[0].input_ids.shape == (2, 16)


@pytest.mark.parametrize(
    ("files", "field", "expect"),
    [
        (["nothing/*.txt"], "body", "data.source.files: 'nothing/*.txt' matches no file"),
        (["notes.md"], "body", "data.source.files: 'notes.md' is a .md; allowed: .txt, .jsonl, .json, .parquet"),
        (["lines.jsonl"], "text", "data.source.files: lines.jsonl line 1: no field 'text' (fields: body, id)"),
        (["bad.jsonl"], "body", "data.source.files: bad.jsonl line 2: not valid JSON"),
        (["t.parquet"], "text", "data.source.files: t.parquet: no column 'text' (columns: body, n)"),
        (["txt/doc0.txt"], "body", "1 non-empty documents in txt/doc0.txt; a run needs at least 2"),
    ],
)
def test_bad_files_are_one_clear_error(tmp_path, monkeypatch, files, field, expect):
    from compresskit.errors import RecipeError

    _corpus(tmp_path)
    (tmp_path / "notes.md").write_text("# notes")
    (tmp_path / "bad.jsonl").write_text('{"body": "fine"}\n{"body": oops}\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as err:
        DataModule.from_section(tiny_tokenizer(), _source(files, text_field=field))
    assert expect in str(err.value)


def test_a_data_source_other_than_wiki_or_files_is_named():
    from pydantic import ValidationError

    from compresskit.recipe import DataSection

    with pytest.raises(ValidationError, match="unknown data source 'wikii'. Did you mean: wiki?"):
        DataSection(source="wikii")
    with pytest.raises(ValidationError, match="file: unknown key 'file'. Did you mean: files?"):
        DataSection(source={"file": ["a.txt"]})
