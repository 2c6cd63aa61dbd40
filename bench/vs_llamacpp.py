"""hybrid against llama.cpp on the same box, shape and expert placement, in one run: batch-1 decode tok/s.

llama.cpp is the yardstick local users compare with (`-ot exps=CPU`: every expert on the CPU; `-ncmoe N`: the
experts of the first N layers on the CPU, the rest in VRAM). This script runs a llama-bench binary on a GGUF
of the shape and bench.hybrid_e2e (CUDA-graph decode, random weights of the same shape) for each case, then
writes a table, JSON and a bar plot with the ratios. Cases (12-layer Qwen3-30B-A3B shape by default):

    bf16    every expert in DRAM, bf16            llama: bf16 GGUF, -ot exps=CPU     hybrid: --resident 0
    int8    every expert in DRAM, 8-bit           llama: Q8_0 GGUF, -ot exps=CPU     hybrid: --cpu-dtype int8
    quarter a quarter of the experts in VRAM      llama: bf16 GGUF, -ncmoe 3L/4      hybrid: --resident E/4
    int4    every expert in DRAM, 4-bit           llama: each --gguf-q4 file (Q4_0, Q4_K_M, ...; the fastest is the
                                                  ratio's yardstick), -ot exps=CPU           hybrid: --cpu-dtype int4
    quarter-layers (not run by default) the quarter as whole layers on both sides: hybrid --resident-layers L/4
    q8_0    (not run by default) int8 as the case above, ours in llama.cpp's own Q8_0 values (int8 in blocks of 32,
            an fp16 scale each: what a Q8_0 file's experts load as)          hybrid: --cpu-dtype q8_0
    q4_k    (not run by default) int4 as the case above, ours in llama.cpp's own Q4_K values (what a Q4_K file's
            experts load as)                                                  hybrid: --cpu-dtype q4_k

The expert VRAM matches in `quarter` (a quarter of all expert bytes) but not its layout: llama.cpp keeps whole
layers resident, we keep the most-routed quarter of every layer; with random routers both choices see the
same routing statistics, but a random-weight model's decode keeps routing to a few experts per sequence that a
prompt's counts do not predict (fewer of a step's routed experts are resident than the quarter suggests), so
`quarter-layers` measures ours in llama.cpp's layout too. The GGUF files are written with llama.cpp's gguf-py
(a make_gguf.py script kept beside the llama-bench build, outside this repository, as llama.cpp's code is).

    python -m bench.vs_llamacpp --llama-bench /tmp/lcpp/bin/llama-bench --gguf-bf16 /tmp/q3.gguf \\
        --gguf-q8 /tmp/q3q8.gguf --profile PROFILE.json --out DIR
    python -m bench.vs_llamacpp --summarize RUN1/vs_llamacpp.json RUN2/vs_llamacpp.json ...

--summarize reads earlier runs' JSON and prints one row per run with the targets against llama.cpp (TARGETS)
marked met or not: which targets each side-by-side run met, and whether any run met them all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ("bf16", "int8", "quarter", "int4")  # the default run
KNOWN_CASES = CASES + ("quarter-layers", "q8_0", "q4_k")


# The targets against llama.cpp on these cases: (column, case, measured key, at least). Ratios are hybrid /
# llama.cpp tok/s at batch 1; shares are of the exact roofline (bench.hybrid_e2e's decode_bB_of_roofline).
TARGETS = (("bf16 ratio", "bf16", "ratio", 1.25), ("bf16 b1", "bf16", "b1_of_roofline", 0.85),
           ("int8 ratio", "int8", "ratio", 1.6), ("quarter ratio", "quarter", "ratio", 1.3),
           ("int4 b1", "int4", "b1_of_roofline", 0.80),
           *((f"{c} b8", c, "b8_of_roofline", 0.85) for c in ("bf16", "int8", "quarter", "int4")))


def target_values(rows: list[dict]) -> list[float | None]:
    """One run's rows -> the TARGETS' measured values (None where the run lacks the case or the value)."""
    by_case = {r["case"]: r for r in rows}
    out = []
    for _, case, key, _ in TARGETS:
        r = by_case.get(case)
        v = None if r is None else (r.get("ratio") if key == "ratio" else r.get("hybrid", {}).get(key))
        out.append(None if v is None else float(v))
    return out


def summarize(paths: list[str]) -> str:
    """A markdown table: one row per run's vs_llamacpp.json, each target's value in bold where met, and how
    many of the targets the run measured it met."""
    def show(key, v):
        return f"{v:.2f}x" if key == "ratio" else f"{100 * v:.0f}%"

    head = "| run | " + " | ".join(f"{name} (>= {show(key, floor)})" for name, _, key, floor in TARGETS) + " | met |"
    lines = [head, "| --- |" + " ---: |" * (len(TARGETS) + 1)]
    for path in paths:
        vals = target_values(json.loads(Path(path).read_text())["rows"])
        cells, met, seen = [], 0, 0
        for (_, _, key, floor), v in zip(TARGETS, vals):
            if v is None:
                cells.append("-")
                continue
            seen += 1
            text = show(key, v)
            if v >= floor:
                met += 1
                text = f"**{text}**"
            cells.append(text)
        lines.append(f"| {path} | " + " | ".join(cells) + f" | {met} of {seen} |")
    return "\n".join(lines)


def run_llama(binary: str, gguf: str, placement: list[str], threads: int, reps: int, prompt: int = 0,
              gen: int = 32) -> dict:
    """llama-bench with the given expert placement: decode of `gen` tokens (batch 1), or with gen 0 a prefill of
    `prompt` tokens; avg and stddev tok/s."""
    cmd = [binary, "-m", gguf, "-ngl", "99", "-fa", "0", "-t", str(threads), *placement, "-p", str(prompt), "-n",
           str(gen), "-r", str(reps), "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(res.stdout)
    r = rows[0]
    return dict(tok_s=float(r["avg_ts"]), stddev=float(r.get("stddev_ts", 0.0)), cmd=" ".join(cmd))


def run_hybrid(args, cpu_dtype: str, placement: list[str]) -> dict:
    """bench.hybrid_e2e's graph decode at batch 1 and 8 (every cold expert on the CPU lane); placement: its
    --resident N or --resident-layers N."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "bench.hybrid_e2e", "--preset", args.preset, "--profile", args.profile,
               "--layers", str(args.layers),
               *placement, "--cpu-dtype", cpu_dtype, "--strategies", "cpu",
               "--prefill", "128", "--decode-batch", "1,8", "--steps", str(args.steps), "--out", tmp]
        if args.graphs:
            cmd.append("--graphs")
        subprocess.run(cmd, check=True)
        res = json.loads((Path(tmp) / f"hybrid_e2e_{args.preset}.json").read_text())
    r = res["results"][0]
    keep = ("tok_s", "roofline_tok_s", "of_roofline", "llc_roofline_tok_s", "of_llc_roofline",
            "cold_reused_from_last_step", "cold_experts_per_layer_step", "replay_token_agreement", "cpu_lane_share",
            "cpu_lane_GBps", "dram_after_GBps", "of_roofline_after", "cold_tokens_per_expert")
    out = {f"b{b}_{k}": r.get(f"decode_b{b}_{k}") for b in (1, 8) for k in keep}
    out.update(tok_s=r["decode_b1_tok_s"], measured=res.get("measured"), header=res.get("header"), cmd=" ".join(cmd))
    return out


def median_run(runs: list[dict]) -> dict:
    """The run whose tok/s is the median (the lower middle of an even count): a whole run, so its roofline and
    lane figures stay those of the tok/s reported."""
    return sorted(runs, key=lambda r: r["tok_s"])[(len(runs) - 1) // 2]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["case"] for r in rows]
    ours = [r["hybrid"]["tok_s"] for r in rows]
    theirs = [r["llama"]["tok_s"] if r.get("llama") else 0.0 for r in rows]
    roof = [r["hybrid"].get("b1_roofline_tok_s") or 0.0 for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar([i - 0.2 for i in x], theirs, 0.4, label="llama.cpp")
    ax.bar([i + 0.2 for i in x], ours, 0.4, label="hybrid")
    ax.scatter([i + 0.2 for i in x], roof, marker="_", s=400, color="k", label="roofline (hybrid's placement)")
    llc = [r["hybrid"].get("b1_llc_roofline_tok_s") or 0.0 for r in rows]
    ax.scatter([i + 0.2 for i in x], llc, marker="_", s=400, color="tab:red", label="roofline, repeated reads from LLC")
    for i, r in enumerate(rows):
        if r.get("ratio"):
            ax.annotate(f"{r['ratio']:.2f}x", (i + 0.2, ours[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("batch-1 decode tok/s")
    ax.legend(fontsize=8)
    ax.set_title("hybrid vs llama.cpp, same box and shape", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summarize", nargs="+", metavar="JSON",
                   help="print the targets met or not for each earlier run's vs_llamacpp.json, and stop")
    p.add_argument("--llama-bench", help="path of a llama-bench binary (required unless --summarize)")
    p.add_argument("--gguf-bf16", help="bf16 GGUF of the shape (required unless --summarize)")
    p.add_argument("--gguf-q8", help="Q8_0 GGUF of the same shape (the int8 and q8_0 cases)")
    p.add_argument("--gguf-q4", nargs="+", default=[], metavar="GGUF",
                   help="4-bit GGUFs of the same shape for the int4 case (llama-quantize's Q4_0, Q4_K_M, ...); the "
                        "ratio is against the fastest of them")
    p.add_argument("--profile", help="hardware profile for bench.hybrid_e2e (required unless --summarize)")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated, of {', '.join(KNOWN_CASES)} (default: {','.join(CASES)})")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama.cpp threads")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every case this many times, the case order reversed every other round (the host's "
                        "memory ceiling drifts within a call); each side's median run is reported, every round's "
                        "tok/s listed under the table")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", default="vs_llamacpp")
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    missing = [f"--{n.replace('_', '-')}" for n in ("llama_bench", "gguf_bf16", "profile") if not getattr(args, n)]
    if missing:
        p.error(f"{', '.join(missing)} required (or --summarize)")
    import torch

    args.graphs = torch.cuda.is_available()  # decode graphs need CUDA; elsewhere (smoke tests) eager decode
    cases = args.cases.split(",")
    bad = [c for c in cases if c not in KNOWN_CASES]
    if bad:
        p.error(f"unknown case(s) {bad} (known: {', '.join(KNOWN_CASES)})")
    ncmoe = args.layers - args.layers // 4
    quarter_llama = (args.gguf_bf16, ["-ncmoe", str(ncmoe)])
    llama_for = {"bf16": (args.gguf_bf16, ["-ot", "exps=CPU"]), "quarter": quarter_llama,
                 "quarter-layers": quarter_llama,
                 "int8": (args.gguf_q8, ["-ot", "exps=CPU"]) if args.gguf_q8 else None,
                 "q8_0": (args.gguf_q8, ["-ot", "exps=CPU"]) if args.gguf_q8 else None,
                 "int4": [(g, ["-ot", "exps=CPU"]) for g in args.gguf_q4] or None,
                 "q4_k": [(g, ["-ot", "exps=CPU"]) for g in args.gguf_q4] or None}
    none = ["--resident", "0"]
    ours_for = {"bf16": ("bf16", none), "int8": ("int8", none), "int4": ("int4", none), "q8_0": ("q8_0", none),
                "q4_k": ("q4_k", none),
                "quarter": ("bf16", ["--resident", str(args.experts // 4)]),
                "quarter-layers": ("bf16", ["--resident-layers", str(args.layers // 4)])}
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    runs_of = {c: [] for c in cases}  # case -> one (llama, variants, hybrid) per round
    for r in range(args.rounds):
        for case in (cases if r % 2 == 0 else cases[::-1]):
            runs = llama_for[case]
            llama, variants = None, None
            if runs:
                files = runs if isinstance(runs, list) else [runs]
                variants = [dict(run_llama(args.llama_bench, g, pl, args.threads, args.reps), gguf=g)
                            for g, pl in files]
                llama = max(variants, key=lambda v: v["tok_s"])  # the yardstick: llama.cpp's best file
            runs_of[case].append((llama, variants, run_hybrid(args, *ours_for[case])))
            if args.rounds > 1:
                print(f"round {r + 1} {case}: llama {llama['tok_s'] if llama else float('nan'):.1f}, hybrid "
                      f"{runs_of[case][-1][2]['tok_s']:.1f} tok/s", flush=True)
    rows = []
    for case in cases:
        got = runs_of[case]
        row = dict(case=case, hybrid=median_run([h for _, _, h in got]))
        if got[0][0] is not None:
            row["llama"] = median_run([l for l, _, _ in got])
            variants = next(v for l, v, _ in got if l is row["llama"])
            if len(variants) > 1:
                row["llama_variants"] = variants
            row["ratio"] = row["hybrid"]["tok_s"] / row["llama"]["tok_s"]
        if args.rounds > 1:
            row["rounds"] = [dict(hybrid=h["tok_s"], llama=l["tok_s"] if l else None) for l, _, h in got]
        rows.append(row)
        print(f"{case:14} llama {row.get('llama', {}).get('tok_s', float('nan')):7.1f}  hybrid "
              f"{row['hybrid']['tok_s']:7.1f} tok/s  ratio {row.get('ratio', float('nan')):.2f}  "
              f"hybrid/roofline {row['hybrid'].get('b1_of_roofline') or float('nan'):.2f}  "
              f"(b8 {row['hybrid'].get('b8_tok_s') or float('nan'):.1f} tok/s, "
              f"{row['hybrid'].get('b8_of_roofline') or float('nan'):.2f} of roofline; LLC-aware "
              f"{row['hybrid'].get('b1_of_llc_roofline') or float('nan'):.2f} / "
              f"{row['hybrid'].get('b8_of_llc_roofline') or float('nan'):.2f})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_llamacpp.json").write_text(json.dumps(dict(layers=args.layers, preset=args.preset, rounds=args.rounds,
                                                          rows=rows), indent=1))
    # "LLC-aware": the bound if every read the step before also made came from the LLC, as far as it holds
    # them (bench.bounds.llc_adjusted); "reused": the share of a step's cold experts the step before read too.
    # "ceiling after": b1 / b8 shares against the DRAM ceiling measured again right after that batch's steps
    # (hybrid_e2e's decode_bB_of_roofline_after), which brackets how the host's memory moved during the run.
    lines = ["| case | llama.cpp tok/s | hybrid tok/s | ratio | hybrid of roofline (LLC-aware) | b1 reused | "
             "hybrid b8 of roofline (LLC-aware) | b1 / b8 at the ceiling after |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def pct(v):
        return f"{v * 100:.0f}%" if v is not None else "-"

    for r in rows:
        h, l = r["hybrid"], r.get("llama")
        lines.append(f"| {r['case']} | {l['tok_s']:.1f} ± {l['stddev']:.1f} | " if l else f"| {r['case']} | - | ")
        lines[-1] += (f"{h['tok_s']:.1f} | {r['ratio']:.2f}x | " if l else f"{h['tok_s']:.1f} | - | ")
        lines[-1] += (f"{pct(h.get('b1_of_roofline'))} ({pct(h.get('b1_of_llc_roofline'))}) | "
                      f"{pct(h.get('b1_cold_reused_from_last_step'))} | "
                      f"{pct(h.get('b8_of_roofline'))} ({pct(h.get('b8_of_llc_roofline'))}) | "
                      f"{pct(h.get('b1_of_roofline_after'))} / {pct(h.get('b8_of_roofline_after'))} |")
    for r in rows:
        if r.get("rounds"):  # every round's tok/s, in the order they ran
            lines.append("")
            lines.append(f"{r['case']} rounds (hybrid / llama.cpp tok/s): " + ", ".join(
                f"{x['hybrid']:.1f} / {x['llama']:.1f}" if x["llama"] else f"{x['hybrid']:.1f}" for x in r["rounds"]))
        if r.get("llama_variants"):  # several llama.cpp files for one case: each one's speed under the table
            lines.append("")
            lines.append(f"{r['case']}: llama.cpp " + ", ".join(
                f"{Path(v['gguf']).name} {v['tok_s']:.1f} ± {v['stddev']:.1f}" for v in r["llama_variants"])
                + f" tok/s; the ratio is against {Path(r['llama']['gguf']).name}")
    (out / "vs_llamacpp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, out / "vs_llamacpp.png")
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
