"""A decode step's time as the context grows, in a session loaded as `hybrid generate` loads it: for each length,
a prompt of that many tokens prefilled into a fresh slot, then --steps decode steps timed (after --warm ones, so a
context bucket's graph capture stays out), then --profiled more under torch.profiler, whose busiest operators and
kernels are printed.

    python -m bench.decode_context --contexts 1024,8192 --out FILE.json -- --model DIR --gpu-budget 24GiB \\
        --gpu-dtype int4 --cpu-dtype int4 --max-context 32768

Everything after `--` is `hybrid generate`'s model arguments. With CUDA graphs (the default on a GPU) the profile
shows graph replays, not the kernels inside them: add --eager after `--` to see those (eager steps also pay every
launch on the host, so time the two apart). What grows from one length to the next is the attention's price per
cached token (DESIGN.md, MLA).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.prefill_profile import build_generate_args, open_engine, split_at_dashes, top_ops


def decode_ms(engine, slot: int, steps: int) -> float:
    """Milliseconds per decode step over `steps` steps of one slot (token 5 fed each time), to the device's end."""
    engine._sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.decode_step([slot], [5])
    engine._sync()
    return (time.perf_counter() - t0) * 1e3 / steps


def main(argv=None) -> int:
    own, model_args = split_at_dashes(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,8192", help="comma-separated prompt lengths (default %(default)s)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per length (default %(default)s)")
    p.add_argument("--warm", type=int, default=3, help="untimed steps first (default %(default)s)")
    p.add_argument("--profiled", type=int, default=3, help="steps under torch.profiler, 0 = none (default %(default)s)")
    p.add_argument("--rows", type=int, default=12, help="operators printed from each profile (default %(default)s)")
    p.add_argument("--out", help="write the timings and the profiles' top operators as JSON")
    args = p.parse_args(own)
    contexts = [int(t) for t in args.contexts.split(",")]
    if not model_args:
        p.error("give the model's arguments after --, e.g. -- --model DIR")
    if min(contexts) < 1 or args.steps < 1:
        p.error("--contexts and --steps must be positive")

    from hybrid.runtime.engine import spread_ids

    gen = build_generate_args(model_args)
    need = max(contexts) + args.warm + args.steps + args.profiled
    if need >= gen.max_context:  # before a load that may take a minute
        p.error(f"--contexts up to {max(contexts)} and their steps need --max-context above {need} "
                f"(it is {gen.max_context})")
    engine = open_engine(gen)
    device = engine.device.type
    print(f"decode with {'CUDA graphs' if engine.graphs is not None else 'no graphs (eager)'}", flush=True)
    rows = []
    for n in contexts:
        slot = engine.allocate_slot()
        try:
            engine.prefill(slot, spread_ids(n, engine.model.cfg.vocab_size))
            decode_ms(engine, slot, args.warm)
            ms = decode_ms(engine, slot, args.steps)
            row = {"context": n, "steps": args.steps, "ms_per_step": round(ms, 3), "tokens_per_s": round(1e3 / ms, 2)}
            print(f"context {n}: {ms:.1f} ms a step ({1e3 / ms:.1f} tok/s)", flush=True)
            if args.profiled:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
                with profile(activities=acts) as prof:
                    decode_ms(engine, slot, args.profiled)
                row["top"] = [dict(o, self_ms=round(o["self_ms"] / args.profiled, 3), calls=o["calls"] / args.profiled)
                              for o in top_ops(prof, device, args.rows)]  # per step
                for o in row["top"]:
                    print(f"  {o['self_ms']:9.2f} ms a step  {o['calls']:7.0f} calls  {o['name'][:90]}")
            rows.append(row)
        finally:
            engine.free_slot(slot)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model_args": model_args, "device": device, "graphs": engine.graphs is not None,
                       "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
