"""Micro-benchmark: prefill projections from FP8 weights, e4m3 tensor cores (hybrid.gpu_kernels.fp8_gemm) against
the de-quantizing bf16 GEMMs (hybrid.models.qweight.dequant_linear, HYBRID_FP8_GEMM=0) and a bf16 weight's cuBLAS
GEMM (F.linear), on DeepSeek-V3's projection shapes at M prompt rows.

    python -m bench.fp8_gemm --out fp8_gemm.json [--rows 512,2048,8192] [--shapes q_b,o_proj,dense_down] [--reps 20]

Timing: CUDA events around --reps calls after two warm-up calls, the median per call reported; TFLOP/s counts
2 M N K. Each FP8 output is checked against fp8_linear_reference first (max_abs_err, ok), and its relative error
against the de-quantizing path's output (rel_err_vs_dequant: the activations' e4m3 rounding) is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from hybrid.errors import UsageError

SHAPES = {  # DeepSeek-V3's W [N, K]
    "q_a": (1536, 7168),
    "q_b": (24576, 1536),
    "kv_a": (576, 7168),
    "o_proj": (7168, 16384),
    "dense_gate_up": (36864, 7168),
    "dense_down": (7168, 18432),
}


def time_calls(fn, reps: int) -> float:
    """Median seconds of one call of fn over reps calls (CUDA events), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def bench_shape(name: str, M: int, reps: int) -> dict:
    from hybrid.gpu_kernels.fp8_gemm import fp8_linear, fp8_linear_reference
    from hybrid.models.qweight import QWeight, dequant_linear

    N, K = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w_bf16 = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
    w = QWeight.from_float(w_bf16, "fp8")
    y = fp8_linear(x, w)
    ref = fp8_linear_reference(x, w).float()
    err = float((y.float() - ref).abs().max())
    dq = dequant_linear(x, w, None).float()
    flop = 2.0 * M * N * K
    row = dict(shape=name, N=N, K=K, M=M, max_abs_err=err, ok=err <= 1e-2 * float(ref.abs().max()) + 1e-3,
               rel_err_vs_dequant=float((y.float() - dq).norm() / dq.norm()))
    for label, fn in (("fp8", lambda: fp8_linear(x, w)), ("dequant", lambda: dequant_linear(x, w, None)),
                      ("bf16", lambda: F.linear(x, w_bf16))):
        t = time_calls(fn, reps)
        row[f"{label}_ms"] = t * 1e3
        row[f"{label}_tflops"] = flop / t / 1e12
    row["fp8_vs_dequant"] = row["dequant_ms"] / row["fp8_ms"]
    row["fp8_vs_bf16"] = row["bf16_ms"] / row["fp8_ms"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--rows", default="512,2048,8192", help="prompt rows M, comma-separated")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        raise UsageError(f"unknown shape(s) {', '.join(bad)}; choose from {', '.join(SHAPES)}")
    try:
        rows_m = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        raise UsageError(f"--rows takes whole numbers, comma-separated, not {args.rows!r}") from None
    if not torch.cuda.is_available():
        raise UsageError("bench.fp8_gemm times CUDA kernels: run it on a machine with a GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        raise UsageError(f"{torch.cuda.get_device_name()} has no e4m3 tensor-core dots (compute capability 8.9+)")
    rows = []
    print(f"{'shape':<14}{'M':>6} {'fp8 ms':>8} {'dequant ms':>11} {'bf16 ms':>8} {'fp8 TF/s':>9} "
          f"{'vs dequant':>10} {'vs bf16':>8} {'rel err':>8} ok")
    for name in shapes:
        for M in rows_m:
            r = bench_shape(name, M, args.reps)
            rows.append(r)
            print(f"{name:<14}{M:>6} {r['fp8_ms']:>8.3f} {r['dequant_ms']:>11.3f} {r['bf16_ms']:>8.3f} "
                  f"{r['fp8_tflops']:>9.1f} {r['fp8_vs_dequant']:>9.2f}x {r['fp8_vs_bf16']:>7.2f}x "
                  f"{r['rel_err_vs_dequant']:>8.4f} {r['ok']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
