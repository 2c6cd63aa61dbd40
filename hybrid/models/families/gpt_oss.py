"""gpt-oss (model_type gpt_oss; openai/gpt-oss-120b and -20b): grouped-query attention with biases on q/k/v/o
and a learned sink logit per head in every softmax denominator (hybrid.models.layers.sink_attention),
sliding-window layers alternating with full ones as `layer_types` says (sliding_window keys), YaRN, a router
with a bias (softmax over the top-k logits), and experts with biases and the clamped SwiGLU (swiglu_alpha,
swiglu_limit; ExpertFn "swiglu_oai") whose gate and up projections are interleaved in one tensor (gate the
even, up the odd columns: fused_layout "interleaved"). Published checkpoints store the experts in MXFP4
(hybrid.models.mxfp4). Oracle: transformers' GptOssForCausalLM (models/gpt_oss/modeling_gpt_oss.py), whose
config defaults (GptOssConfig) fill fields a config.json leaves out.
"""

from __future__ import annotations

from hybrid.models.config import ExpertFn
from hybrid.models.errors import ModelLoadError
from hybrid.models.families.common import DECODER_WEIGHTS, Family, Fields, base_fields, make_config

LAYER_TYPES = ("sliding_attention", "full_attention")
# GptOssConfig's rope when a config.json says none (YaRN x32 over 4096 positions, theta 150000)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
PREFIX = "model.layers.{i}.mlp.experts"


# GptOssConfig's defaults (transformers) for fields a config.json may leave out.
DEFAULTS = {"head_dim": 64, "num_key_value_heads": 8, "max_position_embeddings": 131072}


def parse_config(raw: dict):
    f = Fields(raw, "gpt_oss", DEFAULTS)
    if not (f.get("rope_parameters") or f.get("rope_scaling")):
        raw = dict(raw, rope_parameters=dict(DEFAULT_ROPE, rope_theta=f.get("rope_theta", 150000.0)))
        f = Fields(raw, "gpt_oss", DEFAULTS)
    elif f.get("rope_theta") is None and "rope_theta" not in (f.get("rope_parameters") or {}):
        raw = dict(raw, rope_theta=150000.0)  # GptOssConfig.default_theta
        f = Fields(raw, "gpt_oss", DEFAULTS)
    base = base_fields(f)
    L = base["num_layers"]
    types = f.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(L)]  # GptOssConfig: sliding first
    if not isinstance(types, list) or len(types) != L or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"config.json: layer_types must list {L} entries of {' / '.join(LAYER_TYPES)}, "
                             f"got {types!r}")
    window = raw.get("sliding_window", 128)  # GptOssConfig's default when absent; an explicit null stays null
    sliding = tuple(t == "sliding_attention" for t in types)
    if any(sliding) and not window:
        raise ModelLoadError("config.json: layer_types has sliding_attention layers but sliding_window is null")
    alpha, limit = f.get("swiglu_alpha", 1.702), f.get("swiglu_limit", 7.0)
    for name, v in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ModelLoadError(f"config.json: {name} must be a positive number, got {v!r}")
    bias = bool(f.get("attention_bias", True))
    return make_config(dict(
        base,
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-5)),
        num_experts=int(f.req("num_local_experts", "num_experts")),
        expert_intermediate_size=int(f.req("intermediate_size")),
        moe_layers=(True,) * L,
        norm_topk_prob=True,  # softmax over the top-k router logits
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=int(window) if any(sliding) else None,
        sliding_layers=sliding,
        attention_sinks=True,
        router_bias=True,
        expert_fn=ExpertFn("swiglu_oai", alpha=float(alpha), limit=float(limit), bias=True),
    ))


FAMILY = Family(
    model_type="gpt_oss",
    architectures=("GptOssForCausalLM",),
    parse_config=parse_config,
    weights={
        **DECODER_WEIGHTS,
        "layers.{i}.attn.sinks": "model.layers.{i}.self_attn.sinks",
        "layers.{i}.moe.router": "model.layers.{i}.mlp.router.weight",
        "layers.{i}.moe.router_bias": "model.layers.{i}.mlp.router.bias",
    },
    experts={},  # stored fused only
    fused_experts={"gate_up": f"{PREFIX}.gate_up_proj", "down": f"{PREFIX}.down_proj",
                   "gate_up_bias": f"{PREFIX}.gate_up_proj_bias", "down_bias": f"{PREFIX}.down_proj_bias"},
    fused_layout="interleaved",
)
