"""Loading a checkpoint as a hybrid model: experts go to the CPU executor, hot ones are made resident.

    hcfg = HybridConfig(gpu_experts=32, schedule="cost", cpu_dtype="bf16")
    model, offload = load_hybrid(model_dir, device, dtype, hcfg)
    ... build the Engine (KV cache) ...
    open_hybrid(engine, offload, hcfg)   # resident experts from the plan, or by a routing-count calibration

The resident set is either a plan's (`--plan FILE` from `hybrid plan`: per layer, chosen across layers
by predicted time saved per byte) or `--gpu-experts N` per layer (or the N a `--gpu-budget` allows),
chosen per layer by routing counts from a short calibration run on a built-in text.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hybrid.errors import UsageError
from placement.cost_model import ExpertShape
from placement.hardware import BUILTIN_PROFILES, default_profile_path, load_profile, resolve_profile
from placement.replace import REPLACE_MODES
from placement.schedule import LayerScheduler, parse_strategy

log = logging.getLogger("hybrid.offload")

CPU_DTYPES = ("bf16", "int8", "int4", "mxfp4")
FALLBACK_PROFILE = "ktransformers-paper-amx"
# Routing calibration text: varied prose, code and numbers so that many experts see tokens.
CALIBRATION_TEXT = (
    "The history of the printing press begins in the fifteenth century. def merge(a, b): return sorted(a + b) "
    "Photosynthesis converts light energy into chemical energy stored in glucose. 3.14159 * r ** 2 = area; "
    "Il pleut sur la ville comme il pleut sur mon coeur. SELECT name, count(*) FROM users GROUP BY name; "
    "The quarterly report shows revenue of $4.2 million, up 12% year over year. Bonjour, comment allez-vous? "
    "for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; } Mount Everest is 8,849 metres above sea level. "
)


def parse_bytes(text: str) -> int:
    """'24GiB', '24000MB', '1.5TB', '123' -> bytes (binary for KiB/MiB/GiB/TiB, decimal for KB/MB/GB/TB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise UsageError(f"cannot read {text!r} as a size (examples: 24GiB, 24000MB, 25769803776)")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(value * scale)


@dataclass(frozen=True)
class HybridConfig:
    gpu_experts: int | None = None  # resident experts per MoE layer
    gpu_budget: int | None = None  # bytes of VRAM for everything; resident experts get what is left
    schedule: str = "cost"
    cpu_dtype: str = "bf16"
    # False: cpu_dtype is the default, not the user's choice; an MXFP4 checkpoint then keeps its experts in mxfp4
    cpu_dtype_chosen: bool = True
    cpu_isa: str | None = None
    cpu_threads: int | None = None
    profile: str | None = None
    staging_slots: int = 4
    plan: object = None  # placement.plan_file.Plan: residency from the planner instead of a calibration run
    replace: str = "off"  # "online": re-place experts from a sliding window of routing counts (eager only)
    defer_experts: int = 0  # expert deferral: each token's N lowest-ranked experts added one layer late (opt-in)

    def __post_init__(self):
        parse_strategy(self.schedule)
        if self.replace not in REPLACE_MODES:
            raise UsageError(f"--replace must be one of {', '.join(REPLACE_MODES)}, got {self.replace!r}")
        if self.plan is not None and (self.gpu_experts is not None or self.gpu_budget is not None):
            raise UsageError("give --plan or --gpu-experts / --gpu-budget, not both (the plan holds the placement)")
        if self.cpu_dtype not in CPU_DTYPES:
            raise UsageError(f"--cpu-dtype must be one of {', '.join(CPU_DTYPES)}, got {self.cpu_dtype!r}")
        if self.gpu_experts is not None and self.gpu_experts < 0:
            raise UsageError(f"--gpu-experts must be >= 0, got {self.gpu_experts}")
        if self.gpu_budget is not None and self.gpu_budget <= 0:
            raise UsageError("--gpu-budget must be positive")
        if self.gpu_experts is not None and self.gpu_budget is not None:
            raise UsageError("give --gpu-experts or --gpu-budget, not both")
        if self.staging_slots < 1:
            raise UsageError("--staging-slots must be >= 1")
        if self.defer_experts < 0:
            raise UsageError(f"--defer-experts must be >= 0, got {self.defer_experts}")
        if self.defer_experts and self.replace != "off":
            raise UsageError("--defer-experts and --replace online cannot be combined (a deferred layer call is "
                             "two calls of the re-placement's batch)")
        if self.cpu_threads is not None:
            if self.cpu_threads < 1:
                raise UsageError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            if self.cpu_threads > cores:  # threads beyond the cores only contend with each other
                log.warning("--cpu-threads %d is more than the %d cores this process may use; the executor's "
                            "threads will share cores", self.cpu_threads, cores)


def add_hybrid_arguments(p) -> None:
    g = p.add_argument_group("hybrid experts (cold experts on the CPU; any of these turns it on)")
    g.add_argument("--gpu-experts", type=int, metavar="N",
                   help="resident experts per MoE layer, chosen by routing counts of a short calibration run")
    g.add_argument("--gpu-budget", metavar="SIZE", help="VRAM for the whole model (24GiB, 24000MB or bytes); "
                   "resident experts get what the rest leaves")
    g.add_argument("--schedule", default=None, help="cold-expert split per batch: cost (default: the calibrated "
                   "cost model), cpu (llama.cpp -ot exps=CPU), ship (always ship weights), threshold:N")
    g.add_argument("--cpu-dtype", default=None, choices=CPU_DTYPES, help="dtype of the CPU-resident experts "
                   "(default bf16, and mxfp4 for MXFP4 checkpoints: 4-bit e2m1 + one exponent per 32 values, "
                   "gpt-oss's published format, kept as published; bf16/int8/int4 convert them)")
    g.add_argument("--cpu-threads", type=int, help="CPU executor threads (default: all this process may use)")
    g.add_argument("--profile", help="hardware profile for the scheduler (default: this machine's calibrated "
                   f"profile, else the built-in {FALLBACK_PROFILE})")
    g.add_argument("--plan", metavar="FILE", help="placement plan written by `hybrid plan --out` (resident experts "
                   "per layer, CPU dtype); replaces --gpu-experts / --gpu-budget")
    g.add_argument("--defer-experts", type=int, default=None, metavar="N",
                   help="expert deferral, experimental (changes the model's output; off by default): each token's N lowest-ranked "
                   "routed experts of a layer are added to the next layer's output, so that in decode graphs their "
                   "CPU work overlaps the next layer's attention (KTransformers' Expert Deferral)")
    g.add_argument("--replace", choices=REPLACE_MODES, default=None, help="online: move experts into VRAM as "
                   "routing shifts, when the copy pays for itself (DESIGN.md, Placement); decodes eagerly (default off)")


def hybrid_config_from_args(args) -> HybridConfig | None:
    """None when no hybrid flag was given (all experts on the model's device). Every flag of the group turns it
    on, as its title says: --cpu-threads or --profile alone used to be dropped without a word."""
    flags = ("gpu_experts", "gpu_budget", "schedule", "cpu_dtype", "cpu_threads", "profile", "plan", "replace",
             "defer_experts")
    if all(getattr(args, f, None) is None for f in flags):
        return None
    plan, cpu_dtype = None, args.cpu_dtype
    if getattr(args, "plan", None) is not None:
        from placement.plan_file import load_plan

        plan = load_plan(args.plan)
        planned = plan.settings.get("cpu_dtype", "bf16")
        if cpu_dtype is not None and cpu_dtype != planned:
            raise UsageError(f"--cpu-dtype {cpu_dtype} differs from the plan's {planned}; make a new plan with "
                             f"`hybrid plan --cpu-dtype {cpu_dtype}` or drop --cpu-dtype")
        cpu_dtype = planned
    return HybridConfig(gpu_experts=args.gpu_experts,
                        gpu_budget=parse_bytes(args.gpu_budget) if args.gpu_budget else None,
                        schedule=args.schedule or "cost", cpu_dtype=cpu_dtype or "bf16",
                        cpu_dtype_chosen=cpu_dtype is not None,
                        cpu_threads=getattr(args, "cpu_threads", None), profile=getattr(args, "profile", None),
                        plan=plan, replace=getattr(args, "replace", None) or "off",
                        defer_experts=getattr(args, "defer_experts", None) or 0,
                        # the plan's VRAM includes its staging slots
                        staging_slots=int(plan.settings.get("staging_slots", 4)) if plan is not None else 4)


def scheduler_profile(name: str | None):
    if name is not None:
        return resolve_profile(name)
    path = default_profile_path()
    if path.exists():
        hw = load_profile(path)
        if hw.has_gpu:
            return hw
        log.warning("calibrated profile %s has no GPU figures; scheduling with %s", path, FALLBACK_PROFILE)
    else:
        log.warning("no calibrated profile at %s (run `hybrid calibrate`); scheduling with the built-in %s",
                    path, FALLBACK_PROFILE)
    return BUILTIN_PROFILES[FALLBACK_PROFILE]


def warn_shape_mismatch(hw, shape: ExpertShape) -> bool:
    """C_C(m) is measured at one expert shape; say so when the model's experts have another."""
    d, f = hw.machine.get("hidden"), hw.machine.get("intermediate")
    if hw.cpu_curves and d and f and (d, f) != (shape.hidden, shape.intermediate):
        log.warning("profile %s measured the CPU kernels at D=%s F=%s; this model's experts are D=%d F=%d, so "
                    "CPU-lane predictions may be off: `hybrid calibrate --hidden %d --intermediate %d` measures "
                    "this shape", hw.name, d, f, shape.hidden, shape.intermediate, shape.hidden, shape.intermediate)
        return True
    return False


def expert_shape(cfg, cpu_dtype: str, act_dtype: torch.dtype) -> ExpertShape:
    """The cost model's view of one cold expert of this model (weights priced in the CPU dtype)."""
    bpw = {"bf16": 2.0, "int8": 1.0 + 4.0 / cfg.hidden_size, "int4": 0.5 + 4.0 / 128, "mxfp4": 0.53125}[cpu_dtype]
    return ExpertShape(cfg.family, hidden=cfg.hidden_size, intermediate=cfg.expert_intermediate_size,
                       num_experts=cfg.num_experts, topk=cfg.experts_per_token,
                       layers=max(1, sum(cfg.moe_layers)), bytes_per_weight=bpw,
                       act_bytes=torch.empty((), dtype=act_dtype).element_size())


def load_hybrid(model_dir, device, dtype: torch.dtype, hcfg: HybridConfig, progress: bool = True):
    """Load with every expert in the CPU executor (one packed DRAM copy); none resident yet."""
    from hybrid.models import load_model
    from hybrid.models.loader import read_config
    from hybrid.offload import HybridExperts, Offload

    device = torch.device(device)
    _, cfg, raw = read_config(model_dir)
    from hybrid.models.mxfp4 import declared

    if declared(raw) and not hcfg.cpu_dtype_chosen and hcfg.cpu_dtype != "mxfp4":
        from dataclasses import replace as _replace

        log.warning("MXFP4 checkpoint: the CPU experts stay mxfp4 as published (the default for MXFP4 checkpoints; "
                 "--cpu-dtype bf16|int8|int4 converts them)")
        hcfg = _replace(hcfg, cpu_dtype="mxfp4")
    hw = scheduler_profile(hcfg.profile)
    from cpu_kernels.knee import set_default_knee

    set_default_knee(hw.machine.get("amx_knee"))  # the calibrated AMX knee (none: cpu_kernels' fallback)
    shape = expert_shape(cfg, hcfg.cpu_dtype, dtype)
    warn_shape_mismatch(hw, shape)
    sched = LayerScheduler(shape, hw, hcfg.schedule, can_ship=True)
    if hcfg.defer_experts and hcfg.defer_experts >= cfg.experts_per_token:
        raise UsageError(f"--defer-experts {hcfg.defer_experts} must be below the model's experts per token "
                         f"({cfg.experts_per_token})")
    offload = Offload(device, dtype, sched, cpu_dtype=hcfg.cpu_dtype, cpu_isa=hcfg.cpu_isa,
                      threads=hcfg.cpu_threads, staging_slots=hcfg.staging_slots, defer=hcfg.defer_experts)
    from tqdm import tqdm

    # Packing (and quantizing) every layer's experts for the CPU executor takes seconds per layer on big
    # models, after the tensors are read: a bar of its own, so a long load never looks hung.
    bar = tqdm(total=sum(cfg.moe_layers), unit="layer", desc=f"packing experts ({hcfg.cpu_dtype}) for the CPU",
               disable=not progress or os.environ.get("HYBRID_NO_PROGRESS") == "1")

    def make(i, g, u, d, biases=None):
        layer = HybridExperts(i, g, u, d, offload, fn=cfg.expert_fn, biases=biases)
        bar.update(1)
        return layer

    try:
        model = load_model(model_dir, device=device, dtype=dtype, expert_device="cpu",
                           expert_dtype=torch.bfloat16 if hcfg.cpu_dtype == "bf16" else torch.float32,
                           experts_factory=make, progress=progress, mxfp4_experts=hcfg.cpu_dtype == "mxfp4")
    finally:
        bar.close()
    offload.profile_name = hw.name
    if hcfg.replace == "online":
        from dataclasses import replace as _replace

        from hybrid.offload.replace import OnlineReplacer

        gpu_shape = _replace(shape, bytes_per_weight=float(torch.empty((), dtype=dtype).element_size()))
        offload.replacer = OnlineReplacer(offload, shape, gpu_shape, hw)
    return model, offload


def random_expert_stacks(E: int, F: int, D: int, generator: torch.Generator, scale: float = 0.02):
    """Random bf16 expert weights on the host: gate [E, F, D], up [E, F, D], down [E, D, F], drawn on the
    generator's device (a GPU draws 30B/235B-sized stacks far faster than the CPU) with N(0, scale^2)."""
    dev = generator.device
    return [(torch.randn(*s, device=dev, generator=generator, dtype=torch.float32) * scale).to(torch.bfloat16).cpu()
            for s in ((E, F, D), (E, F, D), (E, D, F))]


def expert_vram_bytes(cfg, dtype: torch.dtype) -> int:
    return 3 * cfg.hidden_size * cfg.expert_intermediate_size * torch.empty((), dtype=dtype).element_size()


def resident_count(model, offload, hcfg: HybridConfig, fixed_vram_bytes: int) -> int:
    """Resident experts per layer: --gpu-experts, or what --gpu-budget leaves after the fixed part."""
    cfg = model.cfg
    if hcfg.gpu_budget is None:
        if (hcfg.gpu_experts or 0) > cfg.num_experts:
            log.warning("--gpu-experts %d is more than the model's %d experts per layer: all %d are resident",
                        hcfg.gpu_experts, cfg.num_experts, cfg.num_experts)
        return min(hcfg.gpu_experts or 0, cfg.num_experts)
    per_layer = len(offload.layers) * expert_vram_bytes(cfg, offload.dtype)
    left = hcfg.gpu_budget - fixed_vram_bytes
    if left < 0:
        raise UsageError(f"--gpu-budget {hcfg.gpu_budget / 2**30:.2f} GiB is below what the model needs without "
                         f"experts ({fixed_vram_bytes / 2**30:.2f} GiB: non-expert weights, KV cache, staging); "
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
    # the experts' biases (gpt-oss) stay on the GPU for every expert, fp32 (placement.memory.expert_bias_bytes)
    params += sum(t.numel() * t.element_size() for layer in offload.layers for t in (layer.bias_dev or ()))
    # ShipLane holds n_slots chunks of `chunk` experts each (dense; + raw packed bytes when the packed
    # layout is not the dense one, which placement.memory prices exactly for `hybrid plan`)
    lane = offload.ship_lane
    staging = lane.n_slots * lane.chunk * expert_vram_bytes(model.cfg, offload.dtype)
    return params + cache_bytes + staging


def open_hybrid(engine, offload, hcfg: HybridConfig, log=print) -> None:
    """Choose the resident experts with the engine's own prefill, then report placement and memory."""
    from hybrid.runtime.engine import Stats

    model = engine.model
    if hcfg.plan is not None:
        counts = place_from_plan(engine, offload, hcfg.plan, log)
        how = (f"{min(counts)}..{max(counts)}" if counts else "0") + " (from the plan)"
    else:
        tokens = engine.tokenizer.encode(CALIBRATION_TEXT * 4)[: engine.max_context - 1]
        slot = engine.allocate_slot()
        try:
            n = place_resident(model, offload, hcfg, lambda t: engine.prefill(slot, t), tokens,
                               fixed_vram(model, engine.cache.nbytes, offload))
        finally:
            engine.free_slot(slot)
        engine.stats = Stats()  # the calibration run is not part of the user's numbers
        how = str(n)  # per layer
    mem = offload.memory()
    from hybrid.runtime.device_role import CPU_ONLY_NOTE, is_cuda

    if is_cuda(offload.device):
        log(f"hybrid: {how} of {model.cfg.num_experts} experts resident per MoE layer ({len(offload.layers)} layers); "
            f"schedule {offload.scheduler.strategy}, CPU {offload.layers[0].cpu_moe.isa} {offload.cpu_dtype}, "
            f"profile {offload.profile_name}; DRAM experts {mem['dram_expert_bytes'] / 2**30:.2f} GiB, pinned "
            f"{mem['pinned_bytes'] / 2**30:.2f} GiB, VRAM resident {mem['vram_resident_bytes'] / 2**30:.2f} GiB")
    else:  # issue 14: no VRAM, no PCIe here; say what the numbers are on this machine
        log(f"hybrid: {CPU_ONLY_NOTE}")
        log(f"hybrid: {how} of {model.cfg.num_experts} experts 'resident' (torch on the CPU) per MoE layer "
            f"({len(offload.layers)} layers); schedule {offload.scheduler.strategy} priced with profile "
            f"{offload.profile_name}'s GPU and link figures (not this machine's), CPU executor "
            f"{offload.layers[0].cpu_moe.isa} {offload.cpu_dtype}; DRAM: experts "
            f"{mem['dram_expert_bytes'] / 2**30:.2f} GiB + 'resident' torch copies "
            f"{mem['vram_resident_bytes'] / 2**30:.2f} GiB")


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
