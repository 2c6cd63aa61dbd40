"""Where decode warms L2 (gpu_kernels.prefetch's touch kernel): the switch, the budget and the side stream.

Kept apart from the kernel so that the model imports it without Triton (the kernel is imported when a touch is
first queued, which happens only where the fused decode kernels are on).
"""

from __future__ import annotations

import os

import torch


ENV = "HYBRID_L2_WARM"  # 0: off; 1 (default): on, default eviction; last: on, evict_last loads
BUDGET = 0.8  # share of the L2 a layer's warmed weights may take (the rest: activations, KV, the lane's buffers)


def warm_policy() -> str | None:
    """The load policy HYBRID_L2_WARM asks for, or None when warming is off (read at each capture, so a process
    can A/B it between engines)."""
    v = os.environ.get(ENV, "1").strip().lower()
    if v in ("0", "off", "false", "no"):
        return None
    if v in ("1", "on", "true", "yes", ""):
        return ""
    if v in ("last", "evict_last"):
        return "evict_last"
    raise ValueError(f"{ENV}={v!r}: expected 0, 1 or last")


def within_budget(tensors, budget_bytes: int) -> list[torch.Tensor]:
    """The longest prefix of tensors (in the order a layer reads them) whose bytes fit budget_bytes."""
    out, total = [], 0
    for t in tensors:
        total += t.numel() * t.element_size()
        if total > budget_bytes:
            break
        out.append(t)
    return out


class L2Warmer:
    """Warms L2 with tensors on a side stream forked from the current one; join() makes the current stream wait
    for it. Used by captured and eager decode alike: fork and join are stream dependencies, which a graph
    capture records as edges. One per model; a model runs on one stream at a time."""

    def __init__(self):
        self.side: torch.cuda.Stream | None = None
        self.pending = False

    def start(self, tensors, policy: str) -> int:
        """Forks, queues one touch per tensor; -> the tensors touched."""
        if not tensors:
            return 0
        main = torch.cuda.current_stream()
        if self.side is None or self.side.device != main.device:
            self.side = torch.cuda.Stream(device=main.device)
        self.side.wait_stream(main)
        from hybrid.gpu_kernels.prefetch import l2_touch

        n = 0
        with torch.cuda.stream(self.side):
            for t in tensors:
                n += l2_touch(t, policy)
        self.pending = True
        return n

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream().wait_stream(self.side)
            self.pending = False


_L2: dict[int, int] = {}


def l2_bytes(device: torch.device) -> int:
    """The device's L2 size in bytes (0 where the driver does not say)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _L2:
        _L2[i] = int(getattr(torch.cuda.get_device_properties(i), "L2_cache_size", 0))
    return _L2[i]
