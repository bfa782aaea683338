"""Calibration/training text and held-out text for one run, from one source or a weighted list of them:

* ``wiki`` (the default): an English Wikipedia excerpt shipped inside the ``gensim`` wheel. The
  articles are extracted once (markup removed with gensim's own wiki filter, redirects and stubs
  dropped) and cached as JSON.
* local files (``data.source: {files: [corpus/*.txt, more.jsonl]}``): ``.txt`` files (one document
  each), ``.jsonl`` (one document a line), ``.json`` (an array of documents) and ``.parquet`` (one
  document a row), the text in ``text_field`` (default ``text``); paths and globs are relative to
  the working directory;
* a Hugging Face dataset (``data.source: {hf: NAME, config: ..., split: train}``, read from the
  local ``datasets`` cache unless ``model.allow_download``; or a folder written by
  ``Dataset.save_to_disk``);
* a list ``[{source: ..., weight: w}, ...]``: each source is split on its own, its training documents
  enter the training text ``w`` times (a seeded share of them for the fraction), its held-out ones once.

A document given as a list of chat messages (``[{role, content}, ...]`` in the text field) is
formatted with the tokenizer's chat template. Documents are split *by document*, deterministically
from ``data.split_seed``, into a calibration/training part and a held-out part that calibration
never sees; the held-out part feeds perplexity and the next-sentence task.
"""

from __future__ import annotations

import bz2
import glob
import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from compresskit.errors import CompressKitError, RecipeError
from compresskit.files import write_text
from compresskit.hub import hub_offline
from compresskit.interfaces import Batch
from compresskit.modeling import cache_dir

# Imported inside the functions that use them: datasets, gensim and pyarrow (each needed by one kind of source only);
# so importing this module, and running the commands that do not need them (`--help` and `validate` first), stays
# fast.

if TYPE_CHECKING:
    from compresskit.recipe import DataSection, FilesSource, HubSource

WIKI_GLOB = "test/test_data/enwiki-latest-pages-articles1*.bz2"
MIN_ARTICLE_CHARS = 2000
EXTRACT_VERSION = 2


@dataclass(frozen=True)
class Article:
    title: str
    pageid: int
    text: str
    chat: bool = False  # text holds JSON chat messages, formatted with the tokenizer's chat template


@dataclass
class SourceDocuments:
    """What one source gave: its documents, its weight in the training text and what identifies it."""

    kind: str  # "wiki", "files", "hf" or "generated"
    articles: list[Article]
    weight: float = 1.0
    info: dict[str, Any] | None = None  # files: [{path, sha256, documents}]; hf: name, split, fingerprint
    pending: Any = None  # a generated source's Generation until generation.write_generated has run


def wiki_dump_path() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or spec.origin is None:
        raise CompressKitError("data.source: 'wiki' needs the gensim package (pip install gensim)")
    hits = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), WIKI_GLOB)))
    if not hits:
        raise CompressKitError(f"data.source: gensim is installed but ships no {WIKI_GLOB}")
    return Path(hits[0])


_HEADING = re.compile(r"^\s*=+\s*(.*?)\s*=+\s*$")
_BAD_LINE = re.compile(r"^\s*(\||!|\{\||\|\}|[*#:;]|thumb\b|left\||right\||Category:|File:|Image:)")


def clean_wiki_text(text: str) -> str:
    """Plain prose from gensim-filtered wiki text: paragraphs separated by blank lines."""
    text = text.replace("'''", "").replace("''", "")
    paragraphs, current = [], []
    for line in text.splitlines():
        line = line.strip()
        if not line or _HEADING.match(line) or _BAD_LINE.match(line):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        line = re.sub(r"\s+", " ", line)
        current.append(line)
    if current:
        paragraphs.append(" ".join(current))
    # Keep prose: paragraphs with a sentence end and enough words (drops lists of links, tables).
    keep = [p for p in paragraphs if len(p.split()) >= 8 and re.search(r"[.!?]", p)]
    return "\n\n".join(keep)


def load_wiki_articles() -> list[Article]:
    """All usable articles of the embedded dump, in dump order (cached after the first call)."""
    dump = wiki_dump_path()
    key = hashlib.sha256(f"{dump.name}:{dump.stat().st_size}:{EXTRACT_VERSION}".encode()).hexdigest()[:16]
    cached = cache_dir() / "data" / f"wiki-{key}.json"
    if cached.is_file():
        return [Article(**a) for a in json.loads(cached.read_text())]
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    articles = []
    with bz2.BZ2File(dump) as f:
        for title, raw, pageid in extract_pages(f):
            if raw.lstrip().lower().startswith("#redirect"):
                continue
            text = clean_wiki_text(filter_wiki(raw))
            if len(text) >= MIN_ARTICLE_CHARS:
                articles.append(Article(title=title, pageid=int(pageid), text=text))
    write_text(cached, json.dumps([asdict(a) for a in articles]))
    return articles


# ---------------------------------------------------------------------------------------------
# local files

FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
_FIELD = "data.source.files"


def resolve_files(source: FilesSource, field: str = _FIELD) -> list[Path]:
    """The files of a ``files`` source, in a stable order: every pattern must match a supported file
    (errors name ``field``: the recipe key, or the flag that gave the files)."""
    found: list[Path] = []
    for pattern in source.files:
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [m for m in matches if m.is_file()]
        if not matches:
            raise RecipeError(f"{field}: {pattern!r} matches no file (relative paths start at {os.getcwd()})")
        for m in matches:
            if m.suffix.lower() not in FILE_SUFFIXES:
                raise RecipeError(
                    f"{field}: {str(m)!r} is a {m.suffix or 'file without suffix'}; allowed: {', '.join(FILE_SUFFIXES)}"
                )
            if m not in found:
                found.append(m)
    return found


def sources(section: DataSection) -> list[tuple[Any, float]]:
    """``(source, weight)`` of every source of a ``data`` section (one, of weight 1, unless it lists several)."""
    if isinstance(section.source, list):
        return [(m.source, m.weight) for m in section.source]
    return [(section.source, 1.0)]


def check_source(section: DataSection, files_field: str = _FIELD) -> None:
    """What can be checked of a ``data`` section without reading the text: the files and the
    dataset folders exist (errors about the files name ``files_field``)."""
    for source, _ in sources(section):
        if getattr(source, "files", None) is not None:
            resolve_files(source, files_field)
        elif getattr(source, "hf", None) is not None and _looks_like_path(source.hf):
            if not Path(source.hf).expanduser().is_dir():
                raise RecipeError(f"data.source.hf: {source.hf!r} is not a folder (a Dataset.save_to_disk output)")


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.sep in name and Path(name).expanduser().exists()


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _text_of(record: Any, field: str, where: str, source_field: str = _FIELD) -> str | list:
    """The text of one record, or its chat messages (a list of ``{role, content}``)."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise RecipeError(
            f"{source_field}: {where}: expected an object with a {field!r} field, got {type(record).__name__}"
        )
    if field not in record:
        raise RecipeError(
            f"{source_field}: {where}: no field {field!r} (fields: {', '.join(map(str, record)) or 'none'}); "
            "set data.source.text_field"
        )
    value = record[field]
    if not isinstance(value, str) and not _is_chat(value):
        raise RecipeError(
            f"{source_field}: {where}: field {field!r} holds a {type(value).__name__}, not text or chat messages"
        )
    return value


def _article(title: str, pageid: int, doc: str | list) -> Article:
    if isinstance(doc, list):
        return Article(title=title, pageid=pageid, text=json.dumps(doc, ensure_ascii=False), chat=True)
    return Article(title=title, pageid=pageid, text=doc.strip())


def _non_empty(doc: str | list) -> bool:
    return bool(doc) if isinstance(doc, list) else bool(doc.strip())


def read_documents(path: Path, text_field: str) -> list[str | list]:
    """The documents of one file (see the module docstring for the formats)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt":
            return [path.read_text()]
        if suffix == ".jsonl":
            docs = []
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise RecipeError(f"{_FIELD}: {path} line {i}: not valid JSON ({exc.msg})") from None
                    docs.append(_text_of(record, text_field, f"{path} line {i}"))
            return docs
        if suffix == ".json":
            try:
                records = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise RecipeError(f"{_FIELD}: {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
            if not isinstance(records, list):
                raise RecipeError(f"{_FIELD}: {path}: expected a JSON array of documents, got {type(records).__name__}")
            return [_text_of(r, text_field, f"{path} item {i}") for i, r in enumerate(records)]
        return _read_parquet(path, text_field)
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{_FIELD}: {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise RecipeError(f"{_FIELD}: {path}: cannot be read ({exc})") from None


def _read_parquet(path: Path, text_field: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        if text_field not in schema.names:
            raise RecipeError(
                f"{_FIELD}: {path}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
                "set data.source.text_field"
            )
        column = pq.read_table(path, columns=[text_field]).column(0).to_pylist()
    except pa.ArrowException as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RecipeError(f"{_FIELD}: {path}: not a readable parquet file ({reason})") from None
    return [_text_of(v, text_field, f"{path} row {i}") for i, v in enumerate(column) if v is not None]


WINDOW_CHARS = 4000  # a lone long document is cut into windows of about this many characters (~1k tokens)


def windows(text: str, size: int = WINDOW_CHARS) -> list[str]:
    """``text`` cut into consecutive windows of about ``size`` characters, each ending at a paragraph break,
    else a line break, else a sentence end, else a space, where one falls in its second half (none is cut
    mid-word where a space allows); every character of ``text`` is in exactly one window, stripped."""
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            half = start + size // 2
            for mark in ("\n\n", "\n", ". ", " "):
                cut = text.rfind(mark, half, end)
                if cut != -1:
                    end = cut + len(mark)
                    break
        piece = text[start:end].strip()
        if piece:
            out.append(piece)
        start = end
    return out


def load_file_documents(source: FilesSource) -> tuple[list[Article], list[dict[str, Any]]]:
    """(documents as articles, one ``{path, sha256, documents}`` record per file). A document's
    title is ``<path>#<index>``, which fixes its place in the split. Where the files hold one document
    (a book, a long log), it is cut into :func:`windows` (``<path>#0.<w>``; the record says ``windows``), so
    that a share of it can be held out; a text too short for two windows is refused in one line."""
    articles: list[Article] = []
    files = []
    for path in resolve_files(source):
        docs = [d for d in read_documents(path, source.text_field) if _non_empty(d)]
        files.append(
            {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "documents": len(docs)}
        )
        articles += [_article(f"{path}#{i}", len(articles) + i, d) for i, d in enumerate(docs)]
    if len(articles) == 1 and not articles[0].chat:
        lone = articles[0]
        pieces = windows(lone.text)
        if len(pieces) >= 2:
            articles = [_article(f"{lone.title}.{w}", w, piece) for w, piece in enumerate(pieces)]
            next(f for f in files if f["documents"]).update(windows=len(pieces), window_chars=WINDOW_CHARS)
        else:
            raise RecipeError(
                f"{_FIELD}: {', '.join(source.files)} holds one document of {len(lone.text):,} characters, too "
                f"short to hold a share out: a lone document is cut into windows of about {WINDOW_CHARS:,} "
                f"characters and a run needs at least 2 (one to train on, one held out); give more text"
            )
    at_least_two(articles, _FIELD, ", ".join(source.files))
    return articles, files


def at_least_two(articles: list[Article], field: str, what: str) -> None:
    if len(articles) < 2:
        raise RecipeError(
            f"{field}: {len(articles)} non-empty documents in {what}; "
            "a run needs at least 2 (one to train on, one held out): split the text into several .txt files, "
            "or write it as .jsonl, a document a line"
        )


def load_hub_documents(source: HubSource, *, allow_download: bool = False) -> tuple[list[Article], dict[str, Any]]:
    """(documents, ``{hf, config, split, fingerprint, documents}``) of a Hugging Face dataset: a
    ``save_to_disk`` folder, or a dataset name read from the local cache (offline unless
    ``allow_download``). A document's title is ``<name>:<split>#<row>``."""
    import datasets

    field = "data.source.hf"
    folder = Path(source.hf).expanduser()
    try:
        with hub_offline(not allow_download):
            if folder.is_dir():
                ds = datasets.load_from_disk(str(folder))
                if isinstance(ds, datasets.DatasetDict):
                    if source.split not in ds:
                        raise RecipeError(f"{field}: {source.hf}: no split {source.split!r} (splits: {', '.join(ds)})")
                    ds = ds[source.split]
            else:
                ds = datasets.load_dataset(source.hf, source.config, split=source.split)
    except RecipeError:
        raise
    except Exception as exc:  # datasets raises many kinds here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        how = "" if allow_download else "not available offline (or set model.allow_download: true): "
        raise RecipeError(f"{field}: {source.hf!r} cannot be read: {how}{first}") from None
    if source.text_field not in ds.column_names:
        raise RecipeError(
            f"{field}: {source.hf}: no column {source.text_field!r} (columns: {', '.join(ds.column_names)}); "
            "set data.source.text_field"
        )
    if source.max_documents is not None:
        ds = ds.select(range(min(source.max_documents, len(ds))))
    docs = [_text_of(r, source.text_field, f"row {i}", field) for i, r in enumerate(ds)]
    articles = [_article(f"{source.hf}:{source.split}#{i}", i, d) for i, d in enumerate(docs) if _non_empty(d)]
    at_least_two(articles, field, source.hf)
    info = {
        "hf": source.hf,
        "config": source.config,
        "split": source.split,
        "fingerprint": getattr(ds, "_fingerprint", None),
        "documents": len(articles),
    }
    return articles, info


def load_documents(section: DataSection, *, allow_download: bool = False) -> list[SourceDocuments]:
    """Every source of a ``data`` section, read: what :class:`DataModule` splits and mixes."""
    out = []
    for source, weight in sources(section):
        if source == "wiki":
            out.append(SourceDocuments("wiki", load_wiki_articles(), weight, {"extract_version": EXTRACT_VERSION}))
        elif getattr(source, "files", None) is not None:
            articles, files = load_file_documents(source)
            out.append(SourceDocuments("files", articles, weight, {"files": files}))
        elif getattr(source, "generated", None) is not None:  # written by the model: generation.write_generated
            out.append(SourceDocuments("generated", [], weight, None, pending=source.generated))
        else:
            articles, info = load_hub_documents(source, allow_download=allow_download)
            out.append(SourceDocuments("hf", articles, weight, info))
    return out


def weighted_documents(train: list[Article], weight: float, seed: int) -> list[Article]:
    """A source's training documents ``weight`` times: whole copies, then for the fraction a seeded
    share of them (ordered by sha256(seed:weight:title)), in document order."""
    whole = int(weight)
    ranked = sorted(train, key=lambda a: hashlib.sha256(f"{seed}:weight:{a.title}".encode()).hexdigest())
    extra = sorted(ranked[: round((weight - whole) * len(train))], key=lambda a: a.pageid)
    return train * whole + extra


def held_out_documents(section: DataSection, documents: list[SourceDocuments]) -> list[Article] | None:
    """The documents ``DataModule`` holds out for evaluation from what :func:`load_documents` read, known
    before the model loads; None where a source's documents are chat messages (their text is the tokenizer's
    to make)."""
    held: list[Article] = []
    for src in documents:
        if src.kind == "generated":
            continue
        if src.pending is not None or any(a.chat for a in src.articles):
            return None
        held += split_articles(src.articles, section.test_fraction, section.split_seed)[1]
    return held


def _format_chat(article: Article, tokenizer) -> Article:
    """A chat document as the text its tokenizer's chat template makes of it."""
    if not article.chat:
        return article
    if getattr(tokenizer, "chat_template", None) is None:
        raise RecipeError(
            f"data.source: {article.title} is a list of chat messages, and this model's tokenizer has no chat "
            "template to format them; give the documents as plain text"
        )
    text = tokenizer.apply_chat_template(json.loads(article.text), tokenize=False)
    return Article(title=article.title, pageid=article.pageid, text=text)


def source_labels(kinds: list[str]) -> list[str]:
    """A short name for each source of a run, from its kind ("wiki", "files", "hf", "generated"), numbered
    where a kind repeats ("files1", "files2")."""
    return [k if kinds.count(k) == 1 else f"{k}{kinds[: i + 1].count(k)}" for i, k in enumerate(kinds)]


def split_articles(articles: list[Article], test_fraction: float, seed: int) -> tuple[list[Article], list[Article]]:
    """Deterministic split by article: order by sha256(seed:title), the first share is held out."""
    ranked = sorted(articles, key=lambda a: hashlib.sha256(f"{seed}:{a.title}".encode()).hexdigest())
    n_test = max(1, round(test_fraction * len(ranked)))
    test = sorted(ranked[:n_test], key=lambda a: a.pageid)
    train = sorted(ranked[n_test:], key=lambda a: a.pageid)
    return train, test


class DataModule:
    """Calibration/training batches and held-out text for one run.

    Args:
        tokenizer: an HF tokenizer.
        test_fraction, split_seed: the split of each source (see :func:`split_articles`).
        articles: one source's documents instead of the embedded wiki text (tests); ``files``: where
            they came from.
        sources: what :func:`load_documents` read (several sources, weighted).
    """

    def __init__(
        self,
        tokenizer,
        *,
        test_fraction: float = 0.25,
        split_seed: int = 0,
        articles: list[Article] | None = None,
        files: list[dict[str, Any]] | None = None,
        sources: list[SourceDocuments] | None = None,
    ):
        self.tokenizer = tokenizer
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        if sources is None:
            if articles is None:
                articles = load_wiki_articles()
            kind, info = ("files", {"files": files}) if files is not None else ("wiki", {})
            sources = [SourceDocuments(kind, articles, 1.0, info)]
        self.sources = sources
        self.articles, self.train, self.test, self._shares = [], [], [], []
        self.labels = source_labels([s.kind for s in sources])  # each source's short name
        self.test_sources: list[str] = []  # the label of each held-out document's source
        for src, label in zip(sources, self.labels, strict=True):
            if src.pending is not None:
                raise RuntimeError(
                    "a generated source is not written yet: call compresskit.generation.write_generated first"
                )
            arts = [_format_chat(a, tokenizer) for a in src.articles]
            if src.kind == "generated":  # the dense model wrote it: training text only, never a judge of the pruned one
                train, test = arts, []
            else:
                train, test = split_articles(arts, test_fraction, split_seed)
            weighted = weighted_documents(train, src.weight, split_seed)
            self.articles += arts
            self.train += weighted
            self.test += test
            self.test_sources += [label] * len(test)
            self._shares.append((len(arts), len(weighted), len(test)))
        found = [f for src in sources for f in (src.info or {}).get("files", [])]
        self.files = found or None  # the local files the documents came from (None: none)
        self._train_ids: torch.Tensor | None = None

    @classmethod
    def from_section(
        cls, tokenizer, section: DataSection, documents: list[SourceDocuments] | None = None
    ) -> DataModule:
        """The data a recipe's ``data`` section names; ``documents``: what :func:`load_documents`
        returned for it, when it was read already."""
        return cls(
            tokenizer,
            test_fraction=section.test_fraction,
            split_seed=section.split_seed,
            sources=documents if documents is not None else load_documents(section),
        )

    def fingerprint(self) -> str:
        """What identifies the text of the run: each source's kind, weight and contents (file
        hashes, a dataset's fingerprint, the wiki extract's version)."""
        ids = [(s.kind, s.weight, s.info or {}) for s in self.sources]
        return hashlib.sha256(json.dumps(ids, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def split_info(self) -> dict:
        """What results record about the sources and the split."""
        kinds = {"wiki": "gensim enwiki excerpt", "files": "files", "hf": "hf", "generated": "generated"}
        return {
            "source": kinds[self.sources[0].kind] if len(self.sources) == 1 else "mixture",
            **({"files": self.files} if self.files is not None else {}),
            "sources": [
                {"kind": s.kind, "label": label, "weight": s.weight, "documents": n, "train": tr, "test": te}
                | (s.info or {})
                for s, label, (n, tr, te) in zip(self.sources, self.labels, self._shares, strict=True)
            ],
            "fingerprint": self.fingerprint(),
            "articles": len(self.articles),
            "train_articles": len(self.train),
            "test_articles": len(self.test),
            "test_fraction": self.test_fraction,
            "split_seed": self.split_seed,
            "test_titles": [a.title for a in self.test],
            "train_tokens": int(self.train_token_ids().numel()),
        }

    def train_token_ids(self) -> torch.Tensor:
        """All training articles tokenised and joined with the EOS token: ``[N]``."""
        if self._train_ids is None:
            eos = self.tokenizer.eos_token_id
            ids: list[int] = []
            for art in self.train:
                ids.extend(self.tokenizer(art.text, add_special_tokens=False)["input_ids"])
                if eos is not None:
                    ids.append(eos)
            self._train_ids = torch.tensor(ids, dtype=torch.long)
        return self._train_ids

    def _chunks(self, seq_len: int) -> torch.Tensor:
        ids = self.train_token_ids()
        n = ids.numel() // seq_len
        if n == 0:
            raise CompressKitError(
                f"data.calibration.seq_len: {seq_len} is longer than the training text ({ids.numel()} tokens)"
            )
        return ids[: n * seq_len].view(n, seq_len)  # [n, seq_len]

    def calibration_batches(self, n_samples: int, seq_len: int, batch_size: int, seed: int = 0) -> list[Batch]:
        """``n_samples`` packed sequences of ``seq_len`` tokens (a seeded choice), in batches."""
        chunks = self._chunks(seq_len)
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(chunks.shape[0], generator=gen)
        if n_samples > order.numel():  # fewer chunks than asked: cycle through a fresh permutation
            reps = -(-n_samples // order.numel())
            order = torch.cat([torch.randperm(chunks.shape[0], generator=gen) for _ in range(reps)])
        picked = chunks[order[:n_samples]]
        return [
            Batch(picked[i : i + batch_size], torch.ones_like(picked[i : i + batch_size]))
            for i in range(0, n_samples, batch_size)
        ]

    def training_batches(self, seq_len: int, batch_size: int, seed: int = 0, start_step: int = 0) -> Iterator[Batch]:
        """An endless stream of packed batches; epoch e uses permutation seed + e. ``start_step``
        skips that many batches so a resumed run sees the same data as an uninterrupted one."""
        chunks = self._chunks(seq_len)
        per_epoch = max(1, chunks.shape[0] // batch_size)
        step, epoch = start_step, start_step // per_epoch
        while True:
            order = torch.randperm(chunks.shape[0], generator=torch.Generator().manual_seed(seed + epoch))
            for b in range(step - epoch * per_epoch, per_epoch):
                rows = chunks[order[b * batch_size : (b + 1) * batch_size]]
                yield Batch(rows, torch.ones_like(rows))
                step += 1
            epoch += 1
