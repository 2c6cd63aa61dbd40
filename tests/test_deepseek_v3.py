"""DeepSeek-V3 family against transformers' DeepseekV3ForCausalLM on tiny random configs (the base config
runs in test_model_equality too): padded-batch prefill and decode logits in fp32 within 1e-4, greedy tokens
identical, the absorbed (latent-space) decode equal to the expanded form, the latent-only KV cache, the
router against transformers' DeepseekV3TopkRouter, the MTP layer skipped, and the Kimi-K2 / K2.5 configs."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("transformers")

from hybrid.models import load_model  # noqa: E402
from hybrid.models.families import family_for  # noqa: E402
from hybrid.models.mla import MLAttention  # noqa: E402
from hybrid.runtime import Engine  # noqa: E402
from tiny_models import (DEEPSEEK_VARIANTS, check_logits_and_greedy, check_topk_router, hf_config,  # noqa: E402
                         hf_logits, make_checkpoint, single_logits)

PROMPTS = ([5, 77, 3, 200, 41, 9, 17], [250, 1, 64, 33, 2, 8, 90, 100, 101, 7, 6, 5], [9, 9, 31])



@pytest.fixture(scope="module", params=sorted(DEEPSEEK_VARIANTS))
def variant(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint("deepseek_v3", path, seed=4, **DEEPSEEK_VARIANTS[request.param])
    return request.param, path, hf


def test_variant_logits_and_greedy_match_transformers(variant):
    name, path, hf = variant
    model = load_model(path, progress=False)
    cfg = model.cfg
    over = DEEPSEEK_VARIANTS[name]
    assert cfg.mla.q_lora_rank == over.get("q_lora_rank", 24) and cfg.tie_word_embeddings == over.get(
        "tie_word_embeddings", False)
    assert cfg.router.n_group == over["n_group"] and cfg.moe_layers.count(False) == over["first_k_dense_replace"]
    check_logits_and_greedy(model, hf, PROMPTS, 2, name)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3")
    hf = make_checkpoint("deepseek_v3", path, seed=6)
    return path, hf


def _set_mode(model, mode):
    layers = [layer.attn for layer in model.layers if isinstance(layer.attn, MLAttention)]
    assert len(layers) == model.cfg.num_layers
    for attn in layers:
        attn.mode = mode


def test_absorbed_decode_matches_expanded(base):
    path, _ = base
    outs = {}
    for mode in ("expanded", "absorbed"):
        model = load_model(path, progress=False)
        _set_mode(model, mode)
        engine = Engine(model, max_batch=2, max_context=40)
        slot = engine.allocate_slot()
        first = engine.prefill(slot, list(PROMPTS[1][:6]))  # fresh prefill
        rest = engine.prefill(slot, list(PROMPTS[1][6:]))  # continues over the cache
        steps = [engine.decode_step([slot], [t])[0].clone() for t in (3, 99, 180)]
        outs[mode] = torch.stack([first, rest, *steps])
    assert (outs["expanded"] - outs["absorbed"]).abs().max().item() <= 1e-4
    # not trivially equal: the two forms round differently
    assert not torch.equal(outs["expanded"], outs["absorbed"])


def test_cache_holds_only_latent_and_rope_key(base):
    from placement.memory import MemorySettings, breakdown

    path, _ = base
    model = load_model(path, progress=False)
    m = model.cfg.mla
    engine = Engine(model, max_batch=3, max_context=20)
    assert list(engine.cache.buffers) == ["latent"]
    assert engine.cache.buffers["latent"].shape == (model.cfg.num_layers, 3, 21, m.kv_lora_rank + m.qk_rope_head_dim)
    mem = breakdown(model.cfg, MemorySettings(max_context=20, max_batch=3, gpu_dtype_bytes=4))
    assert mem.kv_cache == engine.cache.nbytes == model.cfg.num_layers * 3 * 21 * (32 + 8) * 4


def test_router_matches_transformers_topk_router():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from hybrid.models.moe import select_experts

    cfg = hf_config("deepseek_v3", n_routed_experts=32, n_group=8, topk_group=3, num_experts_per_tok=6)
    logits, ours, _, ids = check_topk_router(DeepseekV3TopkRouter, cfg, 6)
    # the bias must only steer the choice: unbiased and biased scores choose different experts here
    ids_nobias, _ = select_experts(logits, ours.router, 6, True, None)
    assert not torch.equal(ids_nobias.sort(-1).values, ids)


def _save(tensors: dict, path, config: dict):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def test_mtp_layer_is_skipped_with_a_log_line(base, tmp_path, caplog):
    from safetensors.torch import load_file

    path, hf = base
    tensors = load_file(str(path / "model.safetensors"))
    L = hf.config.num_hidden_layers
    tensors[f"model.layers.{L}.eh_proj.weight"] = torch.ones(64, 128)  # the MTP module's own tensors
    tensors[f"model.layers.{L}.enorm.weight"] = torch.ones(64)
    _save(tensors, tmp_path / "mtp", json.loads((path / "config.json").read_text()))
    with caplog.at_level(logging.INFO, logger="hybrid.models"):
        model = load_model(tmp_path / "mtp", progress=False)
    assert "skipping 2 tensor(s): multi-token-prediction layer" in caplog.text
    p = list(PROMPTS[0])
    assert (single_logits(model, p) - hf_logits(hf, p)).abs().max().item() <= 1e-4


def test_kimi_k2_config_maps_onto_deepseek_v3(base):
    path, _ = base
    raw = json.loads((path / "config.json").read_text())
    ds = family_for(raw).parse_config(raw)
    k2 = dict(raw, model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    assert family_for(k2).parse_config(k2) == ds
    k25 = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
           "text_config": dict(raw, model_type="kimi_k2"), "vision_config": {"hidden_size": 8}}
    assert family_for(k25).parse_config(k25) == ds


def test_kimi_k25_checkpoint_loads_its_text_model(base, tmp_path, caplog):
    """Kimi-K2.5's layout: text weights under language_model., a vision tower beside them (not loaded)."""
    from safetensors.torch import load_file

    path, hf = base
    raw = json.loads((path / "config.json").read_text())
    tensors = {"language_model." + k: v for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.ones(8, 8)
    tensors["mm_projector.proj.0.weight"] = torch.ones(8, 8)
    _save(tensors, tmp_path / "k25", {"model_type": "kimi_k25", "text_config": dict(raw, model_type="kimi_k2")})
    with caplog.at_level(logging.INFO, logger="hybrid.models"):
        model = load_model(tmp_path / "k25", progress=False)
    assert "skipping 2 tensor(s): not part of the text model" in caplog.text
    p = list(PROMPTS[2])
    assert (single_logits(model, p) - hf_logits(hf, p)).abs().max().item() <= 1e-4


def test_config_validation():
    from hybrid.models.errors import ModelLoadError

    raw = hf_config("deepseek_v3").to_dict()
    with pytest.raises(ModelLoadError, match="topk_group 1 groups of 2 experts cannot hold 4"):
        family_for(raw).parse_config(dict(raw, topk_group=1, num_experts_per_tok=4))
    with pytest.raises(ModelLoadError, match="not a multiple of n_group"):
        family_for(raw).parse_config(dict(raw, n_group=3))
    with pytest.raises(ModelLoadError, match="scoring_func 'softmax'"):
        family_for(raw).parse_config(dict(raw, scoring_func="softmax"))
