"""The shared evaluator: one code path scores every method.

It runs lm-eval in memory (``HFLM(pretrained=model)``, no network) on the tasks of
:mod:`compresskit.tasks` (held-out perplexity, PIQA, next-sentence choice) and on any lm-eval task
or group the recipe names (its data read from the local datasets cache unless
``model.allow_download``).

While it runs it measures the pruner's *realised* sparsity (fraction of prunable MACs skipped),
per task and overall.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from compresskit import crashpoints
from compresskit import tasks as task_registry
from compresskit.data import DataModule
from compresskit.errors import RecipeError, RuntimeUnsupportedError
from compresskit.interfaces import Pruner
from compresskit.modeling import peak_memory, release_freed_memory, reset_peak_memory
from compresskit.progress import Progress
from compresskit.recipe import EvaluationSection
from compresskit.runtime import runtime_for
from compresskit.runtime.llama import SUPPORTED
from compresskit.sparsity import SparsityReport
from compresskit.tokens import token_mask, valid_tokens

# Imported inside the functions that use them: lm-eval; so importing this module, and running the commands that do not
# need them (`--help` and `validate` first), stays fast.

# ---------------------------------------------------------------------------------------------
# the engine: what computes the logits


def resolve_engine(model: torch.nn.Module, section: EvaluationSection) -> str:
    """The engine ``evaluation.engine`` resolves to on this model, ``runtime`` or ``transformers`` (auto:
    the runtime on a GPU where it runs the architecture); a ``RecipeError`` where the runtime is asked for
    a model it cannot run."""
    model_type = getattr(model.config, "model_type", None)
    if section.engine == "runtime" and model_type not in SUPPORTED:
        raise RecipeError(
            f"evaluation.engine: runtime does not run model type {model_type!r} (it runs {', '.join(SUPPORTED)}); "
            "give transformers or auto"
        )
    if section.engine == "auto":
        on_gpu = next(model.parameters()).device.type == "cuda"
        return "runtime" if on_gpu and model_type in SUPPORTED else "transformers"
    return section.engine


def _scored(model, section: EvaluationSection, pruner, executor, progress: Progress):
    """``(what computes the logits, its engine)``: the model, or the runtime standing in for it (with
    ``executor``'s blocks, else the pruner's). Under ``auto`` a model the runtime refuses is scored through
    transformers, with a line saying why; ``runtime`` as asked is that line as an error."""
    engine = resolve_engine(model, section)
    if engine != "runtime":
        return model, engine
    try:
        return RuntimeModel(model, runtime_for(model, pruner, executor)), engine
    except RuntimeUnsupportedError as exc:
        if section.engine == "runtime":
            raise RecipeError(f"evaluation.engine: {exc}") from None
        progress.log(f"evaluation: {exc}; scored through transformers (evaluation.engine: auto)")
        return model, "transformers"


class RuntimeModel(torch.nn.Module):
    """The inference runtime standing in for the transformers model lm-eval calls: ``forward(input_ids)``
    gives the logits ``[B, T, V]`` of one prefill into a fresh cache, the right padding lm-eval adds
    marked as such (the real-token mask the evaluator declares), so that routing blocks count real tokens
    only."""

    def __init__(self, model: torch.nn.Module, runtime) -> None:
        super().__init__()
        self.inner = model
        self.runtime = runtime
        self.config = model.config

    @property
    def device(self) -> torch.device:
        return next(self.inner.parameters()).device

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def tie_weights(self) -> None:
        """(lm-eval calls it; the runtime shares the model's weights as they are.)"""

    def forward(self, input_ids: torch.Tensor, *args, **kwargs):
        b, t = input_ids.shape
        valid = valid_tokens()
        if valid is not None and valid.shape != (b, t):
            valid = None
        cache = self.runtime.new_cache(b, t)
        logits = self.runtime.forward(input_ids, cache, new_valid=None if valid is None else valid.to(input_ids.device))
        return _Output(logits)


@dataclass
class _Output:
    logits: torch.Tensor


def _reset_counts(model, scored, pruner) -> None:
    if isinstance(scored, RuntimeModel):
        scored.runtime.reset_counts(pruner)
    elif pruner is not None:
        pruner.reset_sparsity(model)


def _counted(model, scored, pruner) -> SparsityReport | None:
    """The realised sparsity since the last reset: the runtime's count where the runtime scored
    (``Runtime.counted_sparsity``), else the pruner's own."""
    if isinstance(scored, RuntimeModel):
        return scored.runtime.counted_sparsity(pruner)
    return pruner.sparsity(model) if pruner is not None else None


# ---------------------------------------------------------------------------------------------
# the in-memory lm-eval model with progress


def _progress_lm(model, tokenizer, *, section: EvaluationSection, progress: Progress):
    """lm-eval's ``HFLM`` on the in-memory model, batching as lm-eval does (its length-sorted
    batches), with two additions:

    * the batch size is lowered, per request list, so that one batch's full-vocabulary
      log-probabilities (lm-eval holds the fp32 logits and their fp32 log-softmax at once) fit in
      ``evaluation.logits_budget_mb``: at a 1k-token context and a 49k-token vocabulary each row
      needs 0.4 GB, so 16 rows would need 6.4 GB;
    * progress: rows scored against the rows (requests, or rolling windows) of the task.
    """
    from lm_eval import utils as lm_utils
    from lm_eval.models.huggingface import HFLM

    vocab = model.get_output_embeddings().weight.shape[0]
    budget = section.logits_budget_mb * 2**20

    class ProgressHFLM(HFLM):
        task = None  # the progress Task of the lm-eval task in flight

        def fit_batch(self, longest: int) -> None:
            per_row = longest * vocab * 4 * 2  # fp32 logits and their fp32 log-softmax
            self.batch_size_per_gpu = max(1, min(section.batch_size, budget // per_row))
            self.batch_sizes_used.add(self.batch_size_per_gpu)

        def _model_call(self, inps, attn_mask=None, labels=None):
            # Tell dynamic pruners which positions are lm-eval's right padding (not real tokens).
            lengths, self._pad_lengths = self._pad_lengths, None
            valid = None
            if lengths is not None and len(lengths) == inps.shape[0]:
                positions = torch.arange(inps.shape[1], device=inps.device)
                valid = positions[None, :] < torch.tensor(lengths, device=inps.device)[:, None]  # [B, T]
            with token_mask(valid):
                out = super()._model_call(inps, attn_mask=attn_mask, labels=labels)
            if self.task is not None:
                self.task.advance(inps.shape[0])
            return out

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            if requests and override_bs is None:  # (rolling windows come sized already)
                self.fit_batch(min(self.max_length, max(len(ctx) + len(cont) for _, ctx, cont in requests)))
            return super()._loglikelihood_tokens(requests, disable_tqdm=True, override_bs=override_bs)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            windows = sum(
                sum(
                    1
                    for _ in lm_utils.get_rolling_token_windows(
                        token_list=self.tok_encode(req.args[0]),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    )
                )
                for req in requests
            )
            self.fit_batch(self.max_length)
            with progress.task(self.label, total=windows) as task:
                self.task = task
                try:
                    return super().loglikelihood_rolling(requests, disable_tqdm=True)
                finally:
                    self.task = None

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            # rows <= requests: lm-eval scores requests that share a context in one row
            with progress.task(self.label, total=len(requests)) as task:
                self.task = task
                try:
                    return super().loglikelihood(requests, disable_tqdm=True)
                finally:
                    self.task = None

    lm = ProgressHFLM(
        pretrained=model, tokenizer=tokenizer, batch_size=section.batch_size, max_length=section.max_length
    )
    lm.label = "evaluating"
    lm.batch_sizes_used = set()
    lm._pad_lengths = None
    return lm


@contextlib.contextmanager
def _recording_pad_lengths(lm):
    """lm-eval right-pads each batch with zeros and passes no attention mask to the model; record
    the true lengths where it pads (its module-level ``pad_and_concat``), for ``_model_call``. This
    is the one place compresskit reaches inside lm-eval; ``tests/core/test_evaluate.py`` fails if
    lm-eval stops padding there."""
    import lm_eval.models.huggingface as hf

    original = getattr(hf, "pad_and_concat", None)
    if original is None:  # another lm-eval layout: pads would be counted as tokens
        warnings.warn(
            f"lm-eval {getattr(hf, '__version__', '')} has no huggingface.pad_and_concat: padding is counted as "
            "tokens in the measured sparsity",
            stacklevel=2,
        )
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
    batch_size: int | None = None  # the largest batch lm-eval ran (logits_budget_mb may lower it)
    peak_memory_bytes: int | None = None  # while the task ran (compresskit.modeling.peak_memory)


@dataclass
class EvalResult:
    tasks: dict[str, TaskResult] = field(default_factory=dict)
    sparsity: SparsityReport | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    higher_is_better: dict[str, dict[str, bool]] = field(default_factory=dict)  # lm-eval's, per task and metric

    def metrics(self) -> dict[str, dict[str, float]]:
        return {name: dict(t.metrics) for name, t in self.tasks.items()}

    def zero_shot_average(self) -> float | None:
        accs = [self.tasks[t].metrics["acc"] for t in task_registry.zero_shot_tasks() if t in self.tasks]
        return sum(accs) / len(accs) if accs else None


def evaluate(
    model: torch.nn.Module,
    tokenizer,
    data: DataModule,
    section: EvaluationSection,
    *,
    pruner: Pruner | None = None,
    executor=None,
    progress: Progress | None = None,
    allow_download: bool = False,
) -> EvalResult:
    """Evaluate ``model`` on the recipe's tasks; measure realised sparsity while doing so. An lm-eval
    task named by the recipe reports each of its (sub)tasks' metrics under its own name. The logits come
    from ``evaluation.engine``'s path: on the runtime, with ``executor``'s blocks where it supplies some
    (the recipe's executor), else the pruner's."""
    import lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    progress = progress or Progress()
    model.eval()
    device = next(model.parameters()).device
    scored, engine = _scored(model, section, pruner, executor, progress)
    with task_registry.quiet_lm_eval():
        lm = _progress_lm(scored, tokenizer, section=section, progress=progress)
        manager = TaskManager(include_defaults=False)
        external = task_registry.lm_eval_manager(section) if task_registry.lm_eval_names(section) else None
    result = EvalResult(
        meta={
            "lm_eval_version": getattr(lm_eval, "__version__", "unknown"),
            "batch_size": section.batch_size,
            "logits_budget_mb": section.logits_budget_mb,
            "max_length": section.max_length,
            "limit": section.limit,
            "seed": section.seed,
            "num_fewshot": section.num_fewshot,
            "device": str(device),
            "engine": engine if engine == "transformers" else f"runtime ({scored.runtime.mode})",
        }
    )
    configs = {
        name: task_registry.get(name).build(data, tokenizer, section)
        for name in section.tasks
        if task_registry.builtin(name)
    }
    overall: SparsityReport | None = None
    for name in section.tasks:
        crashpoints.point(f"evaluation: {name} starts")
        release_freed_memory()  # (what training or the task before freed)
        reset_peak_memory(device)
        builtin = task_registry.builtin(name)
        lm.label = f"eval {name}"
        lm.batch_sizes_used = set()
        _reset_counts(model, scored, pruner)
        t0 = time.perf_counter()
        offline = task_registry.hub_offline(not allow_download)
        with torch.inference_mode(), task_registry.quiet_lm_eval(), _recording_pad_lengths(lm), offline:
            out = simple_evaluate(
                model=lm,
                tasks=[configs[name] if builtin else name],
                task_manager=manager if builtin else external,
                limit=section.limit if not builtin or task_registry.get(name).limited else None,
                num_fewshot=task_registry.fewshot(section, name),
                batch_size=section.batch_size,
                random_seed=section.seed,
                numpy_random_seed=section.seed,
                torch_random_seed=section.seed,
                fewshot_random_seed=section.seed,
                bootstrap_iters=0,
                log_samples=False,
            )
        rep = _counted(model, scored, pruner)
        seconds = time.perf_counter() - t0
        # a built-in task reports under its recipe name; an lm-eval group under each of its tasks too
        names = {configs[name]["task"]: name} if builtin else {key: key for key in out["results"]}
        for key, shown in names.items():
            metrics = {
                k.split(",")[0]: float(v)
                for k, v in out["results"][key].items()
                if "," in k and not k.split(",")[0].endswith("_stderr") and isinstance(v, int | float)
            }
            if not metrics:  # a group without an aggregate of its own
                continue
            n_items = int(out.get("n-samples", {}).get(key, {}).get("effective", 0))
            batch = max(lm.batch_sizes_used, default=None)
            result.tasks[shown] = TaskResult(shown, metrics, n_items, seconds, rep, batch, peak_memory(device))
            if not builtin:
                result.higher_is_better[shown] = dict(out.get("higher_is_better", {}).get(key, {}))
        if rep is not None:
            overall = rep if overall is None or not rep.dynamic else overall.merge(rep)
    result.sparsity = overall
    return result


def recovery(
    compressed: dict[str, dict[str, float]],
    dense: dict[str, dict[str, float]],
    higher_is_better: dict[str, dict[str, bool]] | None = None,
) -> dict[str, dict[str, float]]:
    """Compressed / dense per metric; for lower-is-better metrics dense / compressed, so that
    1.0 means "as good as dense" for every metric. ``higher_is_better``: lm-eval's word on its own
    tasks' metrics (the built-in metrics' direction is known)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in compressed.items():
        for metric, value in metrics.items():
            base = dense.get(task, {}).get(metric)
            higher = (higher_is_better or {}).get(task, {}).get(metric)
            if higher is None:
                higher = task_registry.HIGHER_IS_BETTER.get(task_registry.metric_kind(metric), True)
            if base is None or (base if higher else value) == 0:  # no ratio: a division by zero
                continue
            ratio = value / base if higher else base / value  # (0.0 where the compressed model scores 0)
            out.setdefault(task, {})[metric] = ratio
    return out
