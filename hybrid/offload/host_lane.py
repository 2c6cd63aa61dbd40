"""The CPU lane as CUDA stream-ordered host functions (DESIGN section 3b), in eager and captured steps.

On a side stream, per hybrid layer call:

    D2H copies of x, routing ids (int32) and weights (fp32) into pinned buffers
    -> host function: the CPU executor runs the CPU lane's experts (no CUDA call inside)
    -> H2D copy of the summed output

while the main stream computes the resident (and shipped) experts; the streams join before the merge.
The host function is the compiled library's own C function (cpu_kernels HostJob): it runs on the CUDA
driver's callback thread without Python and without the GIL. That matters twice: a Python host function
has to win the GIL from the launching thread (up to a 5 ms switch interval whenever that thread is busy
launching the ship lane), and a Python worker thread's torch calls start OpenMP teams. It is launched
with the driver's cuLaunchHostFunc (libcuda, found at run time), so nothing CUDA-specific is compiled into
the CPU kernels.

Captured steps (decode graphs) cannot read a routing histogram on the host, so their split is fixed:
resident experts on the GPU, every cold expert on this lane. Eager steps send the experts the scheduler
chose. With a compiled ISA on CUDA both kinds of step hand their jobs to the doorbell lane
(hybrid.offload.doorbell: a spinning CPU thread signalled by stream memory operations) rather than to host
functions; captured steps also write their inputs and read their output in place (mapped page-locked
memory, no copies). Host functions remain the fallback where no doorbell lane can take a job (a full lane, a
capture that started none). With the `ref` ISA (pure
torch) the host function is a Python callback (tests); it takes the GIL, so after replaying such a graph
synchronise with torch.cuda.synchronize (which releases the GIL) before a call that blocks on the GPU while
holding it (.item(), .cpu()).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging

import torch

from cpu_kernels.knobs import knobs
from hybrid.offload import doorbell
from hybrid.offload.lanes import HostBuffers

log = logging.getLogger("hybrid.offload")

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_libcuda = None


def _launch_host_func(stream: torch.cuda.Stream, fn: int, arg: int) -> None:
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _libcuda.cuLaunchHostFunc.restype = ctypes.c_int
    rc = _libcuda.cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(fn), ctypes.c_void_p(arg))
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")


class HostFnLane:
    """Pinned buffers, the side stream and the host jobs shared by the hybrid layers of one model."""

    MAX_ROWS = 512  # decode buckets; larger (prefill) batches never run captured
    _EAGER_JOBS = 64  # eager jobs kept alive until surely run (each layer call syncs the host once)

    def __init__(self, device: torch.device, pin_cpus: set[int] | None = None, defer: bool = False):
        self.device = device
        self.defer = defer  # expert deferral: deferred jobs get their own stream, buffers and doorbell
        self.pin_cpu = min(pin_cpus) if pin_cpus else -1
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # None: host-side tests
        self.defer_stream = torch.cuda.Stream(device) if device.type == "cuda" and defer else None
        self._deferred_wait = None  # (lane, job id, its inputs) of the deferred job the next layer waits for
        # Decode-sized calls (<= MAX_ROWS rows; what graphs capture): graphs hold these buffers' addresses,
        # so a grown buffer keeps its predecessor alive. Larger (eager prefill) calls: their own buffers,
        # replaced when they grow (a job still queued holds its tensors through its HostJob).
        self.bufs = HostBuffers(pin=self.stream is not None, keep_old=True, min_rows=64)
        self.big = HostBuffers(pin=self.stream is not None)
        self._graph_jobs: list = []  # jobs captured graphs point at: alive as long as the lane
        self._eager_jobs: collections.deque = collections.deque()
        self._retired_busy = 0.0  # busy_s of eager jobs no longer kept
        self._calls: dict[int, tuple] = {}  # ref ISA: key -> (layer, xh, ih, wh, oh, mask), read by _run
        self._keys = itertools.count(1)
        self._py_fn = _HOST_FN(self._run)  # one Python callback for every ref-ISA layer; kept alive here
        self._py_fn_ptr = ctypes.cast(self._py_fn, ctypes.c_void_p).value
        self._failures = 0
        self._doorbells: dict[str, doorbell.DoorbellLane] = {}  # per ISA library: its own lane thread
        self._use_doorbell = self.stream is not None  # the doorbell lane needs CUDA's stream memory operations
        self._aliases: dict[tuple, torch.Tensor] = {}
        self._packs: dict[tuple, tuple] = {}  # captured decode's packed input blocks by (T, D, K, dtype)
        self._eager_ids: dict[str, list[int]] = {}  # per lane: the ids eager jobs cycle through
        self._eager_turn: dict[str, int] = {}
        self._full_warned = False

    def prepare(self, isa: str) -> None:
        """Start `isa`'s doorbell lane (outside graph capture: its words are page-locked at start). Called by
        every eager call that could be captured later; a capture that finds no lane uses host functions."""
        if self._use_doorbell and isa != "ref" and isa not in self._doorbells \
                and not torch.cuda.is_current_stream_capturing():
            self.doorbell(isa)

    def doorbell(self, isa: str) -> "doorbell.DoorbellLane | None":
        """The doorbell lane of `isa` (started by prepare()), or None where it is not used."""
        if not self._use_doorbell or isa == "ref":
            return None
        if isa not in self._doorbells:
            if torch.cuda.is_current_stream_capturing():
                return None
            import cpu_kernels

            # Workers spin through the gap between two layer calls of a step (GPU attention etc.) instead of
            # sleeping and paying a futex wake-up per call (HYBRID_SPIN_US, cpu_kernels.knobs).
            cpu_kernels._native.tune(isa, "spin_us", knobs().spin_us)
            self._doorbells[isa] = doorbell.DoorbellLane(isa, self.pin_cpu, self.device)
            log.info("captured CPU-lane jobs go to the doorbell lane (%s, cpu %d)", isa, self.pin_cpu)
        lane = self._doorbells[isa]
        if lane.full and not self._full_warned:
            self._full_warned = True
            log.warning("the doorbell lane holds %d jobs (re-captured decode graphs keep their old jobs); new "
                        "captures use CUDA host functions, which are slower per layer", lane.CAP)
        return None if lane.full else lane

    def buffers(self, T: int, D: int, K: int, dtype):
        """One set shared by every layer: on the side stream each layer's output copy precedes the next
        layer's input copies, so a layer's host function never sees another's data. Allocate them
        before capture (an eager call of the same size), as pinned allocation may not run in capture."""
        b = self.bufs if T <= self.MAX_ROWS else self.big
        if T <= self.MAX_ROWS and self._use_doorbell and not torch.cuda.is_current_stream_capturing():
            self._packed(T, D, K, dtype)  # what a capture of this size will write into
            if self.defer:
                self._packed(T, D, K, dtype, "defer")
        return (b.get("x", T, D, dtype), b.get("ids", T, K, torch.int32), b.get("w", T, K, torch.float32),
                b.get("out", T, D, dtype), b.get("outd", T, D, dtype, device=self.device))

    def _packed(self, T: int, D: int, K: int, dtype, tag: str = ""):
        """Captured decode's page-locked inputs for T rows, back to back in one block: ids int64 [T, K] |
        weights fp32 [T, K] | x [T, D] (as the router and the layer produce them), so one cat kernel writes
        all three through the block's mapped alias; and the output [T, D]. Shared by every layer (the side
        stream is serial). None if not allocated yet (inside a capture: the three-write path is used).
        tag "defer": the deferred jobs' own block (they run while the next layer's job is written)."""
        key = (T, D, K, dtype, tag)
        p = self._packs.get(key)
        if p is None and not torch.cuda.is_current_stream_capturing():
            esz = torch.empty(0, dtype=dtype).element_size()
            nk = T * K
            block = torch.empty(nk * 12 + T * D * esz, dtype=torch.uint8, pin_memory=True)
            ih = block[:nk * 8].view(torch.int64).view(T, K)
            wh = block[nk * 8:nk * 12].view(torch.float32).view(T, K)
            xh = block[nk * 12:].view(dtype).view(T, D)
            oh = torch.empty(T, D, dtype=dtype, pin_memory=True)
            p = self._packs[key] = (block, xh, ih, wh, oh)
        return p

    @property
    def pinned_bytes(self) -> int:
        packs = sum(t.numel() * t.element_size() for p in self._packs.values() for t in (p[0], p[4]))
        return self.bufs.pinned_bytes + self.big.pinned_bytes + packs

    @property
    def failures(self) -> int:
        """CPU-lane calls that failed inside a host function (their output was set to NaN)."""
        return self._failures + sum(j.failures for j in itertools.chain(self._graph_jobs, self._eager_jobs))

    def _run(self, key) -> None:
        """ref ISA only: the Python host function (CUDA's callback thread; no CUDA calls)."""
        layer, xh, ih, wh, oh, mask = self._calls[int(key or 0)]
        try:
            layer.cpu_moe.forward(xh, ih, wh, expert_mask=mask, out=oh)
        except Exception:  # noqa: BLE001 - cannot raise through the driver: poison the output, loudly
            self._failures += 1
            log.exception("hybrid layer %d: CPU lane failed in a host function; output set to NaN", layer.layer)
            oh.fill_(float("nan"))

    @property
    def busy_s(self) -> float:
        """Seconds the compiled CPU-lane jobs have spent computing, all jobs so far (retired eager ones included);
        bench.hybrid_e2e divides its growth over timed steps by the steps (the CPU lane's share of a step)."""
        return self._retired_busy + sum(j.busy_s for j in itertools.chain(self._graph_jobs, self._eager_jobs))

    def _retire_eager(self) -> None:
        while len(self._eager_jobs) >= self._EAGER_JOBS:
            job = self._eager_jobs.popleft()
            self._retired_busy += job.busy_s
            if job.failures:
                self._failures += job.failures
                log.error("a CPU-lane host job failed with code %d; its layer output was set to NaN", job.rc)

    def job(self, layer, xh, ih, wh, oh, mask: torch.Tensor, captured: bool) -> tuple[int, int, int]:
        """(host function, argument, doorbell id or 0) running layer's CPU experts of `mask` on the pinned
        buffers; a captured job with a doorbell id is rung on the doorbell lane instead of launched."""
        if layer.cpu_moe.isa == "ref":
            key = next(self._keys)
            self._calls[key] = (layer, xh, ih, wh, oh, mask)
            return self._py_fn_ptr, key, 0
        job = layer.cpu_moe.host_job(xh, ih, wh, oh, expert_mask=mask, pin_cpu=self.pin_cpu)
        jid = 0
        bell = self.doorbell(layer.cpu_moe.isa)
        if captured:
            self._graph_jobs.append(job)
            if bell is not None:
                jid = bell.add(job)
        else:
            self._retire_eager()
            self._eager_jobs.append(job)
            if bell is not None:  # one CPU thread for both kinds of step: no host-function thread beside it
                jid = self._eager_id(bell, job)
        return job.fn, job.arg, jid

    def _eager_id(self, bell, job) -> int:
        """Eager jobs cycle through _EAGER_JOBS ids of their lane: an id comes back after as many calls as
        _retire_eager keeps jobs alive, when its old job has surely run."""
        ids = self._eager_ids.setdefault(bell.isa, [])
        if len(ids) < self._EAGER_JOBS:
            ids.append(bell.add(job))
            return ids[-1]
        n = self._eager_turn[bell.isa] = (self._eager_turn.get(bell.isa, -1) + 1) % self._EAGER_JOBS
        bell.set(ids[n], job)
        return ids[n]

    def inputs_in_place(self, layer, T: int, D: int, K: int, dtype):
        """Inside a capture: the mapped aliases (x, ids, weights) of the page-locked block the next enqueue of
        `layer` at this size will hand the lane, for a kernel before it to write (then enqueue(...,
        inputs_written=True)); None where enqueue would not read them from there."""
        if self.stream is None or T > self.MAX_ROWS or not torch.cuda.is_current_stream_capturing():
            return None
        if self.doorbell(layer.cpu_moe.isa) is None:
            return None
        pack = self._packed(T, D, K, dtype)
        if pack is None:
            return None
        _block, xh, ih, wh, _oh = pack
        return self._alias(xh), self._alias(ih), self._alias(wh)

    def enqueue(self, layer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, mask: torch.Tensor,
                inputs_written: bool = False) -> torch.Tensor:
        """Put the CPU lane of `layer` (experts in `mask`, bool [E] on the host) on the side stream; returns
        its output [T, D] on the device, valid on the main stream after `join`. inputs_written: a kernel on
        the current stream already wrote x, ids and weights to inputs_in_place's targets."""
        T, D = x.shape
        K = ids.shape[1]
        captured = torch.cuda.is_current_stream_capturing()
        self.prepare(layer.cpu_moe.isa)
        self.stream.wait_stream(torch.cuda.current_stream())
        xh, ih, wh, oh, od = self.buffers(T, D, K, x.dtype)
        pack = self._packed(T, D, K, x.dtype) if captured and self.doorbell(layer.cpu_moe.isa) is not None else None
        if inputs_written and pack is None:
            raise RuntimeError("inputs_written, but this call has no page-locked block to read them from")
        if pack is not None:  # doorbell lane in graphs: one kernel writes the inputs in place, output read in place
            block, xh, ih, wh, oh = pack
            fn, arg, jid = self.job(layer, xh, ih, wh, oh, mask, captured)
            with torch.cuda.stream(self.stream):
                if not inputs_written:
                    self._write_packed(block, x, ids, w)
                self._doorbells[layer.cpu_moe.isa].ring(self.stream, jid, rearm=not self._rings_differ(layer))
            return self._alias(oh)
        fn, arg, jid = self.job(layer, xh, ih, wh, oh, mask, captured)
        if jid and captured:  # doorbell lane in graphs, buffers of this size not packed: three writes in place
            xa, ia, wa, oa = (self._alias(t) for t in (xh, ih, wh, oh))
            with torch.cuda.stream(self.stream):
                doorbell.write_mapped(xa, x)
                doorbell.write_mapped(ia, ids)
                doorbell.write_mapped(wa, w)
                self._doorbells[layer.cpu_moe.isa].ring(self.stream, jid)
            return oa
        with torch.cuda.stream(self.stream):
            xh.copy_(x, non_blocking=True)
            ih.copy_(ids.to(torch.int32), non_blocking=True)
            wh.copy_(w.to(torch.float32), non_blocking=True)
            if jid:  # eager steps copy (large prefill rows move faster by DMA than by mapped writes)
                self._doorbells[layer.cpu_moe.isa].ring(self.stream, jid)
            else:
                _launch_host_func(self.stream, fn, arg)
            od.copy_(oh, non_blocking=True)
        return od

    @staticmethod
    def _rings_differ(layer) -> bool:
        """Whether captured steps never ring one doorbell id twice in a row: each CPU-lane layer rings its own
        job, so with two or more of them consecutive rings differ (within a step, and from one step's last
        layer to the next step's first, whichever graph replays). Then the lane thread re-arms each done
        word and the graph needs no re-arm node. A model with one CPU-lane layer keeps the re-arm, and so does
        expert deferral (its layers' rings are not one per layer)."""
        off = getattr(layer, "offload", None)
        return off is not None and not off.defer and sum(1 for other in off.layers if other.cold_ids.size) >= 2

    def enqueue_deferred(self, layer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, mask: torch.Tensor):
        """Captured steps with expert deferral: put the deferred CPU experts of `layer` on the deferred
        stream and doorbell without waiting for them; join_deferred() (the next hybrid layer) waits. Returns
        the output [T, D] (read in place), or None where this is not possible (no doorbell lane or no buffers
        of this size: the caller then runs them at once)."""
        T, D = x.shape
        K = ids.shape[1]
        bell = self.doorbell(layer.cpu_moe.isa)
        pack = self._packed(T, D, K, x.dtype, "defer") if bell is not None and self.defer_stream is not None else None
        if pack is None or self._deferred_wait is not None:
            return None
        block, xh, ih, wh, oh = pack
        job = layer.cpu_moe.host_job(xh, ih, wh, oh, expert_mask=mask, pin_cpu=self.pin_cpu)
        self._graph_jobs.append(job)
        jid = bell.add(job)
        self.defer_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.defer_stream):
            self._write_packed(block, x, ids, w)
            bell.ring(self.defer_stream, jid, wait=False, bell=1)
        # The inputs stay referenced until the next layer's join: the main stream must not reuse their memory
        # (the caching allocator would, once Python drops them) before the deferred stream has read them.
        self._deferred_wait = (bell, jid, (x, ids, w))
        return self._alias(oh)

    def join_deferred(self) -> None:
        """The current stream waits for the deferred job put on by enqueue_deferred."""
        bell, jid, _inputs = self._deferred_wait
        with torch.cuda.stream(self.defer_stream):
            bell.wait_done(self.defer_stream, jid)
        torch.cuda.current_stream().wait_stream(self.defer_stream)
        self._deferred_wait = None  # the inputs may be freed now: every later use of their memory is ordered

    def _write_packed(self, block, x, ids, w) -> None:
        """ids (int64), weights (fp32) and x into a _packed block, in place, on the current stream. The deferred
        experts' ids and weights are column slices of the routing's [T, K]: contiguous() packs them (one
        deferred expert per token would otherwise flatten to a strided view, which cannot be read as bytes)."""
        parts = [ids.to(torch.int64), w.to(torch.float32), x]
        torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in parts], out=self._alias(block))

    def _alias(self, t: torch.Tensor) -> torch.Tensor:
        """The mapped CUDA alias of a pinned buffer view (made once per view; graphs hold its address)."""
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        a = self._aliases.get(key)
        if a is None:
            a = self._aliases[key] = doorbell.mapped_alias(t, self.device)
        return a

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)
