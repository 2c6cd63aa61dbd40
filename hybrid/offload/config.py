"""HybridConfig: how the hybrid layer holds a model's experts (cold ones in the CPU executor, hot ones resident),
validated once; `hybrid.loading.parse` builds it from the command line."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

from cpu_kernels.dtypes import CPU_DTYPES as CPU_DTYPE_TABLE, NAMES as CPU_DTYPES  # the one table of CPU dtypes
from hybrid.errors import UsageError
from placement.hardware import FALLBACK_PROFILE  # noqa: F401  (re-exported: the one fallback profile)
from placement.replace import REPLACE_MODES
from placement.schedule import parse_strategy

log = logging.getLogger("hybrid.offload")



@dataclass(frozen=True)
class HybridConfig:
    gpu_experts: int | None = None  # resident experts per MoE layer
    gpu_budget: int | None = None  # bytes of VRAM for everything; resident experts get what is left
    schedule: str = "cost"
    cpu_dtype: str = "bf16"
    # False: cpu_dtype is the default, not the user's choice; an MXFP4 checkpoint then keeps its experts in mxfp4
    cpu_dtype_chosen: bool = True
    # a GGUF file of mixed types whose format was chosen from its blocks (no --cpu-dtype): each layer keeps the format
    # of its own gate and up blocks where one holds them (hybrid.models.gguf.repack.layer_format)
    layer_formats: bool = False
    cpu_isa: str | None = None
    cpu_threads: int | None = None
    profile: str | None = None
    # the ship lane's staging: slots x experts per slot (a plan's, which its VRAM includes; without one, under
    # --gpu-budget, what `hybrid plan` would choose: hybrid.loading.parse.with_ship_staging)
    staging_slots: int = 4
    ship_chunk: int = 8
    plan: object = None  # placement.plan_file.Plan: residency from the planner instead of a calibration run
    replace: str = "off"  # "online": re-place experts from a sliding window of routing counts (eager only)
    defer_experts: int = 0  # expert deferral: each token's N lowest-ranked experts added one layer late (opt-in)
    cpu_group: int = CPU_DTYPE_TABLE["int4"].default_group  # int4 experts: inputs per scale (cpu_kernels.dtypes)
    # the packed-expert cache (hybrid.offload.packed_cache): read the CPU executor's bytes from it when it holds
    # this checkpoint and layout, else write it; False (--no-cache): neither read nor write it
    packed_cache: bool = True

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
        if self.ship_chunk < 1:
            raise UsageError(f"the ship lane's chunk (ship_chunk) must be >= 1 expert, got {self.ship_chunk}")
        groups = CPU_DTYPE_TABLE["int4"].group_sizes
        if self.cpu_group not in groups:
            raise UsageError(f"int4 group size must be one of {', '.join(map(str, groups))}, got {self.cpu_group}")
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


def checkpoint_cpu_dtype(hcfg: HybridConfig | None, raw: dict) -> HybridConfig | None:
    """`hcfg` with the CPU experts' dtype this checkpoint gets when the user named none: experts published as
    MXFP4 stay mxfp4 (0.53125 bytes a weight, no float copy), anything else bf16. `hybrid plan`, the checks
    before loading and the loader all take the dtype from here, so they price and load the same bytes."""
    if hcfg is None or hcfg.cpu_dtype_chosen or default_cpu_dtype(raw) == hcfg.cpu_dtype:
        return hcfg
    log.warning("MXFP4 checkpoint: the CPU experts stay mxfp4 as published (the default for MXFP4 checkpoints; "
                "--cpu-dtype bf16|int8|int4 converts them)")
    return replace(hcfg, cpu_dtype=default_cpu_dtype(raw))


def default_cpu_dtype(raw: dict) -> str:
    """The CPU experts' dtype for a checkpoint's config.json when the user names none."""
    from hybrid.models.mxfp4 import declared

    return "mxfp4" if declared(raw) else "bf16"
