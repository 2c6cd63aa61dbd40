"""What the families share: reading config.json fields, the RoPE block, and the weight names every
Llama-style decoder uses. A family module adds only what differs (router and expert names, shared
expert, QK-norm, biases)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from hybrid.models.config import ROPE_KINDS, ModelConfig, RopeConfig
from hybrid.models.errors import ModelLoadError


class Fields:
    """config.json accessor whose missing-field error names the field and the family. `defaults`: the family's
    own defaults (its transformers config class's), which take precedence over the generic one a caller of
    get() passes, so that a config.json that leaves a field out means what it means to transformers."""

    def __init__(self, raw: dict, family: str, defaults: dict | None = None):
        self.raw, self.family, self.defaults = raw, family, defaults or {}

    def req(self, *names: str) -> Any:
        for n in names:
            if self.raw.get(n) is not None:
                return self.raw[n]
        raise ModelLoadError(f"config.json: missing field {names[0]!r} (required for {self.family})")

    def get(self, name: str, default: Any = None) -> Any:
        value = self.raw.get(name)
        return self.defaults.get(name, default) if value is None else value


def parse_rope(f: Fields, partial_rotary_default: float | None = None) -> RopeConfig:
    """partial_rotary_default: None for families without partial rotary (the field is not read); else the
    family's default for partial_rotary_factor, read from the rope parameters or the top level (GLM-4.5)."""
    # transformers >= 5 writes "rope_parameters" (theta inside); older configs "rope_theta" + "rope_scaling".
    params = dict(f.get("rope_parameters") or {})
    scaling = f.get("rope_scaling") or {}
    if not params:
        params = dict(scaling)
    theta = params.get("rope_theta", f.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_KINDS:
        raise ModelLoadError(f"config.json: unsupported rope scaling {kind!r} for {f.family} "
                             f"(supported: {', '.join(ROPE_KINDS)})")
    orig = params.get("original_max_position_embeddings", f.get("original_max_position_embeddings"))
    if kind in ("yarn", "llama3") and not orig:
        raise ModelLoadError(f"config.json: rope scaling {kind!r} needs 'original_max_position_embeddings'")
    factor = params.get("factor")
    if factor is None:
        factor = f.get("max_position_embeddings") / orig if (kind == "yarn" and orig) else 1.0
    opt = {k: params[k] for k in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                                  "truncate", "low_freq_factor", "high_freq_factor") if params.get(k) is not None}
    if partial_rotary_default is not None:
        partial = params.get("partial_rotary_factor", f.get("partial_rotary_factor", partial_rotary_default))
        if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
            raise ModelLoadError(f"config.json: partial_rotary_factor must be a number in (0, 1], got {partial!r}")
        opt["partial_rotary_factor"] = float(partial)
    return RopeConfig(theta=float(theta), kind=kind, factor=float(factor), original_max_position=orig, **opt)


def token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def moe_layer_pattern(f: Fields, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    # Qwen2/3-MoE: a layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th.
    dense = set(f.get("mlp_only_layers", []))
    step = int(f.get("decoder_sparse_step", 1))
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def qwen_moe_fields(f: Fields, num_layers: int) -> dict:
    """What Qwen2-MoE and Qwen3-MoE read the same way: expert count and sizes, the sparse-layer pattern,
    top-k renormalisation and the optional sliding window."""
    # Real checkpoints say num_experts; transformers 5's save_pretrained writes num_local_experts.
    E = int(f.req("num_experts", "num_local_experts"))
    return dict(
        num_experts=E,
        expert_intermediate_size=int(f.req("moe_intermediate_size")),
        dense_intermediate_size=int(f.get("intermediate_size", 0)),
        moe_layers=moe_layer_pattern(f, num_layers, E),
        norm_topk_prob=bool(f.get("norm_topk_prob", False)),
        sliding_window=f.get("sliding_window") if f.get("use_sliding_window", False) else None,
    )


def base_fields(f: Fields, partial_rotary_default: float | None = None) -> dict:
    """Fields every family reads the same way (partial_rotary_default: see parse_rope)."""
    if f.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"config.json: hidden_act {f.get('hidden_act')!r} not supported (only silu)")
    hidden, heads = int(f.req("hidden_size")), int(f.req("num_attention_heads"))
    return dict(
        family=f.family,
        vocab_size=int(f.req("vocab_size")),
        hidden_size=hidden,
        num_layers=int(f.req("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(f.get("num_key_value_heads", heads)),
        head_dim=int(f.get("head_dim", hidden // heads)),
        experts_per_token=int(f.req("num_experts_per_tok")),
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(f, partial_rotary_default),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        max_position_embeddings=int(f.get("max_position_embeddings", 4096)),
        bos_token_id=f.get("bos_token_id"),
        eos_token_ids=token_ids(f.get("eos_token_id")),
    )


def make_config(fields: dict) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise ModelLoadError(f"config.json: {exc}") from None


# Our parameter name -> checkpoint name. "{i}" is the layer index.
DECODER_WEIGHTS = {
    "embed": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"layers.{{i}}.attn.{p}_proj.{t}": f"model.layers.{{i}}.self_attn.{p}_proj.{t}"
       for p in "qkvo" for t in ("weight", "bias")},
    "layers.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    # Dense-MLP layers (Qwen2/3-MoE mlp_only_layers).
    **{f"layers.{{i}}.mlp.{p}": f"model.layers.{{i}}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
}


@dataclass(frozen=True)
class Family:
    """One supported architecture: how to read its config and what its tensors are called.

    weights:  our parameter name -> checkpoint name ("{i}" = layer)
    experts:  {"w_gate"|"w_up"|"w_down": checkpoint name of one expert's matrix ("{i}", "{e}")}
    fused_experts: the stacked layout transformers 5 uses in memory and some converted checkpoints
        carry: {"gate_up": name of [E, 2F, D] (gate rows first), "down": name of [E, D, F]}; with
        expert biases also "gate_up_bias" [E, 2F] and "down_bias" [E, D]
    fused_layout: "gate_first" (above) or "interleaved" (gpt-oss): gate_up [E, D, 2F] with gate in the even
        and up in the odd columns, down [E, F, D]; its MXFP4 form (hybrid.models.mxfp4) `gate_up_blocks`
        [E, 2F, D/32, 16] (even rows gate, odd rows up) and `down_blocks` [E, D, F/32, 16], with `_scales`
    """

    model_type: str
    architectures: tuple[str, ...]
    parse_config: Callable[[dict], ModelConfig]
    weights: dict[str, str]
    experts: dict[str, str]
    fused_experts: dict[str, str] = field(default_factory=dict)
    fused_layout: str = "gate_first"
    # (regex, replacement) renaming other spellings of a tensor (e.g. transformers 5's in-memory names)
    # to the one in `weights` before matching.
    aliases: tuple[tuple[str, str], ...] = ()
    # (checkpoint name, ModelConfig) -> why the tensor is deliberately not loaded, or None (it must be);
    # the loader logs each reason once with a count (DeepSeek-V3's multi-token-prediction layer).
    skipped: Callable[[str, ModelConfig], str | None] | None = None


def mlp_experts(prefix: str = "model.layers.{i}.mlp") -> tuple[dict[str, str], dict[str, str]]:
    """Per-expert and fused names under `prefix` in the gate_proj/up_proj/down_proj convention."""
    per = {w: f"{prefix}.experts.{{e}}.{p}.weight" for w, p in
           (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))}
    fused = {"gate_up": f"{prefix}.experts.gate_up_proj", "down": f"{prefix}.experts.down_proj"}
    return per, fused
