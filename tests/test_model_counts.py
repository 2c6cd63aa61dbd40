"""The sizes the planner prices a model by (ModelConfig.param_counts, attention_flops_per_key, kv_values_per_token
and placement.memory's bytes), exact for every family: against transformers' model of the same config (its
tensors counted on the meta device), against our own model's tensors, and against hand counts written out."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hybrid.models.families import family_for  # noqa: E402
from hybrid.models.loader import build_empty  # noqa: E402
from placement.memory import MemorySettings, breakdown, expert_bias_bytes  # noqa: E402
from tiny_models import DEEPSEEK_VARIANTS, FAMILIES, GLM_VARIANTS, GPT_OSS_VARIANTS, hf_config  # noqa: E402

CASES = [(mt, {}) for mt in FAMILIES] + [("deepseek_v3", v) for v in DEEPSEEK_VARIANTS.values()] + \
    [("glm4_moe", v) for v in GLM_VARIANTS.values()] + [("gpt_oss", v) for v in GPT_OSS_VARIANTS.values()]
IDS = list(FAMILIES) + [f"deepseek_v3-{k}" for k in DEEPSEEK_VARIANTS] + [f"glm4_moe-{k}" for k in GLM_VARIANTS] + \
    [f"gpt_oss-{k}" for k in GPT_OSS_VARIANTS]


def parsed(model_type: str, overrides: dict):
    ref = hf_config(model_type, **{**FAMILIES[model_type][2], **overrides})
    raw = dict(ref.to_dict(), model_type=model_type)
    return ref, family_for(raw).parse_config(raw)


def hf_counts(ref) -> dict[str, int]:
    """transformers' model's parameters and persistent buffers (e_score_correction_bias), a tied head once."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(ref)
    kept = model.state_dict().keys()
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n in kept)
    experts = sum(t.numel() for n, t in tensors.items() if ".mlp.experts." in n)
    return {"experts": experts, "non_expert": sum(t.numel() for t in tensors.values()) - experts}


@pytest.mark.parametrize("model_type,overrides", CASES, ids=IDS)
def test_param_counts_equal_transformers_tensors(model_type, overrides):
    ref, cfg = parsed(model_type, overrides)
    assert cfg.param_counts() == hf_counts(ref)


@pytest.mark.parametrize("model_type,overrides", CASES, ids=IDS)
def test_non_expert_bytes_equal_our_model_at_bf16(model_type, overrides):
    """placement.memory's VRAM for the non-expert weights is what our model allocates for them in bf16 (the
    sigmoid router's fp32 weights included), plus the routed experts' fp32 biases the GPU keeps (gpt-oss)."""
    _, cfg = parsed(model_type, overrides)
    model = build_empty(cfg, "meta", torch.bfloat16, build_experts=False)
    allocated = sum(p.numel() * p.element_size() for p in model.parameters())
    assert breakdown(cfg, MemorySettings()).non_expert == allocated + expert_bias_bytes(cfg)


def test_mla_and_shared_expert_by_hand():
    """DeepSeek-V3's tiny config (tests/tiny_models.py) counted by hand: D 64, H 4, vocab 256, 3 layers of which
    the first is dense (F 96), 8 routed experts of F 32 and one shared expert of F 32, MLA q_lora 24, kv_lora 32,
    nope 16, rope 8, v 12."""
    _, cfg = parsed("deepseek_v3", {})
    D, H = 64, 4
    q = D * 24 + 24 + 24 * H * (16 + 8)  # q_a_proj, q_a_layernorm, q_b_proj
    kv = D * (32 + 8) + 32 + 32 * H * (16 + 12)  # kv_a_proj_with_mqa (latent and rope rows), layernorm, kv_b_proj
    o = H * 12 * D
    layer = q + kv + o + 2 * D  # + input and post-attention norms
    dense = 3 * D * 96
    moe = 8 * D + 8 + 3 * D * 32  # router, e_score_correction_bias, shared expert (gate, up, down)
    embed_head_norm = 2 * 256 * D + D
    assert cfg.param_counts() == {"experts": 2 * 8 * 3 * D * 32,
                                  "non_expert": 3 * layer + dense + 2 * moe + embed_head_norm}
    assert cfg.kv_values_per_token == 3 * (32 + 8)  # the latent and the rope key per layer


def test_attention_flops_per_key_by_hand():
    """Per query token, key position and layer: grouped-query attention 2 H hd (scores) + 2 H hd (weighted
    values); MLA prefill the same over expanded heads (qk 16 + 8, v 12); MLA decode in latent space: scores
    over latent + rope key (32 + 8), values over the latent (32)."""
    _, gqa = parsed("qwen3_moe", {})
    assert gqa.attention_flops_per_key(prefill=True) == gqa.attention_flops_per_key(prefill=False) == 4 * 4 * 16
    _, mla = parsed("deepseek_v3", {})
    H = 4
    assert mla.attention_flops_per_key(prefill=True) == 2 * H * (16 + 8) + 2 * H * 12
    assert mla.attention_flops_per_key(prefill=False) == 2 * H * (32 + 8) + 2 * H * 32


def test_mla_decode_flops_per_key_equal_the_absorbed_attention():
    """The decode figure is what the absorbed attention (hybrid.models.mla) spends per extra cached position,
    measured by torch's FLOP counter: one query token against 8, then 24 cached keys."""
    from torch.utils.flop_counter import FlopCounterMode

    from hybrid.models.mla import MLAttention

    _, cfg = parsed("deepseek_v3", {})
    attn = MLAttention(cfg, 0)
    m, H = cfg.mla, cfg.num_heads

    def flops(keys: int) -> int:
        q_nope = torch.randn(1, 1, H, m.qk_nope_head_dim)
        q_rope = torch.randn(1, 1, H, m.qk_rope_head_dim)
        lat = torch.randn(1, keys, m.kv_lora_rank + m.qk_rope_head_dim)
        with FlopCounterMode(display=False) as counter:
            attn._absorbed(q_nope, q_rope, lat, None)
        return counter.get_total_flops()

    assert (flops(24) - flops(8)) / 16 == cfg.attention_flops_per_key(prefill=False)
