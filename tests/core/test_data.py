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
        (["txt/doc0.txt"], "body", "txt/doc0.txt holds one document of 649 characters, too short to hold a share"),
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


def test_one_long_document_is_cut_into_windows_and_a_share_held_out(tmp_path, monkeypatch):
    """A book in one .txt: windows of about WINDOW_CHARS characters at paragraph breaks, every character in
    exactly one window, a quarter of them held out, the cut recorded for the report."""
    from compresskit.data import WINDOW_CHARS, windows
    from compresskit.report import _data_source

    said = "says something of its own, sentence after sentence."
    paragraphs = [f"Paragraph {i} {said} " * (3 + i % 7) for i in range(90)]
    book = "\n\n".join(paragraphs)
    (tmp_path / "book.txt").write_text(book)
    monkeypatch.chdir(tmp_path)
    dm = DataModule.from_section(tiny_tokenizer(), _source(["book.txt"]))
    n = len(dm.articles)
    assert n == len(windows(book)) and n >= len(book) // WINDOW_CHARS
    assert len(dm.test) == round(0.25 * n) and len(dm.train) == n - len(dm.test)
    joined = "".join(a.text for a in sorted(dm.articles, key=lambda a: a.pageid))
    assert joined.replace(" ", "").replace("\n", "") == book.replace(" ", "").replace("\n", "")
    assert all(len(a.text) <= WINDOW_CHARS for a in dm.articles)
    assert all(a.text.endswith("sentence.") for a in dm.articles)  # cut at paragraph breaks, not mid-sentence
    info = dm.split_info()
    assert info["files"][0]["windows"] == n
    assert _data_source({**info, "articles": n}).startswith(f"one document cut into {n} windows of about 4,000")
    assert windows("") == [] and windows("x" * 10) == ["x" * 10]  # a space-free text is still cut whole
    assert "".join(windows("y" * 9000, 4000)) == "y" * 9000


def test_a_data_source_other_than_wiki_or_files_is_named():
    from pydantic import ValidationError

    from compresskit.recipe import DataSection

    with pytest.raises(ValidationError, match="unknown data source 'wikii'. Did you mean: wiki?"):
        DataSection(source="wikii")
    with pytest.raises(ValidationError, match="file: unknown key 'file'. Did you mean: files?"):
        DataSection(source={"file": ["a.txt"]})


# -- Hugging Face datasets, chat documents, weighted mixtures ------------------------------------


def _saved_dataset(root, n=8, field="text", splits=False):
    import datasets

    rows = {field: [f"Dataset row {i}. " * 30 for i in range(n)], "n": list(range(n))}
    ds = datasets.Dataset.from_dict(rows)
    if splits:
        ds = datasets.DatasetDict({"train": ds, "validation": ds.select(range(2))})
    ds.save_to_disk(str(root / "ds"))
    return root / "ds"


def test_a_saved_dataset_is_read_split_and_fingerprinted(tmp_path):
    from compresskit.recipe import DataSection

    folder = _saved_dataset(tmp_path, splits=True)
    section = DataSection(source={"hf": str(folder), "split": "train", "max_documents": 6})
    dm = DataModule.from_section(tiny_tokenizer(), section)
    assert len(dm.articles) == 6 and len(dm.test) == 2 and dm.articles[0].text.startswith("Dataset row 0.")
    info = dm.split_info()
    assert info["source"] == "hf" and info["sources"][0]["fingerprint"] and info["sources"][0]["documents"] == 6
    again = DataModule.from_section(tiny_tokenizer(), section)
    assert [a.title for a in again.test] == [a.title for a in dm.test] and again.fingerprint() == dm.fingerprint()
    other = DataModule.from_section(tiny_tokenizer(), DataSection(source={"hf": str(folder), "split": "validation"}))
    assert other.fingerprint() != dm.fingerprint()


def test_dataset_errors_are_one_line(tmp_path):
    from compresskit.data import check_source
    from compresskit.errors import RecipeError
    from compresskit.recipe import DataSection

    folder = _saved_dataset(tmp_path, field="body", splits=True)
    cases = [
        ({"hf": str(folder), "split": "test"}, "data.source.hf: .*: no split 'test' \\(splits: train, validation\\)"),
        (
            {"hf": str(folder)},
            "data.source.hf: .*: no column 'text' \\(columns: body, n\\); set data.source.text_field",
        ),
        ({"hf": "no-such-org/no-such-dataset"}, "data.source.hf: 'no-such-org/no-such-dataset' cannot be read: not "),
    ]
    for source, expect in cases:
        with pytest.raises(RecipeError, match=expect):
            DataModule.from_section(tiny_tokenizer(), DataSection(source=source))
    with pytest.raises(RecipeError, match="data.source.hf: '.*nowhere' is not a folder"):
        check_source(DataSection(source={"hf": str(tmp_path / "nowhere")}))


def test_weighted_sources_mix_the_training_text_and_keep_each_held_out_part(tmp_path, monkeypatch):
    import json

    from compresskit.recipe import DataSection

    folder = _saved_dataset(tmp_path, n=8)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"File doc {i}. " * 30}) + "\n" for i in range(8)))
    monkeypatch.chdir(tmp_path)
    one = DataModule.from_section(tiny_tokenizer(), DataSection(source={"files": ["a.jsonl"]}))
    mix = [{"source": {"files": ["a.jsonl"]}, "weight": 2.0}, {"source": {"hf": str(folder)}, "weight": 0.5}]
    dm = DataModule.from_section(tiny_tokenizer(), DataSection(source=mix))
    file_train = [a for a in dm.train if a.title.startswith("a.jsonl")]
    hf_train = [a for a in dm.train if not a.title.startswith("a.jsonl")]
    assert len(file_train) == 2 * 6 and len(hf_train) == 3  # twice the 6 training docs; half of the dataset's 6
    assert len(dm.test) == 2 + 2  # each source's own held-out part, once
    assert {a.title for a in dm.test if a.title.startswith("a.jsonl")} == {a.title for a in one.test}
    info = dm.split_info()
    assert info["source"] == "mixture" and [s["weight"] for s in info["sources"]] == [2.0, 0.5]
    assert [(s["train"], s["test"]) for s in info["sources"]] == [(12, 2), (3, 2)]
    again = DataModule.from_section(tiny_tokenizer(), DataSection(source=mix))
    assert [a.title for a in again.train] == [a.title for a in dm.train]


def test_chat_documents_use_the_tokenizers_chat_template(tmp_path, monkeypatch):
    import json

    from compresskit.errors import RecipeError
    from compresskit.recipe import DataSection

    chats = [
        [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
        for i in range(4)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    monkeypatch.chdir(tmp_path)
    section = DataSection(source={"files": ["chat.jsonl"], "text_field": "messages"})
    tok = tiny_tokenizer()
    with pytest.raises(RecipeError, match="list of chat messages, and this model's tokenizer has no chat template"):
        DataModule.from_section(tok, section)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    dm = DataModule.from_section(tok, section)
    assert [a.text for a in dm.articles] == [f"<user>Question {i}?\n<assistant>Answer {i}.\n" for i in range(4)]
    assert dm.train_token_ids().numel() > 0


def test_generated_text_is_written_once_by_the_dense_model_and_cached(tiny_model_dir, monkeypatch):
    """The ``generated`` source: the model continues the openings in turn on the runtime,
    reproducibly (seeded batches), the documents are cached by the model and the settings, and a
    second read writes nothing; other settings write other text."""
    from compresskit.data import load_documents
    from compresskit.generation import write_generated
    from compresskit.modeling import load_model
    from compresskit.recipe import DataSection
    from compresskit.runtime import Runtime

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    spec = {"documents": 5, "max_new_tokens": 8, "batch_size": 2, "prompts": ["Alpha says", "Beta writes"]}
    section = DataSection(source=[{"source": {"generated": spec}, "weight": 1}, {"source": "wiki", "weight": 0.1}])
    docs = load_documents(section)
    assert docs[0].pending is not None and docs[0].articles == []
    calls = []
    real = Runtime.generate
    monkeypatch.setattr(Runtime, "generate", lambda self, *a, **k: calls.append(k["seed"]) or real(self, *a, **k))
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("a Llama model writes on the runtime"))
    write_generated(docs, model, tok, model_id=str(tiny_model_dir))
    texts = [a.text for a in docs[0].articles]
    assert calls == [0, 2, 4] and len(texts) == 5  # batches of 2, 2 and 1, each seeded by where it starts
    assert [t.split()[0] for t in texts] == ["Alpha", "Beta", "Alpha", "Beta", "Alpha"]
    assert all(len(t) > len("Alpha says") for t in texts)
    assert docs[0].info["engine"] == "runtime"
    dm = DataModule.from_section(tok, section, docs)
    info = dm.split_info()
    assert info["source"] == "mixture" and info["sources"][0]["kind"] == "generated"
    # the dense model's own text trains but never judges: none of it is held out, the wiki's share is
    assert info["sources"][0]["test"] == 0 and info["sources"][0]["train"] == 5 and info["sources"][1]["test"] > 0
    assert not any(a.title.startswith("generated:") for a in dm.test)
    again = load_documents(section)
    write_generated(again, model, tok, model_id=str(tiny_model_dir))
    assert len(calls) == 3 and [a.text for a in again[0].articles] == texts  # from the cache
    other = load_documents(DataSection(source={"generated": {**spec, "seed": 1}}))
    write_generated(other, model, tok, model_id=str(tiny_model_dir))
    assert len(calls) == 6 and [a.text for a in other[0].articles] != texts
    with pytest.raises(RuntimeError, match="not written yet"):
        DataModule.from_section(tok, section, load_documents(section))


def test_generated_text_of_an_architecture_the_runtime_lacks_comes_from_transformers(tiny_model_dir, monkeypatch):
    """A model type the runtime does not run writes through transformers' ``generate``, sampled and
    seeded the same way, under its own cache key."""
    from compresskit.data import load_documents
    from compresskit.generation import generation_engine, write_generated
    from compresskit.modeling import load_model
    from compresskit.recipe import DataSection

    model, tok = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    monkeypatch.setattr(model.config, "model_type", "gpt_neox")
    assert generation_engine(model) == "transformers"
    spec = {"documents": 3, "max_new_tokens": 8, "batch_size": 2, "prompts": ["Alpha says", "Beta writes"]}
    calls = []
    real = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    docs = load_documents(DataSection(source={"generated": spec}))
    write_generated(docs, model, tok, model_id=str(tiny_model_dir))
    texts = [a.text for a in docs[0].articles]
    assert len(calls) == 2 and [t.split()[0] for t in texts] == ["Alpha", "Beta", "Alpha"]
    assert docs[0].info["engine"] == "transformers" and all(len(t) > len("Alpha says") for t in texts)
    again = load_documents(DataSection(source={"generated": spec}))
    write_generated(again, model, tok, model_id=str(tiny_model_dir))
    assert len(calls) == 2 and [a.text for a in again[0].articles] == texts
