"""The doorbell lane: captured decode steps hand their CPU-lane jobs to a spinning CPU thread through page-locked
words (cpu_kernels/csrc/lane.h) instead of CUDA host functions.

Per captured layer call, on the lane's side stream (the inputs written straight into page-locked memory by
kernels through mapped aliases, no copies):

    cuStreamWriteValue32(doorbell, id)      the lane thread, spinning on the doorbell, runs job `id`
    cuStreamWaitValue32(done[id], == 1)     the stream waits for it without any CPU thread in the way
    cuStreamWriteValue32(done[id], 0)       re-armed for the next replay (graphs replay the same values)

and the next kernel reads the output where the lane thread wrote it. A host function costs the driver's
callback thread a wake-up and the stream a hand-back after it returns, plus one copy each way per buffer;
here both sides already poll (the lane thread on the CPU, the GPU's front end on `done`). The stream
memory operations are the driver API's (v2 entry points, on by default since CUDA 11.7) and graphs capture
them as memory-operation nodes. Only the driver library torch already loaded is used; nothing is compiled
against CUDA.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from cpu_kernels import _native

log = logging.getLogger("hybrid.offload")

_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
_cu = None


def _driver():
    global _cu
    if _cu is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.restype = ctypes.c_int
        _cu = lib
    return _cu


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def device_pointer(host_ptr: int) -> int:
    """The device address of page-locked host memory (under unified addressing, the same number)."""
    dptr = ctypes.c_uint64()
    _check(_driver().cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(host_ptr), 0),
           "cuMemHostGetDevicePointer")
    return dptr.value


def mapped_alias(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the page-locked host tensor t's memory: kernels read and write it across PCIe with no
    copy. It does not own the memory: keep t alive as long as the alias is used."""
    nbytes = t.numel() * t.element_size()
    if device.index is None:  # the storage's device must name the index, as torch.empty's does
        device = torch.device(device.type, torch.cuda.current_device())
    # A private torch entry point (torch.compile's CUDA-graph trees build storages with it), here because no
    # public one makes a CUDA tensor over memory torch did not allocate on the device; ran on torch 2.11.
    st = torch._C._construct_storage_from_data_pointer(device_pointer(t.data_ptr()), device, nbytes)
    return torch.empty(0, dtype=t.dtype, device=device).set_(st, 0, t.shape, t.stride())


def write_mapped(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (a mapped alias) := src with a kernel: a same-dtype copy_ would be a device-to-device memcpy,
    whose kind does not match host memory; x * 1 is exact (NaN, -0 and infinities kept)."""
    if dst.dtype == src.dtype:
        torch.mul(src, 1, out=dst)
    else:
        dst.copy_(src)


class DoorbellLane:
    """One lane thread (pinned to `pin_cpu`, the CPU pool's first cpu) serving the captured jobs of one model.

    Off CUDA (tests) ring_from_host() plays the stream's part."""

    CAP = 16384  # jobs per lane: layers x decode graphs (batch x context buckets) x captures; a full lane falls back to host functions

    def __init__(self, isa: str, pin_cpu: int = -1, device: torch.device | None = None):
        self.isa = isa
        self._lib = _native.load(isa)
        on_cuda = device is not None and device.type == "cuda"
        # [doorbell, deferred doorbell, done...]
        self._words = torch.zeros(2 + self.CAP, dtype=torch.int32, pin_memory=on_cuda)
        self._jobs: list = []  # the HostJobs the lane points at: alive as long as the lane
        base = self._words.data_ptr()
        self._lane = self._lib.hy_lane_create(base, base + 8, self.CAP, int(pin_cpu))
        if not self._lane:
            raise RuntimeError("cpu_kernels: could not start the doorbell lane thread")
        self._dev_base = device_pointer(base) if on_cuda else None

    @property
    def full(self) -> bool:
        return len(self._jobs) >= self.CAP

    @property
    def served(self) -> int:
        """Doorbells the lane thread has answered."""
        return int(self._lib.hy_lane_served(self._lane))

    def add(self, job) -> int:
        """Register a cpu_kernels HostJob; returns its id (the value the stream writes to the doorbell)."""
        jid = self._lib.hy_lane_add(self._lane, ctypes.c_void_p(job.arg))
        if jid < 1:
            raise RuntimeError("doorbell lane is full")
        self._jobs.append(job)
        return jid

    def ring(self, stream: torch.cuda.Stream, jid: int, wait: bool = True, bell: int = 0, rearm: bool = True) -> None:
        """Enqueue on `stream`: run job `jid` on the lane thread (doorbell `bell`: 0 now, 1 deferred) and,
        with `wait`, wait for it (else call wait_done later, on a stream ordered after this one).

        rearm=False leaves the done word for the lane thread to clear when it answers the next doorbell: one
        stream memory operation fewer, correct only if this doorbell never rings the same id twice in a row
        (the caller's promise: a captured step whose layers each ring their own id, two or more of them)."""
        cu, s = _driver(), ctypes.c_void_p(stream.cuda_stream)
        _check(cu.cuStreamWriteValue32_v2(s, self._dev_base + 4 * bell, jid, 0), "cuStreamWriteValue32")
        if wait:
            self.wait_done(stream, jid, rearm)

    def wait_done(self, stream: torch.cuda.Stream, jid: int, rearm: bool = True) -> None:
        """Enqueue on `stream`: wait until job `jid` has run, then (with `rearm`) re-arm its done word."""
        cu, s = _driver(), ctypes.c_void_p(stream.cuda_stream)
        done = self._dev_base + 4 * (jid + 1)  # done[jid - 1] sits after the two doorbell words
        _check(cu.cuStreamWaitValue32_v2(s, done, 1, _WAIT_EQ), "cuStreamWaitValue32")
        if rearm:
            _check(cu.cuStreamWriteValue32_v2(s, done, 0, 0), "cuStreamWriteValue32")

    def set(self, jid: int, job) -> None:
        """Re-point id `jid` at `job` (every stream use of the old job must have run)."""
        if self._lib.hy_lane_set(self._lane, jid, ctypes.c_void_p(job.arg)) != 0:
            raise RuntimeError(f"doorbell lane has no id {jid}")
        self._jobs[jid - 1] = job

    def ring_from_host(self, jid: int, bell: int = 0, timeout_s: float = 10.0, rearm: bool = True) -> None:
        """What ring() enqueues, done by this thread (tests and CPU-only hosts)."""
        import time

        self._words[bell] = jid
        t0 = time.monotonic()
        while int(self._words[jid + 1]) != 1:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"doorbell lane did not answer job {jid}")
            time.sleep(0)
        if rearm:
            self._words[jid + 1] = 0

    def done_word(self, jid: int) -> int:
        """Job `jid`'s done word as it is now (1: answered and not re-armed yet)."""
        return int(self._words[jid + 1])

    def close(self) -> None:
        """Stop the lane thread. Every stream that rings it must have finished."""
        if self._lane:
            self._lib.hy_lane_destroy(self._lane)
            self._lane = None

    def __del__(self):
        self.close()
