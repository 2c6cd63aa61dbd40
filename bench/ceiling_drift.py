"""How much the host's DRAM read ceiling moves on its own: the executor's stream read (the ceiling every decode
roofline here divides by) sampled back to back for a while, nothing else of ours running (diagnostic).

    python -m bench.ceiling_drift [--seconds 60] [--mib N] [--threads N] [--out FILE.json]
    python -m bench.ceiling_drift --summarize FILE.json   # the summary of a saved series again

Why: the e2e benches measure the ceiling once before a process's timed steps and once after each batch, and on
the GPU box (a VM) those figures have differed by 20-40% within one call (issue 12 run 17: 101.5 to 160 GB/s
between processes minutes apart), which moves every "% of roofline" as much. Each sample is one call of
cpu_kernels.measure_read_bandwidth with repeats=1 (the best of its prefetch distances); the e2e benches call it
with its default repeats=3, so their ceiling is the best of 3 such samples, and the summary gives that too
(`best_of_3_*`: over consecutive windows of 3). This prints each sample (seconds since the start, GB/s) and the
median, 5th/95th percentiles, range and the largest change between neighbouring samples.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import cpu_kernels
from cpu_kernels.bandwidth import default_read_bytes

E2E_REPEATS = 3  # measure_read_bandwidth's default repeats, which the e2e benches' ceiling uses


def sample(seconds: float, nbytes: int, threads: int | None, read=cpu_kernels.measure_read_bandwidth) -> list:
    """[(seconds since the start, GB/s)] read back to back until `seconds` have passed (at least two)."""
    out, t0 = [], time.perf_counter()
    while len(out) < 2 or time.perf_counter() - t0 < seconds:
        gbps = read(nbytes, threads=threads, repeats=1)
        out.append((time.perf_counter() - t0, gbps))
    return out


def summary(series: list, best_of: int = E2E_REPEATS) -> dict:
    v = [g for _, g in series]
    steps = [abs(b - a) for a, b in zip(v, v[1:])]
    best = [max(v[i:i + best_of]) for i in range(0, len(v) - best_of + 1, best_of)] or [max(v)]
    p5, p95 = np.percentile(v, [5, 95])
    b5, b50, b95 = np.percentile(best, [5, 50, 95])
    return {"samples": len(v), "median_GBps": statistics.median(v), "p5_GBps": float(p5), "p95_GBps": float(p95),
            "min_GBps": min(v), "max_GBps": max(v), "max_over_min": max(v) / min(v),
            "largest_step_GBps": max(steps) if steps else 0.0, f"best_of_{best_of}_p5_GBps": float(b5),
            f"best_of_{best_of}_median_GBps": float(b50), f"best_of_{best_of}_p95_GBps": float(b95)}


def report(s: dict, nbytes: int) -> str:
    k = E2E_REPEATS
    return (f"# {s['samples']} reads of {nbytes >> 20} MiB: median {s['median_GBps']:.1f} GB/s, 5-95% "
            f"{s['p5_GBps']:.1f}-{s['p95_GBps']:.1f}, range {s['min_GBps']:.1f}-{s['max_GBps']:.1f} (max/min "
            f"{s['max_over_min']:.2f}), largest change between neighbours {s['largest_step_GBps']:.1f} GB/s; best of "
            f"{k} consecutive (the e2e ceiling) 5/50/95%: {s[f'best_of_{k}_p5_GBps']:.1f} / "
            f"{s[f'best_of_{k}_median_GBps']:.1f} / {s[f'best_of_{k}_p95_GBps']:.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--mib", type=int, help="buffer MiB (default: the e2e benches' default_read_bytes)")
    p.add_argument("--threads", type=int, help="executor threads (default: the executor's default)")
    p.add_argument("--out", help="write the series and summary here as JSON")
    p.add_argument("--summarize", metavar="FILE", help="print the summary of a series saved by --out; reads nothing")
    a = p.parse_args(argv)
    if a.summarize:
        with open(a.summarize) as f:
            saved = json.load(f)
        print(report(summary(saved["series"]), saved["buffer_bytes"]))
        return 0
    nbytes = (a.mib << 20) if a.mib else default_read_bytes()
    series = sample(a.seconds, nbytes, a.threads)
    for t, g in series:
        print(f"{t:7.2f} s  {g:7.1f} GB/s")
    s = summary(series)
    print(report(s, nbytes))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"buffer_bytes": nbytes, "series": series, **s}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
