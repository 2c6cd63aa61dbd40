"""DeepSeek-V3 (V3, R1, V3.1) and the Kimi-K2 text models built on it: Multi-head Latent Attention
(hybrid.models.mla), the sigmoid router with e_score_correction_bias and group-limited top-k, shared
experts added without a gate, and the first `first_k_dense_replace` layers dense. Oracle: transformers'
DeepseekV3ForCausalLM (models/deepseek_v3/modeling_deepseek_v3.py).

Three config.json spellings map here: model_type deepseek_v3; kimi_k2 (Kimi-K2's own config class, same
fields); kimi_k25 (Kimi-K2.5, a vision-language model whose `text_config` is a deepseek_v3 config and whose
text weights sit under `language_model.`; the vision tower is not loaded). Published checkpoints carry a
multi-token-prediction layer at index num_hidden_layers (`model.layers.61.*` in V3); it is a speculative-
decoding head, not part of the model's forward pass, and is skipped with a log line.
"""

from __future__ import annotations

import re

from hybrid.models.config import MLAConfig, RouterConfig
from hybrid.models.errors import ModelLoadError
from hybrid.models.families.common import DECODER_WEIGHTS, Family, Fields, base_fields, make_config, mlp_experts

EXPERTS, FUSED = mlp_experts()
# DeepseekV3Config's defaults (transformers) for fields a config.json may leave out (DeepSeek-V3's own sizes);
# num_key_value_heads is not read: MLA expands keys and values for every query head.
DEFAULTS = {"intermediate_size": 18432, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8,
            "topk_group": 4, "first_k_dense_replace": 3}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def text_config(raw: dict) -> dict:
    """The deepseek_v3 fields of any of the three spellings (Kimi-K2.5: its nested text_config)."""
    if raw.get("model_type") == "kimi_k25":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError("config.json: kimi_k25 without a text_config object")
        if text.get("model_type", "deepseek_v3") not in ("deepseek_v3", "kimi_k2"):
            raise ModelLoadError(f"config.json: kimi_k25 text_config model_type {text.get('model_type')!r} "
                                 "is not deepseek_v3")
        return text
    return raw


def parse_config(raw: dict):
    text = text_config(raw)
    f = Fields(text, "deepseek_v3", DEFAULTS)
    base = base_fields(f)
    L, E = base["num_layers"], int(f.req("n_routed_experts", "num_local_experts"))
    if int(f.get("moe_layer_freq", 1)) != 1:  # DeepSeek-V2 spacing; transformers' V3 has none
        raise ModelLoadError(f"config.json: moe_layer_freq {f.get('moe_layer_freq')} is not supported (only 1)")
    scoring = f.get("scoring_func", "sigmoid")
    if scoring != "sigmoid" or f.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ModelLoadError(f"config.json: router scoring_func {scoring!r} / topk_method {f.get('topk_method')!r} "
                             "is not DeepSeek-V3's (sigmoid, noaux_tc)")
    first_dense = int(f.get("first_k_dense_replace"))
    # absent: DeepseekV3Config's 1536; an explicit null means no q bottleneck (DeepSeek-V2-Lite)
    q_lora = text.get("q_lora_rank", 1536)
    mla = MLAConfig(kv_lora_rank=int(f.req("kv_lora_rank")), qk_nope_head_dim=int(f.req("qk_nope_head_dim")),
                    qk_rope_head_dim=int(f.req("qk_rope_head_dim")), v_head_dim=int(f.req("v_head_dim")),
                    q_lora_rank=None if q_lora is None else int(q_lora),
                    rope_interleave=bool(f.get("rope_interleave", True)))
    n_shared = int(f.get("n_shared_experts"))
    F_ = int(f.req("moe_intermediate_size"))
    return make_config(dict(
        base,
        head_dim=mla.qk_rope_head_dim,  # the rotary tables cover the rope part of q and k only
        num_experts=E,
        expert_intermediate_size=F_,
        dense_intermediate_size=int(f.get("intermediate_size", 0)),
        moe_layers=tuple(i >= first_dense for i in range(L)),
        shared_expert_intermediate_size=F_ * n_shared,
        shared_expert_gate=False,
        norm_topk_prob=bool(f.get("norm_topk_prob", True)),
        router=RouterConfig(kind="sigmoid", n_group=int(f.get("n_group")), topk_group=int(f.get("topk_group")),
                            scaling=float(f.get("routed_scaling_factor")), score_bias=True),
        mla=mla,
        qkv_bias=bool(f.get("attention_bias", False)),
        o_bias=bool(f.get("attention_bias", False)),
    ))


def _attn(ours: str, theirs: str) -> dict[str, str]:
    return {f"layers.{{i}}.attn.{ours}.{t}": f"model.layers.{{i}}.self_attn.{theirs}.{t}" for t in ("weight", "bias")}


WEIGHTS = {
    **DECODER_WEIGHTS,
    **_attn("q_a_proj", "q_a_proj"), **_attn("q_b_proj", "q_b_proj"), **_attn("kv_a_proj", "kv_a_proj_with_mqa"),
    **_attn("kv_b_proj", "kv_b_proj"),
    "layers.{i}.attn.q_a_norm.weight": "model.layers.{i}.self_attn.q_a_layernorm.weight",
    "layers.{i}.attn.kv_a_norm.weight": "model.layers.{i}.self_attn.kv_a_layernorm.weight",
    "layers.{i}.moe.router": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.moe.score_bias": "model.layers.{i}.mlp.gate.e_score_correction_bias",
    **{f"layers.{{i}}.moe.shared.{p}": f"model.layers.{{i}}.mlp.shared_experts.{p}.weight"
       for p in ("gate_proj", "up_proj", "down_proj")},
}


def skipped(name: str, cfg) -> str | None:
    """Why a checkpoint tensor is deliberately not loaded (None: it must be loaded)."""
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= cfg.num_layers:
        return "multi-token-prediction layer (index >= num_hidden_layers; speculative decoding, not used)"
    return None


def skipped_k25(name: str, cfg) -> str | None:
    if not name.startswith(("model.", "lm_head.")):  # what is left after the language_model. aliases
        return "not part of the text model (vision tower, projector)"
    return skipped(name, cfg)


FAMILY = Family(model_type="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), parse_config=parse_config,
                weights=WEIGHTS, experts=EXPERTS, fused_experts=FUSED, skipped=skipped)
KIMI_K2 = Family(model_type="kimi_k2", architectures=(), parse_config=parse_config, weights=WEIGHTS, experts=EXPERTS,
                 fused_experts=FUSED, skipped=skipped)
KIMI_K25 = Family(model_type="kimi_k25", architectures=("KimiK25ForConditionalGeneration",),
                  parse_config=parse_config, weights=WEIGHTS, experts=EXPERTS, fused_experts=FUSED,
                  aliases=((r"^language_model\.model\.", "model."), (r"^language_model\.lm_head\.", "lm_head.")),
                  skipped=skipped_k25)
