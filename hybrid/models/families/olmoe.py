"""OLMoE (OLMoE-1B-7B): QK-norm over all heads at once (before the head split), optional clip_qkv."""

from hybrid.models.families.common import DECODER_WEIGHTS, Family, Fields, base_fields, make_config, \
    mlp_experts

EXPERTS, FUSED = mlp_experts()


# OlmoeConfig's defaults (transformers) for fields a config.json may leave out.
DEFAULTS = {"rms_norm_eps": 1e-5}


def parse_config(raw: dict):
    f = Fields(raw, "olmoe", DEFAULTS)
    base = base_fields(f)
    return make_config(dict(
        base,
        num_experts=int(f.req("num_experts")),
        expert_intermediate_size=int(f.req("intermediate_size")),
        moe_layers=(True,) * base["num_layers"],
        norm_topk_prob=bool(f.get("norm_topk_prob", False)),
        qk_norm="full",
        qkv_bias=bool(f.get("attention_bias", False)),
        o_bias=bool(f.get("attention_bias", False)),
        clip_qkv=f.get("clip_qkv"),
    ))


FAMILY = Family(
    model_type="olmoe",
    architectures=("OlmoeForCausalLM",),
    parse_config=parse_config,
    weights={**DECODER_WEIGHTS, "layers.{i}.moe.router": "model.layers.{i}.mlp.gate.weight"},
    experts=EXPERTS,
    fused_experts=FUSED,
)
