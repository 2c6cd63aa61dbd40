"""The hybrid layer inside a captured CUDA graph (decode): the CPU lane as a stream-ordered host function.

DESIGN section 3b: inside a graph, a step cannot read its routing histogram on the host, so the split is
fixed for captured steps: resident experts on the GPU, every cold expert on the CPU lane (a decode step's
few tokens per expert nearly always favour the CPU; the ship lane needs host decisions and stays with
eager prefill). The CPU lane is captured on a side stream as

    D2H copies of x, routing ids and weights into static pinned buffers
    -> host function: the CPU executor runs the cold experts (no CUDA call inside)
    -> H2D copy of the summed output

while the main stream computes the resident experts with grouped GEMMs; the streams join before the
merge. The host function is launched with the driver's cuLaunchHostFunc (libcuda, present wherever a
GPU is), so nothing CUDA-specific is compiled into the CPU kernels.

Contract with the caller: after replaying a graph, synchronise with torch.cuda.synchronize (which
releases the GIL) before any call that blocks on the GPU while holding the GIL (.item(), .cpu()):
the host function needs the GIL to run the executor's Python wrapper.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from hybrid.offload.lanes import HostBuffers

log = logging.getLogger("hybrid.offload")

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_libcuda = None


def _launch_host_func(stream: torch.cuda.Stream, fn, key: int) -> None:
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
        _libcuda.cuLaunchHostFunc.restype = ctypes.c_int
    rc = _libcuda.cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), fn, ctypes.c_void_p(key))
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")


class GraphCpuLane:
    """Static pinned buffers and captured host functions shared by the hybrid layers of one model."""

    def __init__(self, device: torch.device, pin_cpus: set[int] | None = None):
        self.device = device
        self.pin_cpus = pin_cpus
        self._pinned_thread = False
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # None: host-side tests
        # graphs hold these buffers' addresses: a grown buffer keeps its predecessor alive
        self.bufs = HostBuffers(pin=self.stream is not None, keep_old=True, min_rows=64)
        self._calls: dict[int, tuple] = {}  # key -> (layer, rows); read by the host function
        self._fn = _HOST_FN(self._run)  # one C callback for every layer; kept alive here
        self.failures = 0

    MAX_ROWS = 512  # decode buckets; larger (prefill) batches never run captured

    def buffers(self, T: int, D: int, K: int, dtype):
        """One set shared by every layer: on the side stream each layer's output copy precedes the next
        layer's input copies, so a layer's host function never sees another's data. Allocate them
        before capture (an eager call of the same size), as pinned allocation may not run in capture."""
        b = self.bufs
        return (b.get("x", T, D, dtype), b.get("ids", T, K, torch.int64), b.get("w", T, K, torch.float32),
                b.get("out", T, D, dtype), b.get("outd", T, D, dtype, device=self.device))

    @property
    def pinned_bytes(self) -> int:
        return self.bufs.pinned_bytes

    def _run(self, key) -> None:
        """Runs on CUDA's host-callback thread: the cold experts on the CPU, no CUDA calls."""
        layer, xh, ih, wh, oh = self._calls[int(key or 0)]
        if self.pin_cpus and not self._pinned_thread:  # the driver's callback thread: keep it off the
            self._pinned_thread = True  # launching thread's cores and on the pool's first (see Offload)
            try:
                import os

                os.sched_setaffinity(0, self.pin_cpus)
            except OSError:
                pass
        try:
            layer.cpu_moe.forward(xh, ih, wh, expert_mask=layer.cold_mask, out=oh)
        except Exception:  # noqa: BLE001 - cannot raise through the driver: poison the output, loudly
            self.failures += 1
            log.exception("hybrid layer %d: CPU lane failed inside a CUDA graph; output set to NaN", layer.layer)
            oh.fill_(float("nan"))

    def enqueue(self, layer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Capture the CPU lane for `layer` on the side stream; returns its output [T, D] on the device
        (valid on the main stream after `join`)."""
        T, D = x.shape
        K = ids.shape[1]
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        xh, ih, wh, oh, od = self.buffers(T, D, K, x.dtype)
        key = len(self._calls) + 1
        self._calls[key] = (layer, xh, ih, wh, oh)
        with torch.cuda.stream(self.stream):
            xh.copy_(x, non_blocking=True)
            ih.copy_(ids, non_blocking=True)
            wh.copy_(w, non_blocking=True)
            _launch_host_func(self.stream, self._fn, key)
            od.copy_(oh, non_blocking=True)
        return od

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)
