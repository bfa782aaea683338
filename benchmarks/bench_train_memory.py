"""The dry run's peak-memory estimate (``compresskit/memory.py``) against the measured peak of a few
training steps, on one GPU, and the tokens a second those steps trained.

    python benchmarks/bench_train_memory.py --out DIR                          # H200: SmolLM2-135M and 8B shapes
    python benchmarks/bench_train_memory.py --smoke --out DIR                  # CPU: the path runs, nothing measured
    python benchmarks/bench_train_memory.py --shapes smollm2-135m --batch 8,32 --steps 30 --distill --out DIR
                                                                               # throughput: batch sizes, distillation

For each shape (``compresskit.bench.SHAPES``, random weights in bf16, built on the GPU) and each
stage (WIDE routers; LoRA with the routers), the script plans the stage as ``compresskit apply --dry-run``
does, then trains it for ``--steps`` steps on random token ids (memory does not depend on the text, and
the GPU machine lacks the embedded model's package) with the peak-memory counter reset after the model is
built, and prints the estimate beside ``torch.cuda.max_memory_allocated``
(plus the CUDA context the estimate adds), and the stage's tokens a second over those steps (after
``--warmup`` steps of the same stage, not counted, so that one-time costs stay out). ``--distill``: each
stage also distils the dense model (KL at temperature 2, half of the loss; the teacher is the same model
with the pruner off), as the recovery recipes do. Results: a table on stdout and ``train_memory.json`` /
``.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[i] / p) for i, p in ((0, ""), (1, "plugins/wide"), (1, ""))]
import benchmark_report as report  # noqa: E402  (beside this script)


class RandomTokens:
    """What a training stage reads of its data (``training_batches``): random token ids."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def training_batches(self, seq_len: int, batch_size: int, seed: int = 0, start_step: int = 0):
        from compresskit.interfaces import Batch

        gen = torch.Generator().manual_seed(seed + start_step)
        while True:
            ids = torch.randint(3, self.vocab, (batch_size, seq_len), generator=gen)
            yield Batch(ids, torch.ones_like(ids))


def stages(steps: int, batch: int, seq: int, distill: bool) -> list[dict]:
    base = {"steps": steps, "batch_size": batch, "seq_len": seq, "checkpoint_every": 10_000}
    if distill:
        base["distill"] = {"weight": 0.5, "temperature": 2.0}
    return [{"name": "router", "config": base}, {"name": "lora", "config": {**base, "r": 16}}]


def main() -> int:
    from compresskit import plugins
    from compresskit.bench import SHAPES, shape_model
    from compresskit.interfaces import RunContext
    from compresskit.memory import CONTEXT_BYTES, plan, size
    from compresskit.recipe import load_recipe

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,llama-3.1-8b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", default="4", help="batch sizes, comma-separated")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each stage run first, not measured")
    parser.add_argument("--distill", action="store_true", help="each stage also distils the dense model")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--smoke", action="store_true", help="CPU: run the path on tiny shapes, measure nothing")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    where = report.gpu_or_smoke(args.smoke)
    if where is None:
        return 2
    device, dtype = where
    cuda = device.type == "cuda"
    if args.smoke:
        args.shapes, args.steps, args.batch, args.seq, args.warmup = "tiny", 1, "1", 16, 1
    batches = [int(b) for b in args.batch.split(",") if b.strip()]

    rows = []
    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        if name not in SHAPES:
            parser.error(f"--shapes: unknown {name!r}; known: {', '.join(SHAPES)}")
        for stage in [st for batch in batches for st in stages(args.steps, batch, args.seq, args.distill)]:
            wide = {"target_sparsity": 0.5, "ffn_group_size": 16 if name == "tiny" else 128}
            recipe = {
                "model": {"name_or_path": "smollm2-135m", "dtype": str(dtype).removeprefix("torch.")},
                "pruner": {"name": "wide", "config": wide},
                "training": [stage],
                "output": {"dir": str(Path(args.out) / "unused")},
            }  # (validated only: the model is built from the shape)
            resolved = load_recipe(recipe)
            model = shape_model(name, device=device, dtype=dtype)
            estimate = plan(resolved, world=1, config=model.config, dtype=dtype, device="cuda" if cuda else "cpu")
            st = estimate.stages[0]
            cls = plugins.load("pruner", "wide")
            pruner = cls(cls.Config(**wide))
            ctx = RunContext(model_config=model.config, device=device, dtype=dtype, seed=0)
            pruner.prepare(model, ctx)
            data = RandomTokens(model.config.vocab_size)
            trainer_cls = plugins.load("trainer", stage["name"])
            warm = trainer_cls(trainer_cls.Config.model_validate({**stage["config"], "steps": args.warmup}))
            warm.fit(model, pruner, data, ctx)
            trainer = trainer_cls(trainer_cls.Config.model_validate(stage["config"]))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            summary = trainer.fit(model, pruner, data, ctx)
            measured = torch.cuda.max_memory_allocated() if cuda else None
            row = {
                "shape": name,
                "stage": stage["name"],
                "trained_params": st.trainable_params,
                "estimate_peak": st.peak,
                "estimate_without_context": st.peak - CONTEXT_BYTES,
                "measured_peak_allocated": measured,
                "allocated_before_training": before if cuda else None,
                "ratio": None if measured is None else round(measured / (st.peak - CONTEXT_BYTES), 3),
                "final_loss": summary.final_loss,
                "batch": stage["config"]["batch_size"],
                "distill": args.distill,
                "tokens_per_s": round(summary.tokens / summary.seconds),
            }
            rows.append(row)
            without = size(st.peak - CONTEXT_BYTES)
            print(
                f"{name:14s} {stage['name']:7s} batch {row['batch']:3d} estimate {size(st.peak)} (without context"
                f" {without})  measured {size(measured) if measured else '-'}  ratio {row['ratio']}"
                f"  {row['tokens_per_s']} tok/s",
                flush=True,
            )
            del model, pruner, trainer
            if cuda:
                torch.cuda.empty_cache()
    facts = report.run_facts(cuda, steps=args.steps, batch=args.batch, seq=args.seq, distill=args.distill)
    if not cuda:
        facts["gpu"] = "none (smoke run: nothing measured)"
    lines = [
        "| shape | stage | batch | trained params | estimate (no context) | measured peak allocated "
        "| measured / estimate | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = "-" if r["measured_peak_allocated"] is None else size(r["measured_peak_allocated"])
        lines.append(
            f"| {r['shape']} | {r['stage']} | {r['batch']} | {r['trained_params']:,} "
            f"| {size(r['estimate_without_context'])} | {m} | {r['ratio'] if r['ratio'] is not None else '-'} "
            f"| {r['tokens_per_s'] if cuda else '-'} |"
        )
    report.write(args.out, "train_memory", "Dry-run estimate against measured peak", facts, lines, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
