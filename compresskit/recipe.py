"""Recipes: the YAML that drives ``compresskit apply``.

Sample::

    include: _base/eval.yaml            # a path or a list, relative to this file
    seed: 0
    model: {name_or_path: smollm2-135m, dtype: auto}
    data: {calibration: {n_samples: 64, seq_len: 512}}
    pruner: {name: PRUNER, config: {target_sparsity: 0.5}}   # compresskit plugins lists them
    training:
      - {name: router, config: {steps: 200}}
    executor: {name: torch}
    evaluation: {tasks: [perplexity, piqa, next_sentence], limit: 200}
    output: {dir: runs/my-run}

Precedence: ``--set key=value`` overrides > the recipe (an including file over what it
includes) > defaults. Validation runs in two stages: the envelope below (unknown keys are
errors), then each plugin's own ``Config`` once the plugin is loaded; every error names the
YAML path, the value given and what is allowed.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from compresskit import plugins, tasks
from compresskit.errors import CompressKitError, RecipeError, RecipeProblems, did_you_mean
from compresskit.interfaces import PluginConfig
from compresskit.pipeline import NAME, Pipeline, PipelineConfig

SCHEMA_VERSION = 1


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    name_or_path: str = Field(description="A built-in alias (smollm2-135m), a local HF directory, or a hub id.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on a GPU, float32 on the CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    allow_download: bool = Field(False, description="Let transformers download a hub id (needs network).")


class CalibrationSection(_Section):
    n_samples: int = Field(64, ge=1, description="Sequences of calibration/training text per pass.")
    seq_len: int = Field(512, ge=8, le=32768)
    batch_size: int = Field(8, ge=1)


class FilesSource(_Section):
    """Local text files: ``data: {source: {files: [corpus/*.txt, more.jsonl]}}``."""

    files: list[str] = Field(
        min_length=1,
        description="Paths or glob patterns (relative to the working directory) of .txt (a document each), .jsonl "
        "(a document a line), .json (an array of documents) or .parquet (a document a row) files.",
    )
    text_field: str = Field(
        "text",
        description="The field or column that holds the text (.jsonl, .json, .parquet); a list of chat messages "
        "({role, content}) there is formatted with the tokenizer's chat template.",
    )


class HubSource(_Section):
    """A Hugging Face dataset: ``data: {source: {hf: wikitext, config: wikitext-2-raw-v1, split: train}}``, or a
    folder written by ``Dataset.save_to_disk``."""

    hf: str = Field(
        min_length=1,
        description="A dataset name (read from the local datasets cache unless model.allow_download) or a folder "
        "saved with Dataset.save_to_disk.",
    )
    config: str | None = Field(None, description="The dataset's configuration (load_dataset's second argument).")
    split: str = Field("train", description="The split to read (a name, or a slice such as train[:2000]).")
    text_field: str = Field("text", description="The column that holds the text (or a list of chat messages).")
    max_documents: int | None = Field(None, ge=2, description="Read at most this many documents (None: all).")


class Generation(_Section):
    """How the dense model writes the ``generated`` source's documents."""

    documents: int = Field(256, ge=2, description="How many documents to write.")
    max_new_tokens: int = Field(256, ge=8, description="Tokens the model writes after each opening.")
    temperature: float = Field(0.8, gt=0.0, description="Sampling temperature.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    batch_size: int = Field(16, ge=1, description="Documents written at once.")
    prompts: list[str] | None = Field(
        None,
        description="Openings the model continues, in turn (None: the 59 varied ones shipped in "
        "compresskit/resources/prompts).",
    )
    seed: int = Field(0, description="Seed of the sampling.")


class GeneratedSource(_Section):
    """Text the dense model writes itself: ``data: {source: {generated: {documents: 256}}}``. Written once,
    then read from the cache (keyed by the model and everything above)."""

    generated: Generation = Generation()


SingleSource = Literal["wiki"] | FilesSource | HubSource | GeneratedSource


class WeightedSource(_Section):
    """One member of a list of sources: ``{source: wiki, weight: 1.0}``."""

    source: SingleSource
    weight: float = Field(
        1.0,
        gt=0.0,
        description="How many times this source's training documents enter the training text (2: twice; 0.5: a "
        "seeded half of them); the held-out documents are kept once whatever the weight.",
    )

    @field_validator("source", mode="before")
    @classmethod
    def _one_source(cls, value: Any) -> Any:
        return _single_source(value)


def _single_source(value: Any) -> Any:
    """One message for the kind of source given, rather than one per member of the union."""
    if isinstance(value, str):
        if value != "wiki":
            raise ValueError(
                did_you_mean(value, ["wiki"], what="data source")
                + "; or local files {files: [corpus/*.txt]}, or a Hugging Face dataset {hf: NAME}"
            )
        return value
    if isinstance(value, dict):
        kinds = {"files": FilesSource, "hf": HubSource, "generated": GeneratedSource}
        kind = next((k for key, k in kinds.items() if key in value), None)
        if kind is None:
            key = str(next(iter(value), ""))
            raise ValueError(f"{key}: " + did_you_mean(key, list(kinds), what="key") + " (or the source 'wiki')")
        try:
            return kind.model_validate(value)
        except ValidationError as exc:
            raise ValueError(format_validation_error(exc, kind)) from None
    if isinstance(value, FilesSource | HubSource | GeneratedSource):
        return value
    raise ValueError("expected 'wiki', local files ({files: [corpus/*.txt]}) or a Hugging Face dataset ({hf: NAME})")


class DataSection(_Section):
    source: SingleSource | list[WeightedSource] = Field(
        "wiki",
        description="wiki: the English Wikipedia excerpt shipped in gensim; {files: [...]}: local files; "
        "{hf: NAME}: a Hugging Face dataset; {generated: {...}}: text the dense model writes; or a list of "
        "{source: ..., weight: w} to mix several.",
    )
    test_fraction: float = Field(
        0.25,
        gt=0.0,
        lt=1.0,
        description="Share of each source's documents held out for evaluation (a generated source: none).",
    )
    split_seed: int = 0
    calibration: CalibrationSection = CalibrationSection()

    @field_validator("source", mode="before")
    @classmethod
    def _source_kind(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return _single_source(value)
        if not value:
            raise ValueError("a list of sources needs at least one {source: ..., weight: w}")
        members = []
        for i, item in enumerate(value):
            if isinstance(item, WeightedSource):
                members.append(item)
                continue
            if not isinstance(item, dict) or "source" not in item:
                raise ValueError(f"item {i}: expected {{source: ..., weight: w}}, got {item!r}")
            try:
                members.append(WeightedSource.model_validate(item))
            except ValidationError as exc:
                raise ValueError(f"item {i}: " + format_validation_error(exc, WeightedSource)) from None
        return members


class PluginSection(_Section):
    name: str
    config: dict[str, Any] = Field(default_factory=dict)


class StepSection(_Section):
    """One step of a pipeline (``steps``): a pruner, its config and the stages that train what it left."""

    pruner: str = Field(description="The step's pruner (compresskit plugins lists them).")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The pruner's config (compresskit schema PRUNER); its target_sparsity is its share of the "
        "original model's projection MACs, aimed at what the earlier steps left.",
    )
    training: list[PluginSection] = Field(
        default_factory=list, description="Training stages run after this step's pruner, before the next step."
    )


class SpeedSection(_Section):
    """Time to first token and per output token on the inference runtime, beside the dense base."""

    measure: bool | Literal["auto"] = Field(
        "auto",
        description="auto: on a GPU (compiled decode, CUDA graphs), 'not measured' on a CPU; true: wherever the "
        "model runs (eagerly on a CPU); false: never",
    )
    prompt: int = Field(512, ge=1, description="Prompt tokens (random ids) of each timed generation.")
    new_tokens: int = Field(32, ge=2, description="Tokens generated after the prompt (TPOT is their mean).")
    batch: int = Field(1, ge=1, description="Sequences generated together.")
    repeats: int = Field(3, ge=1, description="Timed generations after one warm-up; medians are reported.")


class EvaluationSection(_Section):
    tasks: list[str] = Field(
        default_factory=lambda: list(tasks.DEFAULT_TASKS),
        description="Tasks to run, in order: the built-in offline ones (perplexity, piqa, next_sentence by "
        "default; code_perplexity, legal_perplexity: text of domains the default training mix lacks) or any "
        "lm-eval task or group name (its data must be available offline unless model.allow_download is set).",
    )
    num_fewshot: int | dict[str, int] = Field(
        0,
        description="Few-shot examples for the lm-eval tasks: one number for all, or {task: n}; the built-in "
        "tasks are zero-shot.",
    )
    task_paths: list[str] = Field(
        default_factory=list, description="Folders of lm-eval task YAML files (lm-eval's include_path)."
    )
    limit: int | None = Field(None, ge=1, description="Items per zero-shot task (None: all); a fixed prefix.")
    perplexity_docs: int | None = Field(None, ge=1, description="Held-out articles for perplexity (None: all).")
    batch_size: int = Field(16, ge=1, description="Most sequences lm-eval scores in one forward pass.")
    logits_budget_mb: int = Field(
        1024,
        ge=16,
        description="Memory one batch's full-vocabulary log-probabilities may take (fp32 logits and their "
        "log-softmax, as lm-eval holds them): batches are made smaller than batch_size to fit.",
    )
    max_length: int = Field(1024, ge=16, description="Context window of the rolling perplexity and of lm-eval.")
    next_sentence_items: int = Field(500, ge=1)
    compare_dense: bool = Field(True, description="Also evaluate the unpruned model (cached) and report recovery.")
    engine: Literal["auto", "transformers", "runtime"] = Field(
        "auto",
        description="What computes the logits the evaluator scores. runtime: compresskit's inference runtime with "
        "the method's own blocks (what generate and bench run); transformers: the model's own modules (the "
        "reference path); auto: the runtime on a GPU where it runs the model's architecture (the Llama family), "
        "transformers elsewhere. results.json says which ran (evaluation.engine).",
    )
    speed: SpeedSection = Field(
        default_factory=SpeedSection, description="TTFT / TPOT on the runtime against the dense base (a GPU's)."
    )
    seed: int = 1234

    @field_validator("tasks")
    @classmethod
    def _named_tasks(cls, names: list[str]) -> list[str]:
        # built-in names here; lm-eval's are resolved by tasks.check_lm_eval_tasks before the model loads
        if not names:
            raise ValueError(f"name at least one task: built in {', '.join(tasks.names())}, or lm-eval tasks")
        if len(set(names)) != len(names):
            raise ValueError(f"a task is listed twice: {names}")
        return names

    @model_validator(mode="after")
    def _fewshot_for_listed_lm_eval_tasks(self) -> EvaluationSection:
        counts = self.num_fewshot if isinstance(self.num_fewshot, dict) else {"": self.num_fewshot}
        for name, n in counts.items():
            if n < 0:
                raise ValueError(f"num_fewshot{'.' + name if name else ''} must be >= 0, got {n}")
            if name and name not in self.tasks:
                raise ValueError(f"num_fewshot names {name!r}, which is not in tasks {self.tasks}")
            if name and tasks.builtin(name) and n:
                raise ValueError(f"num_fewshot.{name}: the built-in task {name!r} is zero-shot")
        return self


class OutputSection(_Section):
    dir: str
    overwrite: bool = Field(False, description="Replace a finished run of a different recipe in dir.")


class DistributedSection(_Section):
    """Training on several GPUs of one host (launched by ``compresskit apply --nproc N`` or torchrun)."""

    strategy: Literal["fsdp2"] = Field(
        "fsdp2",
        description="how several ranks train: fsdp2, the backbone sharded over the ranks "
        "(torch.distributed.fsdp.fully_shard, one unit per decoder layer), each rank training on its share of "
        "every optimiser step's micro-batches; one process trains alone whatever this says",
    )
    timeout_s: int = Field(
        1800, ge=10, description="A collective that waits longer than this fails the run instead of hanging."
    )


class Recipe(_Section):
    schema_version: int = SCHEMA_VERSION
    name: str | None = None
    seed: int = 0
    deterministic: bool = Field(
        False,
        description="Deterministic algorithms only (torch.use_deterministic_algorithms, a fixed cuBLAS "
        "workspace): a run repeated on the same GPU and versions gives the same numbers, at some cost in "
        "speed. Off, a GPU's atomic adds and library heuristics make runs of one seed differ slightly.",
    )
    model: ModelSection
    data: DataSection = DataSection()
    pruner: PluginSection | None = None
    training: list[PluginSection] = Field(default_factory=list)
    steps: list[StepSection] | None = Field(
        None,
        min_length=1,
        description="A pipeline: pruners applied in turn, each with its own training stages (instead of pruner "
        "and training); compresskit.pipeline says which orders compose.",
    )
    executor: PluginSection = PluginSection(name="torch")
    evaluation: EvaluationSection = EvaluationSection()
    distributed: DistributedSection = DistributedSection()
    output: OutputSection

    @model_validator(mode="after")
    def _steps_or_one_pruner(self) -> Recipe:
        if self.steps is not None and (self.pruner is not None or self.training):
            given = " and ".join(k for k, v in (("pruner", self.pruner), ("training", self.training)) if v)
            raise ValueError(
                f"steps: a recipe gives its pruners as steps or as one pruner with training, not both (given steps "
                f"and {given}); move them into a step: {{pruner: NAME, config: {{...}}, training: [...]}}"
            )
        return self

    @model_validator(mode="after")
    def _output_is_not_the_model(self) -> Recipe:
        model_dir = Path(self.model.name_or_path).expanduser().resolve()
        out_dir = Path(self.output.dir).expanduser().resolve()
        if out_dir == model_dir or model_dir.is_relative_to(out_dir):
            raise ValueError(
                f"output.dir {self.output.dir!r} would overwrite the input model.name_or_path "
                f"{self.model.name_or_path!r}; write the run somewhere else"
            )
        return self

    @model_validator(mode="after")
    def _held_out_text_for_the_tasks_that_read_it(self) -> Recipe:
        sources = self.data.source if isinstance(self.data.source, list) else [self.data.source]
        kinds = [s.source if isinstance(s, WeightedSource) else s for s in sources]
        readers = [t for t in ("perplexity", "next_sentence") if t in self.evaluation.tasks]
        if readers and all(isinstance(k, GeneratedSource) for k in kinds):
            raise ValueError(
                f"data.source: only generated text, which is training text only, so evaluation.tasks "
                f"{', '.join(readers)} would have no held-out text; add a source to hold out (wiki, files or hf)"
            )
        return self


# ---------------------------------------------------------------------------------------------
# error formatting


def _walk(model: type[BaseModel], loc: tuple) -> tuple[Any, Any] | None:
    """(annotation, FieldInfo) reached by walking ``loc`` from ``model`` (None if unknown); list
    indices are skipped, the FieldInfo is None for an empty ``loc``."""
    current: Any = model
    info = None
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        info = current.model_fields[part]
        current = _unwrap(info.annotation)
    return current, info


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str] | None:
    """Field names of the sub-model found by walking ``loc`` from ``model`` (None if unknown)."""
    found = _walk(model, loc)
    if found is not None and isinstance(found[0], type) and issubclass(found[0], BaseModel):
        return list(found[0].model_fields)
    return None


def _unwrap(annotation: Any) -> Any:
    """The model an annotation holds: itself, or the first model inside an optional, union or list of them."""
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        inner = _unwrap(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return annotation


_LOWER = {"ge": "<=", "gt": "<"}  # bound <= value
_UPPER = {"le": "<=", "lt": "<"}  # value <= bound


def _allowed_range(model: type[BaseModel], loc: tuple) -> str | None:
    """``"allowed: 0 <= value < 1"`` for a numeric field with bounds (None when it has none)."""
    found = _walk(model, loc)
    if found is None or found[1] is None:
        return None
    lower = upper = ""
    for meta in found[1].metadata:
        for attr, sign in _LOWER.items():
            if getattr(meta, attr, None) is not None:
                lower = f"{getattr(meta, attr)} {sign} "
        for attr, sign in _UPPER.items():
            if getattr(meta, attr, None) is not None:
                upper = f" {sign} {getattr(meta, attr)}"
    return f"allowed: {lower}value{upper}" if lower or upper else None


def format_validation_error(
    exc: ValidationError, model: type[BaseModel], prefix: str = "", names: dict[str, str] | None = None
) -> str:
    """:func:`validation_problems` joined with '; ' (one line)."""
    return "; ".join(validation_problems(exc, model, prefix, names))


def validation_problems(
    exc: ValidationError, model: type[BaseModel], prefix: str = "", names: dict[str, str] | None = None
) -> list[str]:
    """One entry per problem: ``path: what is wrong (given: X; allowed: ...)``. ``names`` renames a
    top-level field where the value came from elsewhere (a CLI flag)."""
    parts = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        if names and loc and loc[0] in names:
            path = names[str(loc[0])]
        else:
            path = (prefix + ".".join(str(p) for p in loc)).rstrip(".") or "recipe"
        if err["type"] == "extra_forbidden":
            allowed = _fields_at(model, loc[:-1]) or []
            parts.append(f"{path}: {did_you_mean(str(loc[-1]), allowed, what='key')}")
        elif err["type"] == "missing":
            parts.append(f"{path}: required key is missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            given = err.get("input")
            if isinstance(given, (dict, list)):  # a rule across fields: the message says what is wrong
                parts.append(f"{path}: {msg}")
                continue
            given_s = json.dumps(given) if isinstance(given, (int, float, str, bool, type(None))) else repr(given)
            bounds = (
                _allowed_range(model, loc)
                if err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
                else None
            )
            parts.append(f"{path}: {msg} (given: {given_s[:80]}" + (f"; {bounds})" if bounds else ")"))
    return parts


# ---------------------------------------------------------------------------------------------
# YAML loading, include and overrides


def _deep_merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        raise RecipeError(
            f"{path}: the file is empty (or holds only comments); a recipe needs at least model.name_or_path "
            "and output.dir, e.g. recipes/quickstart.yaml"
        )
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of keys, got {type(data).__name__}")
    return data


def load_raw(path: str | Path, _stack: tuple[Path, ...] = ()) -> dict:
    """Read a recipe YAML and resolve ``include:`` (relative paths, in order, the file itself last)."""
    path = Path(path).resolve()
    if path in _stack:
        chain = " -> ".join(str(p) for p in (*_stack, path))
        raise RecipeError(f"include cycle: {chain}")
    data = _read_yaml(path)
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise RecipeError(f"{path}: include: expected a path or a list of paths, given {includes!r}")
    merged: dict = {}
    for inc in includes:
        merged = _deep_merge(merged, load_raw(path.parent / inc, (*_stack, path)))
    return _deep_merge(merged, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.0.c=value`` -> (["a", "b", "0", "c"], yaml-parsed value)."""
    if "=" not in text:
        raise RecipeError(f"--set {text!r}: expected KEY=VALUE, for example --set evaluation.limit=50")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"--set {text!r}: the key must be a dotted path such as pruner.config.target_sparsity")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.split("."), parsed


def apply_overrides(raw: dict, overrides: list[str] | dict[str, Any] | None) -> dict:
    """Apply ``--set`` overrides (a list of KEY=VALUE strings or a {dotted.key: value} dict)."""
    if not overrides:
        return raw
    items = (
        [parse_override(o) for o in overrides]
        if isinstance(overrides, list)
        else [(k.split("."), v) for k, v in overrides.items()]
    )
    out = copy.deepcopy(raw)
    for parts, value in items:
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            nxt = parts[i + 1]
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise RecipeError(f"--set {'.'.join(parts)}: index {part} is out of range (list of {len(node)})")
                node = node[int(part)]
            else:
                if node.get(part) is None:
                    node[part] = [] if nxt.isdigit() else {}
                node = node[part]
        last = parts[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) > len(node):
                raise RecipeError(f"--set {'.'.join(parts)}: index {last} is out of range (list of {len(node)})")
            if int(last) == len(node):
                node.append(value)
            else:
                node[int(last)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            parent = ".".join(parts[:-1])
            given = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
            raise RecipeError(
                f"--set {'.'.join(parts)}: {parent} is a {type(node).__name__} ({node!r}), not a mapping, so it has "
                f"no key {last!r}; write the mapping whole: --set '{parent}={{{last}: {given}}}'"
            )
    return out


# ---------------------------------------------------------------------------------------------
# validation


@dataclass
class ResolvedPlugin:
    kind: str
    name: str
    cls: type
    config: PluginConfig
    path: str  # YAML path of the section, e.g. "training.0"


# fields added after runs were saved (dotted paths): left out of the resolved recipe (and its hash) at their
# default, so that those runs stay the same recipe's and are reused
OMITTED_AT_DEFAULT = {"deterministic": False, "evaluation.engine": "auto", "steps": None}


@dataclass
class ResolvedStep:
    """One step of a run: its pruner (None: a run without one) and the stages that train what it left. ``path``:
    the YAML path of the step (``steps.0``), "" for a recipe's one ``pruner`` and ``training``."""

    pruner: ResolvedPlugin | None
    training: list[ResolvedPlugin]
    path: str = ""


@dataclass
class ResolvedRecipe:
    """A recipe with every plugin loaded and every plugin config validated (defaults filled). ``steps``: what
    runs, in order (a recipe's one pruner and training as one step, its pruner None in a dense run); for a pipeline,
    ``pruner`` is its :class:`compresskit.pipeline.Pipeline` (named ``pipeline``) and ``training`` every step's
    stages in order."""

    recipe: Recipe
    pruner: ResolvedPlugin | None
    training: list[ResolvedPlugin]
    executor: ResolvedPlugin
    source: str | None = None
    overrides: list[str] = field(default_factory=list)
    steps: list[ResolvedStep] = field(default_factory=list)

    @property
    def pipeline(self) -> bool:
        """Whether the recipe gives its pruners as ``steps``."""
        return self.recipe.steps is not None

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved recipe as plain JSON data (what is saved with every output)."""
        data = self.recipe.model_dump(mode="json")
        if self.pipeline:
            del data["pruner"], data["training"]
            for k, step in enumerate(self.steps):
                data["steps"][k]["config"] = step.pruner.config.model_dump(mode="json")
                data["steps"][k]["training"] = [_stage_dict(s) for s in step.training]
        else:
            if self.pruner is not None:
                data["pruner"]["config"] = self.pruner.config.model_dump(mode="json")
            data["training"] = [_stage_dict(s) for s in self.training]
        data["executor"]["config"] = self.executor.config.model_dump(mode="json")
        for path, default in OMITTED_AT_DEFAULT.items():  # recipes written before the field keep their hash
            *parents, key = path.split(".")
            section = data
            for name in parents:
                section = section.get(name) or {}
            if key in section and section[key] == default:
                del section[key]
        return data

    def hash(self) -> str:
        """sha256 of everything that determines the results (the output section excluded)."""
        data = self.to_dict()
        data.pop("output", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _stage_dict(stage: ResolvedPlugin) -> dict[str, Any]:
    """A training stage as the resolved recipe saves it: its config's fields added later left out at their
    defaults (``omitted_at_default``)."""
    config = stage.config.model_dump(mode="json")
    omitted = stage.config.omitted_at_default
    return {"name": stage.name, "config": {k: v for k, v in config.items() if k not in omitted or v != omitted[k]}}


def validate_plugin(kind: str, section: PluginSection, path: str, pruner_cls: type | None = None) -> ResolvedPlugin:
    """The plugin of ``section`` loaded and its config validated; a training stage's with the options of the
    recipe's pruner (``pruner_cls``) where the stage takes them (:func:`stage_config_class`). A pipeline's
    step (``path`` ``steps.N``) names its pruner under ``pruner``."""
    name_key = f"{path}.pruner" if path.startswith("steps.") and kind == "pruner" else f"{path}.name"
    if kind == "pruner" and section.name == NAME:
        raise RecipeError(f"{name_key}: {NAME} is what a recipe's steps make; give the pruners as steps: [...]")
    try:
        cls = plugins.load(kind, section.name)
    except CompressKitError as exc:
        raise RecipeError(f"{name_key}: {exc}") from None
    config_cls = stage_config_class(cls, pruner_cls) if kind == "trainer" else cls.Config
    try:
        config = config_cls.model_validate(section.config)
    except ValidationError as exc:
        problems = validation_problems(exc, config_cls, prefix=f"{path}.config.")
        if kind == "trainer":
            problems = [_with_owner(p, exc, path, pruner_cls) for p in problems]
        raise RecipeProblems(problems) from None
    return ResolvedPlugin(kind=kind, name=section.name, cls=cls, config=config, path=path)


def _with_owner(problem: str, exc: ValidationError, path: str, pruner_cls: type | None) -> str:
    """A training stage's unknown key that is a training option of an installed pruner: the problem, saying whose
    option it is (another pruner's, or one this stage does not take)."""
    unknown = {f"{path}.config.{e['loc'][0]}": e["loc"][0] for e in exc.errors() if e["type"] == "extra_forbidden"}
    key = unknown.get(problem.split(":", 1)[0])
    if key is None:
        return problem

    def offers(cls) -> bool:
        options = getattr(cls, "TrainingOptions", None)
        return options is not None and key in options.model_fields

    owners = plugins.names_where("pruner", offers)
    if not owners:
        return problem
    if pruner_cls is not None and offers(pruner_cls):
        takers = plugins.names_where("trainer", lambda cls: cls.takes_pruner_options)
        stages = ", ".join(takers)
        return f"{problem} ({key} is the pruner's training option, given to a stage that trains with it: {stages})"
    return f"{problem} ({key} is a training option of pruner {' / '.join(owners)}; this recipe's pruner has none such)"


def stage_config_class(trainer_cls: type, pruner_cls: type | None) -> type[PluginConfig]:
    """The config class of a training stage of ``trainer_cls`` in a recipe whose pruner is of ``pruner_cls``
    (None: no pruner): the stage's own, with the pruner's ``TrainingOptions`` fields merged in where the stage
    trains with the pruner (``Trainer.takes_pruner_options``) and the pruner has options."""
    options = getattr(pruner_cls, "TrainingOptions", None)
    if options is None or not trainer_cls.takes_pruner_options:
        return trainer_cls.Config
    return _merged_config(trainer_cls.Config, options)


@functools.cache
def _merged_config(config: type[PluginConfig], options: type[PluginConfig]) -> type[PluginConfig]:
    merged = create_model(config.__name__, __base__=(config, options), __module__=config.__module__)
    merged.omitted_at_default = {**options.omitted_at_default, **config.omitted_at_default}
    return merged


def problems_of(error: CompressKitError) -> list[str]:
    """The one-line problems an error reports (several for :class:`RecipeProblems`)."""
    return list(getattr(error, "problems", None) or [str(error)])


def valid_section(raw: dict, key: str, model: type[BaseModel]) -> Any:
    """``raw[key]`` validated as ``model`` (its defaults where the key is absent), or None where it
    is not valid: what checks of one section read when another section of the recipe is wrong."""
    try:
        return model.model_validate(raw.get(key) if raw.get(key) is not None else {})
    except ValidationError:
        return None


def _plugin_sections(raw: dict, recipe: Recipe | None) -> list[tuple[str, str, PluginSection, str | None]]:
    """``(kind, path, section, owner)`` of each plugin section, a pruner before the stages that train with it
    (``owner``: the path of a stage's pruner, None for the others): the validated ``recipe``'s, or where the
    recipe as a whole did not validate (None), each section of ``raw`` that is well formed by itself, so that its
    plugin's config can still be checked."""
    if recipe is not None:
        entries: list[tuple[str, str, Any, str | None]] = []
        if recipe.steps is not None:
            for k, step in enumerate(recipe.steps):
                entries.append(("pruner", f"steps.{k}", {"name": step.pruner, "config": step.config}, None))
                entries += [
                    ("trainer", f"steps.{k}.training.{i}", t, f"steps.{k}") for i, t in enumerate(step.training)
                ]
        else:
            entries += [("pruner", "pruner", recipe.pruner, None)] if recipe.pruner else []
            entries += [("trainer", f"training.{i}", s, "pruner") for i, s in enumerate(recipe.training)]
        entries.append(("executor", "executor", recipe.executor, None))
        return [(k, p, PluginSection.model_validate(s), o) for k, p, s, o in entries]
    entries = [("pruner", "pruner", raw.get("pruner"), None), ("executor", "executor", raw.get("executor"), None)]
    stages = raw.get("training")
    if isinstance(stages, list):
        entries += [("trainer", f"training.{i}", s, "pruner") for i, s in enumerate(stages)]
    steps = raw.get("steps")
    for k, step in enumerate(steps if isinstance(steps, list) else []):
        if not isinstance(step, dict) or not isinstance(step.get("pruner"), str):
            continue
        entries.append(("pruner", f"steps.{k}", {"name": step["pruner"], "config": step.get("config") or {}}, None))
        stages = step.get("training")
        if isinstance(stages, list):
            entries += [("trainer", f"steps.{k}.training.{i}", t, f"steps.{k}") for i, t in enumerate(stages)]
    found = []
    for kind, path, value, owner in entries:
        if value is None:
            continue
        try:
            found.append((kind, path, PluginSection.model_validate(value), owner))
        except ValidationError:
            continue  # its problem is among the recipe's own
    return found


def _pipeline_problems(steps: list[ResolvedStep]) -> list[str]:
    """What the composition contract refuses in a pipeline's ``steps``, each naming both steps: an order a
    pruner refuses (``Pruner.followed_by_problem`` / ``follows_problem``), a stage that leaves a model the next
    step cannot prune (``Trainer.followed_problem``), shares of the original MACs that sum to 1 or more."""
    problems = []
    for earlier, later in zip(steps, steps[1:], strict=False):
        a, b = earlier.pruner, later.pruner
        refused = a.cls.followed_by_problem(b.cls)
        problem = f"{a.name} {refused}" if refused else None
        if problem is None and (refused := b.cls.follows_problem(a.cls)):
            problem = f"{b.name} {refused}"
        if problem:
            problems.append(f"{later.path}.pruner: {b.name} cannot follow {a.name} ({earlier.path}): {problem}")
        for stage in earlier.training:
            problem = stage.cls.followed_problem(stage.config)
            if problem:
                problems.append(f"{stage.path}: {problem} ({later.path}, {b.name}, prunes the model after it)")
    shares = [(step, step.pruner.cls.budget(step.pruner.config)) for step in steps]
    given = [(step, share) for step, share in shares if share is not None]
    if sum(share for _, share in given) >= 1.0:
        terms = " + ".join(f"{share:g} ({step.path}, {step.pruner.name})" for step, share in given)
        problems.append(
            f"steps: the steps' target_sparsity are shares of the original model's MACs and sum to "
            f"{sum(s for _, s in given):.4g} = {terms}; together they must stay below 1"
        )
    return problems


def validate(raw: dict, *, source: str | None = None, overrides: list[str] | None = None) -> ResolvedRecipe:
    """Both validation stages on an already-merged recipe mapping. Every problem found is reported
    together (:class:`RecipeProblems`): the recipe's own fields, then each plugin's config, then what each
    training stage needs of its pruner and what a pipeline's order allows."""
    problems: list[str] = []
    recipe = None
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        problems = validation_problems(exc, Recipe)
    if recipe is not None and recipe.schema_version > SCHEMA_VERSION:
        raise RecipeError(
            f"schema_version: {recipe.schema_version} is newer than this compresskit understands "
            f"(<= {SCHEMA_VERSION}); upgrade compresskit"
        )
    resolved: dict[str, ResolvedPlugin] = {}
    for kind, path, section, owner in _plugin_sections(raw, recipe):  # a pruner first: its options reach its stages
        pruner_cls = resolved[owner].cls if owner in resolved else None
        try:
            resolved[path] = validate_plugin(kind, section, path, pruner_cls)
        except CompressKitError as exc:
            problems += problems_of(exc)
    if problems or recipe is None:
        raise RecipeProblems(problems)
    if recipe.steps is not None:
        steps = [
            ResolvedStep(
                resolved[f"steps.{k}"],
                [resolved[f"steps.{k}.training.{i}"] for i in range(len(s.training))],
                f"steps.{k}",
            )
            for k, s in enumerate(recipe.steps)
        ]
    else:
        steps = [ResolvedStep(resolved.get("pruner"), [resolved[f"training.{i}"] for i in range(len(recipe.training))])]
    for step in steps:  # what a stage needs of its pruner, said before any model loads
        for stage in step.training:
            problem = stage.cls.pruner_problem(step.pruner.cls if step.pruner else None)
            if problem:
                problems.append(f"{stage.path}.name: {problem}")
    if recipe.steps is not None:
        problems += _pipeline_problems(steps)
    if problems:
        raise RecipeProblems(problems)
    pruner, training = steps[0].pruner, steps[0].training
    if recipe.steps is not None:
        pruner, training = _pipeline_plugin(steps), [stage for step in steps for stage in step.training]
    return ResolvedRecipe(
        recipe, pruner, training, resolved["executor"], source=source, overrides=list(overrides or []), steps=steps
    )


def _pipeline_plugin(steps: list[ResolvedStep]) -> ResolvedPlugin:
    """The :class:`compresskit.pipeline.Pipeline` of a recipe's ``steps``, as its ``pruner``."""
    config = PipelineConfig(
        steps=[{"name": s.pruner.name, "config": s.pruner.config.model_dump(mode="json")} for s in steps]
    )
    return ResolvedPlugin(kind="pruner", name=NAME, cls=Pipeline, config=config, path="steps")


def load_recipe(path: str | Path | dict, overrides: list[str] | dict[str, Any] | None = None) -> ResolvedRecipe:
    """Load, compose, override and validate a recipe (a YAML path or an already-parsed mapping)."""
    raw = load_raw(path) if not isinstance(path, dict) else copy.deepcopy(path)
    raw = apply_overrides(raw, overrides)
    ov = overrides if isinstance(overrides, list) else [f"{k}={v}" for k, v in (overrides or {}).items()]
    return validate(raw, source=None if isinstance(path, dict) else str(path), overrides=ov)


# ---------------------------------------------------------------------------------------------
# comparisons


class ComparisonOutput(_Section):
    dir: str


class Comparison(_Section):
    """A list of recipes compared on one table (``compresskit compare spec.yaml``)."""

    compare: list[str] = Field(min_length=1, description="Recipe paths, relative to this file.")
    seeds: list[int] | None = Field(
        None, min_length=1, description="Run every member once per recipe seed; the table shows mean ± spread."
    )
    output: ComparisonOutput

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int] | None) -> list[int] | None:
        if seeds is not None and len(set(seeds)) != len(seeds):
            raise ValueError(f"a seed is listed twice: {seeds}")
        return seeds


def is_comparison(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix in (".yaml", ".yml") and path.is_file() and "compare" in _read_yaml(path)


def load_comparison(path: str | Path) -> tuple[list[Path], Path, list[int] | None]:
    """(member recipe paths, output directory, seeds or None) of a comparison spec; every member
    must exist."""
    path = Path(path)
    try:
        spec = Comparison.model_validate(_read_yaml(path))
    except ValidationError as exc:
        raise RecipeError(f"{path}: " + format_validation_error(exc, Comparison)) from None
    members = [path.parent / m for m in spec.compare]
    missing = [str(m) for m in members if not m.is_file()]
    if missing:
        raise RecipeError(f"{path}: compare: recipe files not found: {', '.join(missing)}")
    return members, Path(spec.output.dir), spec.seeds
