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
ROUTER_KINDS = ("softmax", "sigmoid")  # softmax over E (Qwen, Mixtral, OLMoE); sigmoid scores (DeepSeek-V3)
EXPERT_ACTIVATIONS = ("silu", "swiglu_oai")  # down(silu(gate) * up); gpt-oss's clamped SwiGLU (ExpertFn)


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
    # GLM-4.5: only the first int(hd * factor) dims of each head are rotated (half-split layout within
    # them), the rest pass through unrotated; the frequencies are those of a head of that many dims.
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"unsupported rope scaling {self.kind!r} (supported: {', '.join(ROPE_KINDS)})")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be positive")
        if self.kind in ("yarn", "llama3") and not self.original_max_position:
            raise ValueError(f"rope scaling {self.kind!r} needs original_max_position_embeddings")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3): queries through an optional low-rank bottleneck
    (q_lora_rank; None = a plain projection), keys and values from one shared latent of kv_lora_rank values
    plus a single rope key of qk_rope_head_dim, expanded per head by kv_b_proj."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    # rope dims stored as (x0, x1), (x2, x3) pairs (DeepSeek's checkpoints): the loader re-orders the rows once
    # (MLAttention.rope_rows_from_interleaved_)
    rope_interleave: bool = True

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class RouterConfig:
    """How router logits become top-K experts. softmax: probabilities over all E. sigmoid (DeepSeek-V3,
    GLM-4.5): independent scores; with score_bias a learned per-expert bias (e_score_correction_bias) is
    added for choosing only; experts split into n_group groups of which the topk_group with the largest
    top-2 score sums are eligible; the chosen (unbiased) scores are scaled by `scaling`."""

    kind: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0  # routed_scaling_factor
    score_bias: bool = False

    def __post_init__(self):
        if self.kind not in ROUTER_KINDS:
            raise ValueError(f"router kind must be one of {ROUTER_KINDS}, got {self.kind!r}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"need 1 <= topk_group <= n_group, got n_group {self.n_group}, topk_group {self.topk_group}")
        if self.kind == "softmax" and (self.n_group > 1 or self.score_bias):
            raise ValueError("expert groups and a score bias need the sigmoid router")
        if not self.scaling > 0:
            raise ValueError(f"routed scaling factor must be positive, got {self.scaling}")


@dataclass(frozen=True)
class ExpertFn:
    """What one routed expert computes: down(act(gate x + b_gate, up x + b_up)) + b_down. silu: act(g, u) =
    silu(g) * u (no biases in the published families). swiglu_oai (gpt-oss): g = min(g, limit), u = clamp(u,
    -limit, limit), act = g * sigmoid(alpha * g) * (u + 1), with per-expert biases (cpu_kernels.reference's
    gated_activation; transformers' GptOssExperts)."""

    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    bias: bool = False

    def __post_init__(self):
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {EXPERT_ACTIVATIONS}, got {self.activation!r}")
        if not (self.limit > 0 and self.alpha > 0):
            raise ValueError(f"swiglu alpha and limit must be positive, got {self.alpha}, {self.limit}")

    def cpu_kwargs(self) -> dict:
        """The same function's arguments for cpu_kernels.CpuMoE (the biases are passed with the weights)."""
        return dict(activation=self.activation, alpha=self.alpha, limit=self.limit)


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
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE / DeepSeek shared expert (0 = none)
    shared_expert_gate: bool = True  # Qwen2-MoE scales it by sigmoid(gate . x); DeepSeek adds it as is
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qk_norm: str = "none"
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None  # OLMoE clamps q, k, v to [-c, c]
    sliding_window: int | None = None
    # per layer: whether sliding_window applies (gpt-oss layer_types); None = every layer (Mixtral, Qwen)
    sliding_layers: tuple[bool, ...] | None = None
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax denominator
    router_bias: bool = False  # gpt-oss: the router is a linear layer with a bias
    expert_fn: ExpertFn = field(default_factory=ExpertFn)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    router: RouterConfig = field(default_factory=RouterConfig)
    mla: MLAConfig | None = None  # Multi-head Latent Attention instead of grouped-query attention

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
        rot = int(self.head_dim * self.rope.partial_rotary_factor)
        if rot < 2 or rot % 2:
            raise ValueError(f"rotary dims int(head_dim {self.head_dim} x partial_rotary_factor "
                             f"{self.rope.partial_rotary_factor}) = {rot} must be even and >= 2")
        if self.sliding_layers is not None:
            if len(self.sliding_layers) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.sliding_layers)} entries for {self.num_layers} layers")
            if any(self.sliding_layers) and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if (self.attention_sinks or self.expert_fn.bias) and self.mla is not None:
            raise ValueError("attention sinks and expert biases are gpt-oss's (grouped-query attention only)")
        r = self.router
        if r.n_group > 1:
            if self.num_experts % r.n_group:
                raise ValueError(f"num_experts {self.num_experts} is not a multiple of n_group {r.n_group}")
            if self.num_experts // r.n_group < 2:  # groups are ranked by their two best scores
                raise ValueError(f"expert groups need >= 2 experts each ({self.num_experts} experts, {r.n_group} groups)")
            if r.topk_group * (self.num_experts // r.n_group) < self.experts_per_token:
                raise ValueError(f"topk_group {r.topk_group} groups of {self.num_experts // r.n_group} experts "
                                 f"cannot hold {self.experts_per_token} experts per token")
        if self.mla is not None:
            if self.head_dim != self.mla.qk_rope_head_dim:  # the rotary tables cover the rope part only
                raise ValueError(f"MLA: head_dim {self.head_dim} must equal qk_rope_head_dim {self.mla.qk_rope_head_dim}")
            if self.num_kv_heads != self.num_heads:
                raise ValueError("MLA expands keys and values for every query head: num_kv_heads must equal num_heads")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: it attends to every earlier position)."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def smallest_window(self) -> int | None:
        windows = [w for w in map(self.window_of, range(self.num_layers)) if w is not None]
        return min(windows) if windows else None

    @property
    def attention_kind(self) -> str:
        return "gqa" if self.mla is None else "mla"

    @property
    def kv_layout(self) -> dict[str, tuple[int, ...]]:
        """What the KV cache stores per token and layer: buffer name -> shape. Grouped-query attention:
        K and V per key/value head. MLA: the normalised latent and the rotated rope key side by side in
        one row (kv_lora_rank + qk_rope_head_dim values), read back whole as the key of the absorbed
        attention and as its first kv_lora_rank values as the value."""
        if self.mla is None:
            return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}
        return {"latent": (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim,)}

    @property
    def kv_values_per_token(self) -> int:
        """Cache values one token holds across all layers."""
        per_layer = 0
        for shape in self.kv_layout.values():
            n = 1
            for d in shape:
                n *= d
            per_layer += n
        return self.num_layers * per_layer

    def attention_flops_per_key(self, prefill: bool) -> float:
        """FLOPs one query token spends per attended key position in one layer (scores + weighted sum).
        MLA decode attends in latent space (absorbed: H x (latent + rope) for scores, H x latent for
        values); MLA prefill expands keys and values per head."""
        H = self.num_heads
        if self.mla is None:
            return 4.0 * H * self.head_dim
        m = self.mla
        if prefill:
            return 2.0 * H * (m.qk_head_dim + m.v_head_dim)
        return 2.0 * H * (2 * m.kv_lora_rank + m.qk_rope_head_dim)

    # Sizes the benchmarks and the placement planner use.
    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up, down): 3 * D * F (+ 2F + D with gpt-oss's biases)."""
        D, F_ = self.hidden_size, self.expert_intermediate_size
        return 3 * D * F_ + ((2 * F_ + D) if self.expert_fn.bias else 0)

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
        if self.mla is not None:
            attn = self._mla_params()
        else:
            attn = D * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
            if self.qkv_bias:
                attn += hd * (self.num_heads + 2 * self.num_kv_heads)
            if self.qk_norm == "head":
                attn += 2 * hd
            elif self.qk_norm == "full":
                attn += hd * (self.num_heads + self.num_kv_heads)
            attn += D if self.o_bias else 0
            attn += self.num_heads if self.attention_sinks else 0
        per_layer = attn + 2 * D
        other = 0
        for moe in self.moe_layers:
            other += per_layer
            if moe:
                other += self.num_experts * (D + int(self.router.score_bias) + int(self.router_bias))
                if self.shared_expert_intermediate_size:
                    other += 3 * D * self.shared_expert_intermediate_size + D * int(self.shared_expert_gate)
            else:
                other += 3 * D * self.dense_intermediate_size
        embed = self.vocab_size * D * (1 if self.tie_word_embeddings else 2)
        return {
            "experts": self.num_moe_layers * self.num_experts * self.expert_params,
            "non_expert": other + embed + D,
        }

    def gpu_matrices(self) -> dict[str, list[tuple[int, int, int]]]:
        """The non-expert matrices a GPU dtype may quantize (hybrid.models.gpu_weights), per part: (rows, inputs,
        how many). Their biases, norms, routers and gates stay in the compute dtype. A tied head is the
        embedding ("embed"); "head" is then empty."""
        D = self.hidden_size
        if self.mla is None:
            H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
            attn = [(H * hd, D), (Hkv * hd, D), (Hkv * hd, D), (D, H * hd)]
        else:
            m, H = self.mla, self.num_heads
            q = ([(H * m.qk_head_dim, D)] if m.q_lora_rank is None
                 else [(m.q_lora_rank, D), (H * m.qk_head_dim, m.q_lora_rank)])
            attn = q + [(m.kv_lora_rank + m.qk_rope_head_dim, D),
                        (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), (D, H * m.v_head_dim)]
        L, moe = self.num_layers, self.num_moe_layers
        Fs, Fd = self.shared_expert_intermediate_size, self.dense_intermediate_size
        return {
            "attention": [(n, k, L) for n, k in attn],
            "shared": [(Fs, D, 2 * moe), (D, Fs, moe)] if Fs else [],
            "dense": [(Fd, D, 2 * (L - moe)), (D, Fd, L - moe)] if L > moe else [],
            "embed": [(self.vocab_size, D, 1)],
            "head": [] if self.tie_word_embeddings else [(self.vocab_size, D, 1)],
        }

    def _mla_params(self) -> int:
        """hybrid.models.mla.MLAttention's weights: q (direct, or down + norm + up), kv down (latent + rope
        key) + latent norm, kv up (nope keys and values per head), output; biases with attention_bias."""
        m, D, H = self.mla, self.hidden_size, self.num_heads
        if m.q_lora_rank is None:
            q = D * H * m.qk_head_dim
        else:
            q = D * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * m.qk_head_dim
            q += m.q_lora_rank if self.qkv_bias else 0
        kv = D * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
        kv += (m.kv_lora_rank + m.qk_rope_head_dim) if self.qkv_bias else 0
        o = H * m.v_head_dim * D + (D if self.o_bias else 0)
        return q + kv + o
