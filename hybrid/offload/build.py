"""Building a hybrid model while it loads: every expert goes to the CPU executor (one packed DRAM copy), none
resident yet; `hybrid.loading.place` then makes the hot ones resident.

    model, offload = load_hybrid(model_dir, device, dtype, HybridConfig(cpu_dtype="int8"))

The Offload (scheduler, lanes, CPU executor) exists before the weights are read, so that each MoE layer's
experts are packed for the CPU as the loader reaches them.
"""

from __future__ import annotations

import logging

import torch

from cpu_kernels.dtypes import CPU_DTYPES as CPU_DTYPE_TABLE
from cpu_kernels.knobs import knobs
from hybrid.errors import UsageError
from hybrid.offload.config import HybridConfig, checkpoint_cpu_dtype
from placement.cost_model import ExpertShape
from placement.gpu_dtypes import resident_kind
from placement.hardware import priced_kernel, pricing_profile
from placement.schedule import LayerScheduler

log = logging.getLogger("hybrid.offload")


def scheduler_profile(name):
    """The scheduler's profile: placement.hardware.pricing_profile, the rule every command shares (a profile
    object already resolved by the session passes through)."""
    return pricing_profile(name, note=lambda line: log.warning("%s", line))


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
    bpw = CPU_DTYPE_TABLE[cpu_dtype].bytes_per_weight(cfg.hidden_size)  # int4 at its default group size
    return ExpertShape(cfg.family, hidden=cfg.hidden_size, intermediate=cfg.expert_intermediate_size,
                       num_experts=cfg.num_experts, topk=cfg.experts_per_token,
                       layers=max(1, sum(cfg.moe_layers)), bytes_per_weight=bpw,
                       act_bytes=torch.empty((), dtype=act_dtype).element_size())


def packs_views(model_dir, cpu_dtype: str, isa: str | None) -> bool:
    """Whether the loader hands the CPU executor its experts as views of the checkpoint (loader expert_views): a
    safetensors folder whose experts the compiled packer converts (bf16, int8, int4, q8_0, q4_0, iq4_xs on a compiled ISA
    that has it).
    Otherwise each layer is staged in one float stack first, as the PyTorch reference packer needs."""
    from cpu_kernels import _native
    from hybrid.models.gguf import is_gguf

    return cpu_dtype in ("bf16", "int8", "int4", "q8_0", "q4_0", "iq4_xs") and not is_gguf(model_dir) and _native.has_packer(
        _native.resolve_isa(isa))


def load_hybrid(model_dir, device, dtype: torch.dtype, hcfg: HybridConfig, progress: bool = True,
                gpu_dtypes: dict[str, str] | None = None):
    """Load with every expert in the CPU executor (one packed DRAM copy); none resident yet. gpu_dtypes: the
    non-expert parts' GPU dtypes (hybrid.models.gpu_weights; None: all in `dtype`)."""
    from hybrid.models import load_model
    from hybrid.models.checkpoints import read_config
    from hybrid.offload import HybridExperts, Offload

    device = torch.device(device)
    _, cfg, raw = read_config(model_dir)
    hcfg = checkpoint_cpu_dtype(hcfg, raw)
    hw = scheduler_profile(hcfg.profile)
    from cpu_kernels.knee import set_default_knee

    set_default_knee(hw.machine.get("amx_knee"))  # the calibrated AMX knee (none: cpu_kernels' fallback)
    shape = expert_shape(cfg, hcfg.cpu_dtype, dtype)
    warn_shape_mismatch(hw, shape)
    from cpu_kernels import _native

    kernel = priced_kernel(hw, hcfg.cpu_dtype, hcfg.cpu_group, _native.resolve_isa(hcfg.cpu_isa),
                           note=lambda line: log.warning("%s", line))
    sched = LayerScheduler(shape, hw, hcfg.schedule, can_ship=True, chunk=hcfg.ship_chunk, cpu_kernel=kernel)
    if hcfg.defer_experts and hcfg.defer_experts >= cfg.experts_per_token:
        raise UsageError(f"--defer-experts {hcfg.defer_experts} must be below the model's experts per token "
                         f"({cfg.experts_per_token})")
    offload = Offload(device, dtype, sched, cpu_dtype=hcfg.cpu_dtype, cpu_isa=hcfg.cpu_isa,
                      threads=hcfg.cpu_threads, staging_slots=hcfg.staging_slots, ship_chunk=hcfg.ship_chunk,
                      defer=hcfg.defer_experts, group_size=hcfg.cpu_group, resident_dtype=resident_kind(gpu_dtypes))
    from tqdm import tqdm

    # Packing (and quantizing) every layer's experts for the CPU executor takes seconds per layer on big
    # models, after the tensors are read: a bar of its own, so a long load never looks hung.
    bar = tqdm(total=sum(cfg.moe_layers), unit="layer", desc=f"packing experts ({hcfg.cpu_dtype}) for the CPU",
               disable=not progress or knobs().no_progress)

    def own_scheduler(cpu_dtype: str, strategy) -> LayerScheduler:
        """A layer in another CPU dtype than the load's (a GGUF file of mixed layers): its expert bytes and kernel."""
        return LayerScheduler(expert_shape(cfg, cpu_dtype, dtype), hw, strategy, can_ship=True, chunk=hcfg.ship_chunk,
                              cpu_kernel=priced_kernel(hw, cpu_dtype, hcfg.cpu_group, _native.resolve_isa(hcfg.cpu_isa),
                                                       note=lambda line: log.warning("%s", line)))

    offload.scheduler_factory = own_scheduler

    def make(i, g, u, d, biases=None, down_dtype=None, dtype=None):
        layer = HybridExperts(i, g, u, d, offload, fn=cfg.expert_fn, biases=biases, cache=cache, times=times,
                              down_dtype=down_dtype, dtype=dtype)
        offload.scheduler_of(layer.cpu_moe.dtype)  # built (and its tables compiled) at load, not in the first batch
        bar.update(1)
        return layer

    import sys
    import time

    from hybrid.offload.packed_cache import LoadTimes, open_for_load

    t_load, times = time.perf_counter(), LoadTimes()
    cache = open_for_load(model_dir, cfg, offload, times, hcfg.layer_formats) if hcfg.packed_cache else None
    # the compiled packer reads the checkpoint's experts where they lie (memory-mapped), so no layer is staged
    views = {"expert_views": True} if packs_views(model_dir, hcfg.cpu_dtype, offload.cpu_isa) else {}
    try:
        model = load_model(model_dir, device=device, dtype=dtype, expert_device="cpu",
                           expert_dtype=torch.bfloat16 if hcfg.cpu_dtype == "bf16" else torch.float32,
                           experts_factory=make, progress=progress, mxfp4_experts=hcfg.cpu_dtype == "mxfp4",
                           cpu_format=(hcfg.cpu_dtype, hcfg.cpu_group),  # a GGUF's blocks this format holds exactly
                           layer_formats=hcfg.layer_formats,  # a mixed GGUF's layers in formats of their own
                           gpu_dtypes=gpu_dtypes, experts_cached=None if cache is None else cache.holds, **views)
        if cache is not None:
            cache.commit()
    finally:
        bar.close()
        if cache is not None:
            cache.close()
    times.total_s = time.perf_counter() - t_load
    offload.load_times = times
    log.info("hybrid: %s", times.line())
    if progress and not knobs().no_progress:  # beside the bars, which say where the time goes while it goes
        print(times.line(), file=sys.stderr)
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


def expert_vram_bytes(cfg, dtype: torch.dtype, resident_dtype: str = "bf16") -> int:
    """VRAM of one expert: de-quantized in `dtype` (a staging slot's, a bf16 resident's), or a resident one in
    int8 / int4 (placement.memory.resident_expert_bytes)."""
    from placement.memory import resident_expert_bytes

    gb = torch.empty((), dtype=dtype).element_size()
    if resident_dtype == "bf16":
        return 3 * cfg.hidden_size * cfg.expert_intermediate_size * gb
    return resident_expert_bytes(cfg.hidden_size, cfg.expert_intermediate_size, resident_dtype, gb)
