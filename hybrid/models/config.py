"""ModelConfig: the one frozen description of a MoE transformer that every layer is built from.

Family modules (hybrid/models/families/*.py) translate a Hugging Face config.json into it; nothing else
reads config.json. Shape vocabulary used in comments across hybrid/models: T tokens, B batch rows,
E experts, K experts per token, D hidden, F expert intermediate, H query heads, Hkv key/value heads,
hd head dim, V vocab, L key positions attended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROPE_KINDS = ("default", "linear", "yarn", "llama3")
QK_NORMS = ("none", "head", "full")  # Qwen3: RMSNorm per head over hd; OLMoE: over all heads (H*hd)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding and the scaling variants the supported families ship with."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None  # yarn / llama3: the pre-training context
    beta_fast: float = 32.0  # yarn ramp bounds (YaRN paper, sec. 3.2 defaults)
    beta_slow: float = 1.0
    attention_factor: float | None = None  # yarn: None = derived from factor (0.1 ln s + 1)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"unsupported rope scaling {self.kind!r} (supported: {', '.join(ROPE_KINDS)})")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be positive")
        if self.kind in ("yarn", "llama3") and not self.original_max_position:
            raise ValueError(f"rope scaling {self.kind!r} needs original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # Hugging Face model_type, e.g. "qwen3_moe"
    vocab_size: int
    hidden_size: int  # D
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # hd
    num_experts: int  # E
    experts_per_token: int  # K
    expert_intermediate_size: int  # F
    moe_layers: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP (False)
    dense_intermediate_size: int = 0  # dense-MLP layers only (Qwen2/3-MoE mlp_only_layers)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert (0 = none)
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qk_norm: str = "none"
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None  # OLMoE clamps q, k, v to [-c, c]
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "num_experts", "experts_per_token", "expert_intermediate_size")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} > num_experts {self.num_experts}")
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if not all(self.moe_layers) and self.dense_intermediate_size <= 0:
            raise ValueError("dense layers present but dense_intermediate_size is not set")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    # Sizes the benchmarks and the placement planner use.
    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up, down): 3 * D * F."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Indices of the decoder layers with routed experts."""
        return tuple(i for i, moe in enumerate(self.moe_layers) if moe)

    def param_counts(self) -> dict[str, int]:
        """Parameter counts split into routed experts and everything else (attention, norms, router,
        shared experts, dense MLPs, embeddings, head)."""
        D, hd = self.hidden_size, self.head_dim
        attn = D * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm == "head":
            attn += 2 * hd
        elif self.qk_norm == "full":
            attn += hd * (self.num_heads + self.num_kv_heads)
        per_layer = attn + 2 * D
        other = 0
        for moe in self.moe_layers:
            other += per_layer
            if moe:
                other += self.num_experts * D
                if self.shared_expert_intermediate_size:
                    other += 3 * D * self.shared_expert_intermediate_size + D
            else:
                other += 3 * D * self.dense_intermediate_size
        embed = self.vocab_size * D * (1 if self.tie_word_embeddings else 2)
        return {
            "experts": self.num_moe_layers * self.num_experts * self.expert_params,
            "non_expert": other + embed + D,
        }
