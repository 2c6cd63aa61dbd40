"""The CPU executor at decode routing: T tokens each choosing K experts, against the DRAM read ceiling measured
in the same process.

bench.cpu_moe routes one expert per token (K = 1); a decode step routes every token to K experts, so a layer
call reads the distinct experts the batch chose and sums K outputs per token. This probe times exactly that,
for variants of the executor's run-time knobs (cpu_kernels._native.TUNABLES: the fused single phase against the
phased path, the decode task size, ...), counting the distinct experts each call really read. Expert pools rotate
call to call so that weights come from DRAM, not from the last-level cache: the pool holds at least 4 x the LLC of
the smallest dtype asked for (a smaller pool reads partly from the cache and reports more than DRAM can give).

Comparing knobs: a host's read rate can drift within one process, so `--rounds N` runs each case's variants N
times, forward and then backward in turn (A B C, C B A, ...), which cancels a steady drift in the medians it reports
per variant, with each variant's median against the first variant's (`vs first`).

The ceiling is measured before the cases and again after them, as it can move during a run: `% DRAM` is against
the first ceiling, `% best` against the higher of the two (the conservative share).

    python -m bench.decode_probe --out decode_probe.json                     # 30B expert, bf16/int8/int4
    python -m bench.decode_probe --cases 1x8,8x8,4x8same --variants fused,phased,small-tasks
    python -m bench.decode_probe --dtypes int4 --variants fused,fused+tail_split=1 --rounds 4   # a knob A/B
    python -m bench.decode_probe --dtypes bf16,int8 --cases 1x1,1x2,1x4,1x8,2x8 --variants fused --fit  # fixed cost
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import cpu_kernels
from cpu_kernels import CpuMoE, _native
from cpu_kernels.bandwidth import default_read_bytes, llc_bytes
from cpu_kernels.dtypes import CPU_DTYPES

SHAPES = {"qwen3-30b-a3b": (2048, 768), "qwen3-235b-a22b": (4096, 1536), "tiny": (512, 256)}


def pool_size(dtypes: list[str], D: int, F: int, llc: int, least: int = 128) -> int:
    """Experts in the pool: at least `least`, and enough that the smallest dtype's pool is >= 4 x the LLC,
    in multiples of 64 (a layer call reads at most 64 distinct experts at 8 tokens x top-8)."""
    per = 3 * D * F * min(CPU_DTYPES[d.partition("-")[0]].bytes_per_weight(k=D) for d in dtypes)
    need = int(-(-4 * llc // per))
    return max(least, -(-need // 64) * 64)


VARIANTS = {"fused": dict(fused=1), "phased": dict(fused=0),
            # many short decode tasks (64 rows, >= 6 per thread): what the default's longer tasks are measured against
            "small-tasks": dict(fused=1, task_rows=64, task_min=6)}


def variant_knobs(name: str) -> dict:
    """A VARIANTS name, optionally followed by '+knob=value' overrides (any hy_tune knob), e.g.
    'fused+task_rows=512+task_min=1'."""
    base, *extra = name.split("+")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {base!r} (known: {', '.join(VARIANTS)})")
    knobs = dict(VARIANTS[base])
    knobs.update(_native.parse_knob(item, "override") for item in extra)
    return knobs


def round_orders(variants: list[str], rounds: int) -> list[list[str]]:
    """The variant order of each round: forward, backward, forward, ... (A B C, C B A, A B C)."""
    return [list(variants) if r % 2 == 0 else list(reversed(variants)) for r in range(rounds)]


def summarize_rounds(rows: list[dict], variants: list[str]) -> list[dict]:
    """Per (dtype, case, variant), in the order first seen: the median GB/s over its rounds, their range, and the
    median against the first variant's median of the same dtype and case."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["case"], r["variant"]), []).append(r["gbps"])
    out = []
    for (dtype, case, v), vals in groups.items():
        med = statistics.median(vals)
        out.append(dict(dtype=dtype, case=case, variant=v, rounds=len(vals), median_gbps=med, min_gbps=min(vals),
                        max_gbps=max(vals), vs_first=med / statistics.median(groups[dtype, case, variants[0]])))
    return out


def fit_fixed_cost(rows: list[dict]) -> list[dict]:
    """Per (dtype, variant) over every timed call of every case: the least-squares line median_s = fixed_s +
    bytes / stream_gbps. A call that streams at the ceiling but pays a fixed cost per call (waking the pool, the
    first reads' latency, the last tasks' tail) reads below the ceiling by fixed_s / median_s; the fit separates
    the two. Needs two or more distinct byte counts (cases of different expert counts)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["variant"]), []).append(r)
    out = []
    for (dtype, v), rs in groups.items():
        xs, ys = [r["bytes"] for r in rs], [r["median_s"] for r in rs]
        if len(set(xs)) < 2:
            continue
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fixed = my - slope * mx
        resid = [y - (fixed + slope * x) for x, y in zip(xs, ys)]
        out.append(dict(dtype=dtype, variant=v, calls=len(rs), fixed_s=fixed,
                        stream_gbps=(1 / slope / 1e9) if slope > 0 else None,  # None: time fell with bytes
                        rms_resid_s=(statistics.fmean(e * e for e in resid)) ** 0.5))
    return out


def random_experts(E: int, D: int, F: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 gate, up [E, F, D] and down [E, D, F] stacks drawn N(0, 0.02^2)."""
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(E, *shape, generator=g) * 0.02).bfloat16() for shape in ((F, D), (F, D), (D, F)))


def parse_case(text: str) -> tuple[int, int, bool]:
    """'TxK' (T tokens, K experts each, drawn at random) or 'TxKsame' (every token the same K experts)."""
    same = text.endswith("same")
    t, k = text.removesuffix("same").split("x")
    return int(t), int(k), same


def routings(T: int, K: int, same: bool, E: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if same:
            row = torch.randperm(E, generator=g)[:K]
            ids = row.repeat(T, 1)
        else:
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        out.append(ids.to(torch.int32).contiguous())
    return out


def time_case(moe: CpuMoE, T: int, K: int, same: bool, iters: int) -> dict:
    """Median seconds of a layer call as the doorbell lane makes it (a prebuilt HostJob run from here: no
    Python argument checks in the timed region, as in captured decode)."""
    E, D = moe.num_experts, moe.D
    ids_all = routings(T, K, same, E, iters + 3)
    x = torch.randn(T, D).bfloat16()
    w = torch.full((T, K), 1.0 / K)
    out = torch.empty(T, D, dtype=torch.bfloat16)
    jobs = [moe.host_job(x, ids, w, out) for ids in ids_all]
    for job in jobs[:3]:
        job.run()
    times, distinct = [], []
    for ids, job in zip(ids_all[3:], jobs[3:]):
        t0 = time.perf_counter()
        job.run()
        times.append(time.perf_counter() - t0)
        distinct.append(int(torch.unique(ids).numel()))
    if any(j.failures for j in jobs):
        raise RuntimeError(f"a layer call failed (code {max(j.rc for j in jobs)})")
    med = statistics.median(times)
    per_expert = moe.nbytes / E
    nbytes = statistics.median(distinct) * per_expert
    return dict(median_s=med, p90_s=sorted(times)[int(0.9 * len(times))], distinct_experts=statistics.median(distinct),
                bytes=nbytes, gbps=nbytes / med / 1e9)


def measure_floors(D: int) -> dict:
    """Graph decode's per-layer floor (hybrid.offload.overheads) per placement, each in a fresh process (its
    own CUDA context and doorbell lane, as a served model has)."""
    import subprocess
    import sys

    out = {}
    lane = "doorbell"
    for resident in ("none", "half", "all"):
        code = ("import json; from hybrid.offload.overheads import measure_graph_layer_floor as m; "
                f"print(json.dumps(m({D}, resident={resident!r})))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if res.returncode:
            print(f"# floor {lane}/{resident} failed: {res.stderr.strip().splitlines()[-1:]}")
            continue
        fl = json.loads(res.stdout.strip().splitlines()[-1])["graph_layer_floor"]
        out[f"{lane}_{resident}"] = fl
        print(f"# graph floor per layer, lane {lane:8} resident {resident:4}: {fl * 1e6:6.1f} us", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--experts", type=int, help="experts in the pool (reads rotate over them; default: at least 128 "
                   "and 4 x the LLC of the smallest dtype)")
    p.add_argument("--dtypes", default="bf16,int8,int4",
                   help="any CPU dtype (bf16, int8, int4, mxfp4, q8_0, q4_k, ...); int4-natural / int4-interleaved: "
                   "int4 in that stored order (CpuMoE int4_order; plain int4: the ISA's default)")
    p.add_argument("--group", type=int, default=128, help="int4 group size (32, 64 or 128)")
    p.add_argument("--cases", default="1x8,2x8,4x8,8x8,8x1,4x8same",
                   help="TxK[same]: T tokens x K experts each (same: every token the same K)")
    p.add_argument("--variants", default="fused,phased",
                   help=",".join(VARIANTS) + "; each may add +knob=value overrides (cpu_kernels._native.TUNABLES)")
    p.add_argument("--threads", type=int, help="executor threads (default: every allowed cpu but one, as on a GPU host)")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--spin-us", type=int, default=2000, help="pool spin before sleeping (the GPU runtime's setting)")
    p.add_argument("--floor", action="store_true", help="also the captured decode floor per layer (CUDA): a tiny-"
                   "expert model with half / none / all of its experts resident")
    p.add_argument("--rounds", type=int, default=1, help="times each case's variants run, forward then backward in "
                   "turn, for a knob A/B on a drifting host (default 1); a summary of medians per variant follows")
    p.add_argument("--fit", action="store_true", help="fit each dtype's call time as a fixed cost plus bytes at a "
                   "stream rate over the cases (give cases of several expert counts, e.g. 1x1,1x2,1x4,1x8,2x8)")
    p.add_argument("--out", help="JSON file")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    names = a.variants.split(",")
    if len(set(names)) != len(names):
        p.error(f"--variants names one variant twice ({a.variants}); use --rounds to repeat them")
    variants = {v: variant_knobs(v) for v in names}
    D, F = SHAPES[a.shape]
    cpus = len(os.sched_getaffinity(0))
    threads = a.threads or max(1, cpus - 1)
    isa = cpu_kernels.default_isa()
    ceiling = cpu_kernels.measure_read_bandwidth(default_read_bytes(), threads=threads, isa=isa)
    # The pool spins between calls as in GPU decode (hybrid.offload.host_lane sets 2 ms), so that the Python
    # bookkeeping between two timed calls does not put the workers to sleep (a futex wake per call).
    _native.tune(isa, "spin_us", a.spin_us)
    dtypes = a.dtypes.split(",")
    pool = a.experts or pool_size(dtypes, D, F, llc_bytes())
    print(f"# decode_probe: {platform.node()} isa={isa} threads={threads} shape={a.shape} (D={D}, F={F}) "
          f"experts={pool}; DRAM read ceiling {ceiling:.1f} GB/s (same process, {default_read_bytes() >> 20} MiB)")
    wg, wu, wd = random_experts(pool, D, F)
    rows = []
    print(f"{'dtype':12} {'case':9} {'variant':10} {'experts':>7} {'us':>8} {'GB/s':>7} {'% DRAM':>7}")
    # Every dtype's pool is packed first, then each case runs all of them back to back, so that a host whose
    # bandwidth drifts within the run (seen on the GPU box) moves every dtype's figure of a case alike.
    moes = {}
    for dtype in dtypes:
        base, _, order = dtype.partition("-")
        moes[dtype] = CpuMoE(wg, wu, wd, dtype=base, threads=threads, group_size=a.group,
                             int4_order=order or None)
    for case in a.cases.split(","):
        T, K, same = parse_case(case)
        for dtype, moe in moes.items():
            for rnd, order in enumerate(round_orders(names, a.rounds)):
                for v in order:
                    saved = {k: _native.tune(moe.isa, k, val) for k, val in variants[v].items()}
                    r = time_case(moe, T, K, same, a.iters)
                    for k, val in saved.items():
                        _native.tune(moe.isa, k, val)
                    r.update(dtype=dtype, case=case, variant=v, round=rnd, pct_dram=100 * r["gbps"] / ceiling)
                    rows.append(r)
                    print(f"{dtype:12} {case:9} {v:10} {r['distinct_experts']:7.0f} {r['median_s'] * 1e6:8.0f} "
                          f"{r['gbps']:7.1f} {r['pct_dram']:6.0f}%", flush=True)
    del moes
    after = cpu_kernels.measure_read_bandwidth(default_read_bytes(), threads=threads, isa=isa)
    best = max(ceiling, after)
    for r in rows:
        r["pct_dram_best"] = 100 * r["gbps"] / best
    print(f"# DRAM read ceiling after the cases {after:.1f} GB/s (before: {ceiling:.1f}); % best = against the higher")
    print(f"{'dtype':12} {'case':9} {'variant':10} {'% best':>7}")
    for r in rows:
        print(f"{r['dtype']:12} {r['case']:9} {r['variant']:10} {r['pct_dram_best']:6.0f}%")
    summary = summarize_rounds(rows, names) if a.rounds > 1 else []
    if summary:
        print(f"# medians over {a.rounds} rounds (forward and backward in turn)")
        print(f"{'dtype':12} {'case':9} {'variant':10} {'GB/s':>7} {'range':>13} {'% best':>7} {'vs first':>8}")
        for m in summary:
            print(f"{m['dtype']:12} {m['case']:9} {m['variant']:10} {m['median_gbps']:7.1f} "
                  f"{m['min_gbps']:6.1f}-{m['max_gbps']:<6.1f} {100 * m['median_gbps'] / best:6.0f}% {m['vs_first']:8.3f}")
    fits = fit_fixed_cost(rows) if a.fit else []
    if fits:
        print("# per call: median_s = fixed + bytes / stream rate, least squares over every case and round")
        print(f"{'dtype':12} {'variant':10} {'fixed us':>9} {'stream GB/s':>12} {'% best':>7} {'rms us':>7}")
        for f in fits:
            rate = (f"{f['stream_gbps']:12.1f} {100 * f['stream_gbps'] / best:6.0f}%" if f["stream_gbps"]
                    else f"{'-':>12} {'-':>7}")
            print(f"{f['dtype']:12} {f['variant']:10} {f['fixed_s'] * 1e6:9.1f} {rate} {f['rms_resid_s'] * 1e6:7.1f}")
    floors = measure_floors(D) if a.floor else {}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(machine=platform.node(), isa=isa, threads=threads, shape=a.shape, D=D, F=F, pool=pool, group=a.group,
                           rounds=a.rounds, ceiling_gbps=ceiling, ceiling_after_gbps=after, rows=rows,
                           summary=summary, fits=fits, floors_s=floors), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
