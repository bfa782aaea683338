"""What a recipe's run will need, before anything is loaded: ``compresskit apply --dry-run``.

The model is built on the meta device from its config (no weights read), the pruner attached to it
and each stage's trainable parameters set up as in the real run, so the parameter counts are exact.
The peak memory per GPU (or, on the CPU, of the process) is an estimate, a row per training stage, the
sum of:

- **weights**: every parameter in the model's dtype, divided over the ranks when sharded (FSDP2),
  plus two decoder layers gathered whole (the one running and the one prefetched), plus the dense copy a
  distilling run keeps as its teacher where the model cannot show the dense one (a pruner that changes
  weights, or a stage that distils during or after a ``finetune`` stage or a merged LoRA);
- **trainable state**: the trained parameters in fp32 with their gradient and AdamW's two moments
  (16 bytes a parameter), divided over the ranks when sharded;
- **activations**: what backward keeps per token and layer of a micro-batch with the backbone frozen, without
  recomputation: the two norms' inputs, q / k / v, the attention output, the FFN's gate, up, activation and
  product and the reduction's input; under bf16 autocast (a GPU) also the five bf16 copies of the normed inputs
  the projections cast, and each router's fp32 input; with LoRA, each adapted projection's input again (its
  adapter's own copy: a cast under autocast, the dropout's output without) and, with dropout, its mask (one byte
  an element on a GPU, a float in the compute dtype on the CPU);
- **logits**: the micro-batch's logits in the compute dtype, their fp32 copy for the loss and its
  gradient; with distillation six fp32 tensors of the logits' size more, which the KL holds at once (the
  teacher's and the student's logits at temperature, their two log-distributions, the teacher's
  probabilities and the elementwise term; measured on the H200 at 12.2-12.9 bytes a logit above the
  three this term counted before, docs/train-memory-h200.md);
- a fixed 0.5 GiB for the CUDA context and workspaces; on the CPU instead, the process with the libraries a
  run imports (torch, transformers, lm-eval, datasets: 0.54-0.55 GiB resident on this project's 2-core CPU
  machine, 2026-12-03, ``python benchmarks/sample_memory.py --imports``).

On the CPU the step's tensors (trained state, activations, logits) count ``HEAP_GROWTH_CPU`` times: they come
from the C library's heap, which grows past the live bytes as a step's tensors of many sizes are freed and
allocated again (the process's peak resident memory above its libraries and weights was 1.54-1.67 times these
three terms for the router and LoRA stages of ``recipes/wide-smollm2-50-quick.yaml`` at 2 x 256 and 4 x 512 tokens;
docs/memory-cpu.md).

A last row, **evaluation**: the weights, the largest batch's full-vocabulary log-probabilities (lm-eval
holds the fp32 logits and their fp32 log-softmax; ``evaluation.logits_budget_mb`` caps them) and the
forward's per-layer work on it, the context or process again; on the CPU with the same heap growth. It was checked
against runs on the CPU (docs/memory-cpu.md), not yet on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compresskit.distill import keeps_teacher_copy
from compresskit.interfaces import RunContext
from compresskit.modeling import count_parameters, decoder_layers
from compresskit.routing import routed_projections
from compresskit.trainers import inject_lora, projection_names

# Imported inside the functions that use them: peft and transformers; so importing this module, and running the
# commands that do not need them (`--help` and `validate` first), stays fast.

CONTEXT_BYTES = 512 * 2**20
PROCESS_BYTES_CPU = 560 * 2**20  # on the CPU, in place of the CUDA context (module docstring)
HEAP_GROWTH_CPU = 1.6  # on the CPU, resident bytes a step's live tensor byte takes (module docstring)


@dataclass
class StagePlan:
    stage: str  # a training stage's name, or "evaluation"
    steps: int | None  # None: evaluation (its batches are lm-eval's)
    tokens_per_step: int  # over all ranks; evaluation: its largest batch's tokens
    trainable_params: int
    weights: int  # bytes per GPU
    trainable_state: int
    activations: int
    logits: int
    context: int = CONTEXT_BYTES  # the CUDA context, or on the CPU the process with its libraries
    growth: float = 1.0  # what a byte of the step's tensors takes (HEAP_GROWTH_CPU on the CPU)

    @property
    def peak(self) -> int:
        step = self.trainable_state + self.activations + self.logits
        return self.weights + round(self.growth * step) + self.context


@dataclass
class Plan:
    model: str
    params: int
    dtype: str  # what the steps compute in
    world: int
    sharded: bool
    stages: list[StagePlan]  # the training stages, then the evaluation


def meta_model(config):
    """The model of ``config`` on the meta device: its parameters' shapes, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def plan(resolved, *, world: int, config, dtype: torch.dtype, device: str = "cuda") -> Plan:
    """The plan of ``resolved`` (a resolved recipe) on ``world`` ranks, for a model of ``config`` in
    ``dtype`` on ``device`` ("cuda" or "cpu"). A stage computes in bf16 under its bf16 autocast (on a
    GPU), else in ``dtype``."""
    rec = resolved.recipe
    cuda = device == "cuda"
    sharded = world > 1  # (FSDP2, the one strategy: distributed.strategy)
    model = meta_model(config).to(dtype)
    pruners = [step.pruner.cls(step.pruner.config) if step.pruner else None for step in resolved.steps]
    owner = {}  # each stage's step's pruner (a pipeline's each attached to the whole model: an upper bound)
    for step, step_pruner in zip(resolved.steps, pruners, strict=True):
        if step_pruner is not None and not step_pruner.requires_calibration:  # (a calibrated one needs data)
            step_pruner.prepare(model, RunContext(model_config=config, device=torch.device("meta"), dtype=dtype))
        owner.update({id(stage): step_pruner for stage in step.training})
    pruner = pruners[0]
    params = count_parameters(model)
    layers = decoder_layers(model)
    layer_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)
    d, f = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    routers = sum(1 for n, _ in model.named_modules() if n.endswith(".router"))
    weight_elem = torch.finfo(dtype).bits // 8
    weight_bytes = params * weight_elem
    kept = keeps_teacher_copy(resolved.training, pruner, steps=len(resolved.steps))
    teacher = weight_bytes if kept else 0  # (not sharded: one per rank)
    context, growth = (CONTEXT_BYTES, 1.0) if cuda else (PROCESS_BYTES_CPU, HEAP_GROWTH_CPU)
    stages = []
    for stage in resolved.training:
        c = stage.config
        if stage.name == "none":
            continue
        if stage.name == "router-fit":  # forward passes only, then the fit on what every router read
            tokens = c.batch_size * c.seq_len
            fitted = (c.tokens // c.seq_len) * c.seq_len
            groups = sum(p.groups for _, p in routed_projections(model))
            stored = fitted * (routers * d + groups) * 4  # each router's fp32 input and its groups' scores
            stages.append(
                StagePlan(
                    stage=stage.name,
                    steps=c.steps,
                    tokens_per_step=fitted,
                    trainable_params=0,
                    weights=weight_bytes,
                    trainable_state=stored,
                    activations=tokens * (4 * d + 2 * kv + 4 * f) * weight_elem,
                    logits=tokens * config.vocab_size * weight_elem,
                    context=context,
                    growth=growth,
                )
            )
            continue
        autocast = cuda and getattr(c, "autocast_bf16", False)
        elem = 2 if autocast else weight_elem
        casts = 5 * d if autocast else 0  # the bf16 copies of the normed inputs that q, k, v, gate and up cast
        per_token_layer = (4 * d + casts + 2 * kv + 4 * f) * elem
        per_token_router = routers * d * 4 if autocast else 0  # (else the router reads what the projections keep)
        trainable = 0
        trained_with = owner[id(stage)]
        if trained_with is not None and trained_with.state != "new" and getattr(c, "train_pruner_params", True):
            trainable += sum(p.numel() for p in trained_with.trainable_parameters(model))
        per_token_lora = 0
        if stage.name == "lora":
            before = count_parameters(model)
            inject_lora(model, c)
            trainable += count_parameters(model) - before
            mask = (1 if cuda else elem) if c.dropout > 0 else 0
            per_token_lora = _lora_inputs(model) * (elem + mask)
        if stage.name == "finetune":
            names = projection_names(model, c.target_modules, "finetune")
            trainable += sum(model.get_submodule(n).weight.numel() for n in names)
        tokens = c.batch_size * c.seq_len
        stages.append(
            StagePlan(
                stage=stage.name,
                steps=c.steps,
                tokens_per_step=tokens * c.grad_accum * world,
                trainable_params=trainable,
                weights=weight_bytes // world + (2 * layer_bytes if sharded else 0) + teacher,
                trainable_state=(16 * trainable) // (world if sharded else 1),
                activations=tokens * (per_token_layer * len(layers) + per_token_router + per_token_lora),
                logits=tokens * config.vocab_size * (elem + 8 + (24 if c.distill is not None else 0)),
                context=context,
                growth=growth,
            )
        )
    tokens, activations, logits = _evaluation(rec.evaluation, config, elem=weight_elem, cuda=cuda)
    stages.append(StagePlan("evaluation", None, tokens, 0, weight_bytes, 0, activations, logits, context, growth))
    autocast = cuda and any(getattr(s.config, "autocast_bf16", False) for s in resolved.training)
    computes = torch.bfloat16 if autocast else dtype
    return Plan(rec.model.name_or_path, params, str(computes).removeprefix("torch."), world, sharded, stages)


def _evaluation(section, config, *, elem: int, cuda: bool) -> tuple[int, int, int]:
    """``(tokens, activations, logits)`` of the evaluation's row: its largest batch (``evaluation.batch_size``
    rows of ``max_length`` tokens, fewer where their log-probabilities would pass ``logits_budget_mb``, at least
    one row) with its fp32 logits and log-softmax, and the forward's per-layer work: one layer's FFN and
    attention tensors, and on the CPU the attention probabilities of each row (SDPA there forms them, scores
    and softmax, under a padding mask)."""
    vocab, length = config.vocab_size, section.max_length
    per_token = vocab * 8
    tokens = min(section.batch_size * length, max(section.logits_budget_mb * 2**20 // per_token, length))
    d, f = config.hidden_size, config.intermediate_size
    layer = tokens * (4 * d + 3 * f) * elem
    if not cuda:
        layer += (tokens // length) * config.num_attention_heads * length * length * 2 * elem
    return tokens, layer, tokens * per_token


def _lora_inputs(model) -> int:
    """Input features of every LoRA-adapted projection, summed: the elements a token's adapters keep."""
    from peft.tuners.lora import LoraLayer

    return sum(m.get_base_layer().in_features for m in model.modules() if isinstance(m, LoraLayer))


def size(n: int) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
