"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, and a shared expert added to the
routed output through a sigmoid gate."""

from hybrid.models.families.common import DECODER_WEIGHTS, Family, Fields, base_fields, make_config, \
    mlp_experts, qwen_moe_fields

EXPERTS, FUSED = mlp_experts()


# Qwen2MoeConfig's defaults (transformers) for fields a config.json may leave out: a shared expert too.
DEFAULTS = {"num_key_value_heads": 16, "max_position_embeddings": 32768, "intermediate_size": 5632,
            "shared_expert_intermediate_size": 5632, "sliding_window": 4096}


def parse_config(raw: dict):
    f = Fields(raw, "qwen2_moe", DEFAULTS)
    base = base_fields(f)
    return make_config(dict(
        base,
        **qwen_moe_fields(f, base["num_layers"]),
        shared_expert_intermediate_size=int(f.get("shared_expert_intermediate_size", 0)),
        qkv_bias=bool(f.get("qkv_bias", True)),  # Qwen2 has always had q/k/v biases; v5 names the flag
    ))


FAMILY = Family(
    model_type="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    parse_config=parse_config,
    weights={
        **DECODER_WEIGHTS,
        "layers.{i}.moe.router": "model.layers.{i}.mlp.gate.weight",
        **{f"layers.{{i}}.moe.shared.{p}": f"model.layers.{{i}}.mlp.shared_expert.{p}.weight"
           for p in ("gate_proj", "up_proj", "down_proj")},
        "layers.{i}.moe.shared_gate": "model.layers.{i}.mlp.shared_expert_gate.weight",
    },
    experts=EXPERTS,
    fused_experts=FUSED,
)
