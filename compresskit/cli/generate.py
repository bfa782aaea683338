"""``generate``: text from a run, an HF directory or an alias, on the runtime."""

from __future__ import annotations

from rich.console import Console

from compresskit.cli.common import EXIT_OK, MODEL_HELP, _load_for_runtime, with_placement
from compresskit.errors import CompressKitError


def cmd_generate(args, out: Console, err: Console) -> int:
    import time

    from compresskit.runtime import runtime_for

    if args.max_new_tokens < 1:
        raise CompressKitError(f"--max-new-tokens: {args.max_new_tokens}; give 1 or more")
    model, tokenizer, pruner, _ = _load_for_runtime(args.model, args, err, "MODEL (compresskit generate's argument)")
    runtime = runtime_for(model, pruner, counting=False)  # (generation reports no sparsity: nothing to count)
    prompt = tokenizer(args.prompt, add_special_tokens=True)["input_ids"]
    written: list[int] = []
    shown = ""
    out.file.write(args.prompt)

    def stream(row: int, token: int) -> None:
        nonlocal shown
        written.append(token)
        text = tokenizer.decode(written, skip_special_tokens=True)
        out.file.write(text[len(shown) :])
        out.file.flush()
        shown = text

    warm = 0.0
    if runtime.compiled or runtime.graphs:
        with err.status("compiling the runtime for this shape (once a process) ..."):
            warm = runtime.warm_up(1, len(prompt), args.max_new_tokens)
    t0 = time.perf_counter()
    res = runtime.generate(
        [prompt],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        eos_token_id=tokenizer.eos_token_id,
        seed=args.seed,
        on_token=stream,
    )
    out.file.write("\n")
    err.print(
        f"{res.new_tokens} tokens in {time.perf_counter() - t0:.2f} s: first token after "
        f"{res.prefill_seconds * 1e3:.0f} ms, then {(res.new_tokens - 1) / max(res.decode_seconds, 1e-9):.1f} "
        f"tokens/s (compresskit runtime, {runtime.mode}, {runtime.device.type}"
        + (f"; compiled beforehand in {warm:.1f} s" if warm else "")
        + ")",
        markup=False,
        highlight=False,
    )
    return EXIT_OK


def add_generate_parser(sub) -> None:
    """The ``generate`` command's arguments."""
    p = sub.add_parser("generate", help="stream text from a saved run, an HF directory or an alias (the runtime)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, dest="max_new_tokens", help="tokens to generate (64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, dest="top_p", help="nucleus sampling's share (1.0: off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (with --temperature above 0)")
    with_placement(p)
    p.set_defaults(fn=cmd_generate)
