"""Online re-placement policy (DESIGN section 4): pure logic, no tensors; the mechanism that copies
weights is hybrid.offload.replace.

Per MoE layer a sliding window holds the last `window` batches' histograms (tokens per expert [E]).
An expert's saving per batch `dt_e` is the window's mean of saving(m): what a batch with m tokens for
it would save if it were resident (the cheaper of its CPU and ship costs minus its GPU time; the cost
model of DESIGN section 3). The policy proposes to bring in the cold expert c with the largest dt and
evict the resident expert v with the smallest dt; the swap gains
dt = dt_c - dt_v per batch and costs T_copy (one expert's packed weights over the link). It pays from
batch

    N_min = floor(T_copy / dt) + 1

and is done only if the predicted persistence of the hot load is at least N_min batches. Persistence
is predicted from the window split into `slices` equal slices: if c has beaten v in the last h slices
in a row, it is predicted to keep doing so for another h slices (an expected remaining lifetime equal
to the age so far: with no model of the workload, the window is the only evidence, and this is the
median under a scale-free lifetime prior, Gott's "Copernican" estimate).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from placement.errors import UsageError
from placement.cost_model import ExpertShape, cpu_compute_time, gpu_compute_time, weight_transfer_time
from placement.hardware import HardwareProfile

REPLACE_MODES = ("off", "online")


@dataclass(frozen=True)
class ReplaceConfig:
    window: int = 64  # batches per layer in the sliding window
    slices: int = 4  # persistence is judged slice by slice (window / slices batches each)
    max_swaps: int = 1  # per layer per batch: the copy stream carries one expert per layer at a time

    def __post_init__(self):
        if self.window < 1 or self.slices < 1 or self.max_swaps < 1:
            raise UsageError("re-placement window, slices and max_swaps must be >= 1")
        if self.window % self.slices:
            raise UsageError(f"re-placement window {self.window} must be a multiple of its slices {self.slices}")

    @property
    def slice_len(self) -> int:
        return self.window // self.slices


def payback_batches(t_copy: float, dt: float) -> int | None:
    """N_min = floor(T_copy / dt) + 1: the first batch after which a copy of T_copy seconds has paid for
    itself at dt seconds saved per batch; None when nothing is saved (never pays)."""
    if t_copy < 0:
        raise ValueError("copy time must be >= 0")
    if dt <= 0:
        return None
    return math.floor(t_copy / dt) + 1


def saving_fn(cpu_shape: ExpertShape, gpu_shape: ExpertShape, hw: HardwareProfile) -> Callable[[np.ndarray], np.ndarray]:
    """saving(m) [...] seconds per batch: min(T_cpu_kernel(m), T_ship(m)) - T_resident(m) (0 at m = 0)."""
    hw.require_gpu()
    tau = copy_time(cpu_shape, hw) + hw.ship_expert_overhead  # as LayerScheduler.tau

    def saving(m):
        m = np.asarray(m)
        g = gpu_compute_time(gpu_shape, hw, m)
        return np.minimum(cpu_compute_time(cpu_shape, hw, m), np.where(m > 0, tau, 0.0) + g) - g

    return saving


def copy_time(cpu_shape: ExpertShape, hw: HardwareProfile) -> float:
    """T_copy: one expert's packed weights host -> GPU."""
    return float(weight_transfer_time(cpu_shape, hw))


class SlidingWindow:
    """The last `window` histograms [E] of one layer."""

    def __init__(self, num_experts: int, window: int):
        self.num_experts = num_experts
        self.hists: deque[np.ndarray] = deque(maxlen=window)

    def push(self, hist) -> None:
        h = np.asarray(hist, dtype=np.int64)
        if h.shape != (self.num_experts,):
            raise ValueError(f"histogram of shape {h.shape}, expected ({self.num_experts},)")
        self.hists.append(h)

    def __len__(self) -> int:
        return len(self.hists)

    def matrix(self) -> np.ndarray:
        """[W, E] oldest first."""
        return np.stack(self.hists) if self.hists else np.zeros((0, self.num_experts), dtype=np.int64)


@dataclass(frozen=True)
class Swap:
    add: int  # cold expert brought in
    evict: int  # resident expert sent back to the CPU (its DRAM copy is still there: nothing to copy)
    dt: float  # predicted seconds saved per batch
    n_min: int  # payback batches
    persistence: int  # predicted batches the gain lasts


class ReplacePolicy:
    def __init__(self, saving: Callable[[np.ndarray], np.ndarray], t_copy: float, cfg: ReplaceConfig = ReplaceConfig()):
        self.saving, self.t_copy, self.cfg = saving, float(t_copy), cfg

    def decide(self, window: SlidingWindow, resident, frozen=()) -> list[Swap]:
        """Swaps worth starting now. `resident` bool [E]; `frozen`: experts with a copy in flight (skipped)."""
        cfg = self.cfg
        if len(window) < cfg.slice_len:
            return []  # not one slice of evidence yet
        resident = np.asarray(resident, dtype=bool).copy()
        if not resident.any() or resident.all():
            return []
        per_batch = self.saving(window.matrix())  # [W, E] seconds saved per batch if resident
        dt = per_batch.mean(axis=0)  # [E]
        W = per_batch.shape[0]
        n_slices = W // cfg.slice_len
        tail = per_batch[W - n_slices * cfg.slice_len:]
        by_slice = tail.reshape(n_slices, cfg.slice_len, -1).mean(axis=1)  # [S, E] oldest first
        blocked = set(int(e) for e in frozen)
        swaps: list[Swap] = []
        for _ in range(cfg.max_swaps):
            cold = [e for e in np.nonzero(~resident)[0] if e not in blocked]
            res = [e for e in np.nonzero(resident)[0] if e not in blocked]
            if not cold or not res:
                break
            c = max(cold, key=lambda e: (dt[e], -e))
            v = min(res, key=lambda e: (dt[e], e))
            gain = float(dt[c] - dt[v])
            n_min = payback_batches(self.t_copy, gain)
            if n_min is None:
                break
            h = 0
            for s in range(n_slices - 1, -1, -1):  # trailing slices in which c beat v
                if by_slice[s, c] > by_slice[s, v]:
                    h += 1
                else:
                    break
            persistence = h * cfg.slice_len
            if persistence < n_min:
                break
            swaps.append(Swap(int(c), int(v), gain, n_min, persistence))
            resident[c], resident[v] = True, False
            blocked.update((int(c), int(v)))
        return swaps
