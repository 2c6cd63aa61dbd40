"""Measured DRAM read bandwidth (B_D of DESIGN section 3) with the executor's own pinned pools.

A streaming read of a buffer far larger than the last-level cache, split over the pool's threads in
1 MiB chunks, the way the decode kernels stream weights. The calibration and bench.cpu_moe use it as
the ceiling for decode.
"""

from __future__ import annotations

import time

import torch

from . import _native
from .topology import Topology


def measure_read_bandwidth(nbytes: int = 2 << 30, threads: int | None = None, isa: str | None = None,
                           repeats: int = 3, topology: Topology | None = None) -> float:
    """Best of `repeats` multithreaded reads of an nbytes buffer, in GB/s (decimal)."""
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
        dst = torch.empty(per, dtype=torch.uint8)
        lib.hy_pool_copy(p, dst.data_ptr(), src.data_ptr(), per)
        bufs.append(dst)
        del src
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for p, b in zip(pools, bufs):  # nodes one after another: exact on one-node boxes, low on several
            lib.hy_stream_read(p, b.data_ptr(), per)
        best = max(best, per * len(pools) / (time.perf_counter() - t0) / 1e9)
    return best
