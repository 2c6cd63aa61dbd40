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
from dataclasses import dataclass, replace

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
    """[E] each expert's expected CPU time minus its expected GPU time: what making it resident would save
    if the two lanes ran one after the other. They run at once (decode_layer_time), so this is NOT the
    saving of a placement (an expert the CPU runs faster than the GPU still shortens a layer whose CPU
    lane is the longer one); the planner prices residency with decode_lanes. Kept as the per-expert view."""
    return expected_cpu_time(cpu_shape, hw, shares, rows) - expected_gpu_time(gpu_shape, hw, shares, rows)


@dataclass(frozen=True)
class DecodeLanes:
    """One MoE layer's decode-step costs, the parts that decode_layer_time adds up per lane: each expert's
    expected seconds on the CPU lane if cold and on the GPU lane if resident, and the CPU lane's fixed
    seconds, paid whenever the layer has a cold expert (used or not) and gone when it has none."""
    cpu: np.ndarray  # [E]
    gpu: np.ndarray  # [E]
    cpu_fixed: float

    def layer_time(self, resident) -> float:
        """max(CPU lane, GPU lane) with the bool [E] `resident` experts on the GPU."""
        resident = np.asarray(resident, dtype=bool)
        gpu = float(self.gpu[resident].sum()) if resident.any() else 0.0
        cpu = self.cpu_fixed + float(self.cpu[~resident].sum()) if not resident.all() else 0.0
        return max(cpu, gpu)


def cpu_lane_fixed(cpu_shape: ExpertShape, hw: HardwareProfile, rows: int) -> float:
    """Seconds a captured step's CPU lane costs in a layer with any cold expert, used or not: its copies,
    host function and executor call. A measured graph_layer_floor already holds that part (decode_floor)."""
    if hw.graph_layer_floor:
        return 0.0
    return hw.cpu_lane_overhead + float(activation_transfer_time(cpu_shape, hw, rows))


def decode_lanes(cpu_shape: ExpertShape, gpu_shape: ExpertShape, hw: HardwareProfile, shares, rows: int) -> DecodeLanes:
    """The lane costs of one layer with routing `shares` [E] at `rows` decode rows (see DecodeLanes)."""
    shares = np.asarray(shares, dtype=np.float64)
    return DecodeLanes(expected_cpu_time(cpu_shape, hw, shares, rows), expected_gpu_time(gpu_shape, hw, shares, rows),
                       cpu_lane_fixed(cpu_shape, hw, rows))


def decode_layer_time(cpu_shape, gpu_shape, hw: HardwareProfile, shares, resident, rows: int) -> float:
    """Expected seconds of one MoE layer's experts in a decode step of `rows` tokens (graph split): the
    longer of the CPU lane (fixed part + cold experts) and the GPU lane (resident experts), which run at once.
    No hw.layer_overhead: it prices an eager call's routing histogram to the host and its bookkeeping, which
    a captured decode step does not do (the split is fixed inside the graph)."""
    return decode_lanes(cpu_shape, gpu_shape, hw, shares, rows).layer_time(resident)


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


def non_expert_step_time(cfg, hw: HardwareProfile, rows: int, context: int, gb: int, prefill: bool = False,
                         weight_bytes: float | None = None, kv_value_bytes: int | None = None) -> float:
    """GPU seconds of everything but the routed experts for `rows` tokens that each attend `context`
    positions: the weight read or the FLOPs, whichever is larger, plus attention. Decode: every row reads
    its own K/V (bandwidth-bound). Prefill: the rows share one pass over K/V (fused attention tiles the
    queries), so the causal scores' FLOPs dominate. The embedding table is gathered, not read whole.
    weight_bytes: the bytes those weights hold on the GPU when some are quantized (placement.memory
    non_expert_bytes without the embedding); default every one in `gb` bytes. kv_value_bytes: the bytes of one
    cached value (placement.memory.kv_value_bytes: 1 for an fp8 KV cache); default `gb`."""
    params = cfg.param_counts()["non_expert"] - cfg.vocab_size * cfg.hidden_size
    read = params * gb if weight_bytes is None else weight_bytes
    weights = max(2.0 * rows * params / hw.gpu_flops, read / hw.hbm_bw)
    kv_bytes = context * cfg.kv_values_per_token * (gb if kv_value_bytes is None else kv_value_bytes)  # the attention kind's cache (MLA: latent + rope key)
    kv_read = (1 if prefill else rows) * kv_bytes / hw.hbm_bw
    attn_flops = rows * context * cfg.attention_flops_per_key(prefill) * cfg.num_layers / hw.gpu_flops
    return weights + max(kv_read, attn_flops)


def gpu_shape_of(cpu_shape: ExpertShape, gb: int) -> ExpertShape:
    """Resident experts are de-quantized to the compute dtype in VRAM."""
    return replace(cpu_shape, bytes_per_weight=float(gb))
