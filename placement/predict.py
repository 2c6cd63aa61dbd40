"""Expected times of a placement from the cost model (DESIGN section 3), per expert and per step.

Routing enters as `share[e]`: the probability that a token uses expert e (counts / tokens; a layer's
shares sum to K). For a decode step of B rows, the tokens an expert receives are m ~ Binomial(B, share)
(rows route independently), and every time is an expectation over that distribution, so a rarely used
expert is charged its weight read only in the steps where it is used, not a fraction of a token.

Decode runs as CUDA graphs on the box (hybrid.offload.host_lane): resident experts on the GPU, every
cold expert on the CPU lane, the two lanes concurrent, so a layer costs max(CPU lane, GPU lane). Prefill
is eager: the cold experts are split per batch by the LayerScheduler, priced here on the expected
histogram round(P * share).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from placement.cost_model import ExpertShape, activation_transfer_time, cpu_compute_time, gpu_compute_time
from placement.hardware import HardwareProfile
from placement.schedule import LayerScheduler


def binomial_pmf(shares, rows: int) -> np.ndarray:
    """[E, rows + 1]: P(m tokens) for m = 0..rows, m ~ Binomial(rows, share[e])."""
    q = np.clip(np.asarray(shares, dtype=np.float64), 0.0, 1.0)[:, None]  # [E, 1]
    m = np.arange(rows + 1, dtype=np.float64)[None, :]  # [1, rows+1]
    log_c = np.array([math.lgamma(rows + 1) - math.lgamma(k + 1) - math.lgamma(rows - k + 1) for k in range(rows + 1)])
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = log_c[None, :] + np.where(m > 0, m * np.log(q), 0.0) + np.where(rows - m > 0, (rows - m) * np.log1p(-q), 0.0)
    return np.nan_to_num(np.exp(logp))


def expected_cpu_time(shape: ExpertShape, hw: HardwareProfile, shares, rows: int) -> np.ndarray:
    """[E] expected CPU-kernel seconds per step of each expert if it is cold."""
    table = cpu_compute_time(shape, hw, np.arange(rows + 1))  # [rows+1]
    return binomial_pmf(shares, rows) @ table


def expected_gpu_time(shape: ExpertShape, hw: HardwareProfile, shares, rows: int) -> np.ndarray:
    """[E] expected GPU seconds per step of each expert if it is resident (weights in HBM)."""
    table = gpu_compute_time(shape, hw, np.arange(rows + 1))
    return binomial_pmf(shares, rows) @ table


def decode_savings(cpu_shape: ExpertShape, gpu_shape: ExpertShape, hw: HardwareProfile, shares, rows: int) -> np.ndarray:
    """[E] seconds per decode step saved by making each expert resident: its expected CPU-lane time
    minus its expected GPU time. (The activation rows cross the link whenever any cold expert is used,
    so they do not depend on one expert's placement and are left out.)"""
    return expected_cpu_time(cpu_shape, hw, shares, rows) - expected_gpu_time(gpu_shape, hw, shares, rows)


def decode_layer_time(cpu_shape, gpu_shape, hw: HardwareProfile, shares, resident, rows: int) -> float:
    """Expected seconds of one MoE layer's experts in a decode step of `rows` tokens (graph split)."""
    shares = np.asarray(shares, dtype=np.float64)
    resident = np.asarray(resident, dtype=bool)
    cold = ~resident
    gpu = float(expected_gpu_time(gpu_shape, hw, shares[resident], rows).sum()) if resident.any() else 0.0
    cpu = 0.0
    if cold.any():
        # A captured step runs the layer's CPU lane whenever the layer has cold experts, used or not: its
        # copies, host function and executor call are paid every step, on top of the kernel time. A measured
        # graph_layer_floor already holds that fixed part (see decode_floor).
        fixed = 0.0
        if not hw.graph_layer_floor:
            fixed = hw.cpu_lane_overhead + float(activation_transfer_time(cpu_shape, hw, rows))
        cpu = fixed + float(expected_cpu_time(cpu_shape, hw, shares[cold], rows).sum())
    # No hw.layer_overhead: it prices an eager call's routing histogram to the host and its bookkeeping,
    # which a captured decode step does not do (the split is fixed inside the graph).
    return max(cpu, gpu)


def decode_floor(cfg, hw: HardwareProfile) -> float:
    """Seconds per captured decode step that no weight traffic explains: the measured per-layer floor
    (launch latency of the graph's kernels, the CPU lane's copies and host function) x decoder layers."""
    return cfg.num_layers * hw.graph_layer_floor


def prefill_layer_time(scheduler: LayerScheduler, gpu_sched: LayerScheduler, shares, resident, tokens: int) -> float:
    """Seconds of one MoE layer's experts for a prompt of `tokens` tokens (expected histogram)."""
    hist = np.rint(np.asarray(shares, dtype=np.float64) * tokens).astype(np.int64)  # [E]
    resident = np.asarray(resident, dtype=bool)
    busy = gpu_sched.gpu_time(hist[resident]) if resident.any() else 0.0
    return scheduler.decide(hist[~resident], batch_tokens=tokens, gpu_busy=busy, rows=tokens).total


def non_expert_step_time(cfg, hw: HardwareProfile, rows: int, context: int, gb: int, prefill: bool = False) -> float:
    """GPU seconds of everything but the routed experts for `rows` tokens that each attend `context`
    positions: the weight read or the FLOPs, whichever is larger, plus attention. Decode: every row reads
    its own K/V (bandwidth-bound). Prefill: the rows share one pass over K/V (fused attention tiles the
    queries), so the causal scores' FLOPs dominate. The embedding table is gathered, not read whole."""
    params = cfg.param_counts()["non_expert"] - cfg.vocab_size * cfg.hidden_size
    weights = max(2.0 * rows * params / hw.gpu_flops, params * gb / hw.hbm_bw)
    kv_bytes = context * cfg.kv_values_per_token * gb  # the attention kind's cache (MLA: latent + rope key)
    kv_read = (1 if prefill else rows) * kv_bytes / hw.hbm_bw
    attn_flops = rows * context * cfg.attention_flops_per_key(prefill) * cfg.num_layers / hw.gpu_flops
    return weights + max(kv_read, attn_flops)


def gpu_shape_of(cpu_shape: ExpertShape, gb: int) -> ExpertShape:
    """Resident experts are de-quantized to the compute dtype in VRAM."""
    return replace(cpu_shape, bytes_per_weight=float(gb))
