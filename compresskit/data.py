"""The embedded text: an English Wikipedia excerpt shipped inside the ``gensim`` wheel.

The articles are extracted once (markup removed with gensim's own wiki filter, redirects and
stubs dropped) and cached as JSON. They are split *by article*, deterministically from
``data.split_seed``, into a calibration/training part and a held-out part that calibration
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

import torch

from compresskit.errors import CompressKitError
from compresskit.interfaces import Batch

WIKI_GLOB = "test/test_data/enwiki-latest-pages-articles1*.bz2"
MIN_ARTICLE_CHARS = 2000
EXTRACT_VERSION = 2


@dataclass(frozen=True)
class Article:
    title: str
    pageid: int
    text: str


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
    from compresskit.modeling import cache_dir

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
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps([asdict(a) for a in articles]))
    os.replace(tmp, cached)
    return articles


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
        test_fraction, split_seed: the article split (see :func:`split_articles`).
        articles: override the embedded articles (tests).
    """

    def __init__(
        self, tokenizer, *, test_fraction: float = 0.25, split_seed: int = 0, articles: list[Article] | None = None
    ):
        self.tokenizer = tokenizer
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.articles = articles if articles is not None else load_wiki_articles()
        self.train, self.test = split_articles(self.articles, test_fraction, split_seed)
        self._train_ids: torch.Tensor | None = None

    def split_info(self) -> dict:
        """What results record about the split."""
        return {
            "source": "gensim enwiki excerpt",
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
