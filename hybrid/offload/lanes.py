"""The two lanes that serve cold experts, shared by every hybrid MoE layer of a model.

CpuLane (the worker-thread CPU lane: a CPU device or the `ref` ISA; on CUDA with a compiled kernel the CPU
lane is hybrid.offload.host_lane.HostFnLane): the batch's rows, routing ids and weights
go device->host into pinned buffers, a worker thread waits for that copy and runs the CPU executor on the
CPU-lane experts (an expert mask), and the summed outputs come back host->device. The GPU keeps working
(resident and shipped experts) meanwhile.

ShipLane: a small pool of VRAM staging slots. An expert's packed weights are copied host->device on a
copy stream into a free slot, de-quantized there, and computed on the compute stream; each slot is
reused only after the compute that read it has finished (events), so transfers pipeline with compute.

On a machine without CUDA both lanes still run (torch on the CPU plays the GPU; copies are plain
copies), so CI exercises the same code and the same decisions.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from dataclasses import dataclass

import torch

from hybrid.offload.sources import NodeSlice


class HostBuffers:
    """Named host buffers that grow to the largest batch seen (page-locked when `pin`), used by the worker
    CPU lane and the host-function lane (hybrid.offload.host_lane). keep_old: a replaced buffer stays alive (a captured graph may still point at it)."""

    def __init__(self, pin: bool, keep_old: bool = False, min_rows: int = 1):
        self.pin, self.keep_old, self.min_rows = pin, keep_old, min_rows
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._old: list[torch.Tensor] = []
        self.pinned_bytes = 0

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        """[rows, cols] view of the buffer `name` (on `device` if given, else on the host)."""
        key = (name, dtype, device, cols)  # a lane used with two widths (expert deferral) keeps both
        buf = self._bufs.get(key)
        if buf is None or buf.shape[0] < rows:
            on_host = device is None
            if buf is not None:
                if self.keep_old:
                    self._old.append(buf)
                elif on_host and self.pin:
                    self.pinned_bytes -= buf.numel() * buf.element_size()
            cap = max(rows, self.min_rows, 2 * (buf.shape[0] if buf is not None else 0))
            if on_host:
                buf = torch.empty(cap, cols, dtype=dtype, pin_memory=self.pin)
                self.pinned_bytes += buf.numel() * buf.element_size() if self.pin else 0
            else:
                buf = torch.empty(cap, cols, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:rows]


class CpuLane:
    def __init__(self, device: torch.device, pin_cpus: set[int] | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        init = (lambda: os.sched_setaffinity(0, pin_cpus)) if pin_cpus else None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-lane",
                                                           initializer=init)
        self.bufs = HostBuffers(pin=self.cuda)  # bounded by the largest batch

    @property
    def pinned_bytes(self) -> int:
        return self.bufs.pinned_bytes

    def submit(self, moe, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor):
        """Start the CPU experts of `mask` (bool [E], host) on x [T, D]; returns a future of out [T, D] (host)."""
        T, D = x.shape
        K = ids.shape[1]
        if not self.cuda:  # tensors already live on the host: hand them over as they are
            xh, ih, wh = x.contiguous(), ids.contiguous(), weights.float().contiguous()
            oh = torch.empty_like(xh)
            return self._pool.submit(moe.forward, xh, ih, wh, mask, oh)
        xh = self.bufs.get("x", T, D, x.dtype)
        ih = self.bufs.get("ids", T, K, torch.int64)
        wh = self.bufs.get("w", T, K, torch.float32)
        oh = self.bufs.get("out", T, D, x.dtype)
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
        return future.result().to(self.device, non_blocking=True)


_ALIGN = 64  # byte offset of each matrix's bytes within a sub-slot's raw buffer


@dataclass(frozen=True)
class _Layout:
    """How one layer's packed experts sit in a staging sub-slot. Layers may differ (a GGUF file's layers keep
    their own formats, e.g. a Q4_K_M file's q6_k downs in some layers beside q4_k downs in others): each layout
    is carved out of the same raw byte buffers, sized to the largest layout seen."""

    direct: bool  # the packed bytes are the dense weights: copied straight into the dense chunk, no raw bytes
    one_copy: bool  # ...and the executor keeps an expert's three matrices back to back (one copy per expert)
    parts: tuple  # per node, per matrix: ((offset, shape, dtype) of q, (offset, shape, dtype) of scale | None)
    nbytes: int  # raw bytes one expert takes (0 when direct)


@dataclass
class _Slot:
    raw: list  # per sub-slot (expert): a uint8 buffer on the device holding one expert's packed bytes
    dense: list  # (gate [c, F, D], up [c, F, D], down [c, D, F]) in the compute dtype, filled by decode
    ready: object  # torch.cuda.Event | None
    free: object
    experts: list  # experts held, in sub-slot order
    block: torch.Tensor | None = None  # one-copy layout: [c, 3 F D], dense are views of it
    layout: _Layout | None = None  # the layout of the experts held (set by fetch)
    views: dict | None = None  # layout -> per sub-slot, per node, per matrix: (q view, scale view | None)


def _layout(sources: list[NodeSlice], dtype: torch.dtype) -> _Layout:
    direct = (len(sources) == 1 and all(m.kind in ("bf16", "plain") and m.q.dtype == dtype
                                        and tuple(m.q.shape[1:]) == (m.rows, m.k) for m in sources[0].mats()))
    if direct:
        return _Layout(True, sources[0].whole_block(), (), 0)
    off, parts = 0, []

    def place(t: torch.Tensor):
        nonlocal off
        at = off
        off += -(-t[0].numel() * t.element_size() // _ALIGN) * _ALIGN
        return at, tuple(t.shape[1:]), t.dtype

    for ns in sources:
        parts.append(tuple((place(m.q), None if m.scale is None else place(m.scale)) for m in ns.mats()))
    return _Layout(False, False, tuple(parts), off)


class ShipLane:
    """VRAM staging for shipped experts: `n_slots` chunks of `chunk` experts each (bounds the VRAM).

    Experts travel in chunks so that the GPU runs one grouped GEMM per chunk instead of one launch
    sequence per expert: per-launch host overhead (~10-30 us on the GPU box) would otherwise cost more
    than a 30B expert's transfer.
    """

    def __init__(self, device: torch.device, n_slots: int = 3, chunk: int = 8):
        if n_slots < 1 or chunk < 1:
            raise ValueError("the ship lane needs at least one staging slot of at least one expert")
        self.device = device
        self.cuda = device.type == "cuda"
        self.n_slots, self.chunk = n_slots, chunk
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._slots: list[_Slot] | None = None
        self._layouts: dict = {}  # a layer's layout key -> _Layout
        self._dense = None  # (dims, dtype) the dense chunks were made for
        self._raw_cap = 0  # bytes of each sub-slot's raw buffer
        self._next = 0
        self.vram_bytes = 0
        self._last: _Slot | None = None  # the slot fetched last

    def _alloc(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self.vram_bytes += t.numel() * t.element_size()
        return t

    def _ensure(self, sources: list[NodeSlice], dims, dtype) -> _Layout:
        key = tuple(tuple((tuple(m.q.shape[1:]), m.q.dtype, m.kind, None if m.scale is None else
                           (tuple(m.scale.shape[1:]), m.scale.dtype)) for m in ns.mats()) for ns in sources)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _layout(sources, dtype)
        if self._slots is None:
            self._make_slots(layout, dims, dtype)
        elif self._dense != (tuple(dims), dtype):
            raise ValueError(f"the ship lane's experts are {self._dense[0]} in {self._dense[1]}; a layer with "
                             f"{tuple(dims)} in {dtype} cannot share it")
        if layout.nbytes > self._raw_cap:
            self._grow_raw(layout.nbytes)
        return layout

    @property
    def direct(self) -> bool:
        """The chunk fetched last was copied straight into the dense weights (no raw bytes)."""
        return self._last is not None and self._last.layout.direct

    @property
    def one_copy(self) -> bool:
        """The chunk fetched last moved each expert in one copy into the staging block."""
        return self._last is not None and self._last.layout.one_copy and self._last.block is not None

    def _make_slots(self, layout: _Layout, dims, dtype) -> None:
        F_, D = dims
        self._dense = (tuple(dims), dtype)
        slots = []
        for _ in range(self.n_slots):
            block = None
            if layout.one_copy:
                block = self._alloc((self.chunk, 3 * F_ * D), dtype)  # [c, gate | up | down]
                dense = [block[:, :F_ * D].view(self.chunk, F_, D), block[:, F_ * D:2 * F_ * D].view(self.chunk, F_, D),
                         block[:, 2 * F_ * D:].view(self.chunk, D, F_)]
            else:
                dense = [self._alloc((self.chunk, F_, D), dtype), self._alloc((self.chunk, F_, D), dtype),
                         self._alloc((self.chunk, D, F_), dtype)]
            ev = (torch.cuda.Event(), torch.cuda.Event()) if self.cuda else (None, None)
            slots.append(_Slot([], dense, *ev, [], block, views={}))
        self._slots = slots

    def _grow_raw(self, nbytes: int) -> None:
        """Raw buffers of `nbytes` per sub-slot. Growing after use waits for every copy and compute that may
        still read the old buffers (a model whose layers differ in layout grows once per larger layout)."""
        if self._raw_cap and self.cuda:
            torch.cuda.synchronize(self.device)
        for slot in self._slots:
            self.vram_bytes -= sum(b.numel() for b in slot.raw)
            slot.raw = [self._alloc((nbytes,), torch.uint8) for _ in range(self.chunk)]
            slot.views = {}
        self._raw_cap = nbytes

    def _views(self, slot: _Slot, layout: _Layout) -> list:
        """Per sub-slot, per node, per matrix: (q, scale | None) views of the slot's raw buffers in `layout`."""
        v = slot.views.get(layout)
        if v is None:
            def view(buf, part):
                if part is None:
                    return None
                off, shape, dt = part
                n = dt.itemsize
                for d in shape:
                    n *= d
                return buf[off:off + n].view(dt).view(shape)

            v = slot.views[layout] = [[[(view(buf, q), view(buf, sc)) for q, sc in node] for node in layout.parts]
                                      for buf in slot.raw]
        return v

    def fetch(self, sources: list[NodeSlice], experts: list[int], dims, dtype):
        """Start copying up to `chunk` experts' packed weights into the next slot; returns the slot."""
        if len(experts) > self.chunk:
            raise ValueError(f"at most {self.chunk} experts per chunk")
        layout = self._ensure(sources, dims, dtype)
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.n_slots
        slot.experts, slot.layout = list(experts), layout
        self._last = slot
        raw = None if layout.direct else self._views(slot, layout)
        one_copy = layout.one_copy and slot.block is not None
        if self.cuda:
            self.copy_stream.wait_event(slot.free)  # the compute that last read this slot is done
            ctx = torch.cuda.stream(self.copy_stream)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            for j, e in enumerate(experts):
                if one_copy:
                    slot.block[j].copy_(sources[0].block[e].view(slot.block.dtype), non_blocking=self.cuda)
                    continue
                if layout.direct:
                    for m, dst in zip(sources[0].mats(), slot.dense):
                        dst[j].copy_(m.q[e], non_blocking=self.cuda)
                    continue
                for ns, mats in zip(sources, raw[j]):
                    for m, (q, s) in zip(ns.mats(), mats):
                        q.copy_(m.q[e], non_blocking=self.cuda)
                        if s is not None:
                            s.copy_(m.scale[e], non_blocking=self.cuda)
            if self.cuda:
                slot.ready.record(self.copy_stream)
        return slot

    def weights(self, sources: list[NodeSlice], slot: _Slot, dtype: torch.dtype):
        """(gate [c, F, D], up [c, F, D], down [c, D, F]) of a fetched chunk, ready on the compute stream."""
        if self.cuda:
            torch.cuda.current_stream().wait_event(slot.ready)
        c = len(slot.experts)
        if not slot.layout.direct:  # de-quantize / un-pad each node's slice into the dense chunk
            raw = self._views(slot, slot.layout)
            for j in range(c):
                for ns, mats in zip(sources, raw[j]):
                    f = slice(ns.f0, ns.f1)
                    for i, (m, (q, s)) in enumerate(zip(ns.mats(), mats)):
                        w = m.decode(q, s, dtype)
                        if i < 2:
                            slot.dense[i][j, f] = w
                        else:
                            slot.dense[i][j, :, f] = w
        return tuple(t[:c] for t in slot.dense)

    def release(self, slot: _Slot) -> None:
        """Mark the slot reusable once the compute enqueued so far (which read it) has run."""
        if self.cuda:
            slot.free.record()

