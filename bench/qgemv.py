"""Micro-benchmark: the quantized decode GEMV (hybrid.gpu_kernels.qgemv.qlinear_small) against the bf16 one
(gemv.linear_small) and cuBLAS (F.linear), on decoder shapes at T = 1, 2, 4, 8 rows.

    python -m bench.qgemv --out qgemv.json [--kinds int8,int4,fp8] [--tokens 1,2,4,8] [--shapes qkv,o_proj]
                          [--configs 16:256:1:6,32:256:2:4:2]

Timing: each implementation's calls are captured in a CUDA graph (as the decode step runs them), rotating over
enough copies of the weight that the copies' bytes exceed L2 (--l2-mib) three times, so each call streams its
weight from HBM; a replay is timed by CUDA events and divided by its calls; the median over --reps replays is
reported. GB/s counts the weight bytes a call must read (bf16: 2 a value; quantized: the bytes plus their fp32
scales), not x or y. Each quantized output is first checked against F.linear of the de-quantized weight in fp32
(max_abs_err, ok). --configs adds qlinear_small configs to time beside the table's
(block_n:block_k:num_warps:num_stages[:split]), to tune qgemv.TABLE.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from hybrid.errors import UsageError

SHAPES = {  # name: (N, K) of W [N, K]
    "qkv": (5120, 2048),
    "o_proj": (2048, 4096),
    "deepseek_o_proj": (7168, 16384),
    "q_b": (24576, 1536),
    "head": (32768, 2048),
    "qwen3_head": (151936, 2048),  # Qwen3-30B-A3B's whole vocabulary: a decode step's largest GEMV
}
KINDS = ("int8", "int4", "fp8")


def parse_list(text: str, allowed, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise UsageError(f"--{what}: {', '.join(bad) or 'nothing given'} not among {', '.join(allowed)}")
    return items


def parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        tokens = []
    if not tokens or not all(1 <= t <= 8 for t in tokens):
        raise UsageError(f"--tokens {text!r}: give a comma list of row counts from 1 to 8")
    return tokens


def parse_configs(text: str | None) -> list:
    """block_n:block_k:num_warps:num_stages[:split] items -> QGemvConfig."""
    from hybrid.gpu_kernels.qgemv import QGemvConfig

    configs = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        try:
            parts = [int(v) for v in item.split(":")]
            if len(parts) not in (4, 5):
                raise ValueError("four or five numbers")
            configs.append(QGemvConfig(*parts[:4], split=parts[4] if len(parts) == 5 else 1))
        except ValueError as exc:
            raise UsageError(f"--configs {item!r}: expected block_n:block_k:num_warps:num_stages[:split] ({exc})")
    return configs


def time_graph(fn, operands: list[tuple], reps: int) -> float:
    """Median microseconds a call of fn over the rotated operands, captured in one CUDA graph."""
    for ops in operands:  # compile and warm every copy outside the capture
        fn(*ops)
    calls = len(operands) * max(1, math.ceil(20 / len(operands)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*operands[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*operands[i % len(operands)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copies_for(nbytes: int, l2_mib: float) -> int:
    """Weight copies whose bytes exceed L2 three times (at least 2)."""
    return max(2, math.ceil(3 * l2_mib * 2 ** 20 / nbytes))


def bench_shape(name: str, T_list: list[int], kinds: list[str], configs: list, reps: int, l2_mib: float) -> list[dict]:
    """Rows for one shape: bf16 GEMV, cuBLAS, each kind with the table's config and each extra config."""
    import copy

    import torch.nn.functional as F

    from hybrid.gpu_kernels.gemv import linear_small
    from hybrid.gpu_kernels.qgemv import fit, pick_config, qlinear_small
    from hybrid.models.qweight import QWeight, weight_bytes

    N, K = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    bf16 = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2, l2_mib) - 1)]
    qws = {}
    for kind in kinds:
        qw = QWeight.from_float(w, kind)
        qws[kind] = [qw] + [copy.deepcopy(qw) for _ in range(copies_for(qw.nbytes, l2_mib) - 1)]
    del w
    rows = []
    for T in T_list:
        x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
        base = {"shape": name, "N": N, "K": K, "T": T}
        gemv_us = time_graph(lambda wt: linear_small(x, wt), [(wt,) for wt in bf16], reps)
        rows.append(dict(base, impl="bf16_gemv", config=None, us=gemv_us, bytes=weight_bytes("bf16", N, K)))
        rows.append(dict(base, impl="bf16_cublas", config=None, bytes=weight_bytes("bf16", N, K),
                         us=time_graph(lambda wt: F.linear(x, wt), [(wt,) for wt in bf16], reps)))
        for kind in kinds:
            qw = qws[kind][0]
            ref = F.linear(x.float(), qw.dequantize(torch.float32))
            for cfg in [None] + configs:
                err = (qlinear_small(x, qw, None, cfg).float() - ref).abs().max().item()
                us = time_graph(lambda q, c=cfg: qlinear_small(x, q, None, c), [(q,) for q in qws[kind]], reps)
                shown = fit(cfg, N, K) if cfg else pick_config(T, N, K)
                rows.append(dict(base, impl=kind, config=shown.short(), us=us, bytes=qw.nbytes, max_abs_err=err,
                                 ok=err <= 2e-2 * max(1.0, ref.abs().max().item())))
        for r in rows[-(2 + len(kinds) * (1 + len(configs))):]:
            r["gbps"] = r["bytes"] / r["us"] / 1e3
            r["speedup_vs_bf16_gemv"] = gemv_us / r["us"]
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'shape':<16} {'T':>2} {'impl':<12} {'config':<26} {'us':>8} {'GB/s':>7} {'x gemv':>7}")
    for r in rows:
        flag = "" if r.get("ok", True) else "  WRONG"
        print(f"{r['shape']:<16} {r['T']:>2} {r['impl']:<12} {r['config'] or '-':<26} {r['us']:>8.2f} "
              f"{r['gbps']:>7.0f} {r['speedup_vs_bf16_gemv']:>7.2f}{flag}")


def main(argv=None) -> int:
    """Time qlinear_small (int8 / int4 / fp8 weights) against the bf16 decode GEMV and cuBLAS on CUDA."""
    ap = argparse.ArgumentParser(prog="python -m bench.qgemv", description=main.__doc__)
    ap.add_argument("--out", required=True, help="JSON file for the rows")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--tokens", default="1,2,4,8", help="rows per call (1..8)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--configs", help="extra qlinear_small configs, block_n:block_k:num_warps:num_stages[:split],...")
    ap.add_argument("--reps", type=int, default=50, help="graph replays per median (default 50)")
    ap.add_argument("--l2-mib", type=float, default=50.0, help="L2 size the weight copies exceed 3x (H200: 50)")
    a = ap.parse_args(argv)
    kinds = parse_list(a.kinds, KINDS, "kinds")
    shapes = parse_list(a.shapes, tuple(SHAPES), "shapes")
    tokens = parse_tokens(a.tokens)
    configs = parse_configs(a.configs)
    if a.reps < 1:
        raise UsageError("--reps must be at least 1")
    if not torch.cuda.is_available():
        raise UsageError("bench.qgemv times CUDA kernels: run it on a machine with a CUDA GPU")
    rows = []
    for name in shapes:
        rows += bench_shape(name, tokens, kinds, configs, a.reps, a.l2_mib)
        print_rows([r for r in rows if r["shape"] == name])
    out = {"device": torch.cuda.get_device_name(), "l2_mib": a.l2_mib, "reps": a.reps, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
