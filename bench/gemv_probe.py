"""cuBLAS (F.linear) against the decode GEMV (hybrid.gpu_kernels.gemv.linear_small) on the decoder's dense
projections, over a small grid of the GEMV's configs (diagnostic; picks the rows of gemv.TABLE).

    python -m bench.gemv_probe [--out FILE.json] [--full] [--budget-s 50] [--footprint-mb 256]

Shapes (bf16): q/k/v x [T, 2048] @ [5120, 2048]^T, o_proj x [T, 4096] @ [2048, 4096]^T, router
x [T, 2048] @ [128, 2048]^T; T = 1 and 8. Each variant is timed inside CUDA graphs of 50 back-to-back calls
(replayed many times; a call's time is the median replay time / 50). The calls rotate over copies of the
weight totalling at least --footprint-mb (default 256 MB, over five times the H200's 50 MB L2) so every call
streams its weight from HBM, as a model's layers each read their own: one 21 MB weight called 50 times would
otherwise sit in L2 from the second call on. Where 50 calls do not reach the footprint (the router), several
graphs over distinct copies are replayed in turn. --footprint-mb 0: one weight, L2-hot (a lower bound).

Printed per shape and T: cuBLAS's us and TB/s (weight + x + y bytes / time), the table's config (what
linear_small picks with config=None), the best config of the grid with its us and TB/s, and the max abs error
of each against F.linear's output (the JSON has the error against fp32 too, and each config's repr to paste
into the table). --budget-s (default 50) stops trying further configs once spent, shared out among the
cases still to run; each case runs its table config at least, and its row says how many it tried. A first
run spends most of it compiling (each config is a fresh Triton compile); Triton's cache makes a rerun fast,
so run it twice, or raise --budget-s, for the whole grid. --full sweeps a wider grid (minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

CALLS = 50
SHAPES = [("qkv", 5120, 2048), ("o_proj", 2048, 4096), ("router", 128, 2048)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def config_grid(T: int, N: int, K: int, full: bool):
    """The table's config first, then a few around it (FMA and dot, rows per program, tile width, warps,
    stages, split-K); fitted to the shape and deduplicated."""
    from hybrid.gpu_kernels.gemv import GemvConfig as C
    from hybrid.gpu_kernels.gemv import fit, pick_config

    if T == 1:
        grid = [C(4, 512, 4), C(8, 512, 4), C(8, 1024, 4), C(16, 512, 4), C(8, 256, 2), C(16, 1024, 8),
                C(16, 256, 4, 3, dot=True), C(8, 512, 4, split=2), C(4, 256, 4, split=4), C(8, 512, 4, unroll=False)]
        if full:
            grid += [C(bn, bk, nw) for bn in (2, 4, 8, 16, 32) for bk in (256, 512, 1024, 2048) for nw in (2, 4, 8)]
            grid += [C(16, bk, 4, st, dot=True) for bk in (128, 256, 512) for st in (2, 3, 4)]
            grid += [C(bn, 512, 4, split=s) for bn in (4, 8, 16) for s in (2, 4)]
    else:
        grid = [C(16, 256, 4, 3, dot=True), C(16, 512, 4, 3, dot=True), C(32, 256, 4, 3, dot=True),
                C(16, 128, 4, 4, dot=True), C(16, 256, 8, 2, dot=True), C(4, 256, 4), C(8, 128, 4), C(8, 256, 8),
                C(16, 256, 4, 3, split=2, dot=True)]
        if full:
            grid += [C(bn, bk, nw, st, dot=True) for bn in (16, 32, 64) for bk in (64, 128, 256, 512)
                     for nw in (4, 8) for st in (2, 3, 4)]
            grid += [C(bn, bk, nw) for bn in (2, 4, 8) for bk in (64, 128, 256) for nw in (4, 8)]
            grid += [C(16, 256, 4, 3, split=s, dot=True) for s in (2, 4)]
    out, seen = [], set()
    for cfg in [pick_config(T, N, K)] + [fit(c, N, K) for c in grid]:
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


def graphs_of(fn, x, weights, calls):
    """CUDA graphs of `calls` calls fn(x, w) rotating over `weights` (one graph per `calls` distinct copies)."""
    n_graphs = max(1, math.ceil(len(weights) / calls))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graphs = []
    with torch.cuda.stream(s):
        fn(x, weights[0])  # compile / warm outside the capture
        torch.cuda.synchronize()
        for g in range(n_graphs):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                for i in range(calls):
                    fn(x, weights[(g * calls + i) % len(weights)])
            graphs.append(graph)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return graphs


def time_graphs(graphs, rounds: int) -> float:
    """Median microseconds of one replay, over `rounds` passes replaying each graph in turn."""
    for g in graphs * 2:
        g.replay()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(rounds):
        for g in graphs:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            pairs.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs) * 1e3


def probe(name, N, K, T, dtype, args, deadline, dev="cuda"):
    from hybrid.gpu_kernels.gemv import linear_small, pick_config

    elt = torch.tensor([], dtype=dtype).element_size()
    w_bytes = N * K * elt
    n_w = max(1, math.ceil(args.footprint_mb * 2 ** 20 / w_bytes))
    g = torch.Generator(device=dev).manual_seed(N + K + T)
    weights = [(torch.randn(N, K, generator=g, device=dev) / K ** 0.5).to(dtype) for _ in range(n_w)]
    x = torch.randn(T, K, generator=g, device=dev).to(dtype)
    moved = w_bytes + (T * K + T * N) * elt
    ref = F.linear(x, weights[0])
    ref32 = F.linear(x.float(), weights[0].float())

    def tbs(us):
        return moved / (us * 1e-6) / 1e12

    cub = time_graphs(graphs_of(F.linear, x, weights, CALLS), args.rounds) / CALLS
    row = {"shape": name, "N": N, "K": K, "T": T, "dtype": str(dtype).replace("torch.", ""), "weight_copies": n_w,
           "cublas_us": round(cub, 3), "cublas_tbs": round(tbs(cub), 3),
           "cublas_err_vs_fp32": float((ref.float() - ref32).abs().max()), "configs": []}
    table = pick_config(T, N, K)
    grid = config_grid(T, N, K, args.full)
    for cfg in grid:
        if time.monotonic() > deadline and row["configs"]:
            break
        try:
            y = linear_small(x, weights[0], config=cfg).float()
            err, err32 = float((y - ref.float()).abs().max()), float((y - ref32).abs().max())
            us = time_graphs(graphs_of(lambda a, w, c=cfg: linear_small(a, w, config=c), x, weights, CALLS),
                             args.rounds) / CALLS
        except Exception as e:  # a config that does not compile (registers, shared memory) is reported, not fatal
            row["configs"].append({"config": cfg.short(), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        row["configs"].append({"config": cfg.short(), "repr": repr(cfg), "table": cfg == table, "us": round(us, 3),
                               "tbs": round(tbs(us), 3), "max_abs_err_vs_f_linear": err, "max_abs_err_vs_fp32": err32})
    row["tried"] = f"{len(row['configs'])}/{len(grid)}"
    ok = [c for c in row["configs"] if "us" in c]
    if ok:
        best = min(ok, key=lambda c: c["us"])
        row["best"] = best
        row["table_config"] = next((c for c in ok if c["table"]), None)
    del weights
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the rows (every config's time) as JSON")
    p.add_argument("--full", action="store_true", help="a wider config grid (minutes)")
    p.add_argument("--budget-s", type=float, default=50.0, help="stop trying further configs after this long")
    p.add_argument("--footprint-mb", type=float, default=256.0, help="weight copies rotated per variant (0: one)")
    p.add_argument("--rounds", type=int, default=20, help="timed passes over each variant's graphs")
    p.add_argument("--T", default="1,8", help="batch sizes (1..8)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_probe: CUDA is not available here; it measures the GPU box (nothing run)", file=sys.stderr)
        return 0
    import triton

    dtype = DTYPES[a.dtype]
    ts = [int(t) for t in a.T.split(",")]
    start = time.monotonic()
    cases = [(s, t) for s in SHAPES for t in ts]
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; us per call "
          f"(median graph replay / {CALLS}), weights rotated over >= {a.footprint_mb:g} MB", flush=True)
    hdr = (f"{'shape':>7} {'T':>2} {'cuBLAS us':>9} {'TB/s':>5} | {'table us':>8} {'TB/s':>5} | "
           f"{'best config':<34} {'us':>7} {'TB/s':>5} {'x cuBLAS':>8} {'max|err|':>8} {'tried':>6}")
    print(hdr)
    for i, ((name, N, K), T) in enumerate(cases):
        # the budget left is shared by the cases still to run, each getting at least its table config
        deadline = time.monotonic() + max(0.0, a.budget_s - (time.monotonic() - start)) / (len(cases) - i)
        r = probe(name, N, K, T, dtype, a, deadline)
        rows.append(r)
        b, tc = r.get("best"), r.get("table_config")
        if b is None:
            print(f"{name:>7} {T:>2} {r['cublas_us']:9.2f} {r['cublas_tbs']:5.2f} | no config ran: "
                  f"{r['configs'][0].get('error', '')}", flush=True)
            continue
        tus = f"{tc['us']:8.2f} {tc['tbs']:5.2f}" if tc else f"{'-':>8} {'-':>5}"
        print(f"{name:>7} {T:>2} {r['cublas_us']:9.2f} {r['cublas_tbs']:5.2f} | {tus} | {b['config']:<34} "
              f"{b['us']:7.2f} {b['tbs']:5.2f} {r['cublas_us'] / b['us']:7.2f}x {b['max_abs_err_vs_f_linear']:8.1e} "
              f"{r['tried']:>6}", flush=True)
        print(f"        best: {b['repr']}")
        failed = [c for c in r["configs"] if "error" in c]
        for c in failed:
            print(f"        {c['config']}: {c['error']}")
    print(f"({time.monotonic() - start:.0f} s)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "calls_per_graph": CALLS, "footprint_mb": a.footprint_mb,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
