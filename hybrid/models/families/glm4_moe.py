"""GLM-4.5 / 4.6 / 4.7 (model_type glm4_moe; GLM-4.5-Air too): grouped-query attention with q/k/v biases
(attention_bias; none on o_proj), optional per-head QK-norm (use_qk_norm), partial rotary embedding (the
first int(head_dim * partial_rotary_factor) dims of each head rotated in the half-split layout, the rest
passed through; 0.5 when the config does not say), and DeepSeek-V3's MoE: the sigmoid router with
e_score_correction_bias and group-limited top-k, routed_scaling_factor, n_shared_experts shared experts added
without a gate, the first `first_k_dense_replace` layers dense. Oracle: transformers' Glm4MoeForCausalLM
(models/glm4_moe/modeling_glm4_moe.py). Published checkpoints carry num_nextn_predict_layers multi-token-
prediction layers at indices >= num_hidden_layers (`model.layers.92.*` in GLM-4.5); they are skipped with a
log line, as DeepSeek-V3's.
"""

from __future__ import annotations

from hybrid.models.config import RouterConfig
from hybrid.models.families.common import DECODER_WEIGHTS, Family, Fields, base_fields, make_config, mlp_experts
from hybrid.models.families.deepseek_v3 import skipped

EXPERTS, FUSED = mlp_experts()
# Glm4MoeConfig's defaults (transformers) that base_fields reads; the rest are passed where they are read.
DEFAULTS = {"num_key_value_heads": 8, "max_position_embeddings": 131072, "intermediate_size": 10944}


def parse_config(raw: dict):
    # Defaults are Glm4MoeConfig's (transformers), used only where config.json leaves a field out.
    f = Fields(raw, "glm4_moe", DEFAULTS)
    base = base_fields(f, partial_rotary_default=0.5)
    L = base["num_layers"]
    first_dense = int(f.get("first_k_dense_replace", 1))
    F_ = int(f.req("moe_intermediate_size"))
    bias = bool(f.get("attention_bias", False))
    return make_config(dict(
        base,
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-5)),
        num_experts=int(f.req("n_routed_experts", "num_local_experts")),
        expert_intermediate_size=F_,
        dense_intermediate_size=int(f.get("intermediate_size", 0)),
        moe_layers=tuple(i >= first_dense for i in range(L)),
        shared_expert_intermediate_size=F_ * int(f.get("n_shared_experts", 1)),
        shared_expert_gate=False,
        norm_topk_prob=bool(f.get("norm_topk_prob", True)),
        router=RouterConfig(kind="sigmoid", n_group=int(f.get("n_group", 1)), topk_group=int(f.get("topk_group", 1)),
                            scaling=float(f.get("routed_scaling_factor", 1.0)), score_bias=True),
        qk_norm="head" if f.get("use_qk_norm", False) else "none",
        qkv_bias=bias,
        o_bias=False,  # transformers: o_proj never has a bias
    ))


FAMILY = Family(
    model_type="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    parse_config=parse_config,
    weights={
        **DECODER_WEIGHTS,
        "layers.{i}.moe.router": "model.layers.{i}.mlp.gate.weight",
        "layers.{i}.moe.score_bias": "model.layers.{i}.mlp.gate.e_score_correction_bias",
        **{f"layers.{{i}}.moe.shared.{p}": f"model.layers.{{i}}.mlp.shared_experts.{p}.weight"
           for p in ("gate_proj", "up_proj", "down_proj")},
    },
    experts=EXPERTS,
    fused_experts=FUSED,
    skipped=skipped,
)
