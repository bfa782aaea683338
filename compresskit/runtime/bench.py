"""Time to first token (TTFT) and time per output token (TPOT) of a model on the runtime, beside its
dense base on the same runtime and the dense base through transformers' ``generate``, side by side in
one process: medians over repeats, for every batch size and prompt length asked for, with the
realised sparsity of each measured run."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from compresskit.runtime.llama import Runtime


@dataclass
class Row:
    model: str  # "compressed", "dense" or "dense (transformers)"
    batch: int
    prompt: int
    ttft_ms: float
    tpot_ms: float
    sparsity: float | None = None  # realised fraction of projection MACs skipped, where counted
    extra: dict[str, Any] = field(default_factory=dict)


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def time_runtime(model, batch: int, prompt: int, new_tokens: int, repeats: int, seed: int = 0) -> tuple[float, float]:
    """Median TTFT and TPOT (ms) of greedy generation on the runtime (one warm-up first)."""
    rt = Runtime(model)
    prompts = _prompts(batch, prompt, model.config.vocab_size, seed)
    rt.generate(prompts, max_new_tokens=min(new_tokens, 2))  # warm-up: allocator, kernels
    ttft, tpot = [], []
    for _ in range(repeats):
        res = rt.generate(prompts, max_new_tokens=new_tokens)
        ttft.append(res.prefill_seconds * 1e3)
        steps = max(1, len(res.tokens[0]) - 1)
        tpot.append(res.decode_seconds * 1e3 / steps)
    return statistics.median(ttft), statistics.median(tpot)


def time_transformers(model, batch: int, prompt: int, new_tokens: int, repeats: int, seed: int = 0):
    """The same through transformers' ``generate`` (greedy, its default cache): TTFT is a one-token
    call, TPOT the rest of a ``new_tokens`` call per token."""
    ids = torch.tensor(_prompts(batch, prompt, model.config.vocab_size, seed), device=next(model.parameters()).device)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)

    def run(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return (time.perf_counter() - t0) * 1e3

    run(2)  # warm-up
    ttft = statistics.median(run(1) for _ in range(repeats))
    total = statistics.median(run(new_tokens) for _ in range(repeats))
    return ttft, (total - ttft) / max(1, new_tokens - 1)


def bench(
    model,
    dense,
    *,
    pruner=None,
    batches: list[int],
    prompts: list[int],
    new_tokens: int,
    repeats: int,
    progress=None,
) -> list[Row]:
    """Rows for the compressed ``model`` (with its ``pruner``, whose realised sparsity is read per
    run), its ``dense`` base on the runtime and through transformers, for each batch and prompt."""
    import contextlib

    rows = []
    cases = [(b, p) for b in batches for p in prompts]
    task_cm = progress.task("benchmarking", total=len(cases) * 3) if progress else contextlib.nullcontext()
    with task_cm as task:
        for b, p in cases:
            if pruner is not None:
                pruner.reset_sparsity(model)
            ttft, tpot = time_runtime(model, b, p, new_tokens, repeats)
            report = pruner.sparsity(model) if pruner is not None else None
            rows.append(Row("compressed", b, p, ttft, tpot, None if report is None else report.macs))
            for name, fn in (("dense", time_runtime), ("dense (transformers)", time_transformers)):
                if task is not None:
                    task.advance(1)
                ttft, tpot = fn(dense, b, p, new_tokens, repeats)
                rows.append(Row(name, b, p, ttft, tpot))
            if task is not None:
                task.advance(1)
    return rows


def speedups(rows: list[Row]) -> list[dict[str, Any]]:
    """One record per row with its TTFT and TPOT speedup over the dense runtime row of its case."""
    dense = {(r.batch, r.prompt): r for r in rows if r.model == "dense"}
    out = []
    for r in rows:
        d = dense[(r.batch, r.prompt)]
        out.append(
            {
                "model": r.model,
                "batch": r.batch,
                "prompt": r.prompt,
                "ttft_ms": round(r.ttft_ms, 3),
                "tpot_ms": round(r.tpot_ms, 3),
                "ttft_speedup": round(d.ttft_ms / r.ttft_ms, 3),
                "tpot_speedup": round(d.tpot_ms / r.tpot_ms, 3),
                "sparsity_macs": None if r.sparsity is None else round(r.sparsity, 4),
            }
        )
    return out


def markdown(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# compresskit bench",
        "",
        " ".join(f"{k}: {v};" for k, v in meta.items()),
        "",
        "| model | batch | prompt | TTFT ms | TPOT ms | TTFT x dense | TPOT x dense | sparsity MACs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        sp = "-" if r["sparsity_macs"] is None else f"{r['sparsity_macs']:.3f}"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['prompt']} | {r['ttft_ms']:.2f} | {r['tpot_ms']:.2f} | "
            f"{r['ttft_speedup']:.2f}x | {r['tpot_speedup']:.2f}x | {sp} |"
        )
    return "\n".join(lines) + "\n"
