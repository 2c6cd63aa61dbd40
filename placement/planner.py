"""The placement planner (DESIGN section 4): which experts live in VRAM, given budgets and routing stats.

    settings = PlanSettings(gpu_budget=24 * 2**30, cpu_budget=200 * 2**30, memory=MemorySettings(...))
    check_budgets(cfg, settings)            # UsageError before any weight is read, if nothing can work
    p = plan(cfg, stats, hw, settings)      # -> Plan; p.save(path); load_plan(path)

Choice of resident experts: after the fixed part of VRAM (placement.memory), the rest holds
floor(left / bytes per expert) experts, chosen across ALL layers by predicted decode time saved per
byte (placement.predict.decode_savings over the measured routing shares): a skewed layer, whose top
experts take most tokens, gets more residents than a flat one. Every resident expert costs the same
bytes, so the greedy choice by saving per byte is optimal for this additive objective. Ties (uniform
statistics) are broken round-robin over layers, so flat statistics give every layer the same count.

NUMA: the CPU executor splits every expert's F across the nodes in proportion to their threads and
keeps each slice in node-local memory (never a copy per node); the plan reports each node's slice and
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from placement.errors import UsageError
from placement.cost_model import ExpertShape
from placement.hardware import HardwareProfile
from placement.memory import (MemoryBreakdown, MemorySettings, breakdown, f_slices, gib, packed_expert_bytes,
                              packed_slice_bytes)
from placement.plan_file import LayerPlan, Plan
from placement.predict import (decode_floor, decode_layer_time, decode_savings, gpu_shape_of, non_expert_step_time,
                               prefill_layer_time)
from placement.routing_stats import RoutingStats
from placement.schedule import LayerScheduler

DEFAULT_PREFILL_TOKENS = 512


@dataclass(frozen=True)
class PlanSettings:
    gpu_budget: int  # bytes of VRAM for everything
    cpu_budget: int  # bytes of DRAM for the experts and the lanes' buffers
    memory: MemorySettings = field(default_factory=MemorySettings)
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS  # prompt length the prefill prediction is priced at

    def __post_init__(self):
        if self.gpu_budget <= 0 or self.cpu_budget <= 0:
            raise UsageError("--gpu-budget and --cpu-budget must be positive sizes")
        if self.prefill_tokens < 1:
            raise UsageError("the prefill prediction needs at least one token")

    @property
    def decode_rows(self) -> int:
        return self.memory.max_batch


def expert_shapes(cfg, s: MemorySettings) -> tuple[ExpertShape, ExpertShape]:
    """(cold expert priced in the CPU dtype, resident expert in the GPU dtype), as hybrid.offload.build."""
    # the bytes the CPU kernel really reads: packed, padded, with scales (placement.memory)
    bpw = packed_expert_bytes(cfg.hidden_size, cfg.expert_intermediate_size, s.cpu_dtype, list(s.node_threads),
                              s.group) / (3 * cfg.hidden_size * cfg.expert_intermediate_size)
    cpu = ExpertShape(cfg.family, hidden=cfg.hidden_size, intermediate=cfg.expert_intermediate_size,
                      num_experts=cfg.num_experts, topk=cfg.experts_per_token, layers=max(1, cfg.num_moe_layers),
                      bytes_per_weight=bpw, act_bytes=float(s.gpu_dtype_bytes))
    return cpu, gpu_shape_of(cpu, s.gpu_dtype_bytes)


def check_budgets(cfg, settings: PlanSettings) -> MemoryBreakdown:
    """Fail (UsageError) when no placement can fit: the GPU's fixed part or the DRAM part is too big.
    Uses the config only, so it runs before any weight is loaded."""
    mem = breakdown(cfg, settings.memory)
    s = settings.memory
    if mem.gpu_fixed > settings.gpu_budget:
        raise UsageError(
            f"--gpu-budget {gib(settings.gpu_budget)} is too small: the GPU needs {gib(mem.gpu_fixed)} before any "
            f"expert (non-expert weights {gib(mem.non_expert)}, KV cache {gib(mem.kv_cache)} for "
            f"--max-context {s.max_context} x --max-batch {s.max_batch}, staging {gib(mem.staging)}, graph buffers "
            f"{gib(mem.graph_buffers)}, reserve {gib(mem.reserve)}); raise --gpu-budget to at least "
            f"{gib(mem.gpu_fixed)} or lower --max-context / --max-batch")
    if mem.cpu_total > settings.cpu_budget:
        smaller = [d for d in ("int8", "int4") if d != s.cpu_dtype and
                   breakdown(cfg, replace(s, cpu_dtype=d)).cpu_total <= settings.cpu_budget]
        hint = f" or use --cpu-dtype {smaller[0]}" if smaller else ""
        raise UsageError(
            f"--cpu-budget {gib(settings.cpu_budget)} is too small: DRAM needs {gib(mem.cpu_total)} (every expert "
            f"packed as {s.cpu_dtype}: {gib(mem.dram_experts_all)}, the runtime keeps one copy of each including "
            f"the resident ones; pinned lane buffers {gib(mem.pinned_buffers)}); raise --cpu-budget to at least "
            f"{gib(mem.cpu_total)}{hint}")
    return mem


def choose_resident(savings: np.ndarray, expert_bytes: int, budget_bytes: int) -> np.ndarray:
    """bool [L, E]: the experts with the largest saving per byte that fit in `budget_bytes`.

    Only experts that save time (> 0) are taken. Ties go round-robin over layers (rank within its layer
    first, then layer index), so equal savings spread evenly."""
    L, E = savings.shape
    n = int(max(budget_bytes, 0) // expert_bytes) if expert_bytes > 0 else 0
    chosen = np.zeros((L, E), dtype=bool)
    if n == 0:
        return chosen
    rank = np.argsort(np.argsort(-savings, axis=1, kind="stable"), axis=1, kind="stable")  # [L, E] 0 = best
    per_byte = savings / expert_bytes
    layer_idx = np.broadcast_to(np.arange(L)[:, None], (L, E))
    order = np.lexsort((layer_idx.ravel(), rank.ravel(), -per_byte.ravel()))  # last key sorts first
    take = [i for i in order if per_byte.ravel()[i] > 0][:n]
    chosen.ravel()[take] = True
    return chosen


def numa_split(cfg, s: MemorySettings, cold_experts: int) -> list[dict]:
    """Per node: its threads, its slice of F and the DRAM bytes of its slices of all experts / cold ones."""
    D, F = cfg.hidden_size, cfg.expert_intermediate_size
    slices = f_slices(F, list(s.node_threads), s.cpu_dtype, s.group)
    # a slice boundary rounded up to F leaves the trailing nodes without work (and the executor drops them)
    slices += [(F, F)] * (len(s.node_threads) - len(slices))
    out = []
    for node, (threads, (f0, f1)) in enumerate(zip(s.node_threads, slices)):
        per = packed_slice_bytes(D, f0, f1, s.cpu_dtype, s.group) if f1 > f0 else 0
        out.append({"node": node, "threads": threads, "f_start": f0, "f_end": f1,
                    "bytes": per * cfg.num_moe_layers * cfg.num_experts, "cold_bytes": per * cold_experts})
    return out


def decode_step_time(cfg, hw: HardwareProfile, s: MemorySettings, shares, resident, rows: int) -> float:
    """Predicted seconds of one decode step of `rows` rows: routing shares [L, E], resident bool [L, E].
    The step attends the whole cache (decode graphs' shapes are fixed at capture, so they read all
    max_context positions whatever the sequence length), plus the measured per-layer graph floor."""
    cpu_shape, gpu_shape = expert_shapes(cfg, s)
    t = non_expert_step_time(cfg, hw, rows, s.max_context, s.gpu_dtype_bytes) + decode_floor(cfg, hw)
    return t + sum(decode_layer_time(cpu_shape, gpu_shape, hw, sh, res, rows) for sh, res in zip(shares, resident))


def plan(cfg, stats: RoutingStats | None, hw: HardwareProfile, settings: PlanSettings) -> Plan:
    """The placement for model `cfg` (ModelConfig) on machine `hw` (needs GPU figures) under `settings`."""
    hw.require_gpu()
    mem = check_budgets(cfg, settings)
    stats = stats or RoutingStats.uniform(cfg)
    stats.check_model(cfg)
    s = settings.memory
    cpu_shape, gpu_shape = expert_shapes(cfg, s)
    shares = stats.decode_shares()  # [L, E] decode: what residency is for
    pre_shares = stats.prefill_shares()  # [L, E] prompts (the same when decode was not recorded apart)
    rows = settings.decode_rows
    savings = np.stack([decode_savings(cpu_shape, gpu_shape, hw, sh, rows) for sh in shares])  # [L, E]
    resident = choose_resident(savings, mem.resident_expert, settings.gpu_budget - mem.gpu_fixed)  # [L, E]

    n_res = int(resident.sum())
    gpu_bytes = mem.gpu_fixed + n_res * mem.resident_expert
    assert gpu_bytes <= settings.gpu_budget, "planner exceeded the GPU budget"  # choose_resident's contract

    gb = s.gpu_dtype_bytes
    decode_s = decode_step_time(cfg, hw, s, shares, resident, rows)
    sched = LayerScheduler(cpu_shape, hw, "cost")
    gpu_sched = LayerScheduler(gpu_shape, hw, "cpu")  # only its resident GPU time is used
    P = min(settings.prefill_tokens, s.max_context)
    prefill_s = non_expert_step_time(cfg, hw, P, max(1, P // 2), gb, prefill=True)  # causal: P/2 keys on average
    layers = []
    for li, (layer, sh) in enumerate(zip(stats.layers, pre_shares)):
        prefill_s += prefill_layer_time(sched, gpu_sched, sh, resident[li], P)
        ids = np.nonzero(resident[li])[0]
        layers.append(LayerPlan(layer, tuple(int(e) for e in ids), float(savings[li, ids].sum())))
    cold = cfg.num_moe_layers * cfg.num_experts - n_res
    memory = {
        "gpu": {"non_expert": mem.non_expert, "kv_cache": mem.kv_cache, "staging": mem.staging,
                "graph_buffers": mem.graph_buffers, "reserve": mem.reserve,
                "resident_experts": n_res * mem.resident_expert, "per_resident_expert": mem.resident_expert},
        "cpu": {"experts": mem.dram_experts_all, "cold_experts": cold * mem.dram_expert,
                "pinned_buffers": mem.pinned_buffers, "per_expert": mem.dram_expert},
    }
    return Plan(
        model={"family": cfg.family, "num_layers": cfg.num_layers, "num_experts": cfg.num_experts,
               "topk": cfg.experts_per_token, "hidden": cfg.hidden_size, "intermediate": cfg.expert_intermediate_size,
               "moe_layers": list(stats.layers), "attention": cfg.attention_kind,
               "kv_bytes_per_token": cfg.kv_values_per_token * gb},
        settings={"max_context": s.max_context, "max_batch": s.max_batch, "cpu_dtype": s.cpu_dtype,
                  "gpu_dtype_bytes": gb, "staging_slots": s.staging_slots, "ship_chunk": s.ship_chunk,
                  "reserve": s.reserve, "node_threads": list(s.node_threads), "prefill_tokens": P,
                  "profile": hw.name, "stats": stats.source or {"kind": "measured"}},
        gpu_bytes=gpu_bytes, gpu_budget_bytes=settings.gpu_budget, cpu_bytes=mem.cpu_total,
        cpu_budget_bytes=settings.cpu_budget, memory=memory, layers=tuple(layers),
        numa=tuple(numa_split(cfg, s, cold)),
        predicted_decode_tokens_per_s=rows / decode_s, predicted_prefill_tokens_per_s=P / prefill_s)
