"""Where an eager hybrid layer call spends its time at decode sizes, per strategy (diagnostic).

    python -m bench.lane_probe PROFILE.json [T ...]

One Qwen3-30B-A3B-shaped layer (a quarter resident): the median synchronised call time per strategy and
CPU-lane kind, the host->device rate of one expert's packed weights against a torch-pinned copy of the
same size, and a torch.profiler table of the cost strategy's calls.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.layer_sweep import build_layer, routing
from placement.cost_model import get_shape
from placement.hardware import resolve_profile
from placement.schedule import LayerScheduler


def med(fn, reps=40):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def contention(layer, dev, shape):
    """Do the two lanes share DRAM? The host->device rate of registered expert weights alone and while
    the CPU executor streams other experts, and the executor's time alone and while copies run."""
    import threading

    q = layer.sources[0].mats()[0].q  # [E, F, D]
    src = q[-16:]  # 16 experts' gate matrices, contiguous
    dst = torch.empty(src.shape, dtype=src.dtype, device=dev)
    nb = src.numel() * src.element_size()
    cold = torch.from_numpy(layer.cold_ids[:64].copy())
    T = 64
    ids = cold.view(T, 1).repeat(1, shape.topk)[:, :1].contiguous()  # one token per expert, 64 experts
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


def timeit(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    hw = resolve_profile(sys.argv[1])
    Ts = [int(t) for t in sys.argv[2:]] or [1, 8]
    shape = get_shape("qwen3-30b-a3b")
    dev = torch.device("cuda")
    layer, off = build_layer(shape, hw, dev, 32, "bf16", None)
    q = layer.sources[0].mats()[0].q  # [E, F, D] packed gate, registered in place
    e = int(layer.cold_ids[0])
    dst = torch.empty(q[e].shape, dtype=q.dtype, device=dev)
    pinned = torch.empty(q[e].shape, dtype=q.dtype).pin_memory()
    nb = q[e].numel() * q[e].element_size()
    for name, src in (("registered packed", q[e]), ("torch pinned", pinned), ("pageable", q[e].clone())):
        ms = med(lambda: dst.copy_(src, non_blocking=True), 20)
        print(f"H2D {name:18s} {nb / 2**20:.1f} MiB: {ms:.3f} ms = {nb / ms / 1e6:.1f} GB/s", flush=True)
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
