"""Where a prompt's prefill time goes, in a session loaded as `hybrid generate` loads it: prompts of each length
prefilled --repeats times in the same process (after the start-up's own warm-up), then the first length once more
under torch.profiler, whose busiest operators and kernels are printed.

    python -m bench.prefill_profile --tokens 4209,4096 --out FILE.json -- --model DIR --gpu-budget 24GiB \\
        --gpu-dtype int4 --cpu-dtype int4 --max-context 32768

Everything after `--` is `hybrid generate`'s model arguments (--model, --gpu-budget, --gpu-dtype, --prefill-chunk,
...). The prompt of N tokens is N vocabulary ids spread over the vocabulary (many experts see rows), not text. A
prompt longer than the session's prefill pass (`--prefill-chunk`, or the one fitted to --gpu-budget: printed)
runs in several passes, and each pass repeats its per-pass work: quantized GPU weights de-quantized again, the
cache's keys expanded again (MLA), experts shipped again. Comparing a length just over a pass with one just
under it shows that work's price.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def prefill_seconds(engine, n: int) -> float:
    """One prefill of n tokens into a fresh slot, timed to the device's end."""
    from hybrid.runtime.engine import spread_ids

    ids = spread_ids(n, engine.model.cfg.vocab_size)
    slot = engine.allocate_slot()
    try:
        engine._sync()
        t0 = time.perf_counter()
        engine.prefill(slot, ids)
        engine._sync()
        return time.perf_counter() - t0
    finally:
        engine.free_slot(slot)


def top_ops(prof, device: str, rows: int) -> list[dict]:
    """The `rows` operators and kernels with the most self time on the device (CPU: on the host), in ms."""
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
    return [{"name": e.key, "calls": e.count, "self_ms": round(getattr(e, key, 0.0) / 1e3, 3)}
            for e in events[:rows] if getattr(e, key, 0.0) > 0]


def split_at_dashes(argv) -> tuple[list[str], list[str]]:
    """(the bench's own arguments, `hybrid generate`'s model arguments after `--`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def open_engine(gen):
    """The engine of a session loaded as `hybrid generate` loads it, from its parsed arguments (lines to stderr)."""
    from hybrid.loading.session import open_session

    return open_session(gen, log=lambda m: print(m, file=sys.stderr)).engine


def build_generate_args(model_args: list[str]):
    from hybrid.cli import build_parser

    return build_parser(["generate"]).parse_args(["generate", *model_args])


def main(argv=None) -> int:
    own, model_args = split_at_dashes(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096", help="comma-separated prompt lengths (default %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="timed prefills per length (default %(default)s)")
    p.add_argument("--rows", type=int, default=15, help="operators printed from the profile (default %(default)s)")
    p.add_argument("--out", help="write the timings and the profile's top operators as JSON")
    args = p.parse_args(own)
    lengths = [int(t) for t in args.tokens.split(",")]
    if not model_args:
        p.error("give the model's arguments after --, e.g. -- --model DIR")

    gen = build_generate_args(model_args)
    if max(lengths) >= gen.max_context:  # before a load that may take a minute
        p.error(f"--tokens up to {max(lengths)} need --max-context above it (it is {gen.max_context})")
    t0 = time.perf_counter()
    engine = open_engine(gen)
    chunk = engine.config.prefill_chunk
    print(f"loaded in {time.perf_counter() - t0:.1f} s; prefill passes of {chunk} tokens", flush=True)
    runs = []
    for n in lengths:
        for r in range(args.repeats):
            s = prefill_seconds(engine, n)
            passes = -(-n // chunk)
            runs.append({"tokens": n, "repeat": r, "passes": passes, "seconds": round(s, 4),
                         "tokens_per_s": round(n / s, 1)})
            print(f"{n} tokens ({passes} pass{'es' if passes > 1 else ''}), repeat {r}: {s:.3f} s, {n / s:,.0f} tok/s",
                  flush=True)

    from torch.profiler import ProfilerActivity, profile

    device = engine.device.type
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        s = prefill_seconds(engine, lengths[0])
    ops = top_ops(prof, device, args.rows)
    print(f"\n{lengths[0]} tokens under the profiler: {s:.3f} s; most self time on the {device}:")
    for o in ops:
        print(f"  {o['self_ms']:10.1f} ms  {o['calls']:6d} calls  {o['name'][:90]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model_args": model_args, "prefill_chunk": chunk, "device": device,
                       "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "runs": runs, "profiled": {"tokens": lengths[0], "seconds": round(s, 4), "top": ops}}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
