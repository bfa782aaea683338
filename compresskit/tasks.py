"""The evaluation tasks: one registry that the recipe (allowed names), the evaluator (lm-eval task
configs) and the reports (table columns) all read.

Each task is an in-memory lm-eval task built here from data the package ships or the run's own
held-out text, so that evaluation needs no network:

* ``perplexity``: rolling log-likelihood over the held-out Wikipedia articles (lm-eval's
  ``loglikelihood_rolling``, windows of ``evaluation.max_length`` tokens); token-, word- and
  byte-level perplexity and bits per byte. Lower is better.
* ``piqa``: PIQA validation (1,838 items, shipped in the package), scored exactly as lm-eval's
  ``piqa`` task: "Question: {goal}\\nAnswer:" against the two solutions; acc and acc_norm.
* ``next_sentence``: a 4-way choice of the sentence that follows a two-sentence context, built
  deterministically from the held-out articles (one distractor from later in the same article,
  two from other held-out articles); acc and acc_norm.
* ``code_perplexity``, ``legal_perplexity``: the same rolling perplexity over text of a domain the
  default training mix lacks, shipped in the package (``resources/domains``: Python standard-library
  modules; software licences), to measure what pruning costs outside the recovery data.

A new task is one :class:`TaskSpec` added to :data:`REGISTRY`. Any other name in
``evaluation.tasks`` is an lm-eval task or group, resolved by lm-eval's task manager (its own
index and the YAML files in ``evaluation.task_paths``); its data must be available offline
(``check_lm_eval_tasks``, before any model is loaded) unless ``model.allow_download`` is set.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from compresskit.errors import CompressKitError, RecipeError, did_you_mean
from compresskit.hub import hub_offline

# Imported inside the functions that use them: datasets and lm-eval (the CLI reads this registry at its start); so
# importing this module, and running the commands that do not need them (`--help` and `validate` first), stays fast.

# The tasks sit below the recipe, the data and the evaluator, which all read this registry; so they
# import none of them. ``data`` below is a run's ``compresskit.data.DataModule``, ``section`` its
# ``compresskit.recipe.EvaluationSection`` and an article anything with ``title`` and ``text``
# (``compresskit.data.Article``).
Builder = Callable[[Any, Any, Any], dict[str, Any]]  # (data, tokenizer, section) -> lm-eval task config

# metric -> True when higher is better (recovery and table arrows)
HIGHER_IS_BETTER = {
    "acc": True,
    "acc_norm": True,
    "token_perplexity": False,
    "word_perplexity": False,
    "byte_perplexity": False,
    "bits_per_byte": False,
}


@dataclass(frozen=True)
class Column:
    """A metric as tables show it."""

    title: str
    metric: str
    fmt: str


@dataclass(frozen=True)
class TaskSpec:
    """One evaluation task.

    Args:
        name: what recipes write in ``evaluation.tasks``.
        description: one line for help texts.
        columns: the metrics that result tables show, in order.
        zero_shot: its ``acc`` counts in the zero-shot average.
        limited: ``evaluation.limit`` applies (a fixed prefix of its items).
        build: ``(data, tokenizer, section) -> lm-eval task config`` (a dict).
    """

    name: str
    description: str
    columns: tuple[Column, ...]
    zero_shot: bool
    limited: bool
    build: Builder


def piqa_docs() -> list[dict[str, Any]]:
    """PIQA validation with labels, in file order."""
    root = resources.files("compresskit") / "resources" / "piqa"
    rows = [json.loads(line) for line in (root / "valid.jsonl").read_text().splitlines() if line.strip()]
    labels = [int(x) for x in (root / "valid-labels.lst").read_text().split()]
    if len(rows) != len(labels):
        raise RuntimeError(f"PIQA files disagree: {len(rows)} items, {len(labels)} labels")
    return [
        {"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": lab}
        for r, lab in zip(rows, labels, strict=True)
    ]


_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def sentences(paragraph: str) -> list[str]:
    return [s.strip() for s in _SENT_SPLIT.split(paragraph) if s.strip()]


def _usable(s: str) -> bool:
    return 6 <= len(s.split()) <= 60


def next_sentence_docs(articles: list, n_items: int, seed: int = 0) -> list[dict[str, Any]]:
    """Deterministic 4-way next-sentence items from held-out articles.

    Each item: two consecutive sentences of one paragraph as context, the sentence that follows
    as the answer, one distractor from at least five sentences later in the same article and
    two from other articles. The answer's position is drawn from the seeded generator.
    """
    rng = random.Random(seed)
    per_article: list[list[list[str]]] = []  # article -> paragraphs -> sentences
    for art in articles:
        paras = [[s for s in sentences(p)] for p in art.text.split("\n\n")]
        per_article.append([p for p in paras if len(p) >= 3])
    flat = [(a, pi, si) for a, paras in enumerate(per_article) for pi, p in enumerate(paras) for si in range(len(p))]
    candidates = [
        (a, pi, si)
        for a, pi, si in flat
        if si + 2 < len(per_article[a][pi]) and all(_usable(x) for x in per_article[a][pi][si : si + 3])
    ]
    rng.shuffle(candidates)
    docs = []
    for a, pi, si in candidates:
        if len(docs) >= n_items:
            break
        para = per_article[a][pi]
        answer = para[si + 2]
        later = [
            s
            for pj, p in enumerate(per_article[a])
            for sj, s in enumerate(p)
            if (pj > pi or (pj == pi and sj >= si + 7)) and _usable(s) and s != answer
        ]
        others = [x for x in range(len(per_article)) if x != a and per_article[x]]
        if not later or len(others) < 2:
            continue
        distractors = [rng.choice(later)]
        for b in rng.sample(others, 2):
            pool = [s for p in per_article[b] for s in p if _usable(s)]
            distractors.append(rng.choice(pool))
        label = rng.randrange(4)
        choices = distractors[:label] + [answer] + distractors[label:]
        docs.append(
            {"context": " ".join(para[si : si + 2]), "choices": choices, "label": label, "title": articles[a].title}
        )
    return docs


@dataclass(frozen=True)
class _Document:
    title: str
    text: str


def domain_docs(name: str) -> list[dict[str, str]]:
    """The shipped documents of one domain (``resources/domains/<name>.jsonl``): title and text."""
    path = resources.files("compresskit") / "resources" / "domains" / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def perplexity_docs(articles: list, tokenizer, sources: list[str] | None = None) -> list[dict[str, Any]]:
    """Rolling-perplexity documents; ``sources``: each article's source label, which then also gets a
    token perplexity of its own (``token_perplexity:<label>``)."""
    return [
        {
            "page": a.text,
            "title": a.title,
            "n_tokens": len(tokenizer(a.text, add_special_tokens=False)["input_ids"]),
            "source": sources[i] if sources else "",
        }
        for i, a in enumerate(articles)
    ]


def _perplexity_results(doc: dict, results: list) -> dict:
    (loglikelihood,) = results
    n_words = len(re.split(r"\s+", doc["page"]))
    n_bytes = len(doc["page"].encode("utf-8"))
    per_source = {f"token_perplexity:{doc['source']}": (loglikelihood, doc["n_tokens"])} if doc["source"] else {}
    return {
        "token_perplexity": (loglikelihood, doc["n_tokens"]),
        "word_perplexity": (loglikelihood, n_words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
        **per_source,
    }


def metric_kind(metric: str) -> str:
    """A metric's kind without its source: ``token_perplexity:wiki`` -> ``token_perplexity``."""
    return metric.split(":", 1)[0]


def _dataset(docs: list[dict[str, Any]]):
    def build(**_ignored):
        import datasets

        return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})

    return build


_MC_METRICS = [
    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
    {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
]


def _perplexity_task(data, tokenizer, section) -> dict[str, Any]:
    several = len(set(data.test_sources)) > 1  # held-out text of several sources: each its own perplexity too
    docs = perplexity_docs(data.test, tokenizer, data.test_sources if several else None)
    if section.perplexity_docs is not None:
        docs = docs[: section.perplexity_docs]
    return _rolling("ck_heldout_perplexity", docs, sorted({d["source"] for d in docs} - {""}))


def _domain_task(name: str) -> Builder:
    def build(data, tokenizer, section) -> dict[str, Any]:
        articles = [_Document(d["title"], d["text"]) for d in domain_docs(name)]
        return _rolling(f"ck_{name}_perplexity", perplexity_docs(articles, tokenizer))

    return build


def _rolling(task: str, docs: list[dict[str, Any]], sources: list[str] = ()) -> dict[str, Any]:
    """lm-eval's rolling log-likelihood over ``docs`` (perplexity_docs), with compresskit's metrics
    (and a token perplexity for each of ``sources``)."""
    return {
        "task": task,
        "custom_dataset": _dataset(docs),
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{page}}",
        "process_results": _perplexity_results,
        "metric_list": [
            {"metric": m, "aggregation": "weighted_perplexity", "higher_is_better": False}
            for m in (
                "token_perplexity",
                "word_perplexity",
                "byte_perplexity",
                *(f"token_perplexity:{s}" for s in sources),
            )
        ]
        + [{"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False}],
        "metadata": {"version": 1.0},
    }


def _multiple_choice(task: str, docs: list[dict[str, Any]], text: str, choices: str) -> dict[str, Any]:
    return {
        "task": task,
        "custom_dataset": _dataset(docs),
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": text,
        "doc_to_target": "label",
        "doc_to_choice": choices,
        "metric_list": _MC_METRICS,
        "metadata": {"version": 1.0},
    }


def _piqa_task(data, tokenizer, section) -> dict[str, Any]:
    return _multiple_choice("ck_piqa", piqa_docs(), "Question: {{goal}}\nAnswer:", "{{[sol1, sol2]}}")


NEXT_SENTENCE_NEEDS = (
    "an item needs a paragraph with 3 consecutive sentences of 6-60 words (the context and the answer), a "
    "sentence of 6-60 words later in the same document (in a later paragraph, or 5 or more sentences after the "
    "answer) as a distractor, and 2 other held-out documents with such a paragraph"
)


def next_sentence_shortfall(held_out: list, seed: int = 0) -> str | None:
    """Why ``next_sentence`` can build no item from the held-out documents ``held_out`` (articles with
    ``.text``): its requirement and what these documents lack; None where it builds one."""
    if next_sentence_docs(held_out, 1, seed=seed):
        return None
    with_run = 0  # documents with a paragraph of three usable consecutive sentences
    for art in held_out:
        paras = [sentences(p) for p in art.text.split("\n\n")]
        if any(all(_usable(x) for x in p[i : i + 3]) for p in paras for i in range(len(p) - 2)):
            with_run += 1
    if with_run == 0:
        lacks = "none has such a paragraph (sentences end in . ! or ? followed by a capital letter)"
    elif with_run < 3:
        lacks = f"{with_run} {'has' if with_run == 1 else 'have'} such a paragraph, and 3 are needed"
    else:
        lacks = "no such paragraph has a usable sentence after it in its document to serve as the distractor"
    return f"{NEXT_SENTENCE_NEEDS}; of the {len(held_out)} held-out documents, {lacks}"


def check_task_data(section, held_out: list | None, *, seed: int = 0, test_fraction: str = "data.test_fraction"):
    """Before any model is loaded: each built-in task that reads the held-out text can build its items from
    ``held_out`` (the held-out documents; None: not known without the tokenizer, nothing checked). A
    ``RecipeError`` that states the task's requirement and the way out (``test_fraction``: the field or flag
    that holds more documents out) otherwise."""
    if held_out is None:
        return
    readers = [t for t in ("perplexity", "next_sentence") if t in section.tasks]
    if readers and not held_out:
        raise RecipeError(
            f"evaluation.tasks: {', '.join(readers)} read the held-out documents, and none is held out; raise "
            f"{test_fraction} or add documents"
        )
    if "next_sentence" in section.tasks:
        why = next_sentence_shortfall(held_out, seed)
        if why is not None:
            raise RecipeError(
                f"evaluation.tasks: next_sentence can build no item: {why}. Raise {test_fraction} (more documents "
                "held out), give longer documents, or drop next_sentence from the tasks"
            )


def _next_sentence_task(data, tokenizer, section) -> dict[str, Any]:
    docs = next_sentence_docs(data.test, section.next_sentence_items, seed=data.split_seed)
    if not docs:
        raise CompressKitError(
            f"evaluation.tasks: next_sentence found no items: {next_sentence_shortfall(data.test, data.split_seed)}; "
            "raise data.test_fraction or drop the task"
        )
    return _multiple_choice("ck_next_sentence", docs, "{{context}}", "{{choices}}")


_ACC = (Column("acc", "acc", "{:.4f}"), Column("acc_norm", "acc_norm", "{:.4f}"))

REGISTRY: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec(
            "perplexity",
            "rolling log-likelihood over the held-out articles",
            (
                Column("held-out ppl", "token_perplexity", "{:.2f}"),
                Column("word ppl", "word_perplexity", "{:.2f}"),
            ),
            zero_shot=False,
            limited=False,
            build=_perplexity_task,
        ),
        TaskSpec(
            "piqa",
            "PIQA validation, as lm-eval's piqa task",
            tuple(Column(f"PIQA {c.title}", c.metric, c.fmt) for c in _ACC),
            zero_shot=True,
            limited=True,
            build=_piqa_task,
        ),
        TaskSpec(
            "next_sentence",
            "4-way next-sentence choice from the held-out articles",
            tuple(Column(f"next-sent {c.title}", c.metric, c.fmt) for c in _ACC),
            zero_shot=True,
            limited=True,
            build=_next_sentence_task,
        ),
        *(
            TaskSpec(
                f"{name}_perplexity",
                f"rolling log-likelihood over {what} (shipped; absent from the default training mix)",
                (Column(f"{name} ppl", "token_perplexity", "{:.2f}"),),
                zero_shot=False,
                limited=False,
                build=_domain_task(name),
            )
            for name, what in (
                ("code", "11 Python standard-library modules"),
                ("legal", "six software licences (GPL-3, LGPL-2.1, MPL-2.0, Apache-2.0, GFDL-1.3, Artistic)"),
            )
        ),
    )
}


DEFAULT_TASKS = ("perplexity", "piqa", "next_sentence")  # what evaluation.tasks holds unless a recipe says


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(name: str) -> TaskSpec:
    if name not in REGISTRY:
        raise RecipeError(f"evaluation.tasks: {did_you_mean(name, REGISTRY, what='task')}")
    return REGISTRY[name]


def table_columns() -> list[tuple[str, str, str, str]]:
    """(column title, task, metric, format) of every task's shown metrics, in registry order."""
    return [(c.title, t.name, c.metric, c.fmt) for t in REGISTRY.values() for c in t.columns]


def zero_shot_tasks() -> tuple[str, ...]:
    return tuple(n for n, t in REGISTRY.items() if t.zero_shot)


# ---------------------------------------------------------------------------------------------
# lm-eval's own tasks, by name


def builtin(name: str) -> bool:
    """Whether ``name`` is one of compresskit's offline tasks (which take precedence over an lm-eval
    task of the same name)."""
    return name in REGISTRY


def lm_eval_names(section) -> list[str]:
    """The recipe's tasks that lm-eval resolves (task or group names)."""
    return [name for name in section.tasks if not builtin(name)]


@contextlib.contextmanager
def quiet_lm_eval():
    """lm-eval and datasets log at INFO/WARNING and draw tqdm bars; keep the terminal ours."""
    import lm_eval.evaluator

    names = ("lm_eval", "lm-eval", "datasets", "transformers", "lm_eval.models.huggingface")
    saved = {n: logging.getLogger(n).level for n in names}
    # lm-eval asks git for the working directory's commit once per evaluation, and git says "fatal: not a git
    # repository" on the terminal outside a checkout; the results record compresskit's own versions instead
    git_hash = lm_eval.evaluator.get_git_commit_hash
    try:
        lm_eval.evaluator.get_git_commit_hash = lambda: None
        for n in names:
            logging.getLogger(n).setLevel(logging.ERROR)
        import datasets

        datasets.disable_progress_bars()
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = git_hash
        for n, lvl in saved.items():
            logging.getLogger(n).setLevel(lvl)


def lm_eval_manager(section, names: list[str] | None = None):
    """lm-eval's ``TaskManager`` over ``evaluation.task_paths`` (folders of task YAML files), and over
    lm-eval's own task index only where some of ``names`` are not found in those folders (indexing
    lm-eval's ~15k task files takes seconds)."""
    from lm_eval.tasks import TaskManager

    paths = [str(Path(p).expanduser()) for p in section.task_paths] or None
    names = lm_eval_names(section) if names is None else names
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local
    return TaskManager(include_path=paths)


def check_lm_eval_tasks(
    section, *, allow_download: bool = False, download_flag: str = "set model.allow_download: true"
) -> None:
    """Before any model is loaded: every task that is not built in is an lm-eval task or group whose
    data loads here (offline unless ``allow_download``), and ``task_paths`` are folders. One
    :class:`RecipeError` naming the field and the task otherwise (``download_flag``: how the user turns
    downloads on: setting the recipe key, or giving a command's flag)."""
    names = lm_eval_names(section)
    for path in section.task_paths:
        if not Path(path).expanduser().is_dir():
            raise RecipeError(f"evaluation.task_paths: {path!r} is not a folder (of lm-eval task YAML files)")
    if not names:
        return
    with quiet_lm_eval():
        manager = lm_eval_manager(section, names)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, [*REGISTRY, *known], n=3, cutoff=0.6)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise RecipeError(
                f"evaluation.tasks: unknown task {name!r}.{hint} Built in: {', '.join(REGISTRY)}; "
                f"or one of lm-eval's {len(known):,} tasks and groups (lm-eval ls tasks), or a task YAML in "
                "evaluation.task_paths"
            )
    with hub_offline(not allow_download), quiet_lm_eval():
        for name in names:
            try:
                manager.load([name])
            except Exception as exc:  # lm-eval and datasets raise many kinds here
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                how = (
                    "download failed"
                    if allow_download
                    else "not available offline (download it once into the datasets cache, HF_HOME, or "
                    f"{download_flag})"
                )
                raise RecipeError(f"evaluation.tasks: {name!r} cannot load its data: {how}: {first}") from exc


def fewshot(section, name: str) -> int:
    """Few-shot examples for task ``name`` (0 for the built-in tasks, which are zero-shot)."""
    if builtin(name):
        return 0
    n = section.num_fewshot
    return n.get(name, 0) if isinstance(n, dict) else n


def result_columns(metrics: dict[str, dict[str, float]]) -> list[tuple[str, str, str, str]]:
    """Table columns for tasks outside the registry (lm-eval's), from the metrics a run reported:
    acc and acc_norm first where present, then the other metrics by name; and the held-out perplexity
    of each source where the held-out text came from several."""
    cols = []
    for task, values in metrics.items():
        if builtin(task):  # only the held-out perplexity of each source, where there are several
            cols += [
                (f"held-out ppl ({m.split(':', 1)[1]})", task, m, "{:.2f}")
                for m in sorted(values)
                if m.startswith("token_perplexity:")
            ]
            continue
        order = [m for m in ("acc", "acc_norm") if m in values] + sorted(
            m for m in values if m not in ("acc", "acc_norm")
        )
        cols += [(f"{task} {m}", task, m, "{:.4f}") for m in order]
    return cols
