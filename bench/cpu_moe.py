"""Benchmark of the CPU expert executor (cpu_kernels.CpuMoE) on this machine.

Decode (1-4 tokens per expert): effective weight GB/s (bytes of the active experts' weights and
scales / time: bf16 2, int8 1 + scales, int4 0.5 + scales, mxfp4 0.53125 bytes a weight) against the DRAM
read bandwidth measured here by a multithreaded streaming read.
Prefill (many tokens per expert): TFLOP/s (TOPS for int8/int4/mxfp4; 2*m*P_e per expert) against torch's own
bf16 per-expert loop on the same experts and threads.
Experts are rotated call to call over a pool of `--pool-experts` distinct experts (default: >= 4x the
last-level cache, a multiple of 64 so the rotations tile it), so decode reads come from DRAM rather than
the last-level cache. The ceiling is measured before and after the cases with a buffer of
max(2 GiB, 4 x LLC); a row above it gets a note saying so and what could explain it. The phase profile
excludes the warm-up call.

    python -m bench.cpu_moe --out cpu_moe.json            # default sweep (~3-4 min on a 16-core host)
    python -m bench.cpu_moe --quick                       # small shapes, seconds (smoke test)
    python -m bench.cpu_moe --shapes qwen3-30b-a3b --dtypes mxfp4,int4,int8 --decode 8x1,8x4 --prefill ''
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
from cpu_kernels import CpuMoE, _native, moe as moe_mod, quant
from cpu_kernels.bandwidth import available_bytes, default_read_bytes, llc_bytes
from cpu_kernels.dtypes import CPU_DTYPES, FILE_ONLY_DTYPES, VALUE_BYTES
from cpu_kernels.knee import knee_from_times

# Packed bytes per weight, scales aside except mxfp4's (its exponent byte per 32 values is part of the format).
BYTES_PER_WEIGHT = VALUE_BYTES
SHAPES = {"qwen3-235b-a22b": (4096, 1536), "qwen3-30b-a3b": (2048, 768), "gpt-oss-120b": (2880, 2880),
          "tiny": (512, 256)}


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timeit(fn, min_time=0.25, min_iters=3, max_iters=50, after_warmup=None, counted=None) -> float:
    """Median seconds per call after one warm-up call (after_warmup() runs between the two; counted, a
    list, gets the number of timed calls)."""
    fn(0)
    if after_warmup is not None:
        after_warmup()
    times, start, i = [], time.perf_counter(), 1
    while i <= max_iters and (i <= min_iters or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        i += 1
    if counted is not None:
        counted.append(len(times))
    return statistics.median(times)


def ceiling_bytes(quick: bool = False) -> int:
    """The DRAM probe's buffer: max(2 GiB, 4 x LLC) (quick: cpu_kernels.bandwidth's max(1 GiB, 4 x LLC)),
    at most a quarter of the free memory."""
    if quick:
        return default_read_bytes()
    want, avail = max(2 << 30, default_read_bytes()), available_bytes()
    return min(want, max(avail // 4 >> 20 << 20, 256 << 20)) if avail else want


def dram_read_gbps(isa: str, threads: int, nbytes: int | None = None) -> float:
    """Best of 3 multithreaded streaming reads of a buffer far larger than the last-level cache."""
    return cpu_kernels.measure_read_bandwidth(nbytes or ceiling_bytes(), threads=threads, isa=isa)


def routing(n_active: int, m: int, pool_experts: int, it: int):
    """n_active experts (rotated by iteration) with exactly m tokens each, one expert per token (K=1)."""
    base = (it * n_active) % pool_experts
    ids = (base + torch.arange(n_active).repeat_interleave(m)) % pool_experts
    return ids[:, None].to(torch.int32).contiguous(), torch.ones(n_active * m, 1)


_TORCH_W: dict = {}


def torch_loop_tflops(D, F, n_active, m, threads) -> float:
    """torch's bf16 per-expert loop: the baseline a Python implementation reaches for."""
    torch.set_num_threads(threads)
    key = (D, F, n_active)
    if key not in _TORCH_W:
        g = torch.Generator().manual_seed(0)
        _TORCH_W.clear()
        _TORCH_W[key] = [tuple((torch.rand(r, c, generator=g) - 0.5).bfloat16() for r, c in ((F, D), (F, D), (D, F)))
                         for _ in range(n_active)]
    w = _TORCH_W[key]
    x = torch.randn(m, D).bfloat16()
    lin = torch.nn.functional.linear

    def run(_):
        for wg, wu, wd in w:
            lin(torch.nn.functional.silu(lin(x, wg)) * lin(x, wu), wd)

    return 2 * 3 * D * F * m * n_active / timeit(run) / 1e12


def pool_size(D, F, dtype, target_bytes=None) -> int:
    """Experts (a multiple of 64, so n = 8 or 64 experts per call tile it) whose packed weights reach
    target_bytes (default max(0.75 GB, 4 x LLC)): calls rotate over them so an expert is re-read only
    after the whole pool, and decode reads come from DRAM, not from a large last-level cache (~300 MiB
    on the box host)."""
    target = target_bytes or max(0.75e9, 4 * llc_bytes())
    per = 3 * D * F * BYTES_PER_WEIGHT[dtype.partition(":")[0]]
    return max(64, -(-int(target / per) // 64) * 64)


def build(D, F, pool_experts, dtype, isa, threads, knee):
    """dtype: a CPU dtype, or int4:GROUP[:ORDER] (int4 in groups of 32, 64 or 128, plain int4: 128; ORDER natural or
    interleaved, the stored order, default the executor's for the ISA and group)."""
    dtype, _, rest = dtype.partition(":")
    group, _, order = rest.partition(":")
    g = torch.Generator().manual_seed(0)
    uniq = min(8, pool_experts)  # distinct random experts, repeated: packing copies them apart anyway
    reps = -(-pool_experts // uniq)  # exactly pool_experts experts: routing uses ids up to pool_experts - 1
    ws = [((torch.rand(uniq, r, c, generator=g) - 0.5) * 0.05) for r, c in ((F, D), (F, D), (D, F))]
    if dtype == "mxfp4":  # as a checkpoint publishes them: quantized once, the blocks packed as they are
        pub = [quant.quantize_mxfp4(w) for w in ws]
        return CpuMoE.from_mxfp4(*[tuple(t.repeat(reps, *[1] * (t.dim() - 1))[:pool_experts] for t in p) for p in pub],
                                 isa=isa, threads=threads, amx_min_tokens=knee)
    if dtype in FILE_ONLY_DTYPES:  # a GGUF file's blocks only (no quantizer): random blocks, d small and finite
        raws = []
        for r, c in ((F, D), (F, D), (D, F)):
            raw = torch.randint(0, 256, (uniq, r, c // 256, int(CPU_DTYPES[dtype].bytes_per_weight() * 256)), generator=g,
                                dtype=torch.uint8)
            if dtype == "iq1_m":  # no d field: d's 4 nibbles on top of the 4 scales words
                bits = int(torch.tensor(1e-3).half().view(torch.int16)) & 0xFFFF
                for w in range(4):
                    raw[..., 49 + 2 * w] = (raw[..., 49 + 2 * w] & 0x0F) | ((bits >> (4 * w)) & 0xF) << 4
            else:
                raw[..., :2] = torch.full(raw.shape[:-1] + (1,), 1e-3).half().view(torch.uint8)
            raws.append(raw.repeat(reps, 1, 1, 1)[:pool_experts])
        return CpuMoE(*(moe_mod.gguf_blocks(n, w, dtype.upper()) for n, w in zip(("gate", "up", "down"), raws)),
                      dtype=dtype, isa=isa, threads=threads, amx_min_tokens=knee)
    ws = [w.repeat(reps, 1, 1)[:pool_experts].bfloat16() for w in ws]
    return CpuMoE(*ws, dtype=dtype, isa=isa, threads=threads, amx_min_tokens=knee,
                  **({"group_size": int(group)} if group else {}), **({"int4_order": order} if order else {}))


def run_case(moe, D, n, m, pool_experts, isa):
    """Median seconds per call of n experts x m tokens each, rotating over the expert pool, plus the
    library's per-phase breakdown (mean seconds per call)."""
    rots = [routing(n, m, pool_experts, it) for it in range(max(1, pool_experts // n))]
    x = torch.randn(n * m, D).bfloat16()
    out = torch.empty_like(x)
    n_timed = []
    sec = timeit(lambda it: moe.forward(x, *rots[it % len(rots)], out=out),
                 after_warmup=lambda: _native.profile_read(isa, reset=True), counted=n_timed)  # warm-up dropped
    return sec, dict(_native.profile_read(isa, reset=True), timed_calls=n_timed[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-235b-a22b,qwen3-30b-a3b")
    ap.add_argument("--isas", default="best2", help="comma list, or best2 = the two best compiled ISAs")
    ap.add_argument("--dtypes", default="bf16,int8,int4", help="comma list of CPU dtypes; int4:GROUP for int4 in "
                    "groups of 32, 64 or 128 (plain int4: 128), int4:GROUP:ORDER for its stored order (natural or "
                    "interleaved; default the executor's)")
    ap.add_argument("--threads", default=str(len(os.sched_getaffinity(0))), help="comma list")
    ap.add_argument("--decode", default="8x1,64x1,8x4,64x4", help="experts x tokens/expert")
    ap.add_argument("--prefill", default="8x16,8x64,8x256,8x1024", help="experts x tokens/expert")
    ap.add_argument("--second-isa", default="decode", choices=("decode", "all"),
                    help="cases for ISAs after the first: decode only (bf16, int8) or everything")
    ap.add_argument("--knee-sweep", default="4,8,16,32", help="AMX: tokens/expert where vector and AMX paths are both timed")
    ap.add_argument("--kblocks", default="8,16,32", help="AMX: K-block lengths (64-byte chunks) to time at 8x1024")
    ap.add_argument("--scaling", default="8", help="thread counts for a short scaling check (amx bf16, first shape)")
    ap.add_argument("--pool-experts", type=int, default=0,
                    help="distinct experts cycled through; 0 = a multiple of 64 with >= max(0.75 GB, 4 x LLC) of weights")
    ap.add_argument("--knee", type=int, default=None, help="AMX from this many tokens per expert (default: CpuMoE's per dtype)")
    ap.add_argument("--quick", action="store_true", help="tiny shape, few cases")
    ap.add_argument("--dram-bytes", type=int, help="DRAM probe buffer (default: max(2 GiB, 4 x LLC); --quick: "
                    "max(1 GiB, 4 x LLC)); smaller reads the cache, not DRAM: for smoke tests only")
    ap.add_argument("--out", default="cpu_moe.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.shapes, a.decode, a.prefill, a.pool_experts, a.knee_sweep, a.kblocks = "tiny", "8x1,8x4", "8x64", 16, "8", "16"
    compiled = [i for i in cpu_kernels.available_isas() if i != "ref"]
    isas = compiled[:2] if a.isas == "best2" else a.isas.split(",")
    threads_list = [int(t) for t in a.threads.split(",")]
    dec = [tuple(map(int, c.split("x"))) for c in a.decode.split(",") if c]
    pre = [tuple(map(int, c.split("x"))) for c in a.prefill.split(",") if c]
    sweep = [int(v) for v in a.knee_sweep.split(",") if v]
    kblocks = [int(v) for v in a.kblocks.split(",") if v]

    print(f"# bench.cpu_moe  machine: {cpu_model()}, {len(os.sched_getaffinity(0))} cpus, torch {torch.__version__}")
    print(f"# ISAs: {isas} (available: {cpu_kernels.available_isas()}), threads: {threads_list}, dtypes: {a.dtypes}")
    print(f"# shapes (D, F): {', '.join(f'{s}={SHAPES[s]}' for s in a.shapes.split(','))}; AMX knee {a.knee} "
          f"tokens; experts rotate over a pool of {a.pool_experts or '>= 0.75 GB'}; K=1, every active expert gets m tokens")
    for isa in isas:
        _native.profile_enable(isa)
    rows, knee_rows, kb_rows, scale_rows, dram, derived_knees = [], [], [], [], {}, {}
    nbytes, llc = a.dram_bytes or ceiling_bytes(a.quick), llc_bytes()
    for th in threads_list:
        dram[th] = dram_read_gbps(isas[0], th, nbytes)
        print(f"# DRAM read, {th} threads: {dram[th]:.1f} GB/s (streaming read of {nbytes / 2**20:.0f} MiB; "
              f"LLC {llc / 2**20:.0f} MiB)")
    print(f"{'shape':16} {'isa':12} {'dtype':5} {'thr':>3} {'E':>4} {'m':>5} {'ms':>9} {'GB/s':>7} {'%DRAM':>6} "
          f"{'TFLOP/s':>8} {'torch':>6} {'x torch':>7}")
    for shape in a.shapes.split(","):
        D, F = SHAPES[shape]
        for th in threads_list:
            torch_tf = {(n, m): torch_loop_tflops(D, F, n, m, th) for n, m in pre}
            for ii, isa in enumerate(isas):
                second = ii > 0 and a.second_isa == "decode"
                if second and shape != a.shapes.split(",")[0]:
                    continue  # the second ISA's decode check: first shape only (keeps the default run short)
                for dtype in a.dtypes.split(","):
                    if second and dtype in ("int4", "mxfp4"):
                        continue
                    pool_e = a.pool_experts or pool_size(D, F, dtype)
                    moe = build(D, F, pool_e, dtype, isa, th, a.knee)
                    per_expert = moe.nbytes / pool_e
                    for kind, cases in (("decode", dec), ("prefill", [] if second else pre)):
                        for n, m in cases:
                            sec, prof = run_case(moe, D, n, m, pool_e, isa)
                            gbps = n * per_expert / sec / 1e9
                            tflops = 2 * 3 * D * F * m * n / sec / 1e12
                            tt = torch_tf.get((n, m)) if kind == "prefill" else None
                            r = dict(kind=kind, shape=shape, D=D, F=F, isa=isa, dtype=dtype, threads=th, experts=n,
                                     tokens_per_expert=m, ms=sec * 1e3, weight_gbps=gbps, dram_gbps=dram[th],
                                     dram_frac=gbps / dram[th], tflops=tflops, torch_bf16_tflops=tt,
                                     x_torch=tflops / tt if tt else None, phases_ms={k: v * 1e3 for k, v in prof.items() if k not in ("calls", "timed_calls")},
                                     profiled_calls=prof["calls"], timed_calls=prof["timed_calls"])
                            rows.append(r)
                            r["pool_bytes"], r["pool_experts"] = pool_e * per_expert, pool_e
                            print(f"{shape:16} {isa:12} {dtype:5} {th:3d} {n:4d} {m:5d} {sec * 1e3:9.3f} {gbps:7.1f} "
                                  f"{100 * r['dram_frac']:5.0f}% {tflops:8.2f} " + (f"{tt:6.2f} {r['x_torch']:6.2f}x" if tt else "")
                                  + ("  <- above the DRAM ceiling: see the note at the end" if kind == "decode"
                                     and r["dram_frac"] > 1 else ""), flush=True)
                    if isa in ("amx", "amx_emu") and dtype in ("bf16", "int8", "int4") and shape == a.shapes.split(",")[0] and th == threads_list[-1]:
                        knee0 = moe.amx_min_tokens
                        for m in sweep:  # the knee: same call on the vector path, then on AMX
                            t_vec = run_case_knee(moe, D, 8, m, pool_e, isa, 1 << 30)
                            t_amx = run_case_knee(moe, D, 8, m, pool_e, isa, 1)
                            knee_rows.append(dict(shape=shape, dtype=dtype, experts=8, tokens_per_expert=m,
                                                  vector_ms=t_vec * 1e3, amx_ms=t_amx * 1e3))
                            print(f"# knee {shape} {dtype} m={m}: vector {t_vec * 1e3:.3f} ms, AMX {t_amx * 1e3:.3f} ms")
                        moe.set_amx_min_tokens(knee0)
                        mine = [r for r in knee_rows if r["shape"] == shape and r["dtype"] == dtype]
                        derived = knee_from_times([r["tokens_per_expert"] for r in mine], [r["vector_ms"] for r in mine],
                                                  [r["amx_ms"] for r in mine])
                        derived_knees[dtype] = derived
                        print(f"# knee {shape} {dtype}: derived {derived} tokens/expert (first m of the sweep from "
                              f"which AMX stays faster); this CpuMoE used {knee0}")
                        for m in (1024,) if kblocks else ():  # AMX K-block length (L1/L2 reuse trade-off)
                            for kb in kblocks:
                                _native.tune(isa, "amx_kblock", kb)
                                t = run_case(moe, D, 8, m, pool_e, isa)[0]
                                kb_rows.append(dict(shape=shape, dtype=dtype, experts=8, tokens_per_expert=m, kblock=kb,
                                                    ms=t * 1e3, tflops=2 * 3 * D * F * m * 8 / t / 1e12))
                                print(f"# kblock {shape} {dtype} 8x{m} kb={kb}: {t * 1e3:.3f} ms, "
                                      f"{kb_rows[-1]['tflops']:.2f} TFLOP/s")
                            _native.tune(isa, "amx_kblock", 16)
                    big = [r for r in rows if r["isa"] == isa and r["dtype"] == dtype and r["shape"] == shape]
                    for r in (big[0], big[-1]) if big else ():
                        print(f"#   phases ms ({r['kind']} {r['experts']}x{r['tokens_per_expert']}): "
                              + " ".join(f"{k}={v:.3f}" for k, v in r["phases_ms"].items()))
                    del moe
    shape0 = a.shapes.split(",")[0]
    D, F = SHAPES[shape0]
    for th in [int(v) for v in a.scaling.split(",") if v]:
        pool_e = a.pool_experts or pool_size(D, F, "bf16")
        moe = build(D, F, pool_e, "bf16", isas[0], th, a.knee)
        gb = dram_read_gbps(isas[0], th, nbytes)  # the ceiling at this thread count, once
        for n, m in (dec[1 % len(dec)], pre[-1]) if pre and dec else ():
            t = run_case(moe, D, n, m, pool_e, isas[0])[0]
            scale_rows.append(dict(shape=shape0, isa=isas[0], dtype="bf16", threads=th, experts=n, tokens_per_expert=m,
                                   ms=t * 1e3, weight_gbps=n * moe.nbytes / pool_e / t / 1e9, dram_gbps=gb,
                                   tflops=2 * 3 * D * F * m * n / t / 1e12))
            r = scale_rows[-1]
            print(f"# scaling {shape0} {isas[0]} bf16 {th} threads {n}x{m}: {t * 1e3:.3f} ms, {r['weight_gbps']:.1f} GB/s "
                  f"(DRAM read {gb:.1f}), {r['tflops']:.2f} TFLOP/s")
        del moe
    after = {th: dram_read_gbps(isas[0], th, nbytes) for th in threads_list}  # has the ceiling drifted?
    for th in threads_list:
        print(f"# DRAM read again after the cases, {th} threads: {after[th]:.1f} GB/s (before: {dram[th]:.1f})")
    for r in rows:
        if r["kind"] == "decode" and r["dram_frac"] > 1:
            r["above_ceiling_note"] = note = (
                f"{r['weight_gbps']:.1f} GB/s is above the ceiling measured before ({dram[r['threads']]:.1f}) "
                f"{'and' if r['weight_gbps'] > after[r['threads']] else 'but not'} after ({after[r['threads']]:.1f}) "
                f"the cases: a pool of {r['pool_bytes'] / 2**20:.0f} MiB re-read every "
                f"{max(1, r['pool_experts'] // r['experts'])} calls "
                f"against {llc / 2**20:.0f} MiB of LLC; if it is far above, the kernel reads DRAM better than the "
                f"stream probe (a probe limit, not extra bandwidth); if the ceiling moved, the machine's "
                f"bandwidth changed during the run (other load)")
            print(f"# note {r['shape']} {r['isa']} {r['dtype']} {r['experts']}x{r['tokens_per_expert']}: {note}")
    with open(a.out, "w") as f:
        json.dump(dict(machine=cpu_model(), torch=torch.__version__, isas=isas, dram_gbps=dram, dram_gbps_after=after,
                       dram_buffer_bytes=nbytes, llc_bytes=llc, rows=rows,
                       knee=knee_rows, derived_knee=derived_knees, kblock=kb_rows, scaling=scale_rows), f, indent=1)
    print(f"# wrote {a.out}")
    return 0


def run_case_knee(moe, D, n, m, pool_experts, isa, knee) -> float:
    moe.set_amx_min_tokens(knee)
    return run_case(moe, D, n, m, pool_experts, isa)[0]


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
