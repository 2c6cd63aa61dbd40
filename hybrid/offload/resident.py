"""Resident experts held quantized in VRAM (int8 or int4, hybrid.models.qweight's formats): two to four times as
many experts on the card as bf16 copies in the same bytes.

Each resident expert is quantized on the GPU from the CPU executor's packed copy, de-quantized (the same values
every lane computes with), gate and up stacked into one [2F, D] matrix so a routed row reads both in one kernel.
An int8 or int4 resident therefore adds its own rounding on top of the CPU dtype's (none where the CPU dtype is
int4 in groups of 128 and the residents int4: the same levels and scales come back); DESIGN.md, Resident experts.

Two ways to run them:
- routed rows with their slots (captured decode, small eager batches): the gathered GEMV
  (hybrid.gpu_kernels.expert_qgemv), which reads only the quantized bytes of the experts a row was routed to;
- grouped rows (eager batches past GATHER_ROWS, prefill): the experts with rows de-quantized a few at a time
  (at most DEQUANT_CHUNK_VALUES values, which placement.memory counts) into bf16 and run as a grouped GEMM.
On the CPU (tests, CPU runs) without Triton's interpreter both fall back to de-quantizing per expert.
"""

from __future__ import annotations

import numpy as np
import torch

from hybrid.models.config import ExpertFn
from hybrid.models.moe import gated
from hybrid.models.qweight import DEQUANT_CHUNK_VALUES, GROUP, QWeight, q_dtype, q_shape, quantize_rows, scale_shape

RESIDENT_KINDS = ("bf16", "int8", "int4")
GATHER_ROWS = 64  # routed rows up to which the gathered GEMV runs (decode: batch x top-k)


class QuantStack:
    """R matrices [n, k] in one quantized format: q [R, *q_shape], scale [R, *scale_shape] (contiguous)."""

    def __init__(self, kind: str, R: int, n: int, k: int, device, group: int = GROUP):
        if kind not in ("int8", "int4"):
            raise ValueError(f"resident experts are held as int8 or int4, got {kind!r}")
        self.kind, self.n, self.k, self.group = kind, n, k, group
        self.q = torch.empty((R, *q_shape(kind, n, k)), dtype=q_dtype(kind), device=device)
        self.scale = torch.empty((R, *scale_shape(kind, n, k, group)), dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4

    @torch.no_grad()
    def set_(self, r: int, w: torch.Tensor) -> None:
        """Slot r <- w [n, k] quantized (on the stack's device)."""
        q, s = quantize_rows(w.to(self.q.device), self.kind, self.group)
        self.q[r].copy_(q)
        self.scale[r].copy_(s)

    def matrix(self, r: int) -> QWeight:
        """Slot r as a QWeight viewing the stack's bytes (no copy)."""
        w = QWeight(self.kind, self.n, self.k, device="meta", group=self.group)
        w.q, w.scale = self.q[r], self.scale[r]
        return w

    def dequantize(self, r: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot r's [n, k] in dtype (the GPU's de-quantizing kernel on CUDA; QWeight.dequantize elsewhere)."""
        w = self.matrix(r)
        if w.device.type == "cuda":
            from hybrid.gpu_kernels.qgemv import dequantize_rows

            return dequantize_rows(w, 0, self.n, dtype)
        return w.dequantize(dtype)

    def linear(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor | None:
        """x [M, k] through each row's slot -> [M, n] (zero rows where slot >= R), or None where the gathered
        kernel declines (the caller de-quantizes)."""
        from hybrid.gpu_kernels import expert_qgemv

        if not expert_qgemv.supported(x, self.q, self.scale, self.kind, self.group):
            return None
        return expert_qgemv.gathered_qlinear(x, slot, self.q, self.scale, self.kind, self.group, self.n)


class QuantResidents:
    """One layer's R resident experts: gate_up [R, 2F, D] and down [R, D, F] as QuantStacks."""

    def __init__(self, kind: str, R: int, F: int, D: int, device, group: int = GROUP):
        self.kind, self.F, self.D = kind, F, D
        self.gate_up = QuantStack(kind, R, 2 * F, D, device, group)
        self.down = QuantStack(kind, R, D, F, device, group)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def set_(self, r: int, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
        self.gate_up.set_(r, torch.cat([w_gate, w_up]))
        self.down.set_(r, w_down)

    def weights(self, r: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slot r de-quantized: (gate [F, D], up [F, D], down [D, F]) in dtype."""
        gu = self.gate_up.dequantize(r, dtype)
        return gu[:self.F], gu[self.F:], self.down.dequantize(r, dtype)

    def routed(self, rows: torch.Tensor, slot: torch.Tensor, fn: ExpertFn, biases=None) -> torch.Tensor | None:
        """rows [M, D], each through expert slot[m] (slot >= R: a zero row) -> [M, D], no host sync; None where the
        gathered kernel declines. biases: (b_gate [R, F], b_up [R, F], b_down [R, D]) in slot order, or None."""
        gu = self.gate_up.linear(rows, slot)
        if gu is None:
            return None
        g, u = gu[:, :self.F], gu[:, self.F:]
        if biases is not None:
            b = [t[slot.clamp(max=t.shape[0] - 1)] for t in biases]
            g, u = g + b[0].to(g.dtype), u + b[1].to(u.dtype)
        y = self.down.linear(gated(fn, g, u).contiguous(), slot)
        if y is None:
            return None
        return y if biases is None else y + b[2].to(y.dtype)

    def grouped(self, rows: torch.Tensor, counts, slots, fn: ExpertFn, biases, run_grouped) -> torch.Tensor:
        """rows [n, D] sorted by expert (counts[i] rows for slot slots[i]) -> [n, D]: the gathered GEMV up to
        GATHER_ROWS rows, else the experts de-quantized a chunk at a time into run_grouped(rows, counts, g, u, d,
        fn, biases) (HybridExperts._grouped). biases: in slot order for all R slots, or None."""
        counts = np.asarray(counts, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        n = int(counts.sum())
        if n <= GATHER_ROWS:
            slot = torch.from_numpy(np.repeat(slots, counts)).to(rows.device, non_blocking=True)
            y = self.routed(rows, slot, fn, biases)
            if y is not None:
                return y
        out = torch.empty_like(rows)
        per = max(1, DEQUANT_CHUNK_VALUES // (3 * self.F * self.D))  # experts de-quantized at once
        a = 0
        for c in range(0, len(slots), per):
            ids, cnt = slots[c:c + per], counts[c:c + per]
            m = int(cnt.sum())
            if m:
                parts = [self.weights(int(r), rows.dtype) for r in ids]
                # one expert (a large one: DEQUANT_CHUNK_VALUES holds no two) as views, without stack's copy, where
                # the up half's offset keeps the 16-byte alignment grouped GEMMs want
                views = len(parts) == 1 and self.F * self.D * rows.element_size() % 16 == 0
                g, u, d = (t[0][None] for t in zip(*parts)) if views else map(torch.stack, zip(*parts))
                idx = None if biases is None else torch.from_numpy(ids).to(rows.device)
                b = None if biases is None else tuple(t[idx] for t in biases)
                out[a:a + m] = run_grouped(rows[a:a + m], cnt, g, u, d, fn, b)
            a += m
        return out
