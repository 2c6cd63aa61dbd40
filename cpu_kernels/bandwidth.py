"""Measured DRAM read bandwidth (B_D of DESIGN section 3) with the executor's own pinned pools.

A streaming read of a buffer far larger than the last-level cache, split over the pool's threads in
1 MiB chunks, the way the decode kernels stream weights. The calibration, bench.cpu_moe and
bench.hybrid_e2e use it as the ceiling for decode.

The buffer must dwarf the last-level cache, or part of every pass is served from it and the "DRAM"
ceiling reads high (a ceiling that the kernels then exceed). default_read_bytes(): max(1 GiB, 4 x all L3
caches of the machine), capped at a quarter of the available memory (the probe holds two such buffers for a
moment).
"""

from __future__ import annotations

import glob
import os
import time

import torch

from . import _native
from .memory import weight_buffer
from .topology import Topology


MIN_READ_BYTES = 1 << 30
STREAM_PREFETCH = (0, 512, 2048)  # bytes the probe prefetches ahead of its loads; the best read counts


def llc_bytes() -> int:
    """Bytes of last-level cache on the machine: every distinct L3 (shared_cpu_list tells instances apart)
    summed over sockets, from sysfs; 0 if sysfs does not say."""
    seen, total = set(), 0
    for cpu in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            with open(os.path.join(cpu, "level")) as f:
                if f.read().strip() != "3":
                    continue
            with open(os.path.join(cpu, "shared_cpu_list")) as f:
                who = f.read().strip()
            with open(os.path.join(cpu, "size")) as f:
                size = f.read().strip()
        except OSError:
            continue
        if who in seen:
            continue
        seen.add(who)
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        total += int(size.rstrip("KMGkmg")) * mult
    return total


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def default_read_bytes(llc: int | None = None, avail: int | None = None) -> int:
    """max(1 GiB, 4 x LLC), at most a quarter of the available memory (never below 256 MiB), in MiB."""
    llc = llc_bytes() if llc is None else llc
    avail = available_bytes() if avail is None else avail
    want = max(MIN_READ_BYTES, 4 * llc)
    if avail:
        want = min(want, max(avail // 4, 256 << 20))
    return want >> 20 << 20


def measure_read_bandwidth(nbytes: int | None = None, threads: int | None = None, isa: str | None = None,
                           repeats: int = 3, topology: Topology | None = None) -> float:
    """Best of `repeats` multithreaded reads of an nbytes buffer (default: default_read_bytes()), in GB/s
    (decimal)."""
    nbytes = default_read_bytes() if nbytes is None else int(nbytes)
    isa = _native.resolve_isa(isa)
    if isa == "ref":
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            float(buf.sum())
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
        return best
    topo = (topology or Topology.discover()).limit(threads)
    lib = _native.load(isa)
    pools = [_native.pool(isa, n) for n in topo.nodes]
    per = nbytes // len(pools) // (1 << 20) * (1 << 20)
    # One buffer per node, first touched by that node's threads, so each reads local memory.
    bufs = []
    for p in pools:
        src = torch.ones(per, dtype=torch.uint8)
        dst = weight_buffer(per)  # the same pages as the expert weights (memory.py)
        lib.hy_pool_copy(p, dst.data_ptr(), src.data_ptr(), per)
        bufs.append(dst)
        del src
    best = 0.0
    # With and without software prefetch ahead of the loads: the decode kernels prefetch and can out-read a plain
    # stream, so the ceiling is the best of the reads.
    for pf in STREAM_PREFETCH:
        old = _native.tune(isa, "stream_pf", pf)
        try:
            for _ in range(repeats):
                t0 = time.perf_counter()
                for p, b in zip(pools, bufs):  # nodes one after another: exact on one-node boxes, low on several
                    lib.hy_stream_read(p, b.data_ptr(), per)
                best = max(best, per * len(pools) / (time.perf_counter() - t0) / 1e9)
        finally:
            _native.tune(isa, "stream_pf", old)
    return best
