"""gpt-oss family (gpt_oss) against transformers' GptOssForCausalLM on tiny random configs: padded-batch prefill and
decode logits in fp32 within 1e-4 and greedy tokens identical for each variant (layer patterns sliding-first /
all full / full-first, windows 3, 4 and wider than the prompts, YaRN truncated or not / plain rope, tied or
untied head, with and without attention biases, one or two kv heads), checks that sinks, the window and the
SwiGLU clamp each matter, sink attention's query chunking, the router and experts against transformers'
modules, the hybrid layer's greedy tokens for every schedule and resident count, config refusals, and the
gpt-oss-120b preset. MXFP4 checkpoints: tests/test_gpt_oss_mxfp4.py."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from hybrid.models import load_model  # noqa: E402
from hybrid.models.errors import ModelLoadError  # noqa: E402
from hybrid.models.families import family_for  # noqa: E402
from tiny_models import (GPT_OSS_VARIANTS, check_hybrid_strategies, check_logits_and_greedy,  # noqa: E402
                         engine_greedy, hf_config, hf_logits, edited_checkpoint, make_checkpoint,
                         reference_tokens_of, single_logits)

PROMPTS = ([5, 77, 3, 200, 41, 9, 17], [250, 1, 64, 33, 2, 8, 90, 100, 101, 7, 6, 5], [9, 9, 31])
VARIANTS = {"base": {}, **GPT_OSS_VARIANTS}


def make_gpt_oss(out, seed: int, bf16_values: bool = False, **overrides):
    """tiny_models.make_checkpoint for gpt_oss with sinks drawn N(0, 1) so that they move the softmax well beyond
    the tolerance."""
    return make_checkpoint("gpt_oss", out, seed, extra={"sinks": 1.0}, bf16_values=bf16_values, **overrides)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_gpt_oss(path, seed=3, **VARIANTS[request.param])
    return request.param, path, hf


def test_variant_config_maps_every_feature(variant):
    name, path, hf = variant
    cfg = load_model(path, progress=False).cfg
    c = hf.config
    assert cfg.family == "gpt_oss" and cfg.mla is None and cfg.attention_sinks and cfg.router_bias
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in c.layer_types)
    assert [cfg.window_of(i) for i in range(cfg.num_layers)] == [
        c.sliding_window if t == "sliding_attention" else None for t in c.layer_types]
    assert cfg.rope.kind == c.rope_parameters["rope_type"]
    assert cfg.qkv_bias == cfg.o_bias == c.attention_bias
    assert cfg.expert_fn.activation == "swiglu_oai" and cfg.expert_fn.bias
    assert (cfg.expert_fn.alpha, cfg.expert_fn.limit) == (c.swiglu_alpha, c.swiglu_limit)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_intermediate_size) == (
        c.num_local_experts, c.num_experts_per_tok, c.intermediate_size)
    assert cfg.tie_word_embeddings == c.tie_word_embeddings and cfg.norm_topk_prob


def test_variant_logits_and_greedy_match_transformers(variant):
    name, path, hf = variant
    check_logits_and_greedy(load_model(path, progress=False), hf, PROMPTS, len(PROMPTS), name)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = make_gpt_oss(path, seed=5)
    return path, hf


@pytest.mark.parametrize("edit", ["no_sinks", "no_window", "limit_7", "no_expert_bias", "no_router_bias"])
def test_each_feature_changes_the_logits(base, tmp_path, edit):
    """The equality checks would pass by accident if a feature did nothing on these weights: undoing each one
    (sinks zeroed, the window turned off, the clamp limit at 7 that the tiny weights never reach, biases
    zeroed) moves the logits of a 12-token prompt far beyond the tolerance."""
    path, hf = base
    edits = {"no_sinks": dict(tensors={"sinks": lambda v: torch.full_like(v, -1e4)}),
             "no_window": dict(config={"layer_types": ["full_attention"] * 3}),
             "limit_7": dict(config={"swiglu_limit": 7.0}),
             "no_expert_bias": dict(tensors={"proj_bias": torch.zeros_like}),
             "no_router_bias": dict(tensors={"router.bias": torch.zeros_like})}
    p = list(PROMPTS[1])
    ref = hf_logits(hf, p)
    assert (single_logits(load_model(path, progress=False), p) - ref).abs().max().item() <= 1e-4
    changed = single_logits(load_model(edited_checkpoint(path, tmp_path, edit, **edits[edit]), progress=False), p)
    assert (changed - ref).abs().max().item() > 1e-2, edit


def test_sink_attention_chunks_give_the_same_result():
    """Long prefills split the queries into chunks (SINK_CHUNK_VALUES); any chunk size gives the same output,
    which equals transformers' eager formula (sink column concatenated, softmax, dropped)."""
    from hybrid.models.layers import folded_causal_mask, sink_attention

    g = torch.Generator().manual_seed(0)
    B, Hkv, rep, T, hd = 2, 2, 3, 9, 8
    q, k, v = (torch.randn(B, Hkv, n, hd, generator=g) for n in (rep * T, T, T))
    sinks = torch.randn(Hkv * rep, generator=g)
    pos = torch.arange(T).repeat(B, 1)
    mask = folded_causal_mask(pos, T, rep, 4, {})
    full = sink_attention(q, k, v, mask, sinks, 0.3, rep)
    for c in (1, rep * T * 2, rep * T * 5):
        assert torch.allclose(sink_attention(q, k, v, mask, sinks, 0.3, rep, chunk_values=B * Hkv * c), full,
                              atol=1e-6)
    s = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))  # [B, Hkv, rep*T, T]
    sk = sinks.view(Hkv, rep, 1).expand(Hkv, rep, T).reshape(1, Hkv, rep * T, 1).expand(B, -1, -1, -1)
    p = torch.softmax(torch.cat([s, sk], -1), -1)[..., :-1]
    assert torch.allclose(p @ v, full, atol=1e-6)


def test_router_and_experts_match_transformers():
    """select_experts with the router bias against GptOssTopKRouter; StackedExperts (grouped and dense modes)
    against GptOssExperts on weights whose gate/up values reach the clamp limit."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    from hybrid.models.moe import StackedExperts, select_experts

    c = hf_config("gpt_oss", num_local_experts=16, num_experts_per_tok=4, swiglu_limit=1.5)
    ours = family_for(c.to_dict()).parse_config(c.to_dict())
    g = torch.Generator().manual_seed(2)
    router, experts = GptOssTopKRouter(c), GptOssExperts(c)
    with torch.no_grad():
        for p in list(router.parameters()) + list(experts.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(40, c.hidden_size, generator=g)
    _, w_ref, ids_ref = router(x)
    ids, w = select_experts(torch.nn.functional.linear(x, router.weight, router.bias), ours.router, 4, True)
    assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, atol=1e-6)
    gu, gb = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    ex = StackedExperts.from_weights(gu[:, :, 0::2].transpose(1, 2).contiguous(), gu[:, :, 1::2].transpose(1, 2).contiguous(),
                                     experts.down_proj.detach().transpose(1, 2).contiguous(), ours.expert_fn,
                                     (gb[:, 0::2], gb[:, 1::2], experts.down_proj_bias.detach()))
    with torch.no_grad():
        ref = experts(x, ids_ref, w_ref)
        for mode in ("auto", "dense"):
            ex.mode = mode
            assert (ex(x, ids, w) - ref).abs().max().item() <= 1e-4, mode
        h = x @ gu[0]
        assert h.abs().max() > 1.5  # the clamp is reached


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_bf16")
    hf = make_gpt_oss(path, seed=8, bf16_values=True, num_hidden_layers=2)
    return path, hf


def _greedy(model, n=10):
    return engine_greedy(model, PROMPTS, n)


@pytest.fixture(scope="module")
def reference_tokens(bf16_ckpt):
    return reference_tokens_of(*bf16_ckpt, PROMPTS)


@pytest.mark.parametrize("schedule", ["cost", "cpu", "ship", "threshold:8"])
@pytest.mark.parametrize("n_resident", [0, 3, 8])
def test_hybrid_greedy_identical_across_strategies(bf16_ckpt, reference_tokens, schedule, n_resident):
    path, _ = bf16_ckpt
    check_hybrid_strategies(path, _greedy, reference_tokens, schedule, n_resident, moe_layers=2)


def test_hybrid_compiled_kernels_match_the_reference(bf16_ckpt, reference_tokens):
    """The compiled CPU executor (this machine's best ISA, bf16 weights, biases and the clamped SwiGLU in the
    kernels) gives the same greedy tokens with every cold expert on the CPU."""
    import cpu_kernels

    isa = cpu_kernels.available_isas()[0]
    if isa == "ref":
        pytest.skip("no compiled ISA on this machine")
    path, _ = bf16_ckpt
    check_hybrid_strategies(path, _greedy, reference_tokens, "cpu", 2, moe_layers=2, cpu_isa=isa)


def _raw(**kw):
    return dict(hf_config("gpt_oss").to_dict(), **kw)


def test_config_defaults_follow_transformers():
    """Fields a config.json may leave out take GptOssConfig's defaults: layer_types alternating from a sliding
    layer, YaRN x32 over 4096 positions with theta 150000 (not truncated), attention biases, alpha 1.702,
    limit 7, rms_norm_eps 1e-5."""
    import transformers

    raw = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 32,
           "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 131072}
    ref = transformers.GptOssConfig.from_dict(raw)
    cfg = family_for(raw).parse_config(raw)
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in ref.layer_types) == (True, False, True)
    assert cfg.sliding_window == ref.sliding_window == 128
    rp = ref.rope_parameters
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.original_max_position, cfg.rope.theta, cfg.rope.truncate) == (
        rp["rope_type"], rp["factor"], rp["original_max_position_embeddings"], rp["rope_theta"], rp["truncate"])
    assert cfg.qkv_bias and cfg.o_bias and ref.attention_bias
    assert (cfg.expert_fn.alpha, cfg.expert_fn.limit) == (ref.swiglu_alpha, ref.swiglu_limit)
    assert cfg.rms_norm_eps == ref.rms_norm_eps


@pytest.mark.parametrize("fields,match", [
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types must list 3 entries"),
    (dict(layer_types=["sliding", "full_attention", "full_attention"]), "layer_types must list"),
    (dict(sliding_window=None), "sliding_window is null"),
    (dict(swiglu_limit=0), "swiglu_limit must be a positive"),
    (dict(swiglu_alpha="1.7"), "swiglu_alpha must be a positive"),
    (dict(num_experts_per_tok=9), "experts_per_token 9 > num_experts 8"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_config_refusals(fields, match):
    from hybrid.models.checks import check_config_fields

    raw = _raw(**fields)
    with pytest.raises(ModelLoadError, match=match):
        check_config_fields(raw)
        family_for(raw).parse_config(raw)


def test_missing_expert_tensors_are_named(base, tmp_path):
    path, _ = base
    from safetensors.torch import load_file, save_file

    t = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if k != "model.layers.1.mlp.experts.down_proj"}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((path / "config.json").read_text())
    save_file(t, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.1.mlp.experts.down_proj'"):
        load_model(tmp_path / "m", progress=False)


def test_gpt_oss_120b_preset_parses_to_the_published_size():
    """openai/gpt-oss-120b's model card: 116.8B parameters in total, 5.1B active per token (the input embedding
    table not counted as active)."""
    from hybrid.models.presets import hf_config as preset

    raw = preset("gpt-oss-120b")
    cfg = family_for(raw).parse_config(raw)
    assert (cfg.num_layers, cfg.num_moe_layers, cfg.num_experts, cfg.experts_per_token) == (36, 36, 128, 4)
    assert cfg.sliding_layers == (True, False) * 18 and cfg.sliding_window == 128 and cfg.attention_sinks
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.original_max_position, cfg.rope.truncate) == ("yarn", 32.0, 4096,
                                                                                                    False)
    n = cfg.param_counts()
    total = n["experts"] + n["non_expert"]
    assert 116.7e9 < total < 116.9e9, total
    active = n["non_expert"] - cfg.vocab_size * cfg.hidden_size + cfg.num_moe_layers * cfg.experts_per_token * \
        cfg.expert_params
    assert 5.08e9 < active < 5.18e9, active
    cut = preset("gpt-oss-120b", layers=3)
    assert family_for(cut).parse_config(cut).sliding_layers == (True, False, True)


def test_plan_and_cost_for_the_gpt_oss_preset(capsys):
    """`hybrid plan --preset gpt-oss-120b` (only the config) prices DRAM experts at the CPU dtype (mxfp4: 0.53125
    bytes a weight, bf16: 2) and VRAM residents at bf16; `hybrid cost layer --shape gpt-oss-120b`."""
    from hybrid.cli import main

    argv = ["plan", "--profile", "ktransformers-paper-amx", "--preset", "gpt-oss-120b", "--gpu-budget", "80GiB",
            "--cpu-budget", "256GiB", "--json"]
    dram = {}
    for dtype in ("mxfp4", "bf16"):
        assert main([*argv, "--cpu-dtype", dtype]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["model"]["num_experts"] == 128 and len(out["layers"]) == 36
        assert out["memory"]["gpu"]["per_resident_expert"] == 3 * 2880 * 2880 * 2
        assert 0 < out["gpu_bytes"] <= out["gpu_budget_bytes"]
        dram[dtype] = out["memory"]["cpu"]["per_expert"]
        assert out["memory"]["cpu"]["experts"] == 36 * 128 * dram[dtype]
    assert dram == {"mxfp4": 3 * 2880 * 2880 * 0.53125, "bf16": 3 * 2880 * 2880 * 2}
    assert main(argv[:-1] + ["--cpu-dtype", "mxfp4"]) == 0
    text = capsys.readouterr().out
    assert "model preset gpt-oss-120b: 36 MoE layers x 128 experts" in text and "predicted" in text
    assert main(["cost", "layer", "--shape", "gpt-oss-120b", "--profile", "ktransformers-paper-avx512"]) == 0
    assert "gpt-oss-120b: E=128 top-4" in capsys.readouterr().out


def test_make_checkpoint_writes_mxfp4(tmp_path, monkeypatch):
    """bench.make_checkpoint --preset gpt-oss-120b --mxfp4 (the preset swapped for the tiny config: a real layer is
    3.2B weights) writes a checkpoint that loads; --fp8 with --mxfp4 is refused."""
    import bench.make_checkpoint as mk

    tiny = hf_config("gpt_oss").to_dict()
    monkeypatch.setattr(mk, "hf_config", lambda name, layers=None: dict(tiny, num_hidden_layers=layers,
                                                                         layer_types=tiny["layer_types"][:layers]))
    assert mk.main(["--preset", "gpt-oss-120b", "--layers", "2", "--mxfp4", "--tokenizer", "none",
                    "--out", str(tmp_path / "ck")]) == 0
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "mxfp4" and raw["num_hidden_layers"] == 2
    assert load_model(tmp_path / "ck", progress=False).cfg.num_layers == 2
    with pytest.raises(SystemExit):
        mk.main(["--preset", "gpt-oss-120b", "--fp8", "--mxfp4", "--out", str(tmp_path / "x")])
