"""End to end with hybrid MoE layers: prefill and decode tokens/s per strategy, against the roofline.

    python -m bench.hybrid_e2e --profile PROFILE.json --layers 8 --resident 32 --out DIR

A Qwen3-30B-A3B-shaped model (fewer layers when --layers is given) is built in memory with random
weights: attention, router and norms on the GPU; every MoE layer's experts in the CPU executor, of
which --resident per layer (a quarter by default) are uploaded to VRAM, chosen by routing counts of a
calibration prefill. For each strategy: prefill tokens/s at each prompt length, decode tokens/s at
each batch size (eager: the hybrid layer reads its routing histogram on the host).

Decode roofline implied by the placement: per step, each MoE layer must read the distinct cold experts
its tokens touched from DRAM (B_D of the profile), the resident and non-expert weights from HBM (B_H);
the bound is the sum over layers of the larger of the two, counted from the routing of the measured
steps themselves.
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

from hybrid.models import build_empty, init_random_
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from hybrid.offload.build import expert_shape, expert_vram_bytes, random_expert_stacks
from hybrid.offload import HybridExperts, Offload
from hybrid.runtime import Engine
from placement.calibrate import cpu_name
from placement.hardware import resolve_profile
from placement.schedule import LayerScheduler


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def build(args, hw, device, dtype):
    raw = hf_config(args.preset, layers=args.layers)
    cfg = family_for(raw).parse_config(raw)
    model = build_empty(cfg, device, dtype, build_experts=False)
    init_random_(model, seed=0)
    shape = expert_shape(cfg, args.cpu_dtype, dtype)
    off = Offload(device, dtype, LayerScheduler(shape, hw, "cost"), cpu_dtype=args.cpu_dtype, cpu_isa=args.isa,
                  threads=args.cpu_threads)
    gen = torch.Generator(device=device).manual_seed(1)
    E, F_, D = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    for i, layer in enumerate(model.layers):
        if layer.moe is None:
            continue
        # drawn on the GPU (fast), then kept only in the CPU executor
        layer.moe.experts = HybridExperts(i, *random_expert_stacks(E, F_, D, gen), off)
    return model, cfg, shape, off


def snapshot(off) -> np.ndarray:
    return np.array([[l.stats.batches, l.stats.cpu_experts, l.stats.shipped_experts, l.stats.predicted_s,
                      l.stats.decide_s] for l in off.layers]).sum(0)


def describe(delta: np.ndarray, forwards: int) -> dict:
    """Per forward: the scheduler's predicted expert time (all layers) and its split, per layer call."""
    b = max(delta[0], 1)
    return {"predicted_moe_ms_per_forward": 1e3 * delta[3] / forwards, "cpu_experts_per_layer": delta[1] / b,
            "shipped_experts_per_layer": delta[2] / b, "decide_us": 1e6 * delta[4] / b}


def timed(fn, dev) -> float:
    torch.cuda.synchronize(dev) if dev.type == "cuda" else None
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(dev) if dev.type == "cuda" else None
    return time.perf_counter() - t0


def decode_roofline(off, cfg, hw, dtype, routed_delta: list[np.ndarray], steps: int, batch: int) -> float:
    """Seconds per decode step implied by the placement and the routing seen in `steps` steps."""
    esize = torch.empty((), dtype=dtype).element_size()
    w_cold = off.scheduler.shape.weight_bytes
    w_gpu = expert_vram_bytes(cfg, dtype)
    total = 0.0
    for layer, delta in zip(off.layers, routed_delta):
        # expected distinct experts per step from the per-step average load (uniform within the step)
        per_step = delta / steps
        touched = 1.0 - np.exp(-per_step)  # P(expert touched in a step) for Poisson arrivals
        cold = ~layer.is_resident
        total += max(float((touched * cold).sum()) * w_cold / hw.dram_bw,
                     float((touched * ~cold).sum()) * w_gpu / hw.hbm_bw)
    attn = 2 * cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * esize * cfg.num_layers
    return total + attn / hw.hbm_bw


def trace(step, path: str, repeats: int = 3) -> None:
    """torch.profiler over `repeats` calls of step() (host launches, copies and kernels per stream) as a
    chrome trace, and the top of its table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
    prof.export_chrome_trace(path)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15), flush=True)


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hw = resolve_profile(args.profile)
    t0 = time.perf_counter()
    model, cfg, shape, off = build(args, hw, device, dtype)
    resident = args.resident if args.resident is not None else cfg.num_experts // 4
    max_ctx = max(max(args.prefill), 512) + 64
    eng = Engine(model, None, max_batch=max(args.decode_batch), max_context=max_ctx, eager=not args.graphs)
    gen = torch.Generator().manual_seed(2)
    calib = torch.randint(0, cfg.vocab_size, (512,), generator=gen).tolist()
    slot = eng.allocate_slot()
    before = [layer.stats.routed.copy() for layer in off.layers]
    eng.prefill(slot, calib)
    for layer, b in zip(off.layers, before):
        layer.set_resident(np.argsort(-(layer.stats.routed - b), kind="stable")[:resident].tolist())
    eng.free_slot(slot)
    mem = off.memory()
    header = (f"# hybrid e2e | {cpu_name()} ({platform.node()}), GPU "
              f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'none'} | {args.preset} x {cfg.num_layers} "
              f"layers, {resident}/{cfg.num_experts} experts resident per layer, CPU {off.layers[0].cpu_moe.isa} x "
              f"{sum(len(n) for n in off.layers[0].cpu_moe.topology.nodes)} threads "
              f"{args.cpu_dtype}, {dtype}, decode {'CUDA graphs' if eng.graphs is not None else 'eager'} | profile {hw.name} | build {time.perf_counter() - t0:.0f} s | "
              f"DRAM experts {mem['dram_expert_bytes'] / 2**30:.1f} GiB, VRAM resident "
              f"{mem['vram_resident_bytes'] / 2**30:.2f} GiB")
    print(header, flush=True)
    results = []
    for strat in args.strategies:  # warm-up: first-use allocations (staging, pinned buffers) out of the timings
        off.scheduler = LayerScheduler(shape, hw, strat)
        s = eng.allocate_slot()
        eng.prefill(s, torch.randint(0, cfg.vocab_size, (max(args.prefill),), generator=gen).tolist())
        for _ in range(3):
            eng.decode_step([s], [1])
        eng.free_slot(s)
    for strat in args.strategies:
        off.scheduler = LayerScheduler(shape, hw, strat)
        row = {"strategy": strat}
        for n in args.prefill:
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
            s = eng.allocate_slot()
            eng.prefill(s, ids[: min(n, 256)])  # warm-up
            eng.free_slot(s)
            s = eng.allocate_slot()
            snap = snapshot(off)
            before = [layer.stats.routed.copy() for layer in off.layers]
            dt = timed(lambda: eng.prefill(s, ids), device)
            eng.free_slot(s)
            # PCIe bound: every cold expert the prompt touched crosses the link once per layer
            cold_bytes = sum(int(((layer.stats.routed - b) > 0)[~layer.is_resident].sum()) * shape.weight_bytes
                             for layer, b in zip(off.layers, before))
            row[f"prefill_{n}_pcie_bound_tok_s"] = n / (cold_bytes / hw.link_bw) if cold_bytes else float("inf")
            row[f"prefill_{n}_tok_s"] = n / dt
            row[f"prefill_{n}_ms"] = dt * 1e3
            row[f"prefill_{n}_sched"] = describe(snapshot(off) - snap, 1)
            if args.trace:  # one prefill: where the time goes beside the link's share

                def prefill_once():
                    s = eng.allocate_slot()
                    eng.prefill(s, ids)
                    eng.free_slot(s)

                trace(prefill_once, f"{args.trace}_{strat.replace(':', '')}_prefill{n}.json", repeats=1)
        for b in args.decode_batch:
            slots = [eng.allocate_slot() for _ in range(b)]
            for s in slots:
                eng.prefill(s, torch.randint(0, cfg.vocab_size, (16,), generator=gen).tolist())
            last = [1] * b
            eng.decode_step(slots, last)  # warm-up
            before = [layer.stats.routed.copy() for layer in off.layers]
            snap = snapshot(off)
            times = [timed(lambda: eng.decode_step(slots, last), device) for _ in range(args.steps)]
            row[f"decode_b{b}_sched"] = describe(snapshot(off) - snap, args.steps)
            if eng.graphs is not None:  # captured steps do not count routing on the host: count it on
                graphs, eng.graphs = eng.graphs, None  # as many eager steps of the same batch
                for _ in range(args.steps):
                    eng.decode_step(slots, last)
                eng.graphs = graphs
            delta = [layer.stats.routed - bb for layer, bb in zip(off.layers, before)]
            if args.trace:
                trace(lambda: eng.decode_step(slots, last), f"{args.trace}_{strat.replace(':', '')}_b{b}.json")
            for s in slots:
                eng.free_slot(s)
            step = statistics.median(times)
            bound = decode_roofline(off, cfg, hw, dtype, delta, args.steps, b)
            row[f"decode_b{b}_tok_s"] = b / step
            row[f"decode_b{b}_ms"] = step * 1e3
            row[f"decode_b{b}_roofline_tok_s"] = b / bound
            row[f"decode_b{b}_of_roofline"] = bound / step
        results.append(row)
        print("  " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                              if not isinstance(v, dict)), flush=True)
        for k, v in row.items():
            if isinstance(v, dict):
                print(f"    {k}: " + " ".join(f"{a}={b:.2f}" for a, b in v.items()), flush=True)
    return {"header": header, "graphs": eng.graphs is not None, "preset": args.preset, "layers": cfg.num_layers, "resident": resident,
            "cpu_isa": off.layers[0].cpu_moe.isa, "profile": hw.name, "memory": mem, "results": results}


def run_isolated(args, argv) -> dict:
    """One child process per strategy; their results merged in order (header, memory from the first)."""
    import subprocess
    import sys
    import tempfile

    argv = list(sys.argv[1:] if argv is None else argv)
    merged = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, strat in enumerate(args.strategies):
            out = Path(tmp) / str(i)
            child = [a for a in argv if a != "--isolate"] + ["--strategies", strat, "--out", str(out)]
            subprocess.run([sys.executable, "-m", "bench.hybrid_e2e", *child], check=True)
            res = json.loads((out / f"hybrid_e2e_{args.preset}.json").read_text())
            if merged is None:
                merged = dict(res, isolated=True)
            else:
                merged["results"] += res["results"]
    return merged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--resident", type=int, help="resident experts per layer (default: a quarter)")
    p.add_argument("--profile", required=True)
    p.add_argument("--cpu-dtype", default="bf16", choices=["bf16", "int8", "int4"])
    p.add_argument("--isa")
    p.add_argument("--graphs", action="store_true", help="decode in CUDA graphs (every cold expert on the CPU "
                   "lane as a host function; the strategy then only affects prefill)")
    p.add_argument("--cpu-threads", type=int, help="CPU executor threads (default: all cores but one)")
    p.add_argument("--prefill", type=ints, default=[2048, 8192])
    p.add_argument("--decode-batch", type=ints, default=[1, 8])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--strategies", type=lambda s: s.split(","), default=["cost", "cpu", "ship", "threshold:32"])
    p.add_argument("--isolate", action="store_true",
                   help="measure each strategy in a fresh process (same weights and placement): strategies run "
                        "one after another in one process can change each other's timings (seen on the GPU box)")
    p.add_argument("--trace", help="also profile one prefill per length and 3 decode steps per batch, per "
                   "strategy: chrome traces TRACE_<strategy>_prefill<n>.json and TRACE_<strategy>_b<batch>.json")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    res = run_isolated(args, argv) if args.isolate and len(args.strategies) > 1 else run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"hybrid_e2e_{args.preset}.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
