"""Report: the status lines of a hybrid model once its experts are placed. They name who plays the GPU's part
(hybrid.runtime.device_role): without CUDA there is no VRAM and no PCIe, so the lines say what the figures
are on this machine instead."""

from __future__ import annotations

from hybrid.runtime.device_role import CPU_ONLY_NOTE, is_cuda


def report_placement(model, offload, how: str, log=print) -> None:
    """how: resident experts per layer as `place` returns it."""
    mem = offload.memory()
    if is_cuda(offload.device):
        log(f"hybrid: {how} of {model.cfg.num_experts} experts resident per MoE layer ({len(offload.layers)} layers); "
            f"schedule {offload.scheduler.strategy}, CPU {offload.layers[0].cpu_moe.isa} {offload.cpu_dtype}, "
            f"profile {offload.profile_name}; DRAM experts {mem['dram_expert_bytes'] / 2**30:.2f} GiB, pinned "
            f"{mem['pinned_bytes'] / 2**30:.2f} GiB, VRAM resident {mem['vram_resident_bytes'] / 2**30:.2f} GiB")
    else:
        log(f"hybrid: {CPU_ONLY_NOTE}")
        log(f"hybrid: {how} of {model.cfg.num_experts} experts 'resident' (torch on the CPU) per MoE layer "
            f"({len(offload.layers)} layers); schedule {offload.scheduler.strategy} priced with profile "
            f"{offload.profile_name}'s GPU and link figures (not this machine's), CPU executor "
            f"{offload.layers[0].cpu_moe.isa} {offload.cpu_dtype}; DRAM: experts "
            f"{mem['dram_expert_bytes'] / 2**30:.2f} GiB + 'resident' torch copies "
            f"{mem['vram_resident_bytes'] / 2**30:.2f} GiB")


def report_gpu_weights(model, log=print) -> None:
    """One line: each non-expert part's GPU dtype and bytes (hybrid.models.gpu_weights), when any is quantized."""
    from hybrid.models.gpu_weights import PARTS, matrices
    from hybrid.models.qweight import QWeight

    kinds: dict[str, set] = {}
    sizes: dict[str, int] = {}
    for module, attr, _, part in matrices(model):
        w = getattr(module, attr)
        q = isinstance(w, QWeight)
        kinds.setdefault(part, set()).add(w.kind if q else str(w.dtype).replace("torch.", ""))
        sizes[part] = sizes.get(part, 0) + (w.nbytes if q else w.numel() * w.element_size())
    if not any(isinstance(getattr(m, a), QWeight) for m, a, _, _ in matrices(model)):
        return
    from placement.memory import gib

    parts = ", ".join(f"{p} {'/'.join(sorted(kinds[p]))} {gib(sizes[p])}" for p in PARTS if p in sizes)
    log(f"GPU weights: {parts}")
