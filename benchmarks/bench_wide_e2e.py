"""End-to-end speed of a WIDE-pruned model against the same model dense, through transformers.

    python benchmarks/bench_wide_e2e.py --out DIR                        # on the H200: Llama-3.1-8B shapes
    python benchmarks/bench_wide_e2e.py --smoke --out DIR                # tiny shapes, CPU (TRITON_INTERPRET=1)

One model with random weights (Llama-3.1-8B's shapes, ``--layers`` of them) is timed four ways, in this
order, on the same prompt: dense; WIDE's routers attached (``torch`` executor: masked dense, the
reference path); the ``wide-triton`` executor with ``backend="auto"`` (a kernel only where it was
measured faster); and with ``backend="triton"`` (the kernels everywhere). The routers are untrained
(random, zero bias), which skips about half of the groups per token independently: a speed test, not a
quality one; the realised sparsity is reported beside each WIDE row.

Timings: prefill = one forward of ``--batch x --prompt`` tokens (median of ``--repeats``); decode =
``generate`` of ``--new-tokens`` greedy tokens after that prompt (transformers' dynamic cache, eager),
its time minus one prefill, per new token (median of ``--repeats``). Each row says whether its outputs
matched the dense-masked reference (the ``torch`` executor's logits on the prompt). Results: a table on
stdout and ``e2e.json`` / ``e2e.md`` in ``--out`` with GPU, versions, date and command.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("plugins/wide", ".")]

CUDA = torch.cuda.is_available()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: compilation, autotuning, allocator
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_model(args, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.smoke:
        shape = dict(hidden_size=64, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
        vocab = 512
    else:  # Llama-3.1-8B
        shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
        vocab = 128256
    config = LlamaConfig(
        vocab_size=vocab,
        num_hidden_layers=args.layers,
        max_position_embeddings=args.prompt + args.new_tokens + 8,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def realised(model) -> dict:
    from compresskit.routing import measured_sparsity, routed_projections

    projs = [p for _, p in routed_projections(model)]
    rep = measured_sparsity(projs, model.config)
    for p in projs:
        p.reset_stats()
    return {"attention": round(rep.attention, 4), "ffn": round(rep.ffn, 4), "macs": round(rep.macs, 4)}


def speedups(dense: dict, row: dict) -> tuple[float, float]:
    """(prefill, decode) speedup of ``row`` over the dense row."""
    return (
        dense["prefill_ms"] / max(row["prefill_ms"], 1e-9),
        dense["decode_ms_per_token"] / max(row["decode_ms_per_token"], 1e-9),
    )


def time_model(name, model, ids, args, reference_logits, results):
    from compresskit.routing import routed_projections

    for _, p in routed_projections(model):
        p.reset_stats()
    with torch.no_grad():
        logits = model(ids).logits
        sparsity = realised(model) if routed_projections(model) else None
        ok = reference_logits is None or torch.allclose(
            logits.float(), reference_logits.float(), rtol=5e-2, atol=5e-2 if CUDA else 1e-4
        )
        err = None if reference_logits is None else (logits.float() - reference_logits.float()).abs().max().item()
        prefill = median_seconds(lambda: model(ids, use_cache=False), args.repeats)

        def gen():
            model.generate(
                ids,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

        total = median_seconds(gen, args.repeats)
    per_token = max(total - prefill, 0.0) / max(args.new_tokens - 1, 1)
    row = {
        "model": name,
        "correct": bool(ok),
        "max_abs_err_vs_masked_dense": err,
        "prefill_ms": prefill * 1e3,
        "decode_ms_per_token": per_token * 1e3,
        "sparsity": sparsity,
    }
    results.append(row)
    x_prefill, x_decode = speedups(results[0], row)
    print(
        f"{name:32s} ok={ok!s:5s} prefill {row['prefill_ms']:9.2f} ms ({x_prefill:4.2f}x) "
        f"| decode {row['decode_ms_per_token']:8.2f} ms/token ({x_decode:4.2f}x)"
        + (f" | realised MACs skipped {sparsity['macs']:.3f}" if sparsity else ""),
        flush=True,
    )
    return logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; 2 with --smoke)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 1024; 12 with --smoke)")
    parser.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 64; 3 with --smoke)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not CUDA and not args.smoke:
        print("no CUDA device: use --smoke (tiny shapes under TRITON_INTERPRET=1)")
        return 2
    args.layers = args.layers or (2 if args.smoke else 32)
    args.prompt = args.prompt or (12 if args.smoke else 1024)
    args.new_tokens = args.new_tokens or (3 if args.smoke else 64)
    if args.smoke:
        args.repeats = 1
    device = torch.device("cuda" if CUDA else "cpu")
    dtype = torch.bfloat16 if CUDA else torch.float32

    from compresskit import plugins
    from compresskit.interfaces import RunContext

    model = build_model(args, device, dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=gen).to(device)
    results: list[dict] = []
    time_model("dense", model, ids, args, None, results)

    wide = plugins.load("pruner", "wide")
    pruner = wide(wide.Config(target_sparsity=0.5))
    pruner.prepare(model, RunContext(model_config=model.config, device=device, dtype=dtype))
    model = pruner.finalize(model)
    reference = time_model("WIDE, torch (masked dense)", model, ids, args, None, results)
    executor = plugins.load("executor", "wide-triton")
    for backend in ("auto", "triton"):
        fast = executor(executor.Config(backend=backend))
        fast.check(model)
        converted = fast.convert(copy.deepcopy(model) if backend == "auto" else model)
        time_model(f"WIDE, wide-triton {backend}", converted, ids, args, reference, results)
        del converted
    import transformers
    import triton

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if CUDA else "none (CPU interpreter, timings meaningless)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": str(dtype),
        "command": " ".join(sys.argv),
        "shape": {k: getattr(model.config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads")},
        "layers": args.layers,
        "batch": args.batch,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "routers": "untrained (random init, zero bias), target 0.5",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    dense = results[0]
    lines = [
        f"# WIDE end to end\n\n{json.dumps(meta)}\n",
        "| model | correct | prefill ms | x dense | decode ms/token | x dense | MACs skipped |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        x_prefill, x_decode = speedups(dense, r)
        lines.append(
            f"| {r['model']} | {r['correct']} | {r['prefill_ms']:.2f} | {x_prefill:.2f} | "
            f"{r['decode_ms_per_token']:.2f} | {x_decode:.2f} | {r['sparsity']['macs'] if r['sparsity'] else '-'} |"
        )
    (out / "e2e.md").write_text("\n".join(lines) + "\n")
    bad = [r for r in results if not r["correct"]]
    print(f"{len(results)} rows, {len(bad)} incorrect; written {out / 'e2e.md'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
