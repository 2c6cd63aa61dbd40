"""The one DRAM copy of a layer's experts, seen from the GPU side.

The CPU executor (cpu_kernels.CpuMoE) packs each expert once, per NUMA node, as row-major [rows_p, ldk]
matrices (zero padded; the first rows x k are the plain weight, in bf16, int8 + per-row scales,
packed int4 + group scales, packed mxfp4 codes + uint8 block exponents, q8_0's int8 + fp16 block scales, q4_0's
4-bit values + fp16 block scales, q4_k's
nibbles + super-block heads, q5_k's nibbles + heads with fifth bits, q2_k's 2-bit values + heads, q3_k's 3-bit values + heads, q6_k's 6-bit values + super-block heads, iq4_xs's codebook indices + heads, iq2_xxs's, iq3_xxs's and iq3_s's qs + fp16 d, iq1_s's qs and qh + fp16 d, or iq1_m's qs and qh + scales words). The ship lane and the resident-expert upload read exactly those bytes and
de-quantize on the GPU, so no second, GPU-friendly copy of the cold experts is kept in DRAM (DESIGN
section 3b, "one layout for both lanes"). With the `ref` ISA the executor keeps plain (de-quantized)
torch tensors instead; they are shipped as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("hybrid.offload")

@dataclass
class PackedMatrix:
    """One matrix kind (gate, up or down) of all E experts on one node: q [E, rows_p, cols] + scales."""

    q: torch.Tensor  # bf16 [E, rows_p, ldk] | int8 [E, rows_p, ldk] | uint8 [E, rows_p, ldk/2] | float plain
    scale: torch.Tensor | None  # int8: [E, rows_p]; int4: [E, rows_p, ldk/group]; mxfp4: uint8 [E, rows_p, ldk/32];
    # q8_0, q4_0: fp16 [E, rows_p, ldk/32]; q4_k: uint8 heads [E, rows_p, ldk/256, 16]; q5_k 48, q6_k 18, q2_k 20, q3_k 14,
    # iq4_xs 8, iq2_xxs 2, iq3_xxs 2, iq3_s 2, iq1_s 2, iq1_m 8 bytes
    rows: int
    k: int
    kind: str  # "bf16" | "int8" | "int4" | "mxfp4" | "q8_0" | "q4_0" | "q2_k" | "q3_k" | "q4_k" | "q5_k" | "q6_k" | "iq4_xs" | "iq2_xxs" | "iq3_xxs" | "iq3_s" | "iq1_s" | "iq1_m" | "plain"
    group: int = 0
    fold: int = 0  # int4: groups per fold block of the stored order (cpu_kernels/quant.py); 0: the default

    def expert_bytes(self) -> int:
        n = self.q[0].numel() * self.q.element_size()
        return n + (self.scale[0].numel() * self.scale.element_size() if self.scale is not None else 0)

    def decode(self, q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """One expert's packed bytes (anywhere, typically staged on the GPU) -> plain [rows, k] in dtype."""
        from cpu_kernels import quant

        if self.kind in ("bf16", "plain"):
            w = q
        elif self.kind == "int4":
            w = quant.dequantize_int4(q, scale, self.group, self.fold or None)
        else:
            w = quant.packed_dequantizers()[self.kind](q, scale)
        return w[: self.rows, : self.k].to(dtype)


@dataclass
class NodeSlice:
    """Rows f0:f1 of the intermediate dimension F, held by one NUMA node."""

    f0: int
    f1: int
    gate: PackedMatrix  # [F_n, D]
    up: PackedMatrix  # [F_n, D]
    down: PackedMatrix  # [D, F_n]
    block: torch.Tensor | None = None  # [E, bytes] uint8: expert e's gate | up | down q bytes (not `ref`)

    def mats(self):
        return (self.gate, self.up, self.down)

    def whole_block(self) -> bool:
        """Whether block[e] is exactly gate.q[e], up.q[e], down.q[e] back to back (one copy moves them)."""
        if self.block is None:
            return False
        at = self.block.data_ptr()
        for m in self.mats():
            if m.q.data_ptr() != at:
                return False
            at += m.q[0].numel() * m.q.element_size()
        return at - self.block.data_ptr() == self.block.shape[1]


def packed_sources(moe) -> list[NodeSlice]:
    """The executor's packed weights as tensor views (no copies), node by node (CpuMoE.packed_weights)."""
    out = []
    for node in moe.packed_weights():
        mats = [PackedMatrix(m["q"], m["scale"], m["rows"], m["k"], m["dtype"], m["group"], m.get("fold", 0))
                for m in (node["gate"], node["up"], node["down"])]
        out.append(NodeSlice(node["f0"], node["f1"], *mats, block=node.get("block")))
    return out


def expert_weights(sources: list[NodeSlice], e: int, device, dtype: torch.dtype, non_blocking: bool = False):
    """Expert e's (gate [F, D], up [F, D], down [D, F]) in dtype on `device`, de-quantized from the packed
    copy; node slices of F are joined. non_blocking: the copies do not make the host wait (pinned source)."""
    parts = []
    for ns in sources:
        mats = []
        for m in ns.mats():
            q = m.q[e].to(device, non_blocking=non_blocking)
            s = None if m.scale is None else m.scale[e].to(device, non_blocking=non_blocking)
            mats.append(m.decode(q, s, dtype))
        parts.append(mats)
    if len(parts) == 1:
        return tuple(p.contiguous() for p in parts[0])
    return (torch.cat([p[0] for p in parts], 0), torch.cat([p[1] for p in parts], 0), torch.cat([p[2] for p in parts], 1))


def pin(tensors: list[torch.Tensor]) -> list[int]:
    """Page-lock host tensors in place (cudaHostRegister) so DMA reads them at full link speed.

    Returns the registered pointers; the caller must `unpin` them before the memory is freed (the
    allocator reuses freed ranges, and registering a range twice fails). Failure is loud, not fatal:
    transfers then run from pageable memory (measured ~18 GB/s on the GPU box instead of ~55).
    """
    if not torch.cuda.is_available():
        return []
    cudart = torch.cuda.cudart()
    ranges = {}  # whole storages, once each: several views (gate, up, down of one block) share one
    for t in tensors:
        if t is not None and not t.is_pinned():
            st = t.untyped_storage()
            ranges[st.data_ptr()] = st.nbytes()
    done = []
    for ptr, n in ranges.items():
        rc = cudart.cudaHostRegister(ptr, n, 0)
        if int(rc) != 0:
            cudart.cudaGetLastError()  # clear it, or the next unrelated CUDA call reports it
            log.warning("cudaHostRegister of %.1f MiB failed (error %s): shipping from pageable memory", n / 2**20, rc)
            continue
        done.append((ptr, n))
    return done


def unpin(registered: list) -> None:
    if not registered or not torch.cuda.is_available():
        return
    cudart = torch.cuda.cudart()
    for ptr, _ in registered:
        if int(cudart.cudaHostUnregister(ptr)) != 0:
            cudart.cudaGetLastError()
    registered.clear()
