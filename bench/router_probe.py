"""The decode router on the GPU: cuBLAS GEMM + router_topk against router_gemv_topk's configurations (diagnostic).

    python -m bench.router_probe [--out FILE.json]

Each case is a CUDA graph of N back-to-back router calls, replayed; the figure is the median replay / N (timed
with CUDA events since the call-3 figures of BENCHMARKS.md, which timed the host around each replay). The
calls rotate over N = 200 copies of the router weight (100 MB at 128 x 2048, past the H200's 50 MB L2: a
model's layers each read their own router after ~40 MB of other weights).
Shapes: Qwen3-30B-A3B (E 128, D 2048, top-8) at 1 and 8 rows, Qwen3-235B-A22B (D 4096), gpt-oss-20b (E 32,
D 2880, top-4, bias). The configuration table in hybrid.gpu_kernels.router (GEMV_CONFIG) comes from here.

    python -m bench.router_probe --norm-in [--out FILE.json]

times the MoE input norm folded into the router (router_gemv_topk's norm_in, HYBRID_ROUTER_NORM=1) against
the pair it replaces (add_rms_norm, then router_gemv_topk on its row), each configuration with the weight tile
loaded before the norm (preload_w, the default) and after it; ids are compared with the unfused pair's.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from bench.gemv_probe import graphs_of, time_graphs
from hybrid.gpu_kernels.norm import add_rms_norm
from hybrid.gpu_kernels.router import GEMV_CONFIG, RouterScratch, router_gemv_topk, router_topk

SHAPES = [(1, 128, 2048, 8, False), (8, 128, 2048, 8, False), (1, 128, 4096, 8, False), (1, 32, 2880, 4, True)]
CONFIGS = [(1, 2048, 1), (2, 2048, 1), (2, 1024, 1), (4, 1024, 1), (4, 512, 1), (4, 2048, 2), (4, 2048, 4),
           (8, 1024, 2), (8, 2048, 4), (16, 1024, 4), (16, 2048, 8)]
N = 200


def graph_us(fn, weights, rounds: int = 50) -> float:
    """fn(None, w) for each of the N weights captured in one graph (bench.gemv_probe's graph timing: CUDA
    events around each replay); median microseconds per call."""
    return time_graphs(graphs_of(fn, None, weights, N), rounds) / N


NORM_CONFIGS = [GEMV_CONFIG, (2, 2048, 1), (1, 2048, 2), (2, 2048, 2), (4, 2048, 4)]


def router_weights(dev, g, E: int, D: int, bias: bool):
    """One shape's router (w [E, D], its N rotating copies, the bias or None), drawn from g after the rows."""
    w = (torch.randn(E, D, device=dev, generator=g) / D ** 0.5).bfloat16()
    b = (torch.randn(E, device=dev, generator=g) * 0.1).bfloat16() if bias else None
    return w, [w.clone() for _ in range(N)], b


def norm_in_rows(dev) -> list:
    """--norm-in: the folded norm (each config, preload_w on and off) against add_rms_norm + the router."""
    res = []
    for T, E, D, K, bias in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        h = torch.randn(T, D, device=dev, generator=g).bfloat16()
        delta = torch.randn(T, D, device=dev, generator=g).bfloat16()
        nw = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).bfloat16()
        w, ws, b = router_weights(dev, g, E, D, bias)
        sc = RouterScratch(E, dev)

        def pair(_, wi):
            _, y = add_rms_norm(h, delta, nw, 1e-6)
            return router_gemv_topk(y, wi, b, K, True, 1.0, sc)

        base = graph_us(pair, ws)
        ref = pair(None, w)[0]
        row = {"T": T, "E": E, "D": D, "K": K, "add_rms_norm_then_router_us": base, "configs": {}}
        print(f"T={T} E={E} D={D} K={K} bias={bias}: add_rms_norm + router_gemv_topk {base:6.2f} us", flush=True)
        for cfg in NORM_CONFIGS:
            for pre in (True, False):
                sc2 = RouterScratch(E, dev)

                def fold(_, wi):
                    return router_gemv_topk(h, wi, b, K, True, 1.0, sc2, config=cfg, norm_in=(delta, nw, 1e-6),
                                            preload_w=pre)

                try:
                    us = graph_us(fold, ws)
                    same = float((fold(None, w)[0] == ref).float().mean())
                except Exception as exc:  # noqa: BLE001 - a config the compiler refuses: say so, go on
                    print(f"   {cfg} preload_w={pre}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                    continue
                row["configs"][f"{cfg} preload_w={pre}"] = {"us": us, "ids_agree": same}
                print(f"   {cfg} preload_w={pre}: {us:6.2f} us ({us - base:+.2f}), ids agreeing {same:.3f}", flush=True)
        res.append(row)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--norm-in", action="store_true", help="time the folded MoE input norm against its unfused pair")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("router_probe needs CUDA")
    dev = torch.device("cuda")
    res = norm_in_rows(dev) if a.norm_in else config_rows(dev)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def config_rows(dev) -> list:
    """The router kernel's configurations against cuBLAS + router_topk, per shape."""
    res = []
    for T, E, D, K, bias in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(T, D, device=dev, generator=g).bfloat16()
        w, ws, b = router_weights(dev, g, E, D, bias)
        base = graph_us(lambda _, wi: router_topk(F.linear(x, wi, b), K, True), ws)
        ref = router_topk(F.linear(x, w, b), K, True)
        row = {"T": T, "E": E, "D": D, "K": K, "cublas_topk_us": base, "configs": {}}
        print(f"T={T} E={E} D={D} K={K} bias={bias}: cuBLAS + router_topk {base:6.2f} us", flush=True)
        for cfg in CONFIGS:
            sc = RouterScratch(E, dev)
            try:
                us = graph_us(lambda _, wi: router_gemv_topk(x, wi, b, K, True, 1.0, sc, config=cfg), ws)
                ids, _ = router_gemv_topk(x, w, b, K, True, 1.0, sc, config=cfg)
                same = float((ids == ref[0]).float().mean())
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses: say so, go on
                print(f"   {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            row["configs"][str(cfg)] = {"us": us, "ids_agree": same}
            print(f"   {cfg}: {us:6.2f} us, ids agreeing with cuBLAS's {same:.3f}", flush=True)
        res.append(row)
    return res


if __name__ == "__main__":
    raise SystemExit(main())
