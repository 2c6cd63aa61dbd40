"""Checkpoint errors say what is wrong; the alternate layouts (shards, fused experts) load; the expert
placement hook keeps experts where it is told; RoPE scalings equal transformers' frequencies."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from hybrid.cli import main  # noqa: E402
from hybrid.models import ModelLoadError, StackedExperts, load_model  # noqa: E402
from hybrid.models.families import FAMILIES  # noqa: E402
from hybrid.models.rope import inv_frequencies  # noqa: E402
from hybrid.runtime import Engine  # noqa: E402
from tiny_models import hf_config, hf_logits, make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("q3")
    hf = make_checkpoint("qwen3_moe", path, seed=5)
    return path, hf


def copy(ckpt, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(ckpt[0], dst)
    return dst


def rewrite(path, fn):
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def logits_of(path, ids, **kw):
    engine = Engine(load_model(path, progress=False, **kw), max_batch=1, max_context=32)
    return engine.forward(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]))[0]


def test_truncated_safetensors(ckpt, tmp_path):
    p = copy(ckpt, tmp_path)
    f = p / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"truncated safetensors file \(expected \d+ bytes, found \d+\)"):
        load_model(p, progress=False)


def test_missing_tensor_is_named(ckpt, tmp_path):
    p = copy(ckpt, tmp_path)
    rewrite(p, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        load_model(p, progress=False)


def test_missing_expert_is_named(ckpt, tmp_path):
    p = copy(ckpt, tmp_path)
    rewrite(p, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight'"):
        load_model(p, progress=False)


def test_unexpected_tensor_is_named(ckpt, tmp_path):
    p = copy(ckpt, tmp_path)
    rewrite(p, lambda t: t.__setitem__("model.layers.0.mlp.experts.99.gate_proj.weight", torch.zeros(2)))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.99\.gate_proj"):
        load_model(p, progress=False)


def test_shape_mismatch_expected_vs_found(ckpt, tmp_path):
    p = copy(ckpt, tmp_path)
    rewrite(p, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 32)))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight': shape mismatch, "
                                             r"expected \[64, 64\], found \[64, 32\]"):
        load_model(p, progress=False)


def test_unknown_model_type_lists_supported(ckpt, tmp_path):
    p = copy(ckpt, tmp_path)
    cfg = json.loads((p / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama4_moe", ["Llama4ForCausalLM"]
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        load_model(p, progress=False)
    msg = str(err.value)
    assert "unsupported architecture" in msg and "'llama4_moe'" in msg
    assert all(t in msg for t in FAMILIES)


def test_missing_config_field_and_files(ckpt, tmp_path):
    p = copy(ckpt, tmp_path)
    cfg = json.loads((p / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"missing field 'moe_intermediate_size'"):
        load_model(p, progress=False)
    (p / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing file: .*config\.json"):
        load_model(p, progress=False)
    with pytest.raises(ModelLoadError, match=r"model directory not found"):
        load_model(tmp_path / "nowhere", progress=False)


def test_pickle_only_checkpoint_is_refused(ckpt, tmp_path):
    p = copy(ckpt, tmp_path)
    (p / "model.safetensors").unlink()
    (p / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors .*pytorch_model\.bin.*pickle"):
        load_model(p, progress=False)


def test_cli_reports_load_errors_in_one_line(ckpt, tmp_path, capsys):
    p = copy(ckpt, tmp_path)
    rewrite(p, lambda t: t.pop("lm_head.weight"))
    assert main(["generate", "--model", str(p), "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "hybrid generate: error: missing tensor 'lm_head.weight'"


def test_sharded_and_fused_layouts_load_identically(ckpt, tmp_path):
    """Shards with an index, and the fused [E, 2F, D] expert layout transformers 5 uses in memory."""
    from safetensors.torch import load_file, save_file

    path, hf = ckpt
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = hf_logits(hf, ids)
    tensors = load_file(str(path / "model.safetensors"))
    fused = {}
    for i in range(3):
        pre = f"model.layers.{i}.mlp.experts"
        g = torch.stack([tensors.pop(f"{pre}.{e}.gate_proj.weight") for e in range(8)])
        u = torch.stack([tensors.pop(f"{pre}.{e}.up_proj.weight") for e in range(8)])
        d = torch.stack([tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(8)])
        fused[f"{pre}.gate_up_proj"] = torch.cat([g, u], dim=1).contiguous()
        fused[f"{pre}.down_proj"] = d
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(path / "config.json", out)
    names = sorted(tensors) + sorted(fused)
    half = len(names) // 2
    every = {**tensors, **fused}
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: every[k] for k in keys}, str(out / shard))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    assert (logits_of(out, ids) - ref).abs().max().item() <= 1e-4
    (out / "b.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing file: .*b\.safetensors"):
        load_model(out, progress=False)


def test_expert_hook_places_experts_and_builds_executors(ckpt):
    path, hf = ckpt
    seen = []

    def factory(layer, w_gate, w_up, w_down):
        seen.append((layer, w_gate.dtype, tuple(w_gate.shape), tuple(w_down.shape)))
        return StackedExperts.from_weights(w_gate, w_up, w_down)

    model = load_model(path, progress=False, expert_device="cpu", expert_dtype=torch.bfloat16,
                       experts_factory=factory)
    assert seen == [(i, torch.bfloat16, (8, 32, 64), (8, 64, 32)) for i in range(3)]
    assert model.layers[0].moe.experts.w_gate.dtype == torch.bfloat16
    assert model.embed.dtype == torch.float32


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 2048,
     "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
])
def test_rope_scalings_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_config("qwen3_moe", rope_parameters=dict(rope), max_position_embeddings=32768)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    ours = FAMILIES["qwen3_moe"].parse_config(cfg.to_dict())
    inv, scale = inv_frequencies(ours.rope, ours.head_dim)
    assert torch.allclose(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_legacy_rope_fields_are_read():
    raw = hf_config("qwen3_moe").to_dict()
    raw.pop("rope_parameters")
    raw["rope_theta"] = 5000.0
    raw["rope_scaling"] = {"type": "linear", "factor": 3.0}
    cfg = FAMILIES["qwen3_moe"].parse_config(raw)
    assert (cfg.rope.theta, cfg.rope.kind, cfg.rope.factor) == (5000.0, "linear", 3.0)
    raw["rope_scaling"] = {"type": "dynamic", "factor": 3.0}
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'dynamic'"):
        FAMILIES["qwen3_moe"].parse_config(raw)


def test_mixtral_transformers5_router_spelling(tmp_path):
    """transformers 5 calls Mixtral's router mlp.gate in memory; a checkpoint saved that way loads."""
    from safetensors.torch import load_file, save_file

    hf = make_checkpoint("mixtral", tmp_path, seed=6)
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    for i in range(3):
        t[f"model.layers.{i}.mlp.gate.weight"] = t.pop(f"model.layers.{i}.block_sparse_moe.gate.weight")
    save_file(t, str(f))
    ids = [5, 4, 3, 2, 1, 7, 9]
    assert (logits_of(tmp_path, ids) - hf_logits(hf, ids)).abs().max().item() <= 1e-4


# EOS ids: config.json's, then those generation_config.json adds (transformers' generate stops on the latter).
@pytest.mark.parametrize("config_eos,generation_eos,merged", [
    ([5, 6], [6, 7], (5, 6, 7)),  # config's first, in order, the shared id once
    (5, 9, (5, 9)),  # single ids
    (None, [3], (3,)),  # only generation_config.json names one
    (5, None, (5,)),  # generation_config.json without eos_token_id changes nothing
])
def test_generation_config_eos_ids_are_added_to_config_ids(tmp_path, config_eos, generation_eos, merged):
    from hybrid.models.loader import read_config

    (tmp_path / "config.json").write_text(json.dumps(dict(hf_config("qwen3_moe").to_dict(), model_type="qwen3_moe",
                                                          eos_token_id=config_eos)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos, "do_sample": True}))
    assert read_config(tmp_path)[1].eos_token_ids == merged


def test_gpt_oss_stops_on_the_ids_only_generation_config_names(tmp_path):
    """openai/gpt-oss-120b: config.json names <|return|> (200002); its generation_config.json adds <|endoftext|>
    (199999) and <|call|> (200012), which end a tool-calling turn."""
    from hybrid.models.loader import read_config
    from hybrid.models.presets import hf_config as preset

    (tmp_path / "config.json").write_text(json.dumps(preset("gpt-oss-120b", layers=2)))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 199998, "do_sample": True, "eos_token_id": [200002, 199999, 200012], "pad_token_id": 199999}))
    assert read_config(tmp_path)[1].eos_token_ids == (200002, 199999, 200012)


# Fields a config.json leaves out mean what they mean to transformers (each family's config class): a config
# holding only the fields neither side defaults is parsed against transformers' config and model of it.
MINIMAL = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=16, moe_intermediate_size=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=16, moe_intermediate_size=8)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=16, intermediate_size=8)),
    "olmoe": ("OlmoeConfig", dict(num_experts=16, intermediate_size=8)),
    "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=16, moe_intermediate_size=8, kv_lora_rank=16,
                                             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)),
    "glm4_moe": ("Glm4MoeConfig", dict(n_routed_experts=16, moe_intermediate_size=8)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=16, intermediate_size=8)),
}


@pytest.mark.parametrize("model_type", list(MINIMAL))
def test_config_defaults_follow_transformers(model_type):
    import transformers

    cls, fields = MINIMAL[model_type]
    raw = dict(model_type=model_type, vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=16,
               num_experts_per_tok=2, **fields)
    ref = getattr(transformers, cls).from_dict(raw)
    cfg = FAMILIES[model_type].parse_config(raw)
    get = lambda name, default: default if getattr(ref, name, None) is None else getattr(ref, name)  # noqa: E731
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
        ref.rms_norm_eps, ref.max_position_embeddings, ref.tie_word_embeddings)
    assert (cfg.rope.theta, cfg.rope.kind) == (ref.rope_parameters["rope_theta"], ref.rope_parameters["rope_type"])
    assert cfg.rope.partial_rotary_factor == ref.rope_parameters.get("partial_rotary_factor", 1.0)
    assert cfg.norm_topk_prob == get("norm_topk_prob", True)  # Mixtral always renormalises
    r = cfg.router
    assert (r.n_group, r.topk_group, r.scaling) == (get("n_group", 1), get("topk_group", 1),
                                                    get("routed_scaling_factor", 1.0))
    dense = get("first_k_dense_replace", 0)
    assert cfg.moe_layers == tuple(i >= dense for i in range(4))
    if cfg.mla is not None:
        assert (cfg.mla.q_lora_rank, cfg.mla.rope_interleave) == (ref.q_lora_rank, ref.rope_interleave)
    else:
        head_dim = get("head_dim", 64 // 16)
        assert (cfg.num_kv_heads, cfg.head_dim) == (ref.num_key_value_heads, head_dim)
    window = get("sliding_window", None) if get("use_sliding_window", True) else None
    assert cfg.sliding_window == window
    # the sizes: every tensor transformers' model of this config has (kv heads, head_dim, shared experts, dense
    # layers and their width, the q bottleneck)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(ref)
    kept = model.state_dict().keys()
    n = sum(p.numel() for p in model.parameters()) + sum(b.numel() for k, b in model.named_buffers() if k in kept)
    assert sum(cfg.param_counts().values()) == n
