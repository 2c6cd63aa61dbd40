"""Place: which experts are resident (in VRAM, or torch copies on a machine without CUDA).

Either a plan's (`--plan FILE` from `hybrid plan`: per layer, chosen across layers by predicted time saved
per byte) or `--gpu-experts N` per layer (or the N a `--gpu-budget` allows), chosen per layer by routing
counts from a short calibration run of the engine's own prefill on a built-in text.
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


def resident_count(model, offload, hcfg: HybridConfig, fixed_vram_bytes: int) -> int:
    """Resident experts per layer: --gpu-experts, or what --gpu-budget leaves after the fixed part."""
    cfg = model.cfg
    if hcfg.gpu_budget is None:
        if (hcfg.gpu_experts or 0) > cfg.num_experts:
            log.warning("--gpu-experts %d is more than the model's %d experts per layer: all %d are resident",
                        hcfg.gpu_experts, cfg.num_experts, cfg.num_experts)
        return min(hcfg.gpu_experts or 0, cfg.num_experts)
    per_layer = len(offload.layers) * expert_vram_bytes(cfg, offload.dtype, offload.resident_dtype)
    left = hcfg.gpu_budget - fixed_vram_bytes
    if left < 0:
        raise UsageError(f"--gpu-budget {hcfg.gpu_budget / 2**30:.2f} GiB is below what the model needs without "
                         f"experts ({fixed_vram_bytes / 2**30:.2f} GiB: non-expert weights, KV cache, staging, graph "
                         "buffers, prefill activations, reserve); "
                         "raise the budget or lower --max-context")
    return int(min(cfg.num_experts, left // per_layer))


def place_resident(model, offload, hcfg: HybridConfig, run_prompt: Callable[[list[int]], object],
                   tokens: list[int], fixed_vram_bytes: int) -> int:
    """Count routing on a calibration prompt, then make each layer's N most-routed experts resident."""
    n = resident_count(model, offload, hcfg, fixed_vram_bytes)
    if n == 0:
        return 0
    before = [layer.stats.routed.copy() for layer in offload.layers]
    run_prompt(tokens)
    for layer, prev in zip(offload.layers, before):
        counts = layer.stats.routed - prev
        top = np.argsort(-counts, kind="stable")[:n]
        layer.set_resident(top.tolist())
    return n


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
        counts = place_from_plan(engine, offload, hcfg.plan, log)
        return (f"{min(counts)}..{max(counts)}" if counts else "0") + " (from the plan)"
    tokens = engine.tokenizer.encode(CALIBRATION_TEXT * 4)[: engine.max_context - 1]
    slot = engine.allocate_slot()
    try:
        fixed = fixed_vram(model, engine.cache.nbytes, offload) + modeled_vram(model.cfg, engine, offload, gpu_dtypes)
        n = place_resident(model, offload, hcfg, lambda t: engine.prefill(slot, t), tokens, fixed)
    finally:
        engine.free_slot(slot)
    engine.stats = Stats()  # the calibration run is not part of the user's numbers
    return str(n)  # per layer


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
