"""How much the host's DRAM read ceiling moves on its own: the executor's stream read (the ceiling every decode
roofline here divides by) sampled back to back for a while, nothing else of ours running (diagnostic).

    python -m bench.ceiling_drift [--seconds 60] [--mib N] [--threads N] [--out FILE.json]

Why: the e2e benches measure the ceiling once before a process's timed steps and once after each batch, and on
the GPU box (a VM) those figures have differed by 20-40% within one call (issue 12 run 17: 101.5 to 160 GB/s
between processes minutes apart), which moves every "% of roofline" as much. This prints each sample (seconds
since the start, GB/s) and the median, range and the largest change between neighbouring samples.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import cpu_kernels
from cpu_kernels.bandwidth import default_read_bytes


def sample(seconds: float, nbytes: int, threads: int | None, read=cpu_kernels.measure_read_bandwidth) -> list:
    """[(seconds since the start, GB/s)] read back to back until `seconds` have passed (at least two)."""
    out, t0 = [], time.perf_counter()
    while len(out) < 2 or time.perf_counter() - t0 < seconds:
        gbps = read(nbytes, threads=threads, repeats=1)
        out.append((time.perf_counter() - t0, gbps))
    return out


def summary(series: list) -> dict:
    v = [g for _, g in series]
    steps = [abs(b - a) for a, b in zip(v, v[1:])]
    return {"samples": len(v), "median_GBps": statistics.median(v), "min_GBps": min(v), "max_GBps": max(v),
            "max_over_min": max(v) / min(v), "largest_step_GBps": max(steps) if steps else 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--mib", type=int, help="buffer MiB (default: the e2e benches' default_read_bytes)")
    p.add_argument("--threads", type=int, help="executor threads (default: the executor's default)")
    p.add_argument("--out", help="write the series and summary here as JSON")
    a = p.parse_args(argv)
    nbytes = (a.mib << 20) if a.mib else default_read_bytes()
    series = sample(a.seconds, nbytes, a.threads)
    for t, g in series:
        print(f"{t:7.2f} s  {g:7.1f} GB/s")
    s = summary(series)
    print(f"# {s['samples']} reads of {nbytes >> 20} MiB: median {s['median_GBps']:.1f} GB/s, range "
          f"{s['min_GBps']:.1f}-{s['max_GBps']:.1f} (max/min {s['max_over_min']:.2f}), largest change between "
          f"neighbours {s['largest_step_GBps']:.1f} GB/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"buffer_bytes": nbytes, "series": series, **s}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
