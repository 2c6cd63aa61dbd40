"""One hybrid MoE layer over batch sizes, routing skews and strategies: measured vs predicted time.

    python -m bench.layer_sweep --shape qwen3-30b-a3b --profile PROFILE.json --out DIR

For each batch of T tokens (top-K of E experts; routing uniform or Zipf with exponent s over a random
expert ranking), each strategy (cost, cpu, ship, threshold:N) runs the same layer: resident experts on
the GPU, the rest split between the CPU lane and the ship lane as the strategy says. The measured time
(median, synchronised) sits beside the scheduler's prediction; a table, JSON and one PNG per skew.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from placement.calibrate import cpu_name
from placement.measure import ExpertWeights
from placement.cost_model import get_shape
from placement.hardware import pricing_profile
from placement.schedule import LayerScheduler

DEFAULT_T = [1, 4, 16, 64, 256, 1024, 4096, 8192]
DEFAULT_SKEWS = ["uniform", "zipf0.5", "zipf1.0", "zipf1.5"]
DEFAULT_STRATEGIES = ["cost", "cpu", "ship", "threshold:32"]


def routing(T: int, E: int, K: int, skew: str, gen: torch.Generator, device):
    """topk_ids [T, K] (distinct per token) and normalised weights [T, K] for a skew name."""
    if skew == "uniform":
        p = torch.ones(E)
    else:
        s = float(skew.removeprefix("zipf"))
        rank = torch.randperm(E, generator=gen) + 1  # which experts are hot is random
        p = 1.0 / rank.double() ** s
    ids = torch.multinomial(p.float().expand(T, E), K, replacement=False, generator=gen)
    w = torch.rand(T, K, generator=gen) + 0.1
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def build_layer(shape, profile, device, resident: int, cpu_dtype: str, isa: str | None, seed: int = 0):
    from hybrid.offload import HybridExperts, Offload

    g = torch.Generator().manual_seed(seed)
    E = shape.num_experts
    sched = LayerScheduler(shape, profile, "cost")
    off = Offload(device, torch.bfloat16 if device.type == "cuda" else torch.float32, sched, cpu_dtype=cpu_dtype,
                  cpu_isa=isa)
    layer = HybridExperts(0, *ExpertWeights.random(shape, E, seed=seed).stacks(), off)
    if resident:
        layer.set_resident(torch.randperm(E, generator=g)[:resident].tolist())
    return layer, off


def time_layer(layer, x, ids, w, reps: int) -> tuple[float, float]:
    """Median seconds of one forward, and the scheduler's predicted seconds for it."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    layer(x, ids, w)  # warm-up (staging slots, pinned buffers, kernels)
    sync()
    times, preds = [], []
    t_start = time.perf_counter()
    # at least `reps` runs and 0.3 s of them: small batches take a few milliseconds and are noisy alone
    while len(times) < reps or (time.perf_counter() - t_start < 0.3 and len(times) < 50):
        before = layer.stats.predicted_s
        t0 = time.perf_counter()
        layer(x, ids, w)
        sync()
        times.append(time.perf_counter() - t0)
        preds.append(layer.stats.predicted_s - before)
    return statistics.median(times), statistics.median(preds)


def sweep(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profile = pricing_profile(args.profile, note=lambda line: print(f"# note: {line}", flush=True))
    shape = get_shape(args.shape)
    layer, off = build_layer(shape, profile, device, args.resident, args.cpu_dtype, args.isa)
    gen = torch.Generator().manual_seed(1)
    rows = []
    header = (f"# layer sweep | {cpu_name()} ({platform.node()}), GPU {torch.cuda.get_device_name() if device.type == 'cuda' else 'none'}"
              f" | CPU ISA {layer.cpu_moe.isa}, {layer.cpu_moe.topology.threads} threads, CPU dtype {args.cpu_dtype}, GPU "
              f"dtype {off.dtype} | {shape.name}: E={shape.num_experts} K={shape.topk} D={shape.hidden} "
              f"F={shape.intermediate}, {args.resident} resident | profile {profile.name}")
    print(header, flush=True)
    for skew in args.skews:
        for T in args.tokens:
            ids, w = routing(T, shape.num_experts, shape.topk, skew, gen, device)
            x = torch.randn(T, shape.hidden, generator=gen).to(off.dtype).to(device)
            point = {"skew": skew, "tokens": T, "active_experts": int(torch.unique(ids).numel())}
            for strat in args.strategies:
                off.scheduler = LayerScheduler(shape, profile, strat)
                meas, pred = time_layer(layer, x, ids, w, args.reps)
                point[strat] = {"measured_ms": meas * 1e3, "predicted_ms": pred * 1e3}
            others = [point[s]["measured_ms"] for s in args.strategies if s != "cost"]
            if "cost" in point and others:
                point["cost_over_best_other"] = point["cost"]["measured_ms"] / min(others)
            rows.append(point)
            print(" ".join([f"{skew:>8} T={T:5d} act={point['active_experts']:3d}"] +
                           [f"{s}={point[s]['measured_ms']:8.2f}/{point[s]['predicted_ms']:7.2f}ms" for s in args.strategies]
                           + [f"cost/best={point.get('cost_over_best_other', float('nan')):.3f}"]), flush=True)
    decisions = sum(l.stats.batches for l in off.layers)
    return {"header": header, "machine": {"cpu": cpu_name(), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None},
            "shape": shape.name, "resident": args.resident, "cpu_isa": layer.cpu_moe.isa, "cpu_dtype": args.cpu_dtype,
            "profile": profile.name, "strategies": args.strategies, "points": rows,
            "decision_us_mean": 1e6 * sum(l.stats.decide_s for l in off.layers) / max(decisions, 1)}


def plot(res: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    skews = sorted({p["skew"] for p in res["points"]}, key=lambda s: (s != "uniform", s))
    fig, axes = plt.subplots(1, len(skews), figsize=(5 * len(skews), 4.2), squeeze=False)
    for ax, skew in zip(axes[0], skews):
        pts = [p for p in res["points"] if p["skew"] == skew]
        T = [p["tokens"] for p in pts]
        for i, s in enumerate(res["strategies"]):
            c = f"C{i}"
            ax.plot(T, [p[s]["measured_ms"] for p in pts], "o-", color=c, label=f"{s} measured")
            ax.plot(T, [p[s]["predicted_ms"] for p in pts], "--", color=c, alpha=0.7, label=f"{s} predicted")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{res['shape']}, {skew}")
        ax.set_xlabel("tokens in the batch")
        ax.set_ylabel("layer time (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = out / f"layer_sweep_{res['shape']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--profile", required=True, help="calibrated profile JSON (or a built-in name)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=DEFAULT_T)
    p.add_argument("--skews", type=lambda s: s.split(","), default=DEFAULT_SKEWS)
    p.add_argument("--strategies", type=lambda s: s.split(","), default=DEFAULT_STRATEGIES)
    p.add_argument("--resident", type=int, default=0, help="resident experts in VRAM (default 0)")
    p.add_argument("--cpu-dtype", default="bf16", choices=["bf16", "int8", "int4", "mxfp4"])
    p.add_argument("--isa", help="force the CPU ISA")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    res = sweep(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"layer_sweep_{res['shape']}.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out)
    ratios = [p["cost_over_best_other"] for p in res["points"] if "cost_over_best_other" in p]
    errs = [abs(p[s]["predicted_ms"] - p[s]["measured_ms"]) / p[s]["measured_ms"] for p in res["points"]
            for s in res["strategies"]]
    print(f"cost / best other strategy: median {np.median(ratios):.3f}, worst {max(ratios):.3f}, "
          f"within 5% at {sum(r <= 1.05 for r in ratios)}/{len(ratios)} points")
    print(f"predicted vs measured: median error {np.median(errs):.1%}, within 15% at "
          f"{sum(e <= 0.15 for e in errs)}/{len(errs)}; scheduler decision {res['decision_us_mean']:.1f} us mean")
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
