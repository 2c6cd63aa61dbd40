"""Fixed costs of the hybrid layer itself, measured on a tiny layer (so bandwidth and FLOPs vanish).

The cost model of DESIGN section 3 prices bytes and FLOPs; our runtime adds per-call costs that do not
scale with them: reading the routing histogram on the host, pinned copies and the worker hand-off of
the CPU lane, copy and grouped-GEMM launches of the ship lane (~10-30 us per launch on the GPU box).
`hybrid calibrate` stores these in the profile so that predictions and decisions include them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from placement.cost_model import ExpertShape
from placement.measure import ExpertWeights
from placement.schedule import LayerScheduler

TINY = ExpertShape("tiny", hidden=256, intermediate=256, num_experts=16, topk=1)


def measure_overheads(hw, isa: str | None = None, reps: int = 25) -> dict:
    """Seconds: layer_overhead, cpu_lane_overhead, ship_chunk_overhead, ship_expert_overhead (CUDA only)."""
    from hybrid.offload import HybridExperts, Offload

    dev = torch.device("cuda")
    chunk = 8
    hw0 = replace(hw, layer_overhead=0.0, cpu_lane_overhead=0.0, ship_chunk_overhead=0.0, ship_expert_overhead=0.0)
    off = Offload(dev, torch.bfloat16, LayerScheduler(TINY, hw0, "cpu"), cpu_isa=isa, staging_slots=2,
                  ship_chunk=chunk)
    D = TINY.hidden
    layer = HybridExperts(0, *ExpertWeights.random(TINY, TINY.num_experts).stacks(), off)

    def timed(strategy: str, n_active: int, resident) -> float:
        layer.set_resident(resident)
        off.scheduler = LayerScheduler(TINY, hw0, strategy, chunk=chunk)
        ids = torch.arange(n_active, device=dev).view(n_active, 1)
        w = torch.ones(n_active, 1, device=dev)
        x = torch.randn(n_active, D, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            layer(x, ids, w)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            layer(x, ids, w)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    t_res = timed("cpu", 1, [0])  # one resident expert: the layer's own fixed cost
    t_cpu = timed("cpu", 1, [])  # + the CPU lane
    t_ship1 = timed("ship", 1, [])  # + one chunk of one shipped expert
    t_ship8 = timed("ship", chunk, [])  # + seven more experts in the same chunk
    tiny_link = TINY.weight_bytes / hw.link_bw
    per_expert = max(0.0, (t_ship8 - t_ship1) / (chunk - 1) - hw.alpha - tiny_link)
    return {
        "layer_overhead": t_res,
        "cpu_lane_overhead": max(0.0, t_cpu - t_res),
        "ship_expert_overhead": per_expert,
        "ship_chunk_overhead": max(0.0, t_ship1 - t_res - hw.alpha - tiny_link - per_expert),
        "raw_s": {"resident_only": t_res, "cpu_lane_1": t_cpu, "ship_1": t_ship1, f"ship_{chunk}": t_ship8},
    }
