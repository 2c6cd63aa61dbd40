"""Place: which experts are resident (in VRAM, or torch copies on a machine without CUDA).

Either a plan's (`--plan FILE` from `hybrid plan`: per layer, chosen across layers by predicted time saved
per byte), or by routing counts from a short calibration run of the engine's own prefill on a built-in text:
`--gpu-experts N` each layer's N most-routed, `--gpu-budget` as many as it leaves, the most-routed across layers
(so a budget below one expert per layer still places some, and skewed layers get more).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from hybrid.errors import UsageError
from hybrid.models.gpu_weights import quantized
from hybrid.offload.build import expert_vram_bytes
from hybrid.offload.config import HybridConfig
from hybrid.runtime.device_role import is_cuda
from hybrid.runtime.engine import Stats

log = logging.getLogger("hybrid.offload")

# Routing calibration text: varied prose, code and numbers so that many experts see tokens.
CALIBRATION_TEXT = (
    "The history of the printing press begins in the fifteenth century. def merge(a, b): return sorted(a + b) "
    "Photosynthesis converts light energy into chemical energy stored in glucose. 3.14159 * r ** 2 = area; "
    "Il pleut sur la ville comme il pleut sur mon coeur. SELECT name, count(*) FROM users GROUP BY name; "
    "The quarterly report shows revenue of $4.2 million, up 12% year over year. Bonjour, comment allez-vous? "
    "for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; } Mount Everest is 8,849 metres above sea level. "
)


def resident_count(model, hcfg: HybridConfig) -> int:
    """Resident experts per layer under --gpu-experts N (at most the model's experts per layer)."""
    cfg = model.cfg
    if (hcfg.gpu_experts or 0) > cfg.num_experts:
        log.warning("--gpu-experts %d is more than the model's %d experts per layer: all %d are resident",
                    hcfg.gpu_experts, cfg.num_experts, cfg.num_experts)
    return min(hcfg.gpu_experts or 0, cfg.num_experts)


def budget_count(model, offload, hcfg: HybridConfig, fixed_vram_bytes: int) -> int:
    """Resident experts in all that --gpu-budget leaves after the fixed part (at most every expert of every layer)."""
    cfg = model.cfg
    left = hcfg.gpu_budget - fixed_vram_bytes
    if left < 0:
        raise UsageError(f"--gpu-budget {hcfg.gpu_budget / 2**30:.2f} GiB is below what the model needs without "
                         f"experts ({fixed_vram_bytes / 2**30:.2f} GiB: non-expert weights, KV cache, staging, graph "
                         "buffers, prefill activations, reserve); "
                         "raise the budget or lower --max-context")
    per_expert = expert_vram_bytes(cfg, offload.dtype, offload.resident_dtype)
    return int(min(cfg.num_experts * len(offload.layers), left // per_expert))


def most_routed(counts: list[np.ndarray], n: int) -> list[list[int]]:
    """The n (layer, expert) pairs routed most often (counts: one array per MoE layer), as each layer's expert ids:
    the budget goes where the calibration's tokens went, so a skewed layer gets more than a flat one. Equal counts
    go to each layer's next-ranked expert in turn (a layer's first before any layer's second)."""
    ranked = [np.argsort(-c, kind="stable") for c in counts]
    pairs = sorted(((-int(c[e]), rank, i, int(e)) for i, (c, order) in enumerate(zip(counts, ranked))
                    for rank, e in enumerate(order)))[:n]
    out: list[list[int]] = [[] for _ in counts]
    for _, _, i, e in pairs:
        out[i].append(e)
    return out


def place_resident(model, offload, hcfg: HybridConfig, run_prompt: Callable[[list[int]], object],
                   tokens: list[int], fixed_vram_bytes: int) -> list[int]:
    """Count routing on a calibration prompt, then make experts resident: each layer's N most-routed under
    --gpu-experts N, the most-routed across layers under --gpu-budget. Returns each MoE layer's resident count."""
    budget = hcfg.gpu_budget is not None
    n = budget_count(model, offload, hcfg, fixed_vram_bytes) if budget else resident_count(model, hcfg)
    if n == 0:
        return [0] * len(offload.layers)
    before = [layer.stats.routed.copy() for layer in offload.layers]
    run_prompt(tokens)
    counts = [layer.stats.routed - prev for layer, prev in zip(offload.layers, before)]
    chosen = most_routed(counts, n) if budget else [np.argsort(-c, kind="stable")[:n].tolist() for c in counts]
    for layer, ids in zip(offload.layers, chosen):
        layer.set_resident(ids)
    return [len(ids) for ids in chosen]


def count_range(counts: list[int]) -> str:
    """Per-layer resident counts as the status line says them: "12", or "3..9"."""
    if not counts:
        return "0"
    return str(counts[0]) if min(counts) == max(counts) else f"{min(counts)}..{max(counts)}"


def fixed_vram(model, cache_bytes: int, offload) -> int:
    """VRAM that is not resident experts: non-expert weights (with the experts' biases), KV cache, ship-lane
    staging slots."""
    params = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".moe.experts." not in name)
    params += sum(w.nbytes for w in quantized(model).values())  # quantized GPU weights (hybrid.models.qweight)
    # the experts' biases (gpt-oss) stay on the GPU for every expert, fp32 (placement.memory.expert_bias_bytes)
    params += sum(t.numel() * t.element_size() for layer in offload.layers for t in (layer.bias_dev or ()))
    # ShipLane holds n_slots chunks of `chunk` experts each (dense; + raw packed bytes when the packed
    # layout is not the dense one, which placement.memory prices exactly for `hybrid plan`)
    lane = offload.ship_lane
    staging = lane.n_slots * lane.chunk * expert_vram_bytes(model.cfg, offload.dtype)
    return params + cache_bytes + staging


def modeled_vram(cfg, engine, offload, gpu_dtypes: dict | None) -> int:
    """What the plan counts beside the tensors built at load and no load can measure yet: the decode graphs'
    buffers (with the de-quantized chunk of quantized parts), one prefill pass's activations and the reserve
    (placement.memory.breakdown), so that --gpu-budget leaves the residents what `hybrid plan` leaves them."""
    from placement.memory import MemorySettings, breakdown

    rt = engine.config
    gb = torch.empty((), dtype=offload.dtype).element_size()
    if gb not in (2, 4):
        return 0
    s = MemorySettings(max_context=rt.max_context, max_batch=rt.max_batch, cpu_dtype=offload.cpu_dtype,
                       gpu_dtype_bytes=gb, staging_slots=offload.ship_lane.n_slots, ship_chunk=offload.ship_lane.chunk,
                       gpu_dtypes=gpu_dtypes or {}, kv_dtype=rt.kv_dtype, prefill_chunk=rt.prefill_chunk)
    mem = breakdown(cfg, s)
    return mem.graph_buffers + mem.prefill_activations + mem.reserve


def place(engine, offload, hcfg: HybridConfig, log=print, gpu_dtypes: dict | None = None) -> str:
    """Choose the resident experts with the engine's own prefill; returns how many per layer, as the status
    line says it ("12", or "3..9 (from the plan)")."""
    model = engine.model
    if hcfg.plan is not None and not is_cuda(engine.device):  # hybrid.loading.check.without_cpu_residents said so
        hcfg.plan.check_model(model.cfg)
        return "0 (no CUDA device: the plan's residents need a GPU)"
    if hcfg.plan is not None:
        return count_range(place_from_plan(engine, offload, hcfg.plan, log)) + " (from the plan)"
    tokens = engine.tokenizer.encode(CALIBRATION_TEXT * 4)[: engine.max_context - 1]
    slot = engine.allocate_slot()
    try:
        fixed = fixed_vram(model, engine.cache.nbytes, offload) + modeled_vram(model.cfg, engine, offload, gpu_dtypes)
        counts = place_resident(model, offload, hcfg, lambda t: engine.prefill(slot, t), tokens, fixed)
    finally:
        engine.free_slot(slot)
    engine.stats = Stats()  # the calibration run is not part of the user's numbers
    return count_range(counts)  # per layer


def place_from_plan(engine, offload, plan, log=print) -> list[int]:
    """Make each layer's planned experts resident; warn when the engine holds more KV than was planned.
    Returns the resident count of each MoE layer (they differ: skewed layers get more)."""
    model = engine.model
    plan.check_model(model.cfg)
    planned = plan.settings
    if engine.max_context * engine.max_batch > planned.get("max_context", 0) * planned.get("max_batch", 0):
        log(f"hybrid: warning: the KV cache ({engine.max_batch} x {engine.max_context}) is larger than the plan's "
            f"({planned.get('max_batch')} x {planned.get('max_context')}); VRAM may exceed the planned "
            f"{plan.gpu_bytes / 2**30:.2f} GiB")
    counts = []
    for layer in offload.layers:
        ids = plan.resident_of(layer.layer)
        layer.set_resident(ids)
        counts.append(len(ids))
    return counts
