"""Crossover sweep over several shapes with one profile: in-sample and hold-out predictions side by side.

    python -m bench.crossover --profile PROFILE.json --shapes qwen3-235b-a22b,qwen3-30b-a3b --out DIR

The sweep itself (placement.crossover) is what `hybrid bench crossover` runs for one shape; this adds the
table of both kinds of prediction (crossover_holdout.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from placement.cost_model import get_shape
from placement.crossover import PREDICTION_KIND, calibration_match, print_table, run_sweep, write_outputs
from placement.hardware import pricing_profile

__all__ = ["calibration_match", "main"]


def main(argv=None) -> int:
    """Sweep several shapes with one profile: in-sample and hold-out predictions side by side."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--shapes", default="qwen3-235b-a22b,qwen3-30b-a3b", help="comma list of presets")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", help="comma list of m (default 1,2,...,4096)")
    ap.add_argument("--backend")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-refine", action="store_true")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    profile = pricing_profile(a.profile, note=lambda line: print(f"# note: {line}", flush=True))
    sweep = [int(v) for v in a.tokens.split(",")] if a.tokens else None
    rows = []
    for name in a.shapes.split(","):
        res = run_sweep(get_shape(name), profile, experts=a.experts, sweep=sweep, backend=a.backend, reps=a.reps,
                        refine=not a.no_refine)
        print_table(res)
        write_outputs(res, Path(a.out), name)
        rows.append(res)
    lines = ["| shape | prediction | crossover measured / predicted | T_C median error | T_G median error |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        kind = PREDICTION_KIND[r.get("holdout")]
        err = {k: (f"{100 * r[k]:.1f}%" if k in r else "-") for k in ("t_cpu_relative_error_median",
                                                                      "t_gpu_relative_error_median")}
        lines.append(f"| {r['shape']['name']} | {kind} (calibrated on {r.get('calibrated_shape')}) | "
                     f"{r['measured_crossover_tokens']} / {r.get('predicted_crossover_tokens')} | "
                     f"{err['t_cpu_relative_error_median']} | {err['t_gpu_relative_error_median']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "crossover_holdout.md").write_text(text)
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
