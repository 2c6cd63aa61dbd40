"""GGUF files loaded as users load them, beside llama.cpp on the same files: batch-1 decode and prefill.

    python -m bench.gguf_box --gguf q3-q8_0.gguf q3-q4_k_m.gguf q3-q4_0.gguf --llama-bench PATH/llama-bench \\
        --profile PROFILE.json --out DIR

For each file:
  hybrid     `hybrid --model X.gguf` as a user runs it: the CPU experts in the format the file's expert blocks
             default to (the exact one where there is one: q8_0 for Q8_0, q4_k for Q4_K, q5_k for Q5_K, q6_k for
             Q6_K, iq4_xs for IQ4_XS, iq2_xxs for IQ2_XXS, iq3_xxs for IQ3_XXS, iq1_s for IQ1_S, iq1_m for IQ1_M, q4_0 for Q4_0; --cpu-dtype overrides), every expert in DRAM (no resident expert), the default scheduler
             (the cost model ships a large prefill's experts to the GPU), then bench.hybrid_e2e's measurements
             on the loaded model: prefill and decode tok/s against the roofline of the bytes the
             executor holds (bench.deepseek_box.run_box, which also reports the load's time and memory);
  llama.cpp  llama-bench on the same file with every expert on the CPU (-ot exps=CPU, -ngl 99): decode of 32
             tokens, and a prefill of each --prefill length (without --llama-bench: hybrid only).
One table (ratios hybrid / llama.cpp), DIR/gguf_box.json.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from bench import hybrid_e2e
from cpu_kernels.dtypes import NAMES as CPU_DTYPE_NAMES
from placement.json_file import write_json


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", nargs="+", required=True, metavar="FILE", help="GGUF files (the first part of a split one)")
    p.add_argument("--llama-bench", help="llama-bench binary (none: hybrid only)")
    p.add_argument("--profile", required=True)
    p.add_argument("--cpu-dtype", choices=CPU_DTYPE_NAMES, help="CPU experts' dtype (default: each file's own)")
    p.add_argument("--int4-group", type=int, choices=(32, 64, 128), help="int4's group (default: each file's own)")
    p.add_argument("--isa")
    p.add_argument("--cpu-threads", type=int, help="hybrid's CPU executor threads (default: all cores but one)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads (default: every core)")
    p.add_argument("--reps", type=int, default=3, help="llama-bench repetitions")
    p.add_argument("--prefill", type=hybrid_e2e.ints, default=[8192], help="prompt lengths (default 8192)")
    p.add_argument("--decode-batch", type=hybrid_e2e.ints, default=[1])
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--tune", type=hybrid_e2e.knobs, default={}, metavar="KNOB=V[,KNOB=V]",
                   help="CPU executor knobs set before hybrid's timings (as bench.hybrid_e2e --tune)")
    p.add_argument("--ab", type=hybrid_e2e.ab_values, metavar="KNOB=V1/V2",
                   help="after hybrid's decode timings, an in-process A/B of one CPU knob (as bench.hybrid_e2e --ab)")
    p.add_argument("--ab-rounds", type=int, default=4, metavar="N", help="rounds of --ab (default 4)")
    p.add_argument("--out", default="bench/results")
    return p


def file_format(path: str, args) -> tuple[str, int, dict, str, bool]:
    """(CPU dtype, int4 group, the file's expert bytes per GGUF type, the load's line saying which expert weights
    it keeps as the file's blocks, whether each layer keeps its own blocks' format) of the load, as a user's
    `hybrid --model X.gguf` makes it."""
    from hybrid.loading.parse import gguf_cpu_format
    from hybrid.models.gguf import open_gguf, repack

    ckpt = open_gguf(path)
    by_type = repack.expert_bytes_by_type(ckpt)
    fmt = gguf_cpu_format(path)
    dtype = args.cpu_dtype or (fmt.dtype if fmt is not None else "bf16")
    group = args.int4_group or (fmt.group if fmt is not None and fmt.group else 128)
    own = args.cpu_dtype is None and fmt is not None and not fmt.only  # a mixed file, no --cpu-dtype
    fmt = repack.cpu_format(dtype, group)
    return dtype, group, by_type, repack.describe(repack.choose_file(ckpt, fmt, own), fmt), own


def run_hybrid(path: str, args) -> dict:
    from bench.deepseek_box import run_box

    dtype, group, by_type, kept, own = file_format(path, args)
    box = argparse.Namespace(ckpt=path, layers=None, config=None, cpu_dtype=dtype, cpu_group=group, layer_formats=own,
                             profile=args.profile, isa=args.isa, cpu_threads=args.cpu_threads, resident=0,
                             graphs=torch.cuda.is_available(), prefill=args.prefill, decode_batch=args.decode_batch,
                             steps=args.steps, strategies=["cost"], out=args.out, tune=args.tune, ab=args.ab,
                             ab_rounds=args.ab_rounds)
    res = run_box(box, Path(path).name, "")
    r = res["results"][0]
    # every decode and prefill figure, the schedule's split of each (the *_sched entries: experts a layer on the
    # CPU and shipped, predicted time) included
    keep = {k: v for k, v in r.items() if k.startswith(("decode_b", "prefill_"))}
    return dict(cpu_dtype=dtype, int4_group=group if dtype == "int4" else None, expert_bytes_by_type=by_type,
                experts_kept=kept, load=res["load"], header=res.get("header"), strategy=r["strategy"], **keep)


def run_llama(path: str, args) -> dict:
    from bench.vs_llamacpp import run_llama as llama_bench

    cpu = ["-ot", "exps=CPU"]
    out = {"decode": llama_bench(args.llama_bench, path, cpu, args.threads, args.reps)}
    for n in args.prefill:
        out[f"prefill_{n}"] = llama_bench(args.llama_bench, path, cpu, args.threads, args.reps, prompt=n, gen=0)
    return out


def table(rows: list[dict], prefill: list[int]) -> str:
    head = ["file", "CPU experts", "decode b1 tok/s (hybrid / llama.cpp)", "ratio", "of roofline"]
    head += [f"prefill {n} tok/s (hybrid / llama.cpp)" for n in prefill] + [f"ratio {n}" for n in prefill]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        h, l = r["hybrid"], r.get("llama") or {}
        fmt = h["cpu_dtype"] + (f" group {h['int4_group']}" if h["int4_group"] else "")
        ours, theirs = h.get("decode_b1_tok_s"), (l.get("decode") or {}).get("tok_s")
        cells = [r["gguf"], fmt, f"{ours or float('nan'):.1f} / {theirs or float('nan'):.1f}",
                 f"{ours / theirs:.2f}x" if ours and theirs else "-",
                 f"{h['decode_b1_of_roofline']:.2f}" if h.get("decode_b1_of_roofline") else "-"]
        ratios = []
        for n in prefill:
            po, pt = h.get(f"prefill_{n}_tok_s"), (l.get(f"prefill_{n}") or {}).get("tok_s")
            cells.append(f"{po or float('nan'):.0f} / {pt or float('nan'):.0f}")
            ratios.append(f"{po / pt:.2f}x" if po and pt else "-")
        lines.append("| " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = arguments().parse_args(argv)
    rows = []
    for path in args.gguf:
        print(f"# {path}", flush=True)
        row = {"gguf": Path(path).name, "path": str(path), "bytes": Path(path).stat().st_size,
               "hybrid": run_hybrid(path, args)}
        if args.llama_bench:
            row["llama"] = run_llama(path, args)
        rows.append(row)
    text = table(rows, args.prefill)
    print(text, flush=True)
    write_json(Path(args.out) / "gguf_box.json", {"rows": rows, "table": text}, indent=1)
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
