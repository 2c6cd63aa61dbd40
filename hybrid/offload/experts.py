"""HybridExperts: one MoE layer's expert executor split across the GPU, the CPU lane and the ship lane.

Implements the executor contract of hybrid.models.moe (experts(x [T, D], topk_ids [T, K], topk_weights
[T, K]) -> [T, D]). Per batch: the histogram of tokens per expert is read on the host, the scheduler
splits the cold experts with tokens between the CPU lane and the ship lane (placement.schedule), the
CPU lane is started first, the GPU then runs the resident experts and, as their weights arrive, the
shipped ones; the CPU lane's summed output is added last. Partial outputs are merged in fp32.

Every expert's weights exist once in DRAM, inside the CPU executor (packed, maybe quantized); resident
and shipped experts are de-quantized from those same bytes, so an expert computes the same function
whichever lane runs it.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from hybrid.models.config import ExpertFn
from hybrid.models.moe import SILU, expert_forward, grouped_mm_works, grouped_swiglu
from hybrid.offload.packed_cache import LoadTimes
from hybrid.offload.resident import QuantResidents
from hybrid.offload.sources import expert_weights, packed_sources, pin, unpin

if TYPE_CHECKING:
    from hybrid.offload.packed_cache import PackedCache
    from hybrid.offload.shared import Offload


@dataclass
class LayerStats:
    """Running counters of one layer's decisions (what /metrics and the benchmarks report)."""

    batches: int = 0
    tokens: int = 0
    cpu_experts: int = 0  # cold experts with tokens run on the CPU lane
    shipped_experts: int = 0
    resident_experts: int = 0  # resident experts that received tokens
    decide_s: float = 0.0
    predicted_s: float = 0.0
    cpu_lane_calls: int = 0  # eager calls that used the CPU lane
    cpu_lane_start_s: float = 0.0  # summed seconds from their start to the CPU lane enqueued (calibration)
    routed: np.ndarray | None = field(default=None, repr=False)  # tokens per expert, cumulative [E]

    @property
    def cpu_share(self) -> float:
        n = self.cpu_experts + self.shipped_experts
        return self.cpu_experts / n if n else 0.0


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor to the device without a pageable copy: a pageable host->device copy is staged
    by the driver and can wait behind other work of the context (a running host function, say); a pinned
    block from torch's caching host allocator is reused only after its copy has run."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def _grouped_ok(rows: torch.Tensor) -> bool:
    # torch._grouped_mm wants 16-byte aligned rows; tiny test shapes take the loop.
    return rows.shape[1] * rows.element_size() % 16 == 0 and grouped_mm_works(rows.device, rows.dtype)


def add_resident_captured(out, x, topk_ids, topk_weights, rank, R: int, grouped) -> None:
    """Captured decode's resident experts, no host sync: out [T, D] fp32 += each resident assignment's
    weighted output. rank [E]: resident slot of each expert, R for cold. Assignments are sorted by slot and
    grouped(rows [T*K, D], offs [R] int32) computes only the first offs[-1] rows; the cold rows after them
    hold whatever the GEMM left there, so the keep mask must drop exactly them (tests/test_hybrid_layer.py
    checks this on the CPU)."""
    K = topk_ids.shape[1]
    r = rank[topk_ids.reshape(-1)]  # [T*K] resident slot, R = cold
    order = torch.argsort(r, stable=True)
    counts = torch.zeros(R + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, r, torch.ones_like(r, dtype=torch.int32))
    offs = counts[:R].cumsum(0, dtype=torch.int32)  # rows past offs[-1] (cold) are not computed
    token = order // K
    y = grouped(x[token], offs)  # [T*K, D]
    keep = (r[order] < R)[:, None]
    wts = topk_weights.reshape(-1)[order].float()[:, None]
    out.index_add_(0, token, torch.where(keep, y.float() * wts, 0.0))


def row_groups(counts, cap: int) -> list[tuple[int, int]]:
    """[(i0, i1)] consecutive ranges of `counts` (rows per expert) whose sums stay within `cap` (a range of one
    expert may exceed it), covering every index."""
    out, i0, rows = [], 0, 0
    for i, c in enumerate(np.asarray(counts).tolist()):
        if i > i0 and rows + c > cap:
            out.append((i0, i))
            i0, rows = i, 0
        rows += c
    if len(counts):
        out.append((i0, len(counts)))
    return out


def add_resident_routed(out, x, topk_ids, topk_weights, rank, quant: QuantResidents, fn, biases) -> None:
    """add_resident_captured for quantized residents: every routed row through its slot's quantized bytes (the
    gathered GEMV: cold rows read nothing and come back zero), no sort and no host sync."""
    K = topk_ids.shape[1]
    slot = rank[topk_ids.reshape(-1)]  # [T*K] resident slot, R = cold
    token = torch.arange(slot.shape[0], device=x.device) // K
    y = quant.routed(x[token], slot, fn, biases)
    if y is None:  # no kernel here (a CPU tensor without Triton's interpreter): per resident expert
        R = quant.gate_up.q.shape[0]
        y = torch.zeros(slot.shape[0], x.shape[1], device=x.device, dtype=x.dtype)
        for r in torch.unique(slot[slot < R]).tolist():
            m = slot == r
            b = () if biases is None else tuple(t[r] for t in biases)
            y[m] = expert_forward(x[token[m]], *quant.weights(r, x.dtype), fn, *b)
    keep = (slot < quant.gate_up.q.shape[0])[:, None]
    out.index_add_(0, token, torch.where(keep, y.float() * topk_weights.reshape(-1).float()[:, None], 0.0))


class HybridExperts(nn.Module):
    """See the module docstring. Eager calls split per batch; captured calls (decode graphs) use the fixed
    split of hybrid.offload.host_lane."""

    def __init__(self, layer: int, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                 offload: "Offload", fn: ExpertFn = SILU, biases=None, cache: "PackedCache | None" = None,
                 times: LoadTimes | None = None, down_dtype: str | None = None, dtype: str | None = None):
        """fn: the experts' function (gpt-oss: clamped SwiGLU); biases: (b_gate [E, F], b_up [E, F], b_down
        [E, D]) or None. The CPU executor computes the same function; the GPU lanes keep the biases (fp32,
        E x (2F + D) values) on the device. w_gate, w_up, w_down may be published MXFP4 (blocks, scales) pairs
        ([E, F, D/32, 16], [E, F, D/32]; down [E, D, F/32, 16]) for cpu_dtype mxfp4: packed without a float copy;
        or a GGUF file's blocks as cpu_kernels weight sources (cpu_kernels.moe.gguf_blocks: Q4_0 for int4 in groups
        of 32, MXFP4 for mxfp4), which CpuMoE takes as they are.
        cache: the load's packed cache (hybrid.offload.packed_cache), which the executor is copied from where it
        holds this layer, and written to where it does not; times: the load's LoadTimes, which the seconds spent
        converting, in the cache and on the device are added to. dtype: this layer's CPU dtype where it differs from
        the offload's (a GGUF file of mixed types loaded in its own formats); down_dtype: the down's where it differs
        from the layer's (a GGUF layer whose down is of another type: cpu_kernels.CpuMoE down_dtype)."""
        super().__init__()
        self.layer = layer
        self.offload = offload
        self.fn = fn
        times = LoadTimes() if times is None else times
        self.cpu_moe = self._cpu_executor(w_gate, w_up, w_down, biases, cache, times, down_dtype, dtype)
        self.num_experts, self.F, self.D = self.cpu_moe.E, self.cpu_moe.F, self.cpu_moe.D
        t0 = time.perf_counter()
        self.bias_dev = None if biases is None else tuple(t.float().to(offload.device) for t in biases)
        self.sources = packed_sources(self.cpu_moe)
        self._pinned = []
        if offload.device.type == "cuda":
            self._pinned = pin([t for ns in self.sources for m in ns.mats() for t in (m.q, m.scale)])
            offload.pinned_weight_bytes += sum(n for _, n in self._pinned)
            # unregister before the executor's buffers go back to the allocator
            weakref.finalize(self, unpin, self._pinned)
        self.stats = LayerStats(routed=np.zeros(self.num_experts, dtype=np.int64))
        self.captured = False  # set by a graph capture; the placement is then fixed
        self.set_resident([])
        times.upload_s += time.perf_counter() - t0
        offload.layers.append(self)

    def _cpu_executor(self, w_gate, w_up, w_down, biases, cache: "PackedCache | None", times: LoadTimes,
                      down_dtype: str | None = None, dtype: str | None = None):
        """The CPU executor of this layer's experts: copied from the packed cache where it holds the layer (no
        conversion), else packed (and quantized) from the weights, then stored in the cache."""
        import cpu_kernels

        off = self.offload
        dtype = dtype or off.cpu_dtype
        kw = dict(dtype=dtype, group_size=off.group_size, threads=None if off.topology else off.threads,
                  topology=off.topology, isa=off.cpu_isa, **self.fn.cpu_kwargs(),
                  **({"down_dtype": down_dtype} if down_dtype not in (None, dtype) else {}))
        mx = isinstance(w_gate, tuple)
        shape = None if w_gate is None else (
            (w_gate[0].shape[0], w_gate[0].shape[1], w_gate[0].shape[2] * 32) if mx else tuple(w_gate.shape))
        if cache is not None:
            moe = cache.load(self.layer, shape, with_biases=biases is not None, **kw)
            if moe is not None:
                return moe
        if w_gate is None:  # the loader skipped the experts that the cache said it holds (PackedCache.holds)
            from hybrid.errors import UsageError

            raise UsageError(f"the packed-expert cache failed at layer {self.layer} after the loader had skipped its "
                             "experts; it was removed: run again to convert them from the checkpoint (or --no-cache)")
        t0 = time.perf_counter()
        if biases is not None:
            kw.update(zip(("b_gate", "b_up", "b_down"), biases))
        if mx:
            moe = cpu_kernels.CpuMoE.from_mxfp4(w_gate, w_up, w_down, **kw)
        else:
            moe = cpu_kernels.CpuMoE(*(w.contiguous() if isinstance(w, torch.Tensor) else w  # or ExpertRows
                                       for w in (w_gate, w_up, w_down)), **kw)
        times.convert_s += time.perf_counter() - t0
        if cache is not None:
            cache.store(self.layer, moe)
        return moe

    # -- placement --------------------------------------------------------------------------------
    def expert_weights(self, e: int, device=None, dtype=None):
        """Expert e's (gate [F, D], up [F, D], down [D, F]), de-quantized from the one packed copy."""
        return expert_weights(self.sources, e, device or self.offload.device, dtype or self.offload.dtype)

    def set_resident(self, ids) -> None:
        """Make exactly `ids` resident in VRAM (uploaded from the packed copy); the rest are cold.

        Decode graphs captured before hold the old placement: capture them again afterwards."""
        if self.captured:
            raise RuntimeError("decode graphs hold this layer's placement; change it before capturing them")
        ids = sorted(int(i) for i in ids)
        if any(i < 0 or i >= self.num_experts for i in ids):
            raise ValueError(f"resident ids must be in [0, {self.num_experts})")
        dev, dt = self.offload.device, self.offload.dtype
        R = len(ids)
        self.resident_ids = np.array(ids, dtype=np.int64)
        self.is_resident = np.zeros(self.num_experts, dtype=bool)
        self.is_resident[ids] = True
        kind = self.offload.resident_dtype
        self.quant = None if kind == "bf16" else QuantResidents(kind, R, self.F, self.D, dev)
        shape = (0,) if self.quant is not None else None  # quantized residents keep no bf16 copy
        self.w_gate = torch.empty(shape or (R, self.F, self.D), device=dev, dtype=dt)  # [R, F, D]
        self.w_up = torch.empty(shape or (R, self.F, self.D), device=dev, dtype=dt)
        self.w_down = torch.empty(shape or (R, self.D, self.F), device=dev, dtype=dt)  # [R, D, F]
        for r, e in enumerate(ids):
            self._fill_slot(r, self.expert_weights(e))
        self._slot_of = {e: r for r, e in enumerate(ids)}
        self._refresh_maps()

    def _fill_slot(self, r: int, weights) -> None:
        """Resident slot r <- (gate [F, D], up [F, D], down [D, F]) (quantized where the residents are)."""
        g, u, d = weights
        if self.quant is not None:
            self.quant.set_(r, g, u, d)
            return
        self.w_gate[r].copy_(g)
        self.w_up[r].copy_(u)
        self.w_down[r].copy_(d)

    def _refresh_maps(self) -> None:
        """cold_ids, cold_mask (bool [E], host: the CPU lane's experts in graphs) and rank_dev ([E] on the
        device: resident slot, or R for cold), derived from resident_ids (slot order) and is_resident."""
        self.cold_ids = np.nonzero(~self.is_resident)[0]
        self.cold_mask = torch.from_numpy(~self.is_resident)
        R = len(self.resident_ids)
        rank = np.full(self.num_experts, R, dtype=np.int64)
        rank[self.resident_ids] = np.arange(R)
        # a pageable host->device copy could wait behind the compute stream
        self.rank_dev = _to_device(torch.from_numpy(rank), self.offload.device)
        self.resident_bias = self._biases_of(self.resident_ids)  # in slot order

    def _biases_of(self, ids) -> tuple | None:
        """(b_gate, b_up, b_down) of experts `ids` (in that order) on the device, or None without biases."""
        if self.bias_dev is None:
            return None
        idx = _to_device(torch.from_numpy(np.asarray(ids, dtype=np.int64)), self.offload.device)
        return tuple(b[idx] for b in self.bias_dev)

    def swap_resident(self, evict: int, add: int, weights) -> None:
        """Replace resident expert `evict` by cold expert `add` in evict's VRAM slot (online re-placement,
        hybrid.offload.replace). `weights` = add's (gate [F, D], up [F, D], down [D, F]) on the device.
        The slot copy is stream-ordered after every kernel that still reads the old expert."""
        if self.captured:
            raise RuntimeError("decode graphs hold this layer's placement; re-placement runs in eager mode only")
        if not self.is_resident[evict] or self.is_resident[add]:
            raise ValueError(f"swap needs {evict} resident and {add} cold")
        r = self._slot_of.pop(int(evict))
        self._fill_slot(r, weights)
        self._slot_of[int(add)] = r
        self.resident_ids[r] = add  # slot order, not sorted: the GPU lane pairs resident_ids[r] with slot r
        self.is_resident[evict], self.is_resident[add] = False, True
        self._refresh_maps()

    def launcher_pinned(self):
        """Context: the calling thread off the CPU executor's cores (Offload.launcher_pinned); the engine
        wraps whole steps in it, graph replays included."""
        return self.offload.launcher_pinned()

    @property
    def capturable(self) -> bool:
        """Decode steps can be graph-captured (CUDA, bf16 grouped GEMMs, graphs not turned off)."""
        off = self.offload
        return off.graphs and grouped_mm_works(off.device, off.dtype) and off.dtype == torch.bfloat16

    @property
    def resident_bytes(self) -> int:
        if self.quant is not None:
            return self.quant.nbytes
        return sum(t.numel() * t.element_size() for t in (self.w_gate, self.w_up, self.w_down))

    # -- forward ----------------------------------------------------------------------------------
    def lane_inputs(self, x: torch.Tensor, K: int):
        """Where a captured step's CPU lane reads its inputs, as device-writable (mapped) tensors (x [T, D],
        ids int64 [T, K], weights fp32 [T, K]), for the router kernel to write them in place; None where the
        lane writes them itself (not capturing, deferral, no cold expert, no doorbell lane or buffers)."""
        off = self.offload
        if (off.defer or not self.cold_ids.size or x.device.type != "cuda" or x.dtype != off.dtype
                or not torch.cuda.is_current_stream_capturing()):
            return None
        return off.host_lane.inputs_in_place(self, *x.shape, K, x.dtype)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                inputs_written: bool = False) -> torch.Tensor:
        """inputs_written: the router already wrote x, ids and weights where lane_inputs said (captured only)."""
        off = self.offload
        dev = off.device
        x = x.to(device=dev, dtype=off.dtype)
        topk_ids, topk_weights = topk_ids.to(dev), topk_weights.to(dev)
        captured = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if inputs_written and (not captured or off.defer):
            raise RuntimeError("inputs_written is for captured steps without deferral (see lane_inputs)")
        if not off.defer:
            return self._run(x, topk_ids, topk_weights, captured, inputs_written=inputs_written)
        return self._forward_deferring(x, topk_ids, topk_weights, captured)

    def _run(self, x, topk_ids, topk_weights, captured: bool, deferred: bool = False,
             inputs_written: bool = False) -> torch.Tensor:
        if captured:
            return self._forward_captured(x, topk_ids, topk_weights, inputs_written)
        with self.offload.launcher_pinned():
            return self._forward_eager(x, topk_ids, topk_weights, deferred)

    def _forward_deferring(self, x, topk_ids, topk_weights, captured: bool) -> torch.Tensor:
        """Expert deferral (Offload.defer): the last `defer` of each token's routed experts (the lowest ranked:
        the router returns them in rank order) are computed from this layer's input but added to the next
        hybrid layer's output; the model's last hybrid layer defers nothing and adds what the one before
        deferred. In captured steps the deferred CPU experts run on the lane beside the next layer's
        attention; eager steps compute them at once (the same math, no overlap)."""
        off = self.offload
        if self is off.layers[0]:
            off.pending = None  # a new step: nothing deferred into the first layer
        K = topk_ids.shape[1]
        d = min(off.defer, K - 1) if self is not off.layers[-1] else 0
        out = self._run(x, topk_ids[:, :K - d], topk_weights[:, :K - d], captured)
        pending, off.pending = off.pending, None
        if pending is not None:
            out = (out.float() + pending()).to(x.dtype)
        if d:
            off.pending = self._defer(x, topk_ids[:, K - d:], topk_weights[:, K - d:], captured)
        return out

    def _defer(self, x, ids, w, captured: bool):
        """-> a callable giving the deferred experts' summed output [T, D] fp32 (joined when called)."""
        if not captured:
            y = self._run(x, ids, w, captured=False, deferred=True).float()
            return lambda: y
        lane = self.offload.host_lane
        cpu = None
        if self.cold_ids.size:
            cpu = lane.enqueue_deferred(self, x, ids, w, self.cold_mask)
            if cpu is None:  # no deferred lane here: run them now, join at once
                y = self._forward_captured(x, ids, w).float()
                return lambda: y
        res = None
        if len(self.resident_ids):
            res = torch.zeros(x.shape[0], self.D, device=x.device, dtype=torch.float32)
            self._add_resident_captured(res, x, ids, w)

        def join():
            if cpu is None:
                return res
            lane.join_deferred()
            return cpu.float() if res is None else res + cpu.float()
        return join

    def _forward_eager(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       deferred: bool = False) -> torch.Tensor:
        """The per-batch split: histogram on the host, scheduler, both lanes and the GPU's experts."""
        t_call = time.perf_counter()
        T, K = topk_ids.shape
        off = self.offload
        dev = off.device
        flat = topk_ids.reshape(-1)  # [T*K]
        replacer = off.replacer
        if replacer is not None:  # a finished re-placement copy lands before this batch reads the map
            replacer.before_batch(self)
        hist = torch.bincount(flat, minlength=self.num_experts).cpu().numpy()  # host sync: the split needs it
        t0 = time.perf_counter()
        sched = off.scheduler_of(self.cpu_moe.dtype)  # priced for this layer's CPU dtype (a mixed GGUF's own)
        h_res, h_cold = hist[self.resident_ids], hist[self.cold_ids]
        split = sched.decide(h_cold, batch_tokens=T, gpu_busy=sched.gpu_time(h_res), rows=T)
        decide_s = time.perf_counter() - t0
        ship_ids = self.cold_ids[split.ship]
        cpu_ids = self.cold_ids[~split.ship & (h_cold > 0)]
        self._account(hist, h_res, 0 if deferred else T, len(cpu_ids), len(ship_ids), decide_s, split.total,
                      batch=not deferred)

        out = torch.zeros(T, self.D, device=dev, dtype=torch.float32)  # fp32 merge of the lanes
        future = cpu_out = None
        if cpu_ids.size:  # start the CPU lane first: it runs while the GPU works
            mask = torch.zeros(self.num_experts, dtype=torch.bool)
            mask[torch.from_numpy(cpu_ids)] = True
            if off.uses_host_lane(self):
                cpu_out = off.host_lane.enqueue(self, x, topk_ids, topk_weights, mask)
            else:
                future = off.cpu_lane.submit(self.cpu_moe, x, topk_ids, topk_weights, mask)
            self.stats.cpu_lane_calls += 1
            self.stats.cpu_lane_start_s += time.perf_counter() - t_call

        if cpu_out is None and self.capturable and T <= off.host_lane.MAX_ROWS:
            off.host_lane.buffers(T, self.D, K, off.dtype)  # the decode graphs' warm-up: buffers before capture
            off.host_lane.prepare(self.cpu_moe.isa)
        if int(h_res.sum()) or ship_ids.size:
            self._gpu_lane(x, flat, topk_weights.reshape(-1), hist, ship_ids, K, out)
        if cpu_out is not None:
            off.host_lane.join()
            out += cpu_out.float()
        if future is not None:
            out += off.cpu_lane.collect(future).float()
        if replacer is not None:  # this batch's results are combined: its routing map is no longer needed
            replacer.after_batch(self, hist)
        return out.to(x.dtype)

    def _forward_captured(self, x, topk_ids, topk_weights, inputs_written: bool = False) -> torch.Tensor:
        """No host sync: resident experts on the GPU, all cold experts through the graph's CPU lane."""
        T, K = topk_ids.shape
        lane = self.offload.host_lane
        self.captured = True
        cpu_out = (lane.enqueue(self, x, topk_ids, topk_weights, self.cold_mask, inputs_written)
                   if self.cold_ids.size else None)
        if not len(self.resident_ids):  # nothing to merge: the lane's output as it is (3 fewer kernels per layer)
            lane.join()
            return cpu_out
        out = torch.zeros(T, self.D, device=x.device, dtype=torch.float32)
        self._add_resident_captured(out, x, topk_ids, topk_weights)
        if cpu_out is not None:
            lane.join()
            out += cpu_out.float()
        return out.to(x.dtype)

    def _add_resident_captured(self, out, x, topk_ids, topk_weights) -> None:
        if self.quant is not None:
            add_resident_routed(out, x, topk_ids, topk_weights, self.rank_dev, self.quant, self.fn,
                                self.resident_bias)
            return
        add_resident_captured(out, x, topk_ids, topk_weights, self.rank_dev, len(self.resident_ids),
                              lambda rows, offs: grouped_swiglu(rows, self.w_gate, self.w_up, self.w_down, offs,
                                                                self.fn, self.resident_bias))

    def _gpu_lane(self, x, flat, flat_w, hist, ship_ids, K, out) -> None:
        """Resident and shipped experts into out (fp32), one grouped GEMM per group of experts (residents in groups
        of at most T rows, shipped ones as their chunk arrives), each group's rows gathered and merged on their
        own."""
        off = self.offload
        lane = off.ship_lane
        dev = x.device
        E = self.num_experts
        res = self.resident_ids
        # Sort the GPU experts' assignments: resident experts in id order, then shipped ones in ship order;
        # everything else (the CPU lane's) sorts to the end and is cut off.
        rank = np.full(E, E + 1, dtype=np.int64)
        rank[res] = np.arange(res.size)
        rank[ship_ids] = res.size + np.arange(ship_ids.size)
        n_res, n_ship = int(hist[res].sum()), int(hist[ship_ids].sum())
        order = torch.argsort(_to_device(torch.from_numpy(rank), dev)[flat], stable=True)[: n_res + n_ship]
        token = order // K  # [n] token of each GPU assignment

        def merge(a: int, b: int, run) -> None:
            """Assignments a:b (one expert group) through run(rows) -> [b - a, D], added into out: the rows, their
            outputs and the fp32 products live one group at a time, not for all n (prefill's peak activations)."""
            if b > a:
                y = run(x[token[a:b]])
                out.index_add_(0, token[a:b], y.float() * flat_w[order[a:b], None])

        # residents in groups of consecutive slots holding at most a token's worth of rows each (T; one expert may
        # hold T by itself), so the resident part is about K grouped GEMMs and each group's rows are the batch's
        a = 0
        for r0, r1 in row_groups(hist[res], flat.shape[0] // K) if n_res else ():
            counts = hist[res[r0:r1]]
            b = a + int(counts.sum())
            if self.quant is not None:
                hit = np.nonzero(counts)[0]  # slots with rows (rows are sorted by slot)
                merge(a, b, lambda rows: self.quant.grouped(rows, counts[hit], r0 + hit, self.fn, self.resident_bias,
                                                            self._grouped))
            else:
                bias = None if self.resident_bias is None else tuple(t[r0:r1] for t in self.resident_bias)
                merge(a, b, lambda rows: self._grouped(rows, counts, self.w_gate[r0:r1], self.w_up[r0:r1],
                                                       self.w_down[r0:r1], self.fn, bias))
            a = b
        pending = [int(e) for e in ship_ids]
        chunks = [pending[i:i + lane.chunk] for i in range(0, len(pending), lane.chunk)]
        dims = (self.F, self.D)
        staged = [lane.fetch(self.sources, c, dims, off.dtype) for c in chunks[:lane.n_slots]]  # copies start
        start = n_res
        for i, c in enumerate(chunks):
            slot = staged[i]
            g, u, d = lane.weights(self.sources, slot, off.dtype)
            counts = hist[c]
            n = int(counts.sum())
            merge(start, start + n, lambda rows: self._grouped(rows, counts, g, u, d, self.fn, self._biases_of(c)))
            start += n
            lane.release(slot)
            if i + lane.n_slots < len(chunks):  # refill the slot just read
                staged.append(lane.fetch(self.sources, chunks[i + lane.n_slots], dims, off.dtype))

    @staticmethod
    def _grouped(rows, counts, w_gate, w_up, w_down, fn: ExpertFn = SILU, biases=None):
        """rows [n, D] grouped by expert (counts [G]) through G experts' weights [G, F, D] / [G, D, F] (and
        biases [G, F], [G, F], [G, D])."""
        if _grouped_ok(rows):
            offs = _to_device(torch.from_numpy(np.cumsum(counts).astype(np.int32)), rows.device)
            return grouped_swiglu(rows, w_gate, w_up, w_down, offs, fn, biases)  # [n, D]
        out = torch.empty_like(rows)
        a = 0
        for i, n in enumerate(np.asarray(counts).tolist()):
            if n:
                b = () if biases is None else tuple(t[i] for t in biases)
                out[a:a + n] = expert_forward(rows[a:a + n], w_gate[i], w_up[i], w_down[i], fn, *b)
                a += n
        return out

    def _account(self, hist, h_res, tokens, n_cpu, n_ship, decide_s, predicted_s, batch: bool = True):
        s = self.stats
        s.batches += int(batch)  # a deferred call is part of its batch, not another one
        s.tokens += tokens
        s.cpu_experts += n_cpu
        s.shipped_experts += n_ship
        s.resident_experts += int((h_res > 0).sum())
        s.decide_s += decide_s
        s.predicted_s += predicted_s
        s.routed += hist
