"""The placement planner (DESIGN section 4): which experts live in VRAM, given budgets and routing stats.

    settings = PlanSettings(gpu_budget=24 * 2**30, cpu_budget=200 * 2**30, memory=MemorySettings(...))
    check_budgets(cfg, settings)            # UsageError before any weight is read, if nothing can work
    p = plan(cfg, stats, hw, settings)      # -> Plan; p.save(path); load_plan(path)

Choice of resident experts: after the fixed part of VRAM (placement.memory), the rest holds up to
floor(left / bytes per expert) experts, chosen greedily across ALL layers by the seconds each saves in its
layer's decode makespan, max(CPU lane, GPU lane) (placement.predict.DecodeLanes: the lanes run at once, and the
CPU lane's fixed part goes with the layer's last cold expert), per byte (choose_resident_by_makespan): a skewed
layer, whose top experts take most tokens, gets more residents than a flat one, and an expert the CPU would run
faster than the GPU is still placed while the CPU lane is the longer one. Picking stops when no further resident
shortens a layer, so VRAM may stay idle. Ties (uniform statistics) are broken round-robin over layers, so flat
statistics give every layer the same count. Experts unseen while profiling get a prior of half a token
(placement.routing_stats.PRIOR_TOKENS): free VRAM goes to them last, but it does go to them.

Ship-lane staging (choose_staging): VRAM the staging slots hold is VRAM no resident expert gets, so `hybrid plan`
sizes them by what they save rather than at a fixed 4 slots x 8 experts (3.32 GiB of a 24 GB card for DeepSeek-V3,
whose single expert already fills the link): it prices each choice's prefill with the residents the rest of the
budget then buys, and keeps the smallest staging within STAGING_TOLERANCE of the fastest.

NUMA: the CPU executor splits every expert's F across the nodes in proportion to their threads and
keeps each slice in node-local memory (never a copy per node); the plan reports each node's slice and
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from placement.errors import UsageError
from placement.cost_model import ExpertShape
from placement.hardware import HardwareProfile, priced_kernel
from placement.memory import (GPU_PARTS, RESIDENT_PART, MemoryBreakdown, MemorySettings, breakdown, f_slices, gib, non_expert_bytes,
                              kv_value_bytes, packed_expert_bytes, packed_slice_bytes)
from placement.plan_file import LayerPlan, Plan
from placement.predict import (decode_floor, decode_lanes, decode_layer_time, gpu_shape_of,
                               non_expert_step_time, prefill_layer_time)
from placement.routing_stats import PRIOR_TOKENS, RoutingStats
from placement.schedule import LayerScheduler

DEFAULT_PREFILL_TOKENS = 512
STAGING_SLOTS = 2  # what choose_staging gives: the fewest that overlap a chunk's transfer with the last one's compute
SHIP_CHUNKS = (1, 2, 4, 8)  # experts per slot that choose_staging prices
STAGING_TOLERANCE = 0.02  # a smaller staging is kept while its predicted prefill is within 2% of the fastest


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


def _smaller_gpu_hint(s: MemorySettings) -> str:
    """What --gpu-dtype could still take off the weights (nothing once every part is int4)."""
    if all(s.gpu_dtypes.get(p) == "int4" for p in GPU_PARTS):
        return ""
    return " (or --gpu-dtype int4: 4-bit GPU weights)"


def check_budgets(cfg, settings: PlanSettings) -> MemoryBreakdown:
    """Fail (UsageError) when no placement can fit: the GPU's fixed part or the DRAM part is too big.
    Uses the config only, so it runs before any weight is loaded."""
    mem = breakdown(cfg, settings.memory)
    s = settings.memory
    if mem.gpu_fixed > settings.gpu_budget:
        raise UsageError(
            f"--gpu-budget {gib(settings.gpu_budget)} is too small: the GPU needs {gib(mem.gpu_fixed)} before any "
            f"expert (non-expert weights {gib(mem.non_expert)}, KV cache {gib(mem.kv_cache)} in {s.kv_dtype} for "
            f"--max-context {s.max_context} x --max-batch {s.max_batch}, staging {gib(mem.staging)}, graph buffers "
            f"{gib(mem.graph_buffers)}, prefill activations {gib(mem.prefill_activations)} for passes of "
            f"{min(s.prefill_chunk, s.max_context)} tokens, reserve {gib(mem.reserve)}); raise --gpu-budget to at least "
            f"{gib(mem.gpu_fixed)} or lower --max-context / --max-batch{_smaller_gpu_hint(s)}"
            f"{' (or --kv-dtype fp8: half the KV cache)' if s.kv_dtype != 'fp8' else ''}")
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


FITTED_CPU_DTYPES = ("bf16", "int8", "int4")  # the order a plan tries when the user names no CPU dtype


def fit_cpu_dtype(cfg, settings: PlanSettings) -> tuple[str, str | None]:
    """(dtype, why): the most precise of FITTED_CPU_DTYPES whose DRAM part (every expert packed, pinned buffers) fits
    settings.cpu_budget, and a line saying why it is not the first (None when it is, or when none fits: the first
    then, and check_budgets says why)."""
    totals = {d: breakdown(cfg, replace(settings.memory, cpu_dtype=d)).cpu_total for d in FITTED_CPU_DTYPES}
    fits = [d for d, total in totals.items() if total <= settings.cpu_budget]
    if not fits or fits[0] == FITTED_CPU_DTYPES[0]:
        return FITTED_CPU_DTYPES[0], None
    tried = ", ".join(f"{d} {gib(totals[d])}" for d in FITTED_CPU_DTYPES[:FITTED_CPU_DTYPES.index(fits[0])])
    return fits[0], (f"CPU dtype {fits[0]} ({gib(totals[fits[0]])} of DRAM): the most precise of "
                     f"{', '.join(FITTED_CPU_DTYPES)} whose experts fit --cpu-budget {gib(settings.cpu_budget)} ({tried} "
                     f"do not); --cpu-dtype chooses another, and `hybrid generate --plan` loads the plan's")


def choose_resident(savings: np.ndarray, expert_bytes: int, budget_bytes: int) -> np.ndarray:
    """bool [L, E]: the experts with the largest saving per byte that fit in `budget_bytes`, for savings
    that add up (each expert's alone, as decode_savings gives them). The planner does not use it: a
    layer's lanes run at once, so what an expert saves depends on the others (choose_resident_by_makespan).

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


def choose_resident_by_makespan(lanes: list, expert_bytes: int, budget_bytes: int) -> np.ndarray:
    """bool [L, E]: resident experts for layers whose decode step costs max(CPU lane, GPU lane)
    (placement.predict.DecodeLanes, one per layer), chosen greedily across all layers by the makespan
    seconds each saves per byte, within `budget_bytes`.

    A pick changes only its own layer's lanes, so a priority queue holds each layer's best next pick
    (next_resident) and only the picked layer's entry is recomputed. Picking stops when the best pick
    saves nothing (every further resident would lengthen the GPU lane past the CPU lane) or the budget
    is full. Ties go round-robin: fewest residents in the layer first, then layer index, so equal
    layers end with equal counts +-1."""
    import heapq

    L = len(lanes)
    E = len(lanes[0].cpu) if L else 0
    chosen = np.zeros((L, E), dtype=bool)
    n = int(max(budget_bytes, 0) // expert_bytes) if expert_bytes > 0 else 0
    queue = []
    for li in range(L if n else 0):
        saved, e = next_resident(lanes[li], chosen[li])
        queue.append((-saved / expert_bytes, 0, li, e))
    heapq.heapify(queue)
    taken = 0
    while queue and taken < n:
        per_byte, count, li, e = heapq.heappop(queue)
        if -per_byte <= 0 or e < 0:
            break  # the best pick left saves nothing, so no other does
        chosen[li, e] = True
        taken += 1
        saved, e = next_resident(lanes[li], chosen[li])
        heapq.heappush(queue, (-saved / expert_bytes, count + 1, li, e))
    return chosen


def next_resident(lanes, resident: np.ndarray) -> tuple[float, int]:
    """(seconds saved, expert id) of the best cold expert to make resident in one layer, (0.0, -1) when
    none is cold. Moving expert e takes its CPU time c_e off the CPU lane (and the lane's fixed part with
    the last cold expert) and adds its GPU time g_e to the GPU lane, so with makespan T it saves
    min(T - cpu + c_e, T - gpu - g_e). Among equal savings the largest CPU time wins, then the lowest id."""
    cold = np.flatnonzero(~resident)
    if cold.size == 0:
        return 0.0, -1
    gpu = float(lanes.gpu[resident].sum()) if resident.any() else 0.0
    cpu = lanes.cpu_fixed + float(lanes.cpu[cold].sum())
    span = max(cpu, gpu)
    freed = lanes.cpu[cold] if cold.size > 1 else np.array([cpu])
    saved = np.minimum(span - cpu + freed, span - gpu - lanes.gpu[cold])
    best = np.lexsort((cold, -lanes.cpu[cold], -saved))[0]  # last key sorts first
    return float(saved[best]), int(cold[best])


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


def gpu_read_bytes(cfg, s: MemorySettings) -> int:
    """Bytes of non-expert weights a step reads on the GPU, each part in its GPU dtype: all but the embedding
    table, which is gathered (predict.non_expert_step_time)."""
    parts = non_expert_bytes(cfg, s.gpu_dtypes, s.gpu_dtype_bytes)
    return sum(parts.values()) - parts["embed"]


def decode_step_time(cfg, hw: HardwareProfile, s: MemorySettings, shares, resident, rows: int) -> float:
    """Predicted seconds of one decode step of `rows` rows: routing shares [L, E], resident bool [L, E].
    The step attends the whole cache (decode graphs' shapes are fixed at capture, so they read all
    max_context positions whatever the sequence length), plus the measured per-layer graph floor."""
    cpu_shape, gpu_shape = expert_shapes(cfg, s)
    t = non_expert_step_time(cfg, hw, rows, s.max_context, s.gpu_dtype_bytes, weight_bytes=gpu_read_bytes(cfg, s),
                             kv_value_bytes=kv_value_bytes(s.kv_dtype, s.gpu_dtype_bytes))
    t += decode_floor(cfg, hw)
    return t + sum(decode_layer_time(cpu_shape, gpu_shape, hw, sh, res, rows) for sh, res in zip(shares, resident))


def residency_lanes(cfg, stats: RoutingStats, hw: HardwareProfile, s: MemorySettings) -> tuple[np.ndarray, list]:
    """(decode shares [L, E], placement.predict.DecodeLanes per layer at s.max_batch rows): what residency is
    chosen by. Decode is what residency is for; the shares carry a prior, so an expert unseen while profiling
    still ranks."""
    cpu_shape, gpu_shape = expert_shapes(cfg, s)
    shares = stats.decode_shares(prior=PRIOR_TOKENS)
    return shares, [decode_lanes(cpu_shape, gpu_shape, hw, sh, s.max_batch) for sh in shares]


def prefill_time(cfg, hw: HardwareProfile, s: MemorySettings, shares, resident, tokens: int) -> float:
    """Predicted seconds of one prompt of `tokens` tokens: prompt routing shares [L, E], resident bool [L, E].
    The prompt runs in passes of s.prefill_chunk tokens (hybrid.runtime.Engine.prefill), each priced as a prompt
    of its own: the non-expert part attends tokens / 2 keys on average (causal); each MoE layer's cold experts are
    split between the CPU and the ship lane by the cost schedule, the ship lane in chunks of s.ship_chunk experts
    (each shipped expert carries its share of its chunk's launches: placement.schedule.LayerScheduler), so every
    pass ships its experts again."""
    if tokens > s.prefill_chunk:
        full, rest = divmod(tokens, s.prefill_chunk)
        t = full * prefill_time(cfg, hw, s, shares, resident, s.prefill_chunk)
        return t + (prefill_time(cfg, hw, s, shares, resident, rest) if rest else 0.0)
    cpu_shape, gpu_shape = expert_shapes(cfg, s)
    # the CPU lane at the rate of the kernels s.cpu_dtype runs on (a profile without that curve: its best one)
    kernel = priced_kernel(hw, s.cpu_dtype, s.group, note=lambda _: None)
    sched = LayerScheduler(cpu_shape, hw, "cost", chunk=s.ship_chunk, cpu_kernel=kernel)
    gpu_sched = LayerScheduler(gpu_shape, hw, "cpu")  # only its resident GPU time is used
    t = non_expert_step_time(cfg, hw, tokens, max(1, tokens // 2), s.gpu_dtype_bytes, prefill=True,
                             weight_bytes=gpu_read_bytes(cfg, s),
                             kv_value_bytes=kv_value_bytes(s.kv_dtype, s.gpu_dtype_bytes))
    return t + sum(prefill_layer_time(sched, gpu_sched, sh, res, tokens) for sh, res in zip(shares, resident))


class StagingChoice(NamedTuple):
    """One ship-lane staging that choose_staging prices: its bytes, the residents the rest of the budget buys,
    and the prefill and decode-step seconds predicted with them."""
    slots: int
    chunk: int
    staging: int  # bytes
    residents: int
    prefill_s: float
    decode_s: float


def price_staging(cfg, stats: RoutingStats | None, hw: HardwareProfile, s: MemorySettings, gpu_budget: int,
                  prefill_tokens: int = DEFAULT_PREFILL_TOKENS) -> list[StagingChoice]:
    """Every staging of STAGING_SLOTS slots x SHIP_CHUNKS experts that leaves the budget non-negative, priced as
    plan() prices a placement: residents by makespan in what the budget leaves, then the predicted prefill of a
    `prefill_tokens` prompt (capped at max_context) and the decode step. Smallest staging first."""
    hw.require_gpu()
    stats = stats or RoutingStats.uniform(cfg)
    stats.check_model(cfg)
    shares, lanes = residency_lanes(cfg, stats, hw, s)
    pre_shares, tokens = stats.prefill_shares(), min(prefill_tokens, s.max_context)
    out = []
    for chunk in SHIP_CHUNKS:
        m = replace(s, staging_slots=STAGING_SLOTS, ship_chunk=chunk)
        mem = breakdown(cfg, m)
        if mem.gpu_fixed > gpu_budget:
            continue
        resident = choose_resident_by_makespan(lanes, mem.resident_expert, gpu_budget - mem.gpu_fixed)
        out.append(StagingChoice(STAGING_SLOTS, chunk, mem.staging, int(resident.sum()),
                                 prefill_time(cfg, hw, m, pre_shares, resident, tokens),
                                 decode_step_time(cfg, hw, m, shares, resident, s.max_batch)))
    return sorted(out, key=lambda c: c.staging)


def choose_staging(cfg, stats: RoutingStats | None, hw: HardwareProfile, s: MemorySettings, gpu_budget: int,
                   prefill_tokens: int = DEFAULT_PREFILL_TOKENS) -> tuple[int, int]:
    """(staging slots, experts per slot) of the ship lane: the smallest staging whose predicted prefill is within
    STAGING_TOLERANCE of the fastest choice's (price_staging), so that the bytes it does not take go to resident
    experts. The one rule for `hybrid plan` and for `generate/chat/serve --gpu-budget` without a plan.

    Decode never ships (captured steps run every cold expert on the CPU lane), so a smaller staging only helps
    it: more residents. Prefill trades two things: a larger chunk spreads the per-chunk launch cost
    (profile.ship_chunk_overhead) over more experts; a smaller one leaves room for more residents, which run
    without crossing the link at all. With ship_chunk_overhead 0 (the built-in profiles) the chunk itself costs
    nothing, so the smallest staging is taken unless its extra residents made a prompt slower.

    Slots: always STAGING_SLOTS (2). The cost model does not price slots at all: its ship lane is a two-stage
    flow shop (transfer, then compute when the GPU is free) that never waits for a free slot. Slots only overlap
    one chunk's transfer with the previous chunk's compute, and two already do that whenever a chunk's transfer
    takes at least its compute, which is when shipping is link-bound (a DeepSeek-V3 expert's int4 bytes take
    about 1 ms over a 25 GB/s link, its GPU compute about 0.1 ms). A third slot would only let the link run
    further ahead during resident GPU work, which the model does not see and so could not justify.

    A budget that no staging fits gives the smallest one (check_budgets then says what the GPU needs)."""
    priced = price_staging(cfg, stats, hw, s, gpu_budget, prefill_tokens)
    if not priced:
        return STAGING_SLOTS, SHIP_CHUNKS[0]
    best = min(c.prefill_s for c in priced)
    pick = next(c for c in priced if c.prefill_s <= best * (1 + STAGING_TOLERANCE))
    return pick.slots, pick.chunk


def plan(cfg, stats: RoutingStats | None, hw: HardwareProfile, settings: PlanSettings) -> Plan:
    """The placement for model `cfg` (ModelConfig) on machine `hw` (needs GPU figures) under `settings`."""
    hw.require_gpu()
    mem = check_budgets(cfg, settings)
    stats = stats or RoutingStats.uniform(cfg)
    stats.check_model(cfg)
    s = settings.memory
    shares, lanes = residency_lanes(cfg, stats, hw, s)
    pre_shares = stats.prefill_shares()  # [L, E] prompts (the same when decode was not recorded apart)
    rows = settings.decode_rows
    resident = choose_resident_by_makespan(lanes, mem.resident_expert, settings.gpu_budget - mem.gpu_fixed)  # [L, E]

    n_res = int(resident.sum())
    gpu_bytes = mem.gpu_fixed + n_res * mem.resident_expert
    assert gpu_bytes <= settings.gpu_budget, "planner exceeded the GPU budget"  # choose_resident's contract

    gb = s.gpu_dtype_bytes
    decode_s = decode_step_time(cfg, hw, s, shares, resident, rows)
    P = min(settings.prefill_tokens, s.max_context)
    prefill_s = prefill_time(cfg, hw, s, pre_shares, resident, P)
    layers = []
    for li, layer in enumerate(stats.layers):
        ids = np.nonzero(resident[li])[0]
        saved = lanes[li].layer_time(np.zeros_like(resident[li])) - lanes[li].layer_time(resident[li])
        layers.append(LayerPlan(layer, tuple(int(e) for e in ids), float(saved)))
    cold = cfg.num_moe_layers * cfg.num_experts - n_res
    memory = {
        "gpu": {"non_expert": mem.non_expert, "kv_cache": mem.kv_cache, "staging": mem.staging,
                "graph_buffers": mem.graph_buffers, "prefill_activations": mem.prefill_activations,
                "reserve": mem.reserve,
                "resident_experts": n_res * mem.resident_expert, "per_resident_expert": mem.resident_expert,
                "non_expert_parts": dict(mem.parts)},
        "cpu": {"experts": mem.dram_experts_all, "cold_experts": cold * mem.dram_expert,
                "pinned_buffers": mem.pinned_buffers, "per_expert": mem.dram_expert},
    }
    return Plan(
        model={"family": cfg.family, "num_layers": cfg.num_layers, "num_experts": cfg.num_experts,
               "topk": cfg.experts_per_token, "hidden": cfg.hidden_size, "intermediate": cfg.expert_intermediate_size,
               "moe_layers": list(stats.layers), "attention": cfg.attention_kind,
               "kv_bytes_per_token": cfg.kv_values_per_token * kv_value_bytes(s.kv_dtype, gb)},
        settings={"max_context": s.max_context, "max_batch": s.max_batch, "cpu_dtype": s.cpu_dtype,
                  **({"int4_group": s.group} if s.cpu_dtype == "int4" else {}), "kv_dtype": s.kv_dtype,
                  **({"down_dtypes": list(s.down_dtypes)} if s.down_dtypes else {}),
                  **({"layer_dtypes": list(s.layer_dtypes)} if s.layer_dtypes else {}),
                  "gpu_dtype_bytes": gb, "gpu_dtypes": {p: s.gpu_dtypes.get(p, "bf16") for p in (*GPU_PARTS, RESIDENT_PART)},
                  "staging_slots": s.staging_slots, "ship_chunk": s.ship_chunk, "prefill_chunk": s.prefill_chunk,
                  "reserve": s.reserve, "node_threads": list(s.node_threads), "prefill_tokens": P,
                  "profile": hw.name, "stats": stats.source or {"kind": "measured"}},
        gpu_bytes=gpu_bytes, gpu_budget_bytes=settings.gpu_budget, cpu_bytes=mem.cpu_total,
        cpu_budget_bytes=settings.cpu_budget, memory=memory, layers=tuple(layers),
        numa=tuple(numa_split(cfg, s, cold)),
        predicted_decode_tokens_per_s=rows / decode_s, predicted_prefill_tokens_per_s=P / prefill_s)
