"""The two lanes that serve cold experts, shared by every hybrid MoE layer of a model.

CpuLane: the batch's rows, routing ids and weights go device->host into pinned buffers, a worker thread
waits for that copy and runs the CPU executor on the CPU-lane experts (an expert mask), and the summed
outputs come back host->device. The GPU keeps working (resident and shipped experts) meanwhile.

ShipLane: a small pool of VRAM staging slots. An expert's packed weights are copied host->device on a
copy stream into a free slot, de-quantized there, and computed on the compute stream; each slot is
reused only after the compute that read it has finished (events), so transfers pipeline with compute.

On a machine without CUDA both lanes still run (torch on the CPU plays the GPU; copies are plain
copies), so CI exercises the same code and the same decisions.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

from hybrid.offload.sources import NodeSlice


class CpuLane:
    def __init__(self, device: torch.device, max_rows: int = 256):
        self.device = device
        self.cuda = device.type == "cuda"
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-lane")
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.pinned_bytes = 0

    def _buf(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host buffer that grows to the largest batch seen (bounded by the batch size)."""
        key = (name, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols:
            if buf is not None and buf.is_pinned():
                self.pinned_bytes -= buf.numel() * buf.element_size()
            cap = max(rows, 2 * (buf.shape[0] if buf is not None else 0))
            buf = torch.empty(cap, cols, dtype=dtype, pin_memory=self.cuda)
            self.pinned_bytes += buf.numel() * buf.element_size() if self.cuda else 0
            self._bufs[key] = buf
        return buf[:rows]

    def submit(self, moe, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor):
        """Start the CPU experts of `mask` (bool [E], host) on x [T, D]; returns a future of out [T, D] (host)."""
        T, D = x.shape
        K = ids.shape[1]
        if not self.cuda:  # tensors already live on the host: hand them over as they are
            xh, ih, wh = x.contiguous(), ids.contiguous(), weights.float().contiguous()
            oh = torch.empty_like(xh)
            return self._pool.submit(moe.forward, xh, ih, wh, mask, oh)
        xh = self._buf("x", T, D, x.dtype)
        ih = self._buf("ids", T, K, torch.int64)
        wh = self._buf("w", T, K, torch.float32)
        oh = self._buf("out", T, D, x.dtype)
        xh.copy_(x, non_blocking=True)
        ih.copy_(ids, non_blocking=True)
        wh.copy_(weights, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()

        def run():
            ready.synchronize()  # the rows are on the host
            return moe.forward(xh, ih, wh, expert_mask=mask, out=oh)

        return self._pool.submit(run)

    def collect(self, future) -> torch.Tensor:
        """Wait for the CPU experts; their summed output [T, D] on the device (ordered on this stream)."""
        out = future.result()
        return out.to(self.device, non_blocking=True)


@dataclass
class _Slot:
    raw: list  # per node, per matrix: (q buffer, scale buffer | None) on the device
    ready: object  # torch.cuda.Event | None
    free: object


class ShipLane:
    """VRAM staging slots for shipped experts; `n_slots` bounds the VRAM this lane uses."""

    def __init__(self, device: torch.device, n_slots: int = 4):
        if n_slots < 1:
            raise ValueError("the ship lane needs at least one staging slot")
        self.device = device
        self.cuda = device.type == "cuda"
        self.n_slots = n_slots
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._slots: list[_Slot] | None = None
        self._layout = None
        self._next = 0
        self.vram_bytes = 0

    def _ensure(self, sources: list[NodeSlice]) -> None:
        layout = [tuple((tuple(m.q.shape[1:]), m.q.dtype, None if m.scale is None else
                         (tuple(m.scale.shape[1:]), m.scale.dtype)) for m in ns.mats()) for ns in sources]
        if layout == self._layout:
            return
        if self._layout is not None:
            raise ValueError("all hybrid layers of a model must share one packed expert layout")
        self._layout = layout
        slots = []
        for _ in range(self.n_slots):
            raw = []
            for ns in sources:
                mats = []
                for m in ns.mats():
                    q = torch.empty(m.q.shape[1:], dtype=m.q.dtype, device=self.device)
                    s = None if m.scale is None else torch.empty(m.scale.shape[1:], dtype=m.scale.dtype,
                                                                 device=self.device)
                    self.vram_bytes += q.numel() * q.element_size() + (0 if s is None else s.numel() * s.element_size())
                    mats.append((q, s))
                raw.append(mats)
            ev = (torch.cuda.Event(), torch.cuda.Event()) if self.cuda else (None, None)
            slots.append(_Slot(raw, *ev))
        self._slots = slots

    def fetch(self, sources: list[NodeSlice], e: int):
        """Start copying expert e's packed weights into the next slot; returns the slot."""
        self._ensure(sources)
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.n_slots
        if not self.cuda:
            for ns, mats in zip(sources, slot.raw):
                for m, (q, s) in zip(ns.mats(), mats):
                    q.copy_(m.q[e])
                    if s is not None:
                        s.copy_(m.scale[e])
            return slot
        self.copy_stream.wait_event(slot.free)  # the compute that last read this slot is done
        with torch.cuda.stream(self.copy_stream):
            for ns, mats in zip(sources, slot.raw):
                for m, (q, s) in zip(ns.mats(), mats):
                    q.copy_(m.q[e], non_blocking=True)
                    if s is not None:
                        s.copy_(m.scale[e], non_blocking=True)
            slot.ready.record(self.copy_stream)
        return slot

    def weights(self, sources: list[NodeSlice], slot: _Slot, dtype: torch.dtype):
        """(gate [F, D], up [F, D], down [D, F]) in dtype from a fetched slot, on the compute stream."""
        if self.cuda:
            torch.cuda.current_stream().wait_event(slot.ready)
        parts = [[m.decode(q, s, dtype) for m, (q, s) in zip(ns.mats(), mats)] for ns, mats in zip(sources, slot.raw)]
        if len(parts) == 1:
            return tuple(parts[0])
        return (torch.cat([p[0] for p in parts], 0), torch.cat([p[1] for p in parts], 0),
                torch.cat([p[2] for p in parts], 1))

    def release(self, slot: _Slot) -> None:
        """Mark the slot reusable once the compute enqueued so far (which read it) has run."""
        if self.cuda:
            slot.free.record()
