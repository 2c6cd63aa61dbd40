"""GLM-4.5 family (glm4_moe) against transformers' Glm4MoeForCausalLM on tiny random configs (the base config
runs in test_model_equality too): padded-batch prefill and decode logits in fp32 within 1e-4 and greedy tokens
identical for each variant (QK-norm on/off, dense first layers 0/1/2, n_group 1/2/4, partial_rotary_factor
0.5/1.0, YaRN over the partial dims, tied/untied head), the router against Glm4MoeTopkRouter, partial rotary
against transformers' apply_rotary_pos_emb, the MTP layer skipped, the hybrid layer's greedy tokens identical
for every schedule and resident count, config defaults and refusals, and the glm-4.5 preset."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("transformers")

from hybrid.models import load_model  # noqa: E402
from hybrid.models.errors import ModelLoadError  # noqa: E402
from hybrid.models.families import family_for  # noqa: E402
from tiny_models import (FAMILIES, GLM_VARIANTS, check_hybrid_strategies, check_logits_and_greedy,  # noqa: E402
                         check_topk_router, edited_checkpoint, engine_greedy, hf_config, hf_greedy, hf_logits,
                         make_checkpoint, single_logits)

PROMPTS = ([5, 77, 3, 200, 41, 9, 17], [250, 1, 64, 33, 2, 8, 90, 100, 101, 7, 6, 5], [9, 9, 31])
VARIANTS = {"base": {}, **GLM_VARIANTS}


def make_glm(out, seed: int, bf16_values: bool = False, **overrides):
    """tiny_models.make_checkpoint for glm4_moe with a random e_score_correction_bias (a buffer, which randomize_
    leaves at zero: a bias the loader dropped would go unnoticed)."""
    return make_checkpoint("glm4_moe", out, seed, extra={"e_score_correction_bias": 0.3}, bf16_values=bf16_values,
                           **overrides)



@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_glm(path, seed=4, **VARIANTS[request.param])
    return request.param, path, hf


def test_variant_config_maps_every_feature(variant):
    name, path, hf = variant
    cfg = load_model(path, progress=False).cfg
    c = hf.config
    assert cfg.family == "glm4_moe" and cfg.mla is None
    assert cfg.rope.partial_rotary_factor == c.rope_parameters["partial_rotary_factor"]
    assert cfg.rope.kind == c.rope_parameters["rope_type"]
    assert cfg.qk_norm == ("head" if c.use_qk_norm else "none")
    assert cfg.qkv_bias == c.attention_bias and not cfg.o_bias
    assert cfg.moe_layers == tuple(i >= c.first_k_dense_replace for i in range(c.num_hidden_layers))
    assert cfg.router.kind == "sigmoid" and cfg.router.score_bias
    assert (cfg.router.n_group, cfg.router.topk_group, cfg.router.scaling) == (c.n_group, c.topk_group,
                                                                               c.routed_scaling_factor)
    assert cfg.shared_expert_intermediate_size == c.n_shared_experts * c.moe_intermediate_size
    assert not cfg.shared_expert_gate and cfg.norm_topk_prob == c.norm_topk_prob
    assert cfg.tie_word_embeddings == c.tie_word_embeddings and cfg.head_dim == c.head_dim


def test_variant_logits_and_greedy_match_transformers(variant):
    name, path, hf = variant
    check_logits_and_greedy(load_model(path, progress=False), hf, PROMPTS, len(PROMPTS), name)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm")
    hf = make_glm(path, seed=6)
    return path, hf


def test_partial_rotary_and_score_bias_matter(base, tmp_path):
    """The checks above would pass by accident if half the head were rotated or the bias ignored anyway:
    changing either in config.json / the weights changes the logits far beyond the tolerance."""
    path, hf = base
    p = list(PROMPTS[1])
    ref = hf_logits(hf, p)
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    full = edited_checkpoint(path, tmp_path, "full", config={"rope_parameters": dict(rope, partial_rotary_factor=1.0)})
    assert (single_logits(load_model(full, progress=False), p) - ref).abs().max().item() > 1e-2
    nobias = edited_checkpoint(path, tmp_path, "nobias", tensors={"e_score_correction_bias": torch.zeros_like})
    assert (single_logits(load_model(nobias, progress=False), p) - ref).abs().max().item() > 1e-2


@pytest.mark.parametrize("factor,kind", [(0.5, "default"), (0.25, "default"), (1.0, "default"), (0.5, "yarn")])
def test_rotary_matches_transformers(factor, kind):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    from hybrid.models.rope import Rotary, apply_rotary

    params = {"rope_type": kind, "rope_theta": 500.0, "partial_rotary_factor": factor}
    if kind == "yarn":
        params.update(factor=8.0, original_max_position_embeddings=16)
    c = hf_config("glm4_moe", head_dim=32, rope_parameters=params)
    ours = family_for(c.to_dict()).parse_config(c.to_dict())
    pos = torch.arange(40)[None]
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g)  # [B, heads, T, hd]
    cos_ref, sin_ref = Glm4MoeRotaryEmbedding(c)(q, pos)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos_ref, sin_ref)
    cos, sin = Rotary(ours.rope, ours.head_dim)(pos, torch.float32)
    assert cos.shape[-1] == int(32 * factor)
    qk = apply_rotary(torch.cat((q, k), 1).transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.allclose(qk[:, :4], q_ref, atol=1e-6) and torch.allclose(qk[:, 4:], k_ref, atol=1e-6)


def test_router_matches_transformers_topk_router():
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    check_topk_router(Glm4MoeTopkRouter, hf_config("glm4_moe", n_routed_experts=32, n_group=4, topk_group=2,
                                                   num_experts_per_tok=6), 6)


def test_mtp_layer_is_skipped_with_a_log_line(base, tmp_path, caplog):
    """GLM-4.5's published layout: num_nextn_predict_layers full decoder layers (attention, MoE) plus the MTP
    module's own tensors at index num_hidden_layers."""
    from safetensors.torch import load_file, save_file

    path, hf = base
    tensors = load_file(str(path / "model.safetensors"))
    L = hf.config.num_hidden_layers
    mtp = {k.replace(f"model.layers.{L - 1}.", f"model.layers.{L}."): v.clone()
           for k, v in tensors.items() if k.startswith(f"model.layers.{L - 1}.")}
    mtp[f"model.layers.{L}.eh_proj.weight"] = torch.ones(64, 128)
    for n in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{L}.{n}.weight"] = torch.ones(64)
    raw = json.loads((path / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1
    (tmp_path / "mtp").mkdir()
    save_file({**tensors, **mtp}, str(tmp_path / "mtp" / "model.safetensors"))
    (tmp_path / "mtp" / "config.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.INFO, logger="hybrid.models"):
        model = load_model(tmp_path / "mtp", progress=False)
    assert f"skipping {len(mtp)} tensor(s): multi-token-prediction layer" in caplog.text
    p = list(PROMPTS[0])
    assert (single_logits(model, p) - hf_logits(hf, p)).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm_bf16")
    hf = make_glm(path, seed=8, bf16_values=True)
    return path, hf


def _greedy(model, n=10):
    return engine_greedy(model, PROMPTS, n)


@pytest.fixture(scope="module")
def reference_tokens(bf16_ckpt):
    path, hf = bf16_ckpt
    tokens = _greedy(load_model(path, progress=False))
    assert tokens == [hf_greedy(hf, p, 10) for p in PROMPTS]
    return tokens


@pytest.mark.parametrize("schedule", ["cost", "cpu", "ship", "threshold:8"])
@pytest.mark.parametrize("n_resident", [0, 3, 8])
def test_hybrid_greedy_identical_across_strategies(bf16_ckpt, reference_tokens, schedule, n_resident):
    path, _ = bf16_ckpt
    check_hybrid_strategies(path, _greedy, reference_tokens, schedule, n_resident)


def test_config_defaults_follow_transformers():
    """Fields a config.json may leave out take Glm4MoeConfig's defaults (partial_rotary_factor 0.5, one dense
    layer, one shared expert, rms_norm_eps 1e-5); the partial factor may also sit at the top level (the
    published GLM-4.5 config.json, written by transformers 4.x)."""
    import transformers

    raw = {"model_type": "glm4_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 8, "intermediate_size": 24,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1e6}
    ref = transformers.Glm4MoeConfig.from_dict(raw)
    cfg = family_for(raw).parse_config(raw)
    assert cfg.rope.partial_rotary_factor == ref.rope_parameters["partial_rotary_factor"] == 0.5
    assert cfg.rope.theta == 1e6 and cfg.moe_layers == (False, True) and ref.first_k_dense_replace == 1
    assert cfg.shared_expert_intermediate_size == 8 * ref.n_shared_experts and cfg.rms_norm_eps == ref.rms_norm_eps
    assert cfg.qk_norm == "none" and not cfg.qkv_bias and cfg.norm_topk_prob == ref.norm_topk_prob
    top = family_for(raw).parse_config(dict(raw, partial_rotary_factor=0.25))
    assert top.rope.partial_rotary_factor == 0.25
    assert transformers.Glm4MoeConfig.from_dict(dict(raw, partial_rotary_factor=0.25)).rope_parameters[
        "partial_rotary_factor"] == 0.25


def test_config_validation():
    raw = hf_config("glm4_moe").to_dict()
    parse = family_for(raw).parse_config
    with pytest.raises(ModelLoadError, match="partial_rotary_factor must be a number in"):
        parse(dict(raw, rope_parameters=dict(raw["rope_parameters"], partial_rotary_factor=1.5)))
    with pytest.raises(ModelLoadError, match="partial_rotary_factor must be a number in"):
        parse(dict(raw, rope_parameters=dict(raw["rope_parameters"], partial_rotary_factor="half")))
    with pytest.raises(ModelLoadError, match="rotary dims .* must be even"):  # 24 x 0.125 = 3
        parse(dict(raw, rope_parameters=dict(raw["rope_parameters"], partial_rotary_factor=0.125)))
    with pytest.raises(ModelLoadError, match="not a multiple of n_group"):
        parse(dict(raw, n_group=3))
    from hybrid.models.checks import check_config_fields

    with pytest.raises(ModelLoadError, match="use_qk_norm must be true or false"):  # bool("false") is True
        check_config_fields(dict(raw, use_qk_norm="false"))
    with pytest.raises(ModelLoadError, match="cannot hold"):
        parse(dict(raw, n_group=4, topk_group=1, num_experts_per_tok=4))


def test_other_families_read_no_partial_rotary():
    """partial_rotary_factor is GLM's: other families' configs are parsed as before even if one carries it."""
    c = hf_config("qwen3_moe")
    raw = dict(c.to_dict(), partial_rotary_factor=0.5)
    assert family_for(raw).parse_config(raw).rope.partial_rotary_factor == 1.0
    assert "glm4_moe" in FAMILIES


def test_glm45_preset_parses_to_the_published_size():
    from hybrid.models.presets import hf_config as preset

    raw = preset("glm-4.5")
    cfg = family_for(raw).parse_config(raw)
    assert (cfg.num_layers, cfg.num_moe_layers, cfg.num_experts, cfg.experts_per_token) == (92, 89, 160, 8)
    assert cfg.rope.partial_rotary_factor == 0.5 and cfg.qk_norm == "head" and cfg.qkv_bias
    n = cfg.param_counts()
    total = n["experts"] + n["non_expert"]
    # 355B published total, which includes the MTP layer (~3.5B here not modelled): 350-355B without it
    assert 345e9 < total < 355e9, total
    active = n["non_expert"] + cfg.num_moe_layers * cfg.experts_per_token * cfg.expert_params
    assert 31e9 < active < 34e9, active  # "32B active"


def test_plan_and_cost_for_the_glm45_preset(capsys):
    """`hybrid plan --preset glm-4.5` (only the config) and `hybrid cost layer --shape glm-4.5`. At bf16 the
    experts (336B parameters, 626 GiB) do not fit a 512 GiB DRAM budget: named, refused in one line naming int8;
    unnamed, the plan takes int8 and says so."""
    from hybrid.cli import main

    argv = ["plan", "--profile", "ktransformers-paper-amx", "--preset", "glm-4.5", "--gpu-budget", "80GiB",
            "--cpu-budget", "512GiB"]
    assert main([*argv, "--cpu-dtype", "bf16"]) == 2
    assert "--cpu-dtype int8" in capsys.readouterr().err
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert "note: CPU dtype int8" in captured.err
    out = json.loads(captured.out)
    assert out["settings"]["cpu_dtype"] == "int8"
    assert out["model"]["num_experts"] == 160 and len(out["layers"]) == 89
    assert out["memory"]["gpu"]["per_resident_expert"] == 3 * 5120 * 1536 * 2
    assert 0 < out["gpu_bytes"] <= out["gpu_budget_bytes"]
    assert main(["cost", "layer", "--shape", "glm-4.5", "--profile", "ktransformers-paper-avx512"]) == 0
    assert "glm-4.5: E=160 top-8" in capsys.readouterr().out
