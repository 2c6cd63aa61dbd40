"""Per-core weight throughput of the decode (vector) kernels: int4 / mxfp4 / int8 at 8 experts x 1 token and
8 experts x 4 tokens (the same 8 experts), for a few thread counts. A kernel A/B tool, not a test: with few
threads the layer call is bound by the kernels' instructions per weight byte, not by DRAM, so GB/s per core
compares kernel versions directly.

    python -m bench.int4_core_probe --threads 1,2 --dtypes int4,mxfp4,int8 --reps 5

Each repetition is the median of --iters layer calls (bench.decode_probe.time_case: a prebuilt HostJob, 8
random experts of a --experts pool per call, so weights come from DRAM); the line shows the median over
repetitions and the spread (min..max) of the per-repetition GB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics

import cpu_kernels
from cpu_kernels import CpuMoE, _native

from bench.decode_probe import SHAPES, random_experts, time_case

CASES = {"8x1": (1, 8, True), "8x4": (4, 8, True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--experts", type=int, default=64, help="pool the 8 experts of each call are drawn from")
    p.add_argument("--dtypes", default="int4,mxfp4,int8")
    p.add_argument("--cases", default="8x1,8x4")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    D, F = SHAPES[a.shape]
    isa = cpu_kernels.default_isa()
    _native.tune(isa, "spin_us", 2000)
    wg, wu, wd = random_experts(a.experts, D, F)
    print(f"# int4_core_probe isa={isa} shape={a.shape} (D={D}, F={F}) pool={a.experts} cpus={len(os.sched_getaffinity(0))}")
    print(f"{'dtype':6} {'case':5} {'thr':>3} {'us':>8} {'GB/s':>7} {'GB/s/core':>9}  spread")
    for dtype in a.dtypes.split(","):
        for thr in (int(t) for t in a.threads.split(",")):
            moe = CpuMoE(wg, wu, wd, dtype=dtype, threads=thr)
            for case in a.cases.split(","):
                T, K, same = CASES[case]
                reps = [time_case(moe, T, K, same, a.iters) for _ in range(a.reps)]
                gb = sorted(r["gbps"] for r in reps)
                us = statistics.median(r["median_s"] for r in reps) * 1e6
                med = statistics.median(gb)
                print(f"{dtype:6} {case:5} {thr:3d} {us:8.0f} {med:7.2f} {med / thr:9.2f}  {gb[0]:.2f}..{gb[-1]:.2f}",
                      flush=True)
            del moe
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
