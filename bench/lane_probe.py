"""Where an eager hybrid layer call spends its time at decode sizes, per strategy (diagnostic).

    python -m bench.lane_probe --profile PROFILE.json [--tokens 1,8] [--layers 8]

One Qwen3-30B-A3B-shaped layer (a quarter resident): the median synchronised call time per strategy and
CPU-lane kind, the host->device rate of one expert's packed block and of one of its matrices against a
torch-pinned copy, DRAM contention between the lanes, and a torch.profiler table of the cost strategy's
calls. With --layers N: a stack of N such layers (own weights, one shared Offload, each layer's output
feeding the next, one sync per step, as in a model's eager decode, without attention) per strategy, plus
`mix` = every other active cold expert shipped, and the cpus the launching thread ran on; --trace adds a
chrome trace of mixed steps; --variants repeats the stack under each thread-placement setting. (This is
how the "eager mixed-lane slowdown" of issue 5 was shown not to be the lanes: the stack mixed fine, and
the e2e trace found cuDNN attention plans instead; BENCHMARKS.md.)
"""

from __future__ import annotations

import argparse
import collections
import logging
import statistics
import time

import numpy as np
import torch

from bench.layer_sweep import build_layer, routing
from placement.cost_model import get_shape
from placement.hardware import resolve_profile
from placement.measure import cuda_sync, median_time
from placement.schedule import LayerScheduler


def med(fn, reps=40):
    """Median milliseconds of fn(), synchronised."""
    return 1e3 * median_time(fn, reps, warmup=0, sync=cuda_sync)


def contention(layer, dev, shape):
    """Do the two lanes share DRAM? The host->device rate of registered expert weights alone and while
    the CPU executor streams other experts, and the executor's time alone and while copies run."""
    import threading

    src = layer.sources[0].block[-16:]  # 16 experts' packed blocks (gate | up | down), contiguous
    dst = torch.empty(src.shape, dtype=src.dtype, device=dev)
    nb = src.numel() * src.element_size()
    cold = torch.from_numpy(layer.cold_ids[:64].copy())
    T = 64
    ids = cold.view(T, 1)  # one token per expert, 64 experts
    x = torch.randn(T, shape.hidden).to(torch.bfloat16)
    w = torch.ones(T, 1)
    moe = layer.cpu_moe
    cpu_alone = statistics.median([timeit(lambda: moe.forward(x, ids, w)) for _ in range(10)])
    copy_alone = med(lambda: dst.copy_(src, non_blocking=True), 10)
    stop = threading.Event()
    cpu_busy = []

    def hammer():
        while not stop.is_set():
            cpu_busy.append(timeit(lambda: moe.forward(x, ids, w)))

    th = threading.Thread(target=hammer)
    th.start()
    time.sleep(0.05)
    copy_busy = med(lambda: dst.copy_(src, non_blocking=True), 10)
    stop.set()
    th.join()
    cpu_b = statistics.median(cpu_busy)
    wb = 64 * 3 * shape.hidden * shape.intermediate * 2
    print(f"contention: H2D {nb / 2**20:.0f} MiB alone {nb / copy_alone / 1e6:.1f} GB/s, while the executor runs "
          f"{nb / copy_busy / 1e6:.1f} GB/s; executor 64x1 alone {cpu_alone * 1e3:.2f} ms ({wb / cpu_alone / 1e9:.1f} GB/s), "
          f"during copies {cpu_b * 1e3:.2f} ms ({wb / cpu_b / 1e9:.1f} GB/s)", flush=True)


def _current_cpu() -> int:
    with open("/proc/thread-self/stat") as f:  # field 39: the cpu the thread last ran on
        return int(f.read().rsplit(")", 1)[1].split()[36])


def timeit(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class EveryOtherShipped(LayerScheduler):
    """Diagnostic split: ship every other active cold expert, the rest on the CPU lane."""

    def decide(self, hist, batch_tokens, gpu_busy=0.0, rows=None):
        hist = np.asarray(hist, dtype=np.int64)
        ship = np.zeros(hist.shape, dtype=bool)
        ship[np.flatnonzero(hist)[::2]] = True
        return self.predict(hist, ship, gpu_busy, rows)


def stack(hw, shape, dev, n_layers: int, Ts, trace: str | None = None) -> None:
    from hybrid.offload import HybridExperts, Offload
    from hybrid.offload.build import random_expert_stacks

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    off = Offload(dev, dtype, LayerScheduler(shape, hw, "cost"))
    E, F_, D = shape.num_experts, shape.intermediate, shape.hidden
    gen = torch.Generator(device=dev).manual_seed(3)
    layers = []
    for i in range(n_layers):
        layer = HybridExperts(i, *random_expert_stacks(E, F_, D, gen), off)
        layer.set_resident(list(range(i % 4, E, 4)))  # a quarter, different per layer
        layers.append(layer)
    g = torch.Generator().manual_seed(4)
    for T in Ts:
        routes = [routing(T, E, shape.topk, "uniform", g, dev) for _ in layers]
        x0 = torch.randn(T, D, device=dev, dtype=dtype)

        cpus_seen = collections.Counter()  # where the launching thread ran after each layer call

        def step():
            x = x0
            for layer, (ids, w) in zip(layers, routes):
                x = layer(x, ids, w) * 0.5 + x0  # the next layer depends on this one, as in a model
                cpus_seen[_current_cpu()] += 1
            return x

        for lane in ("host", "worker"):
            off.eager_host_lane = lane == "host"
            for strat in ("cost", "cpu", "ship", "mix"):
                off.scheduler = EveryOtherShipped(shape, hw, "cpu") if strat == "mix" else LayerScheduler(shape, hw, strat)
                step()
                s0 = sum(l.stats.cpu_experts for l in layers), sum(l.stats.shipped_experts for l in layers)
                cpus_seen.clear()
                ms = med(step, 20)
                s1 = sum(l.stats.cpu_experts for l in layers), sum(l.stats.shipped_experts for l in layers)
                n = 20 * len(layers)  # med's calls
                print(f"stack of {n_layers}: T={T} lane={lane:6s} {strat:5s} {ms:8.3f} ms per step "
                      f"({ms / n_layers:.3f} per layer)  cpu {(s1[0] - s0[0]) / n:.1f} ship {(s1[1] - s0[1]) / n:.1f} "
                      f"experts per layer; launcher on cpus {dict(sorted(cpus_seen.items()))}", flush=True)
        if trace:  # where a mixed step's time goes: launches on the host, copies and the lane's gap on streams
            from torch.profiler import ProfilerActivity, profile

            off.eager_host_lane = True
            off.scheduler = EveryOtherShipped(shape, hw, "cpu")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                    cuda_sync()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20), flush=True)
            prof.export_chrome_trace(f"{trace}_T{T}.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--tokens", default="1,8", help="batch sizes (comma list)")
    ap.add_argument("--layers", type=int, default=0, help="also time a stack of this many layers")
    ap.add_argument("--stack-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace", default=None,
                    help="with --layers: profile 3 mixed stack steps per batch size, chrome traces to TRACE_T<T>.json")
    ap.add_argument("--variants", action="store_true",
                    help="run the stack only, once per thread-placement setting (a child process each): default "
                         "(launcher pinned), HYBRID_PIN_LAUNCHER=0, HYBRID_SPARE_CORE=physical (with and without the "
                         "launcher pinned), HYBRID_PIN_LANE=0, HYBRID_CORE_SPLIT=0")
    a = ap.parse_args()
    if a.variants:
        import os
        import subprocess
        import sys

        for i, env in enumerate(({}, {"HYBRID_PIN_LAUNCHER": "0"}, {"HYBRID_SPARE_CORE": "physical"},
                    {"HYBRID_SPARE_CORE": "physical", "HYBRID_PIN_LAUNCHER": "0"}, {"HYBRID_PIN_LANE": "0"},
                    {"HYBRID_CORE_SPLIT": "0"})):
            print(f"# variant: {env or 'default'}", flush=True)
            extra = ["--trace", f"{a.trace}_v{i}"] if a.trace and i < 2 else []  # launcher pinned and floating
            subprocess.run([sys.executable, "-m", "bench.lane_probe", "--profile", a.profile, "--tokens", a.tokens,
                            "--layers", str(a.layers or 8), "--stack-only", *extra], env={**os.environ, **env},
                           check=False)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the executor / launcher core split
    hw = resolve_profile(a.profile)
    Ts = [int(t) for t in a.tokens.split(",") if t]
    shape = get_shape("qwen3-30b-a3b")
    dev = torch.device("cuda")
    if a.layers:
        stack(hw, shape, dev, a.layers, Ts, a.trace)
    if a.stack_only:
        return
    layer, off = build_layer(shape, hw, dev, 32, "bf16", None)
    q = layer.sources[0].mats()[0].q  # [E, F, D] packed gate, registered in place
    e = int(layer.cold_ids[0])
    block = layer.sources[0].block[e]  # the whole expert: what the ship lane copies at once
    for name, src in (("registered expert", block), ("registered matrix", q[e]),
                      ("torch pinned matrix", torch.empty(q[e].shape, dtype=q.dtype).pin_memory()),
                      ("pageable matrix", q[e].clone())):
        dst = torch.empty(src.shape, dtype=src.dtype, device=dev)
        nb = src.numel() * src.element_size()
        ms = med(lambda: dst.copy_(src, non_blocking=True), 20)
        print(f"H2D {name:19s} {nb / 2**20:.1f} MiB: {ms:.3f} ms = {nb / ms / 1e6:.1f} GB/s", flush=True)
    contention(layer, dev, shape)
    gen = torch.Generator().manual_seed(0)
    for T in Ts:
        x = torch.randn(T, shape.hidden, device=dev, dtype=torch.bfloat16)
        ids, w = routing(T, shape.num_experts, shape.topk, "uniform", gen, dev)
        for lane in ("host", "worker"):
            off.eager_host_lane = lane == "host"
            for strat in ("cost", "cpu", "ship"):
                off.scheduler = LayerScheduler(shape, hw, strat)
                layer(x, ids, w)
                s0 = (layer.stats.cpu_experts, layer.stats.shipped_experts, layer.stats.batches)
                ms = med(lambda: layer(x, ids, w))
                s1 = (layer.stats.cpu_experts, layer.stats.shipped_experts, layer.stats.batches)
                n = s1[2] - s0[2]
                print(f"T={T} lane={lane:6s} {strat:5s} {ms:7.3f} ms  cpu {(s1[0] - s0[0]) / n:.1f} "
                      f"ship {(s1[1] - s0[1]) / n:.1f} experts", flush=True)
    off.eager_host_lane = True
    off.scheduler = LayerScheduler(shape, hw, "cost")
    T = Ts[0]
    x = torch.randn(T, shape.hidden, device=dev, dtype=torch.bfloat16)
    ids, w = routing(T, shape.num_experts, shape.topk, "uniform", gen, dev)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            layer(x, ids, w)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)


if __name__ == "__main__":
    main()
