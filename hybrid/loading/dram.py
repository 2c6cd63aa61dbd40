"""DRAM: the host memory a model will take, estimated from config.json alone, against what this machine has.

A model that does not fit in DRAM is not refused by anything else: the process grows for minutes while the
weights load, then the kernel's OOM killer ends it without a message (on a machine without CUDA the plain
model is upcast to fp32: an 8-layer cut of Qwen3-30B-A3B is ~22 GB). So the need is priced before anything is
allocated, from the same figures `hybrid plan` uses (placement.memory), and a need above the available memory
is one line naming the parts, the memory available and what to change.

What lives in DRAM (the GPU's share is VRAM, checked elsewhere):
    non-expert weights and KV cache   on the CPU only (no CUDA device), in the compute dtype
    experts                           the hybrid layer: every expert packed once in the CPU dtype; a plain
                                      model on the CPU: every expert in the compute dtype
    lane buffers, ship-lane staging   the hybrid layer's host buffers (staging is DRAM without CUDA)
    loading                           what is read before it is placed: one MoE layer's expert stack (hybrid,
                                      where the experts are staged in a float stack first) or one tensor (the
                                      embedding, the largest; also where the compiled packer reads the experts
                                      in place, a row at a time)
    runtime                           torch's allocator, a prompt's activations, libraries: a margin

Available: MemAvailable (/proc/meminfo), or the process's cgroup limit less its working set when lower.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hybrid.errors import TooLarge

RUNTIME_MARGIN = 512 * 2**20  # allocator slack, a prompt's activations, libraries loaded later: a guess
NO_LIMIT = 2**60  # cgroup v1 writes ~2**63 for "no limit"


def gib(n: float) -> str:
    from placement.memory import gib as _gib

    return _gib(n)


@dataclass(frozen=True)
class DramNeed:
    """Bytes by part, in the order a message names them; parts of 0 bytes are left out of the message."""

    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)

    def describe(self) -> str:
        return ", ".join(f"{name} {gib(b)}" for name, b in self.parts if b)


def model_dram(cfg, on_cpu: bool, dtype_bytes: int, cpu_dtype: str | None, max_context: int,
               max_batch: int, down_dtypes: tuple[str, ...] = (), layer_dtypes: tuple[str, ...] = (),
               views: bool = False) -> DramNeed:
    """Peak DRAM of model `cfg` (a hybrid.models.ModelConfig) loaded for the session: compute dtype of
    `dtype_bytes`, on the CPU (no CUDA) or not, with the hybrid layer's experts in `cpu_dtype` (None: a plain
    model, every expert on the model's device) and the downs, or gates and ups, of some layers in dtypes of their own
    (`down_dtypes`, `layer_dtypes`: placement.memory.MemorySettings). views: the compiled packer converts the experts
    from the memory-mapped checkpoint (hybrid.offload.build.packs_views), so no layer's stack is staged."""
    from placement.memory import MemorySettings, breakdown

    mem = breakdown(cfg, MemorySettings(max_context=max_context, max_batch=max_batch, cpu_dtype=cpu_dtype or "bf16",
                                        gpu_dtype_bytes=dtype_bytes, reserve=0, down_dtypes=down_dtypes,
                                        layer_dtypes=layer_dtypes))
    D, F, E = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    one_tensor = cfg.vocab_size * D * 4  # the embedding, read (or de-quantized) in at most fp32
    parts = [("non-expert weights", mem.non_expert if on_cpu else 0), ("KV cache", mem.kv_cache if on_cpu else 0)]
    if cpu_dtype is None:
        experts = cfg.param_counts()["experts"] * dtype_bytes if on_cpu else 0
        parts += [(f"experts ({dtype_bytes * 8}-bit floats)", experts), ("loading", one_tensor)]
    else:
        # without views, hybrid.offload.build.load_hybrid reads a layer's experts in bf16 for bf16, mxfp4 as
        # published, else fp32; with them, nothing larger than a row per packing thread
        stack_bytes = {"bf16": 2.0, "mxfp4": 0.53125}.get(cpu_dtype, 4.0)
        stack = 0 if views else int(3 * E * D * F * stack_bytes)
        parts += [(f"experts ({cpu_dtype})", mem.dram_experts_all), ("lane buffers", mem.pinned_buffers),
                  ("ship-lane staging", mem.staging if on_cpu else 0), ("loading", max(stack, one_tensor))]
    parts.append(("runtime", RUNTIME_MARGIN))
    return DramNeed(tuple(parts))


def meminfo_available(path: str | os.PathLike = "/proc/meminfo") -> int:
    """MemAvailable in bytes: what the kernel can give without swapping (psutil's figure where there is no
    /proc/meminfo)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import psutil

    return int(psutil.virtual_memory().available)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2 without a limit) reads as None


def _inactive_file(stat: Path, key: str) -> int:
    """Page cache the kernel reclaims before it kills anything: not part of a cgroup's working set."""
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_headroom(proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                    root: str | os.PathLike = "/sys/fs/cgroup") -> int | None:
    """The smallest (limit - working set) over this process's memory cgroup and its parents, v2 or v1; None
    without a limit (or without cgroups)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root, best = Path(root), None
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":  # v2: one unified hierarchy
            base, files = root, ("memory.max", "memory.current", "memory.stat", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat",
                                            "total_inactive_file")
        else:
            continue
        node = base / path.strip("/")
        while True:  # from the process's own group up to the hierarchy's root
            limit, usage = _read_int(node / files[0]), _read_int(node / files[1])
            if limit is not None and usage is not None and limit < NO_LIMIT:
                left = max(0, limit - max(0, usage - _inactive_file(node / files[2], files[3])))
                best = left if best is None else min(best, left)
            if node == base:
                break
            node = node.parent
    return best


def available_dram() -> tuple[int, str]:
    """(bytes this process can still allocate, where that figure comes from)."""
    avail, source = meminfo_available(), "MemAvailable"
    head = cgroup_headroom()
    if head is not None and head < avail:
        return head, "its cgroup's memory limit"
    return avail, source


def check_dram_fits(need: DramNeed, what: str, change: str, available: tuple[int, str] | None = None) -> None:
    """One line (TooLarge, exit 2) when `need` is above the available memory: `what` needs ... ; `change`."""
    avail, source = available or available_dram()
    if need.total > avail:
        raise TooLarge(f"{what} needs about {gib(need.total)} of DRAM ({need.describe()}) and this machine has "
                       f"{gib(avail)} available ({source}); {change}")
