"""Mixtral (8x7B, 8x22B): experts named w1 (gate), w3 (up), w2 (down) under block_sparse_moe; the
top-2 weights are always renormalised; optional sliding window."""

from hybrid.models.families.common import DECODER_WEIGHTS, Family, Fields, base_fields, make_config, \
    mlp_experts


# MixtralConfig's defaults (transformers) for fields a config.json may leave out.
DEFAULTS = {"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072}


def parse_config(raw: dict):
    f = Fields(raw, "mixtral", DEFAULTS)
    base = base_fields(f)
    L = base["num_layers"]
    return make_config(dict(
        base,
        num_experts=int(f.req("num_local_experts")),
        expert_intermediate_size=int(f.req("intermediate_size")),
        moe_layers=(True,) * L,
        norm_topk_prob=True,
        sliding_window=f.get("sliding_window"),
    ))


_, FUSED = mlp_experts()  # transformers 5 keeps the fused tensors under mlp.experts

FAMILY = Family(
    model_type="mixtral",
    architectures=("MixtralForCausalLM",),
    parse_config=parse_config,
    weights={**DECODER_WEIGHTS, "layers.{i}.moe.router": "model.layers.{i}.block_sparse_moe.gate.weight"},
    experts={w: f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{n}.weight"
             for w, n in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))},
    fused_experts=FUSED,
    # transformers 5 renamed block_sparse_moe to mlp in memory; accept that spelling of the router.
    aliases=((r"^model\.layers\.(\d+)\.mlp\.gate\.weight$", r"model.layers.\1.block_sparse_moe.gate.weight"),),
)
