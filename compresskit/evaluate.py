"""The shared evaluator: one code path scores every method.

It runs lm-eval in memory (``HFLM(pretrained=model)``, task configs built here, no network)
on three tasks:

* ``perplexity``: rolling log-likelihood over the held-out Wikipedia articles (lm-eval's
  ``loglikelihood_rolling``, windows of ``evaluation.max_length`` tokens); reports token-,
  word- and byte-level perplexity and bits per byte. Lower is better.
* ``piqa``: PIQA validation (1,838 items, shipped in the package), scored exactly as lm-eval's
  ``piqa`` task: "Question: {goal}\\nAnswer:" against the two solutions; acc and acc_norm.
* ``next_sentence``: a 4-way choice of the sentence that follows a two-sentence context,
  built deterministically from the held-out articles (one distractor from later in the same
  article, two from other held-out articles); acc and acc_norm.

While it runs it measures the pruner's *realised* sparsity (fraction of prunable MACs skipped),
per task and overall.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch

from compresskit.data import Article, DataModule
from compresskit.errors import CompressKitError
from compresskit.interfaces import Pruner
from compresskit.progress import Progress
from compresskit.recipe import EvaluationSection
from compresskit.sparsity import SparsityReport
from compresskit.tokens import token_mask

# metric -> True when higher is better (used for recovery and table arrows)
HIGHER_IS_BETTER = {
    "acc": True,
    "acc_norm": True,
    "token_perplexity": False,
    "word_perplexity": False,
    "byte_perplexity": False,
    "bits_per_byte": False,
}
ZERO_SHOT = ("piqa", "next_sentence")


# ---------------------------------------------------------------------------------------------
# documents


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


def next_sentence_docs(articles: list[Article], n_items: int, seed: int = 0) -> list[dict[str, Any]]:
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


def perplexity_docs(articles: list[Article], tokenizer) -> list[dict[str, Any]]:
    return [
        {"page": a.text, "title": a.title, "n_tokens": len(tokenizer(a.text, add_special_tokens=False)["input_ids"])}
        for a in articles
    ]


def _perplexity_results(doc: dict, results: list) -> dict:
    (loglikelihood,) = results
    n_words = len(re.split(r"\s+", doc["page"]))
    n_bytes = len(doc["page"].encode("utf-8"))
    return {
        "token_perplexity": (loglikelihood, doc["n_tokens"]),
        "word_perplexity": (loglikelihood, n_words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
    }


def _dataset(docs: list[dict[str, Any]]):
    def build(**_ignored):
        import datasets

        return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})

    return build


def task_configs(data: DataModule, tokenizer, section: EvaluationSection) -> dict[str, dict[str, Any]]:
    """lm-eval task configs (dicts) for the tasks the recipe asks for."""
    mc_metrics = [
        {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
    ]
    configs: dict[str, dict[str, Any]] = {}
    if "perplexity" in section.tasks:
        docs = perplexity_docs(data.test, tokenizer)
        if section.perplexity_docs is not None:
            docs = docs[: section.perplexity_docs]
        configs["perplexity"] = {
            "task": "ck_heldout_perplexity",
            "custom_dataset": _dataset(docs),
            "test_split": "test",
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{page}}",
            "process_results": _perplexity_results,
            "metric_list": [
                {"metric": m, "aggregation": "weighted_perplexity", "higher_is_better": False}
                for m in ("token_perplexity", "word_perplexity", "byte_perplexity")
            ]
            + [{"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False}],
            "metadata": {"version": 1.0},
        }
    if "piqa" in section.tasks:
        configs["piqa"] = {
            "task": "ck_piqa",
            "custom_dataset": _dataset(piqa_docs()),
            "test_split": "test",
            "output_type": "multiple_choice",
            "doc_to_text": "Question: {{goal}}\nAnswer:",
            "doc_to_target": "label",
            "doc_to_choice": "{{[sol1, sol2]}}",
            "metric_list": mc_metrics,
            "metadata": {"version": 1.0},
        }
    if "next_sentence" in section.tasks:
        ns_docs = next_sentence_docs(data.test, section.next_sentence_items, seed=data.split_seed)
        if not ns_docs:
            raise CompressKitError(
                f"evaluation.tasks: next_sentence found no items in the {len(data.test)} held-out articles "
                "(it needs at least 3 articles with 3-sentence paragraphs); raise data.test_fraction or drop the task"
            )
        configs["next_sentence"] = {
            "task": "ck_next_sentence",
            "custom_dataset": _dataset(ns_docs),
            "test_split": "test",
            "output_type": "multiple_choice",
            "doc_to_text": "{{context}}",
            "doc_to_target": "label",
            "doc_to_choice": "{{choices}}",
            "metric_list": mc_metrics,
            "metadata": {"version": 1.0},
        }
    return configs


# ---------------------------------------------------------------------------------------------
# the in-memory lm-eval model with progress


def _progress_lm(model, tokenizer, *, batch_size: int, max_length: int, progress: Progress):
    from lm_eval.models.huggingface import HFLM

    class ProgressHFLM(HFLM):
        """HFLM that reports progress through compresskit's Progress instead of tqdm."""

        _task = None

        def _chunked(self, method, requests, label):
            out = []
            chunk = max(1, batch_size * 8)
            with progress.task(label, total=len(requests)) as task:
                for i in range(0, len(requests), chunk):
                    out.extend(method(requests[i : i + chunk], disable_tqdm=True))
                    task.advance(len(requests[i : i + chunk]))
            return out

        def _model_call(self, inps, attn_mask=None, labels=None):
            # Tell dynamic pruners which positions are lm-eval's right padding (not real tokens).
            lengths, self._pad_lengths = self._pad_lengths, None
            valid = None
            if lengths is not None and len(lengths) == inps.shape[0]:
                positions = torch.arange(inps.shape[1], device=inps.device)
                valid = positions[None, :] < torch.tensor(lengths, device=inps.device)[:, None]  # [B, T]
            with token_mask(valid):
                return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self._chunked(super().loglikelihood, requests, self._label)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self._chunked(super().loglikelihood_rolling, requests, self._label)

    lm = ProgressHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    lm._label = "evaluating"
    lm._pad_lengths = None
    return lm


@contextlib.contextmanager
def _recording_pad_lengths(lm):
    """lm-eval right-pads each batch with zeros and passes no attention mask; record the true
    lengths where it pads (its module-level ``pad_and_concat``), for ``_model_call``."""
    import lm_eval.models.huggingface as hf

    original = getattr(hf, "pad_and_concat", None)
    if original is None:  # another lm-eval layout: pads are then counted as tokens
        yield
        return

    def recording(max_length, tensors, padding_side="right"):
        if padding_side == "right":
            lm._pad_lengths = [t.shape[-1] for t in tensors]
        return original(max_length, tensors, padding_side=padding_side)

    hf.pad_and_concat = recording
    try:
        yield
    finally:
        hf.pad_and_concat = original


@dataclass
class TaskResult:
    task: str
    metrics: dict[str, float]
    n_items: int
    seconds: float
    sparsity: SparsityReport | None = None


@dataclass
class EvalResult:
    tasks: dict[str, TaskResult] = field(default_factory=dict)
    sparsity: SparsityReport | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, dict[str, float]]:
        return {name: dict(t.metrics) for name, t in self.tasks.items()}

    def zero_shot_average(self) -> float | None:
        accs = [self.tasks[t].metrics["acc"] for t in ZERO_SHOT if t in self.tasks]
        return sum(accs) / len(accs) if accs else None


def evaluate(
    model: torch.nn.Module,
    tokenizer,
    data: DataModule,
    section: EvaluationSection,
    *,
    pruner: Pruner | None = None,
    progress: Progress | None = None,
) -> EvalResult:
    """Evaluate ``model`` on the recipe's tasks; measure realised sparsity while doing so."""
    import lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    progress = progress or Progress()
    model.eval()
    with _quiet():
        lm = _progress_lm(
            model, tokenizer, batch_size=section.batch_size, max_length=section.max_length, progress=progress
        )
        manager = TaskManager(include_defaults=False)
    result = EvalResult(
        meta={
            "lm_eval_version": getattr(lm_eval, "__version__", "unknown"),
            "batch_size": section.batch_size,
            "max_length": section.max_length,
            "limit": section.limit,
            "seed": section.seed,
            "num_fewshot": 0,
            "device": str(next(model.parameters()).device),
        }
    )
    configs = task_configs(data, tokenizer, section)
    overall: SparsityReport | None = None
    for name in section.tasks:
        cfg = configs[name]
        lm._label = f"eval {name}"
        if pruner is not None:
            pruner.reset_sparsity(model)
        t0 = time.perf_counter()
        with torch.inference_mode(), _quiet(), _recording_pad_lengths(lm):
            out = simple_evaluate(
                model=lm,
                tasks=[cfg],
                task_manager=manager,
                limit=None if name == "perplexity" else section.limit,
                num_fewshot=0,
                batch_size=section.batch_size,
                random_seed=section.seed,
                numpy_random_seed=section.seed,
                torch_random_seed=section.seed,
                fewshot_random_seed=section.seed,
                bootstrap_iters=0,
                log_samples=False,
            )
        raw = out["results"][cfg["task"]]
        metrics = {
            k.split(",")[0]: float(v) for k, v in raw.items() if "," in k and not k.split(",")[0].endswith("_stderr")
        }
        n_items = int(out.get("n-samples", {}).get(cfg["task"], {}).get("effective", 0))
        rep = pruner.sparsity(model) if pruner is not None else None
        result.tasks[name] = TaskResult(name, metrics, n_items, time.perf_counter() - t0, rep)
        if rep is not None:
            overall = rep if overall is None or not rep.dynamic else overall.merge(rep)
    result.sparsity = overall
    return result


@contextlib.contextmanager
def _quiet():
    """lm-eval and datasets log at INFO/WARNING and draw tqdm bars; keep the terminal ours."""
    import logging

    names = ("lm_eval", "lm-eval", "datasets", "transformers", "lm_eval.models.huggingface")
    saved = {n: logging.getLogger(n).level for n in names}
    try:
        for n in names:
            logging.getLogger(n).setLevel(logging.ERROR)
        import datasets

        datasets.disable_progress_bars()
        yield
    finally:
        for n, lvl in saved.items():
            logging.getLogger(n).setLevel(lvl)


def recovery(
    compressed: dict[str, dict[str, float]], dense: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Compressed / dense per metric; for lower-is-better metrics dense / compressed, so that
    1.0 means "as good as dense" for every metric."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in compressed.items():
        for metric, value in metrics.items():
            base = dense.get(task, {}).get(metric)
            if base is None or value == 0 or base == 0:
                continue
            ratio = value / base if HIGHER_IS_BETTER.get(metric, True) else base / value
            out.setdefault(task, {})[metric] = ratio
    return out
