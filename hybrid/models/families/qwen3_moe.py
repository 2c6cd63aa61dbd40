"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): QK-norm per head, no biases, optional dense layers."""

from hybrid.models.families.common import DECODER_WEIGHTS, Family, Fields, base_fields, make_config, \
    mlp_experts, moe_layer_pattern

EXPERTS, FUSED = mlp_experts()


def parse_config(raw: dict):
    f = Fields(raw, "qwen3_moe")
    base = base_fields(f)
    # Real checkpoints say num_experts; transformers 5's save_pretrained writes num_local_experts.
    E = int(f.req("num_experts", "num_local_experts"))
    return make_config(dict(
        base,
        num_experts=E,
        expert_intermediate_size=int(f.req("moe_intermediate_size")),
        dense_intermediate_size=int(f.get("intermediate_size", 0)),
        moe_layers=moe_layer_pattern(f, base["num_layers"], E),
        norm_topk_prob=bool(f.get("norm_topk_prob", False)),
        qk_norm="head",
        qkv_bias=bool(f.get("attention_bias", False)),
        o_bias=bool(f.get("attention_bias", False)),
        sliding_window=f.get("sliding_window") if f.get("use_sliding_window", False) else None,
    ))


FAMILY = Family(
    model_type="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    parse_config=parse_config,
    weights={**DECODER_WEIGHTS, "layers.{i}.moe.router": "model.layers.{i}.mlp.gate.weight"},
    experts=EXPERTS,
    fused_experts=FUSED,
)
