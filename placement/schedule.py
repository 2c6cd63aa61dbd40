"""Per-batch, per-layer split of the cold experts between the CPU lane and the ship lane.

DESIGN section 3, "Two lanes, one makespan": the CPU lane (activations over the link + the CPU kernel)
and the link/GPU lane (weight transfers pipelined with GPU compute, next to the resident and shared
experts) run at the same time; the best split minimises the larger of the two, not each expert's time
(the CPU lane counted from its head start: an eager call's CPU lane starts before the call's fixed cost
is over, profile.cpu_lane_head).

Strategies (`parse_strategy`): "cost" (that minimisation, default), "cpu" (every cold expert on the CPU:
llama.cpp's `-ot exps=CPU`), "ship" (always ship weights: accelerate / vLLM offload), "threshold:N" (ship
all cold experts of the layer when the batch has >= N tokens, else CPU: the fixed thresholds of llama.cpp
and KTransformers).

The cost decision is exact over "ship the k experts with the largest CPU time" for every k: shipping
costs every expert the same link time, so for a given number of shipped experts the CPU lane is
shortest when they are the CPU lane's most expensive ones. All per-m times are tabulated once; the search
over k is compiled (placement.split_search), a few microseconds for 128 experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from placement.errors import UsageError
from placement.cost_model import ExpertShape, cpu_compute_time, gpu_compute_time, weight_transfer_time
from placement.hardware import HardwareProfile
from placement.split_search import best_split, lane_times, table_sum

STRATEGIES = ("cost", "cpu", "ship", "threshold:N")


@dataclass(frozen=True)
class Strategy:
    kind: str  # "cost" | "cpu" | "ship" | "threshold"
    threshold: int = 0

    def __str__(self) -> str:
        return f"threshold:{self.threshold}" if self.kind == "threshold" else self.kind


def parse_strategy(text: str) -> Strategy:
    text = (text or "").strip()
    if text in ("cost", "cpu", "ship"):
        return Strategy(text)
    m = re.fullmatch(r"threshold:(\d+)", text)
    if m:
        return Strategy("threshold", int(m.group(1)))
    raise UsageError(f"unknown schedule {text!r}; choose one of {', '.join(STRATEGIES)} (e.g. threshold:32)")


@dataclass(frozen=True)
class Split:
    """One decision: which cold experts are shipped, and the predicted lane times (seconds)."""

    ship: np.ndarray  # bool [n_cold]
    cpu_lane: float
    gpu_lane: float
    fixed: float = 0.0  # the layer call's own overhead (profile.layer_overhead)
    head: float = 0.0  # the part of it the CPU lane runs through (profile.cpu_lane_head)

    @property
    def total(self) -> float:
        cpu = self.cpu_lane - self.head if self.cpu_lane > 0 else 0.0
        return self.fixed + max(cpu, self.gpu_lane)


class LayerScheduler:
    """Decides the split for one layer shape on one machine; tables cover m up to `max_m` (then grow)."""

    def __init__(self, shape: ExpertShape, hw: HardwareProfile, strategy: Strategy | str = "cost",
                 can_ship: bool = True, max_m: int = 4096, cpu_kernel: str | None = None, chunk: int = 8):
        self.shape, self.hw = shape, hw
        self.strategy = parse_strategy(strategy) if isinstance(strategy, str) else strategy
        self.can_ship = can_ship
        self.cpu_kernel = cpu_kernel
        hw.require_gpu()
        # one expert's weights over the link (+ its copy launches); each shipped expert's share of its
        # chunk's grouped-GEMM launches is added to its GPU compute
        self.tau = float(weight_transfer_time(shape, hw)) + hw.ship_expert_overhead
        self.chunk_share = hw.ship_chunk_overhead / max(chunk, 1)
        self.cpu_fixed = hw.cpu_lane_overhead
        self.lane_fixed = 2.0 * hw.alpha + self.cpu_fixed  # the CPU lane's fixed part: two transfers + overhead
        self.head = hw.cpu_lane_head
        self.row_time = 2.0 * shape.hidden * shape.act_bytes / hw.link_bw  # one token's row there and back
        self._tables(max_m)
        # compile (or load from numba's cache) now, not in the first batch
        one = np.ones(2, dtype=np.int64)
        self.predict(one, np.zeros(2, dtype=bool), self.gpu_time(one))
        if self.strategy.kind == "cost":
            self._decide_cost(one, 0.0, None)

    def _tables(self, max_m: int) -> None:
        m = np.arange(max_m + 1)
        self.cpu_t = cpu_compute_time(self.shape, self.hw, m, self.cpu_kernel)  # [max_m+1] seconds
        self.gpu_t = gpu_compute_time(self.shape, self.hw, m)
        self.ship_g = self.gpu_t + self.chunk_share  # a shipped expert's GPU stage
        self.max_m = max_m

    def _grow(self, hist: np.ndarray) -> None:
        """Extend the tables to the largest token count in hist (the compiled helpers say when: they
        return a negative result instead of reading past a table)."""
        top = int(hist.max(initial=0))
        if top > self.max_m:
            self._tables(max(top, 2 * self.max_m))

    def gpu_time(self, hist) -> float:
        """GPU compute of experts already in VRAM for this histogram (resident work)."""
        hist = np.asarray(hist, dtype=np.int64)
        t = table_sum(self.gpu_t, hist)
        if t < 0:
            self._grow(hist)
            t = table_sum(self.gpu_t, hist)
        return float(t)

    def predict(self, hist, ship, gpu_busy: float = 0.0, rows: int | None = None) -> Split:
        """Lane times for a given split: ship experts in index order behind `gpu_busy` of resident work."""
        hist = np.asarray(hist, dtype=np.int64)
        ship = np.asarray(ship, dtype=bool) & (hist > 0)
        args = (self.tau, self.lane_fixed, self.row_time, -1 if rows is None else int(rows), float(gpu_busy))
        cpu, gpu = lane_times(hist, ship, self.cpu_t, self.ship_g, *args)
        if cpu < 0:
            self._grow(hist)
            cpu, gpu = lane_times(hist, ship, self.cpu_t, self.ship_g, *args)
        return Split(ship, cpu, gpu, self.hw.layer_overhead, self.head)

    def decide(self, hist, batch_tokens: int, gpu_busy: float = 0.0, rows: int | None = None) -> Split:
        """The split of the cold experts for this batch. hist [n_cold] tokens per cold expert."""
        hist = np.asarray(hist, dtype=np.int64)
        kind = self.strategy.kind if self.can_ship else "cpu"
        if kind == "cost":
            return self._decide_cost(hist, gpu_busy, rows)
        if kind == "threshold":
            kind = "ship" if batch_tokens >= self.strategy.threshold else "cpu"
        return self.predict(hist, hist > 0 if kind == "ship" else np.zeros(hist.shape, dtype=bool), gpu_busy, rows)

    def _decide_cost(self, hist: np.ndarray, gpu_busy: float, rows: int | None) -> Split:
        ship = np.empty(hist.shape, dtype=np.bool_)
        args = (self.tau, self.lane_fixed, self.row_time, -1 if rows is None else int(rows), float(gpu_busy),
                self.head, ship)
        k, cpu, gpu = best_split(hist, self.cpu_t, self.ship_g, *args)
        if k < 0:
            self._grow(hist)
            k, cpu, gpu = best_split(hist, self.cpu_t, self.ship_g, *args)
        return Split(ship, cpu, gpu, self.hw.layer_overhead, self.head)
