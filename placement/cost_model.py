"""The cost model of DESIGN section 3: where should one cold expert run for `m` tokens?

Symbols (one expert): P_e parameters, W_e weight bytes, h hidden width, b bytes per activation element,
m tokens routed to it. Machine (HardwareProfile): C_C CPU matrix throughput, B_D DRAM bandwidth, C_G GPU
throughput, B_H HBM bandwidth, B_L host<->GPU link bandwidth, alpha fixed cost per transfer.

    T_C(m) = 2*alpha + 2*m*h*b / B_L + max(2*m*P_e / C_C, W_e / B_D)   # ship activations, run on CPU
    T_G(m) =   alpha + W_e / B_L     + max(2*m*P_e / C_G, W_e / B_H)   # ship weights, run on GPU

Every function here accepts `m` as an int or a numpy array (vectorised sweeps), and returns seconds.
An expert that receives no tokens costs nothing on either path (it is simply not run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from placement.errors import UsageError
from placement.hardware import HardwareProfile

MAX_CROSSOVER_TOKENS = 1_000_000  # search bound for the crossover; `None` beyond it


@dataclass(frozen=True)
class ExpertShape:
    """One routed expert (gate, up: [F, D]; down: [D, F]) and the MoE layer it sits in.

    `params` defaults to the three gated-MLP matrices, 3*D*F. `bytes_per_weight` is the stored weight
    size (2 = bf16, 1 = int8, 0.5 + scales for int4, 0.53125 for mxfp4: 4-bit codes + an 8-bit exponent per
    32 values, the CPU executor's dtype "mxfp4" and gpt-oss's published format); `act_bytes` is the activation element size on the
    link (b in DESIGN section 3).
    """

    name: str
    hidden: int  # D (h in the formulas)
    intermediate: int  # F
    num_experts: int = 1  # E routed experts per layer
    topk: int = 1  # K experts per token
    layers: int = 1  # MoE layers in the model
    bytes_per_weight: float = 2.0
    act_bytes: float = 2.0
    params: int = 0  # P_e; 0 means 3*D*F
    note: str = ""

    def __post_init__(self):
        for field in ("hidden", "intermediate", "num_experts", "topk", "layers"):
            if int(getattr(self, field)) <= 0:
                raise UsageError(f"expert shape {self.name!r}: {field} must be positive, got {getattr(self, field)}")
        if self.topk > self.num_experts:
            raise UsageError(f"expert shape {self.name!r}: topk {self.topk} > num_experts {self.num_experts}")
        if not self.bytes_per_weight > 0 or not self.act_bytes > 0:
            raise UsageError(f"expert shape {self.name!r}: bytes per weight and per activation must be positive")
        if self.params < 0:
            raise UsageError(f"expert shape {self.name!r}: params must be positive")
        if self.params == 0:
            object.__setattr__(self, "params", 3 * self.hidden * self.intermediate)

    @property
    def weight_bytes(self) -> float:
        """W_e: bytes of one expert's weights."""
        return self.params * self.bytes_per_weight

    def with_overrides(self, **fields) -> "ExpertShape":
        """A copy with the given non-None fields replaced (CLI overrides)."""
        given = {k: v for k, v in fields.items() if v is not None}
        if "params" not in given and ({"hidden", "intermediate"} & given.keys()):
            given["params"] = 0  # recompute 3*D*F from the new dimensions
        return replace(self, **given)


# Published configs (Hugging Face config.json of each model). Weights priced as bf16 unless noted.
PRESETS: dict[str, ExpertShape] = {
    s.name: s
    for s in [
        # Qwen/Qwen3-235B-A22B: hidden_size 4096, moe_intermediate_size 1536, 128 experts, top-8, 94 layers
        ExpertShape("qwen3-235b-a22b", 4096, 1536, num_experts=128, topk=8, layers=94),
        # Qwen/Qwen3-30B-A3B: hidden_size 2048, moe_intermediate_size 768, 128 experts, top-8, 48 layers
        ExpertShape("qwen3-30b-a3b", 2048, 768, num_experts=128, topk=8, layers=48),
        # mistralai/Mixtral-8x7B-v0.1: hidden_size 4096, intermediate_size 14336, 8 experts, top-2, 32 layers
        ExpertShape("mixtral-8x7b", 4096, 14336, num_experts=8, topk=2, layers=32),
        # deepseek-ai/DeepSeek-V3: hidden_size 7168, moe_intermediate_size 2048, 256 routed experts, top-8,
        # 61 layers of which the first 3 are dense (first_k_dense_replace=3); published weights are FP8.
        ExpertShape("deepseek-v3", 7168, 2048, num_experts=256, topk=8, layers=58,
                    note="published weights are FP8 (pass --bytes-per-weight 1 to price them as such)"),
        # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's expert shape with 384 routed experts, top-8, 61 layers of
        # which the first is dense (first_k_dense_replace=1); published weights are FP8.
        ExpertShape("kimi-k2", 7168, 2048, num_experts=384, topk=8, layers=60,
                    note="published weights are FP8 (pass --bytes-per-weight 1 to price them as such)"),
        # zai-org/GLM-4.5 (4.6, 4.7): hidden_size 5120, moe_intermediate_size 1536, 160 routed experts, top-8,
        # 92 layers of which the first 3 are dense (first_k_dense_replace=3).
        ExpertShape("glm-4.5", 5120, 1536, num_experts=160, topk=8, layers=89),
        # openai/gpt-oss-120b: hidden_size 2880, intermediate_size 2880, 128 experts, top-4, 36 layers;
        # published weights are MXFP4 (4-bit values + one 8-bit scale per 32: 0.53125 bytes/weight).
        ExpertShape("gpt-oss-120b", 2880, 2880, num_experts=128, topk=4, layers=36,
                    note="published weights are MXFP4 (pass --bytes-per-weight 0.53125 to price them as such)"),
    ]
}


def get_shape(name: str) -> ExpertShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown expert shape {name!r}; presets: {', '.join(PRESETS)}") from None


def _m_array(m):
    return np.asarray(m, dtype=np.float64)


def cpu_compute_time(shape: ExpertShape, hw: HardwareProfile, m, kernel: str | None = None):
    """max(2 m P_e / C_C(m), W_e / B_D): the CPU kernel's time for one expert (no transfers)."""
    m = _m_array(m)
    flops = hw.cpu_flops_at(m, kernel)
    t = np.maximum(2.0 * m * shape.params / flops, shape.weight_bytes / hw.dram_bw)
    return np.where(m > 0, t, 0.0)


def gpu_compute_time(shape: ExpertShape, hw: HardwareProfile, m):
    """max(2 m P_e / C_G, W_e / B_H): one expert on the GPU once its weights are in HBM."""
    m = _m_array(m)
    hw.require_gpu()
    t = np.maximum(2.0 * m * shape.params / hw.gpu_flops, shape.weight_bytes / hw.hbm_bw)
    return np.where(m > 0, t, 0.0)


def activation_transfer_time(shape: ExpertShape, hw: HardwareProfile, m):
    """2*alpha + 2*m*h*b/B_L: inputs to the host and outputs back, two dependent transfers."""
    m = _m_array(m)
    hw.require_gpu()
    t = 2.0 * hw.alpha + 2.0 * m * shape.hidden * shape.act_bytes / hw.link_bw
    return np.where(m > 0, t, 0.0)


def weight_transfer_time(shape: ExpertShape, hw: HardwareProfile, m=1):
    """alpha + W_e/B_L: one expert's weights over the link (only if it has tokens)."""
    m = _m_array(m)
    hw.require_gpu()
    return np.where(m > 0, hw.alpha + shape.weight_bytes / hw.link_bw, 0.0)


def t_cpu(shape: ExpertShape, hw: HardwareProfile, m, kernel: str | None = None):
    """T_C(m): ship the activations to the CPU and run the expert there (seconds)."""
    return activation_transfer_time(shape, hw, m) + cpu_compute_time(shape, hw, m, kernel)


def t_gpu(shape: ExpertShape, hw: HardwareProfile, m):
    """T_G(m): ship the weights to the GPU and run the expert there (seconds)."""
    return weight_transfer_time(shape, hw, m) + gpu_compute_time(shape, hw, m)


def knee_tokens(shape: ExpertShape, hw: HardwareProfile, kernel: str | None = None) -> float:
    """m where the CPU path turns from bandwidth- to compute-bound: C_C * (W_e/P_e) / (2 B_D).

    Uses the kernel's peak C_C (the scalar in the profile), as DESIGN section 3 defines it.
    """
    c_c = hw.cpu_peak(kernel)
    return c_c * (shape.weight_bytes / shape.params) / (2.0 * hw.dram_bw)


def crossover_tokens(shape: ExpertShape, hw: HardwareProfile, kernel: str | None = None,
                     limit: int = MAX_CROSSOVER_TOKENS) -> int | None:
    """The first m >= 1 at which shipping weights (T_G) is strictly faster than the CPU path (T_C).

    Scans every m up to `limit` (vectorised; measured C_C curves need not make T_C - T_G monotone, so
    no bisection). None if the GPU path never wins up to the limit.
    """
    m = np.arange(1, limit + 1, dtype=np.float64)
    wins = np.nonzero(t_gpu(shape, hw, m) < t_cpu(shape, hw, m, kernel))[0]
    return int(m[wins[0]]) if wins.size else None


def expected_active_experts(num_experts: int, topk: int, tokens: int) -> float:
    """E * (1 - (1 - K/E)^M): distinct experts touched by M tokens routed independently and uniformly."""
    if num_experts <= 0 or topk <= 0 or tokens < 0 or topk > num_experts:
        raise UsageError(f"need 0 < topk <= experts and tokens >= 0 (got E={num_experts}, K={topk}, M={tokens})")
    return num_experts * (1.0 - (1.0 - topk / num_experts) ** tokens)


def expected_weight_bytes(num_experts: int, topk: int, tokens: int, expert_bytes: float) -> float:
    """Expected weight bytes a batch of M tokens must read: active experts x bytes per expert."""
    return expected_active_experts(num_experts, topk, tokens) * expert_bytes

