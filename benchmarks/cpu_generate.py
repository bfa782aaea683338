"""Greedy generation on the CPU: compresskit's runtime against transformers' ``generate``, taking turns in one
process, for the embedded SmolLM2-135M dense and with WIDE routers (untrained, half of each router's groups
skipped: the routing work of a trained model, whatever its quality).

    python benchmarks/cpu_generate.py [--new-tokens 20] [--repeats 5]

Prints the median seconds of each and whether their tokens agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from compresskit import plugins
    from compresskit.interfaces import RunContext
    from compresskit.modeling import device_name, load_model
    from compresskit.routing import calibrate_routers
    from compresskit.runtime import runtime_for

    print(f"{device_name('cpu')}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | runtime s | transformers s | runtime x transformers | same tokens |")
    print("|---|---|---|---|---|")
    for method in ("dense", "wide"):
        model, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
        pruner = None
        if method == "wide":
            cls = plugins.load("pruner", "wide")
            pruner = cls(cls.Config(target_sparsity=0.5, ffn_group_size=128))
            pruner.prepare(model, RunContext(model_config=model.config, tokenizer=tok, seed=0))
            model = pruner.finalize(model).eval()
            calibrate_routers(model, 0.5)
        rt = runtime_for(model, pruner, counting=False)  # (as compresskit generate builds it)
        ids = tok("The history of the city", return_tensors="pt")["input_ids"]
        times = {"runtime": [], "transformers": []}
        same = True
        for _ in range(args.repeats + 1):  # the first of each: a warm-up
            t0 = time.perf_counter()
            res = rt.generate([ids[0].tolist()], max_new_tokens=args.new_tokens)
            t1 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                    pad_token_id=tok.eos_token_id,
                )  # fmt: skip
            t2 = time.perf_counter()
            times["runtime"].append(t1 - t0)
            times["transformers"].append(t2 - t1)
            same = same and res.tokens[0] == out[0, ids.shape[1] :].tolist()
        rt_s, tf_s = (statistics.median(v[1:]) for v in times.values())
        print(f"| {method} | {rt_s:.3f} | {tf_s:.3f} | {tf_s / rt_s:.2f}x | {same} |")


if __name__ == "__main__":
    main()
