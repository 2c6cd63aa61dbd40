"""Buffers for expert weights (and the DRAM probe that is their ceiling), backed by 2 MiB pages where Linux
allows it.

Decode streams every cold expert's weights once per step. With 4 KiB pages a thread crosses a page, and so
a TLB entry and the hardware prefetchers' page-bounded streams, every 4 KiB it reads. Transparent huge pages
(THP) cut that 512-fold. Most distributions set THP to `madvise`, so anonymous memory gets huge pages only
when asked (`madvise(MADV_HUGEPAGE)` before the first touch); torch's allocator never asks.

`weight_buffer(nbytes)` returns a uint8 tensor view aligned to 2 MiB inside a slightly larger allocation,
advised before anything touches it, so the first-touch copies of the NUMA pools fault in whole huge pages
on their node. The policy is read once from HYBRID_HUGEPAGES: `1` (default: advise), `0` (plain torch.empty).
Where the kernel refuses or THP is `never`, the buffer is an ordinary one; nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

from .knobs import knobs

log = logging.getLogger("cpu_kernels")

HUGE = 2 << 20
MADV_HUGEPAGE = 14  # include/uapi/asm-generic/mman-common.h
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE_FILE) -> str:
    """The bracketed THP mode ('always', 'madvise', 'never'), or '' if the file is absent or unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


@functools.lru_cache(maxsize=1)
def hugepages_wanted() -> bool:
    on = knobs().hugepages and sys.platform.startswith("linux")
    mode = thp_mode()
    log.info("cpu_kernels: expert weights %s (THP mode %s)",
             "advised for 2 MiB pages" if on else "in default pages", mode or "unknown")
    return on


@functools.lru_cache(maxsize=1)
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge(addr: int, nbytes: int) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside [addr, addr + nbytes); True if the kernel
    took it (the pages must not be touched yet for the first fault to be a huge one)."""
    lo = -(-addr // HUGE) * HUGE
    hi = (addr + nbytes) // HUGE * HUGE
    if hi <= lo:
        return False
    return _madvise()(lo, hi - lo, MADV_HUGEPAGE) == 0


def weight_buffer(nbytes: int) -> torch.Tensor:
    """An untouched uint8 tensor of nbytes, 2 MiB aligned and advised for huge pages when the policy says so
    and the buffer spans at least one huge page; otherwise plain torch.empty."""
    nbytes = int(nbytes)
    if not hugepages_wanted() or nbytes < HUGE:  # the policy first: a bad value is an error at any size
        return torch.empty(nbytes, dtype=torch.uint8)
    base = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    skip = -base.data_ptr() % HUGE
    view = base[skip:skip + nbytes]  # keeps base alive
    if not advise_huge(view.data_ptr(), nbytes):
        _warn_refused(ctypes.get_errno())
    return view


@functools.lru_cache(maxsize=None)
def _warn_refused(errno: int) -> None:
    """Said once per errno: a kernel without THP refuses every buffer alike."""
    log.warning("cpu_kernels: madvise(MADV_HUGEPAGE) refused (errno %d): expert weights stay in 4 KiB pages", errno)
