"""Fixed costs of the hybrid layer itself, measured on a tiny layer (so bandwidth and FLOPs vanish).

The cost model of DESIGN section 3 prices bytes and FLOPs; our runtime adds per-call costs that do not
scale with them: reading the routing histogram on the host, pinned copies and the host function of
the CPU lane, copy and grouped-GEMM launches of the ship lane (each launch a fixed cost on the GPU).
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
    """Seconds: layer_overhead, cpu_lane_overhead, cpu_lane_start, ship_chunk_overhead, ship_expert_overhead
    (CUDA only)."""
    from hybrid.offload import HybridExperts, Offload

    dev = torch.device("cuda")
    chunk = 8
    hw0 = replace(hw, layer_overhead=0.0, cpu_lane_overhead=0.0, ship_chunk_overhead=0.0, ship_expert_overhead=0.0,
                  cpu_lane_start=None)
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
    st = layer.stats
    calls0, start0 = st.cpu_lane_calls, st.cpu_lane_start_s
    t_cpu = timed("cpu", 1, [])  # + the CPU lane
    # when the CPU lane starts: its enqueue (host side), then the rows' device->host copy (alpha)
    lane_start = (st.cpu_lane_start_s - start0) / max(st.cpu_lane_calls - calls0, 1) + hw.alpha
    t_ship1 = timed("ship", 1, [])  # + one chunk of one shipped expert
    t_ship8 = timed("ship", chunk, [])  # + seven more experts in the same chunk
    tiny_link = TINY.weight_bytes / hw.link_bw
    per_expert = max(0.0, (t_ship8 - t_ship1) / (chunk - 1) - hw.alpha - tiny_link)
    return {
        "layer_overhead": t_res,
        "cpu_lane_overhead": max(0.0, t_cpu - t_res),
        "cpu_lane_start": min(lane_start, t_res),
        "ship_expert_overhead": per_expert,
        "ship_chunk_overhead": max(0.0, t_ship1 - t_res - hw.alpha - tiny_link - per_expert),
        "raw_s": {"resident_only": t_res, "cpu_lane_1": t_cpu, "ship_1": t_ship1, f"ship_{chunk}": t_ship8},
    }


def floor_engine(hidden: int, isa: str | None = None, layers: int = 4, device: str = "cuda", resident: str = "half",
                 intermediate: int = 64, batch: int = 1):
    """The model measure_graph_layer_floor times: (engine, `batch` slots each prefilled with 16 tokens, config).
    Its 16 experts (top-8) are `intermediate` wide (64: the CPU kernels pad the down projection's K to 64 anyway):
    at the 30B width each is then 0.79 MB, so a layer with every expert cold still reads ~6 MB of them at batch 1
    (at batch 8 the rows route to most of the 16: ~12 MB)."""
    if resident not in ("half", "none", "all"):
        raise ValueError(f"resident must be half, none or all, got {resident!r}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    from hybrid.models import build_empty, init_random_
    from hybrid.models.families import family_for
    from hybrid.models.presets import hf_config
    from hybrid.offload import HybridExperts, Offload
    from hybrid.offload.build import expert_shape, random_expert_stacks
    from hybrid.runtime import Engine

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    raw = hf_config("qwen3-235b-a22b" if hidden >= 4096 else "qwen3-30b-a3b", layers=layers)
    raw.update(hidden_size=hidden, num_experts=16, moe_intermediate_size=intermediate, vocab_size=1024)
    cfg = family_for(raw).parse_config(raw)
    model = build_empty(cfg, dev, dtype, build_experts=False)
    init_random_(model, seed=0)
    hw = _probe_profile()
    off = Offload(dev, dtype, LayerScheduler(expert_shape(cfg, "bf16", dtype), hw, "cpu"), cpu_isa=isa)
    gen = torch.Generator().manual_seed(0)
    E, F_, D = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    for i, layer in enumerate(model.layers):
        if layer.moe is not None:
            layer.moe.experts = HybridExperts(i, *random_expert_stacks(E, F_, D, gen), off)
            layer.moe.experts.set_resident({"half": list(range(0, E, 2)), "none": [], "all": list(range(E))}[resident])
    eng = Engine(model, None, max_batch=batch, max_context=256, eager=dev.type != "cuda")
    if dev.type == "cuda" and eng.graphs is None:
        raise RuntimeError("decode graphs are off for this model; no graph floor to measure")
    slots = [eng.allocate_slot() for _ in range(batch)]
    for j, slot in enumerate(slots):  # each row its own prompt, so that the rows route apart
        eng.prefill(slot, [1 + (j * 37 + i) % 1000 for i in range(16)])
    return eng, slots, cfg


def time_decode_steps(eng, slots: list[int], steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps of these slots (after 3 untimed ones), host-synchronised."""
    sync = torch.cuda.synchronize if eng.model.device.type == "cuda" else (lambda: None)
    times = []
    for i in range(steps + 3):
        sync()
        t0 = time.perf_counter()
        eng.decode_step(slots, [1 + (i + 11 * j) % 100 for j in range(len(slots))])
        sync()
        times.append(time.perf_counter() - t0)
    return times[3:]


def measure_graph_layer_floor(hidden: int, isa: str | None = None, layers: int = 4, steps: int = 30,
                              device: str = "cuda", resident: str = "half") -> dict:
    """Seconds per decoder layer of a captured decode step at batch 1, from a small random Qwen3-MoE-shaped
    hybrid model at this hidden size (attention as in the Qwen3 model of that width; 16 experts 64 wide,
    top-8, half of them resident, so the CPU lane runs in every layer). The result is the per-layer latency
    floor of graph decode (the step's own fixed costs, embedding to sampling, divided among the layers); the
    planner's decode prediction adds it per layer (placement.predict.decode_floor).

    An upper bound of the fixed cost, by the small experts' reads: at the 30B width each is 0.79 MB, so a
    layer's cold ones are ~3 MB. Extrapolating over two expert widths to zero bytes (bench.decode_timeline
    --intermediate 64,128) is not used here: the floor model's experts partly sit in a large L3, so the extra
    bytes' cost is not stable from one measurement to the next.
    On a CPU device the same model decodes eagerly (tests of this code; the figure then means nothing for a
    GPU). resident: "half" (the calibrated floor), "none" (every expert on the CPU lane: the floor of an
    all-DRAM placement) or "all" (no CPU lane: what the GPU alone costs per layer)."""
    import numpy as np

    eng, slots, cfg = floor_engine(hidden, isa, layers, device, resident)
    step = float(np.median(time_decode_steps(eng, slots, steps)))
    return {"graph_layer_floor": step / cfg.num_layers, "raw_s": {"decode_step": step, "layers": cfg.num_layers}}


def _probe_profile():
    """Any valid profile: the floor model runs the `cpu` strategy, whose decisions need no figures."""
    from placement.hardware import BUILTIN_PROFILES

    return BUILTIN_PROFILES["ktransformers-paper-amx"]
