"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): QK-norm per head, no biases, optional dense layers."""

from hybrid.models.families.common import DECODER_WEIGHTS, Family, Fields, base_fields, make_config, \
    mlp_experts, qwen_moe_fields

EXPERTS, FUSED = mlp_experts()


# Qwen3MoeConfig's defaults (transformers) for fields a config.json may leave out.
DEFAULTS = {"num_key_value_heads": 4, "max_position_embeddings": 32768, "intermediate_size": 6144,
            "sliding_window": 4096}


def parse_config(raw: dict):
    f = Fields(raw, "qwen3_moe", DEFAULTS)
    base = base_fields(f)
    return make_config(dict(
        base,
        **qwen_moe_fields(f, base["num_layers"]),
        qk_norm="head",
        qkv_bias=bool(f.get("attention_bias", False)),
        o_bias=bool(f.get("attention_bias", False)),
    ))


FAMILY = Family(
    model_type="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    parse_config=parse_config,
    weights={**DECODER_WEIGHTS, "layers.{i}.moe.router": "model.layers.{i}.mlp.gate.weight"},
    experts=EXPERTS,
    fused_experts=FUSED,
)
