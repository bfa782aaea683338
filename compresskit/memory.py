"""What a recipe's training will need, before anything is loaded: ``compresskit apply --dry-run``.

The model is built on the meta device from its config (no weights read), the pruner attached to it
and each stage's trainable parameters set up as in the real run, so the parameter counts are exact.
The peak memory per GPU is an estimate, the sum of:

- **weights**: every parameter in the model's dtype, divided over the ranks when sharded (FSDP2),
  plus two decoder layers gathered whole (the one running and the one prefetched), plus the dense copy a
  distilling run keeps as its teacher where the model cannot show the dense one (a pruner that changes
  weights, or a stage that distils during or after a ``finetune`` stage or a merged LoRA);
- **trainable state**: the trained parameters in fp32 with their gradient and AdamW's two moments
  (16 bytes a parameter), divided over the ranks when sharded;
- **activations**: what backward keeps per token and layer of a micro-batch with the backbone frozen
  (the norms' inputs, q / k / v, the attention output, the FFN's gate, up, activation and product
  in the compute dtype, and each router's fp32 input), without recomputation; with LoRA, each adapted
  projection's input again (its adapter's own copy in the compute dtype, one byte more an element for the
  dropout mask);
- **logits**: the micro-batch's logits in the compute dtype, their fp32 copy for the loss and its
  gradient; with distillation six fp32 tensors of the logits' size more, which the KL holds at once (the
  teacher's and the student's logits at temperature, their two log-distributions, the teacher's
  probabilities and the elementwise term; measured on the H200 at 12.2-12.9 bytes a logit above the
  three this term counted before, docs/train-memory-h200.md);
- a fixed 0.5 GiB for the CUDA context and workspaces; on the CPU instead, the process with the libraries a
  run imports (torch, transformers, lm-eval, datasets: 0.54-0.55 GiB resident on this project's 2-core CPU
  machine, 2026-12-03, ``python benchmarks/sample_memory.py --imports``).

Evaluation is not a row: on the CPU it measured higher than training (``recipes/wide-smollm2-quick.yaml``, by
``python benchmarks/sample_memory.py -- compresskit apply recipes/wide-smollm2-quick.yaml --overwrite``; the README
has the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compresskit.distill import keeps_teacher_copy
from compresskit.interfaces import RunContext
from compresskit.modeling import count_parameters, decoder_layers
from compresskit.trainers import inject_lora, projection_names

# Imported inside the functions that use them: peft and transformers; so importing this module, and running the
# commands that do not need them (`--help` and `validate` first), stays fast.

CONTEXT_BYTES = 512 * 2**20
PROCESS_BYTES_CPU = 560 * 2**20  # on the CPU, in place of the CUDA context (module docstring)


@dataclass
class StagePlan:
    stage: str
    steps: int
    tokens_per_step: int  # over all ranks
    trainable_params: int
    weights: int  # bytes per GPU
    trainable_state: int
    activations: int
    logits: int
    context: int = CONTEXT_BYTES  # the CUDA context, or on the CPU the process with its libraries

    @property
    def peak(self) -> int:
        return self.weights + self.trainable_state + self.activations + self.logits + self.context


@dataclass
class Plan:
    model: str
    params: int
    dtype: str
    world: int
    sharded: bool
    stages: list[StagePlan]


def meta_model(config):
    """The model of ``config`` on the meta device: its parameters' shapes, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def plan(resolved, *, world: int, config, dtype: torch.dtype, device: str = "cuda") -> Plan:
    """The plan of ``resolved`` (a resolved recipe) on ``world`` ranks, for a model of ``config``
    computing in ``dtype`` on ``device`` ("cuda" or "cpu")."""
    rec = resolved.recipe
    sharded = world > 1  # (FSDP2, the one strategy: distributed.strategy)
    model = meta_model(config).to(dtype)
    pruner = None
    if resolved.pruner is not None:
        pruner = resolved.pruner.cls(resolved.pruner.config)
        if not pruner.requires_calibration:  # (a calibrated pruner needs data to attach: its count is left out)
            pruner.prepare(model, RunContext(model_config=config, device=torch.device("meta"), dtype=dtype))
    params = count_parameters(model)
    layers = decoder_layers(model)
    layer_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)
    d, f = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    elem = torch.finfo(dtype).bits // 8
    routers = sum(1 for n, _ in model.named_modules() if n.endswith(".router"))
    per_token_layer = (9 * d + 2 * kv + 4 * f) * elem
    per_token_router = routers * d * 4
    teacher = params * elem if keeps_teacher_copy(resolved.training, pruner) else 0  # (not sharded: one per rank)
    stages = []
    for stage in resolved.training:
        c = stage.config
        if stage.name == "none":
            continue
        trainable = 0
        if pruner is not None and pruner.state != "new" and getattr(c, "train_pruner_params", True):
            trainable += sum(p.numel() for p in pruner.trainable_parameters(model))
        per_token_lora = 0
        if stage.name == "lora":
            before = count_parameters(model)
            inject_lora(model, c)
            trainable += count_parameters(model) - before
            per_token_lora = _lora_inputs(model) * (elem + (1 if c.dropout > 0 else 0))
        if stage.name == "finetune":
            names = projection_names(model, c.target_modules, "finetune")
            trainable += sum(model.get_submodule(n).weight.numel() for n in names)
        tokens = c.batch_size * c.seq_len
        logit_bytes = tokens * config.vocab_size * (elem + 8 + (24 if c.distill is not None else 0))
        stages.append(
            StagePlan(
                stage=stage.name,
                steps=c.steps,
                tokens_per_step=tokens * c.grad_accum * world,
                trainable_params=trainable,
                weights=(params * elem) // world + (2 * layer_bytes if sharded else 0) + teacher,
                trainable_state=(16 * trainable) // (world if sharded else 1),
                activations=tokens * (per_token_layer * len(layers) + per_token_router + per_token_lora),
                logits=logit_bytes,
                context=CONTEXT_BYTES if device == "cuda" else PROCESS_BYTES_CPU,
            )
        )
    return Plan(rec.model.name_or_path, params, str(dtype).removeprefix("torch."), world, sharded, stages)


def _lora_inputs(model) -> int:
    """Input features of every LoRA-adapted projection, summed: the elements a token's adapters keep."""
    from peft.tuners.lora import LoraLayer

    return sum(m.get_base_layer().in_features for m in model.modules() if isinstance(m, LoraLayer))


def size(n: int) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
