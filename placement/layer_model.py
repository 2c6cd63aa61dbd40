"""Batch level of the cost model (DESIGN section 3, "Batch level" and "Two lanes, one makespan").

A layer's batch is a histogram `m[e]` of tokens per expert and a lane per expert:
  - "resident": the expert lives in VRAM and runs on the GPU;
  - "cpu":      its tokens' activations go to the host, the CPU executor runs it, outputs come back;
  - "ship":     its weights go host->GPU over the link (pipelined with GPU compute), the GPU runs it.
The CPU lane and the link/GPU lane run at the same time; the layer takes the larger of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from placement.cost_model import (ExpertShape, activation_transfer_time, cpu_compute_time, gpu_compute_time,
                                  weight_transfer_time)
from placement.hardware import HardwareProfile

CPU, SHIP, RESIDENT = "cpu", "ship", "resident"
LANES = (CPU, SHIP, RESIDENT)


@dataclass(frozen=True)
class LayerTime:
    """Predicted seconds for one MoE layer's experts; `total` = max(cpu_lane, gpu_lane)."""

    total: float
    cpu_lane: float  # activations over the link + CPU kernels
    gpu_lane: float  # resident + shared compute, shipped experts pipelined behind their transfers
    link_busy: float  # seconds the link spends moving shipped weights
    weight_bytes_shipped: float
    cpu_tokens: int  # token-expert assignments run on the CPU


def layer_time(shape: ExpertShape, hw: HardwareProfile, tokens_per_expert, lanes, shared_gpu_time: float = 0.0,
               cpu_kernel: str | None = None) -> LayerTime:
    """Makespan of one layer for a histogram `tokens_per_expert` [E] and a lane per expert [E].

    The CPU lane ships all its rows in one gather each way (2 transfers, hence 2*alpha once), then runs
    its experts one after another (each on all CPU threads). The GPU lane starts with resident experts
    and `shared_gpu_time` (shared experts, no dependency on the link) while the link streams the shipped
    experts' weights in the given order; each shipped expert runs as soon as its weights have arrived
    and the GPU is free (a two-stage flow shop).
    """
    m = np.asarray(tokens_per_expert, dtype=np.int64)
    lanes = list(lanes)
    if len(lanes) != m.size:
        raise ValueError(f"{m.size} experts in the histogram but {len(lanes)} lanes")
    bad = set(lanes) - set(LANES)
    if bad:
        raise ValueError(f"unknown lane(s) {sorted(bad)}; lanes are {LANES}")
    lane_arr = np.array(lanes)
    cpu_m = m[lane_arr == CPU]
    cpu_tokens = int(cpu_m.sum())
    cpu_lane = float(activation_transfer_time(shape, hw, cpu_tokens)) + float(
        cpu_compute_time(shape, hw, cpu_m, cpu_kernel).sum())

    gpu_t = shared_gpu_time + float(gpu_compute_time(shape, hw, m[lane_arr == RESIDENT]).sum())
    link_t = 0.0
    shipped = 0.0
    for e in np.nonzero((lane_arr == SHIP) & (m > 0))[0]:
        link_t += float(weight_transfer_time(shape, hw, 1))
        shipped += shape.weight_bytes
        gpu_t = max(gpu_t, link_t) + float(gpu_compute_time(shape, hw, m[e]))
    return LayerTime(total=max(cpu_lane, gpu_t), cpu_lane=cpu_lane, gpu_lane=gpu_t, link_busy=link_t,
                     weight_bytes_shipped=shipped, cpu_tokens=cpu_tokens)


def histogram(topk_ids, num_experts: int) -> np.ndarray:
    """Tokens per expert [E] from routing ids [T, K]."""
    return np.bincount(np.asarray(topk_ids).reshape(-1), minlength=num_experts)[:num_experts]


def routing_probabilities(num_experts: int, skew: str) -> np.ndarray:
    """Per-expert routing probability [E], hottest first: "uniform" or "zipfS" (p_e ~ 1 / rank^S)."""
    if skew == "uniform":
        return np.full(num_experts, 1.0 / num_experts)
    if not skew.startswith("zipf"):
        raise ValueError(f"skew must be 'uniform' or 'zipf<S>' (e.g. zipf1.0), got {skew!r}")
    try:
        s = float(skew[4:])
    except ValueError:
        raise ValueError(f"skew must be 'uniform' or 'zipf<S>' (e.g. zipf1.0), got {skew!r}") from None
    p = 1.0 / np.arange(1, num_experts + 1) ** s
    return p / p.sum()


def expected_histogram(num_experts: int, topk: int, tokens: int, skew: str = "uniform") -> np.ndarray:
    """Tokens per expert [E] for M tokens x top-K, the expected share of each expert rounded to integers
    that sum to M*K (largest remainders), no expert above M (a token picks an expert at most once)."""
    p = routing_probabilities(num_experts, skew)
    total = tokens * topk
    want = p * total
    for _ in range(num_experts):  # cap at M and hand the excess to the others, in proportion
        over = want > tokens
        if not over.any():
            break
        excess = float((want[over] - tokens).sum())
        want[over] = tokens
        free = want < tokens
        want[free] += excess * p[free] / p[free].sum()
    base = np.floor(want + 1e-9).astype(np.int64)
    short = total - int(base.sum())
    room = np.where(base < tokens, want - base, -np.inf)
    for e in np.argsort(-room, kind="stable")[:max(short, 0)]:
        base[e] += 1
    return base
