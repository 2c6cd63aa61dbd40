"""bench.hf_to_gguf's streamed conversion: a checkpoint folder read one tensor (one layer's expert stack) at a time
writes the same GGUF bytes as the transformers model loaded whole, for every family whose checkpoint it reads
(per-expert matrices as published, fused stacks as transformers saves them); quantized checkpoints and missing
expert matrices are refused, and the default streams where it can."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from bench import hf_to_gguf  # noqa: E402
from bench.hf_to_gguf import STREAMED, Checkpoint, convert  # noqa: E402
from hybrid.runtime.demo import build_tokenizer, demo_checkpoint  # noqa: E402
from tiny_models import VOCAB, make_checkpoint  # noqa: E402


def folder(model_type: str, tmp_path):
    path = tmp_path / model_type
    extra = {"e_score_correction_bias": 0.5} if model_type in ("deepseek_v3", "glm4_moe") else None
    make_checkpoint(model_type, path, seed=3, extra=extra)
    build_tokenizer(path, vocab_size=VOCAB)
    return path


@pytest.mark.parametrize("model_type", STREAMED)
def test_streamed_bytes_are_the_whole_models(model_type, tmp_path):
    path = folder(model_type, tmp_path)
    from safetensors import safe_open

    on_disk = [k for f in path.glob("*.safetensors") for k in safe_open(str(f), "pt").keys()]
    assert any(k.endswith(".experts.0.gate_proj.weight") for k in on_disk)  # one matrix per expert, as published
    assert not any(".experts.0." in k for k in Checkpoint(path).keys())  # seen as transformers' fused stacks
    for qtype in ("bf16", "q8_0"):
        streamed = convert(path, tmp_path / f"s-{qtype}.gguf", qtype, stream=True)
        whole = convert(path, tmp_path / f"w-{qtype}.gguf", qtype, stream=False)
        assert streamed.read_bytes() == whole.read_bytes(), (model_type, qtype)


def test_fused_stacks_as_saved_stream_alike(tmp_path):
    """The demo checkpoint keeps transformers' fused experts.gate_up_proj: read as it is."""
    assert any(k.endswith("experts.gate_up_proj") for k in Checkpoint(demo_checkpoint()).keys())
    a = convert(demo_checkpoint(), tmp_path / "s.gguf", "bf16", stream=True)
    b = convert(demo_checkpoint(), tmp_path / "w.gguf", "bf16", stream=False)
    assert a.read_bytes() == b.read_bytes()


def test_meta_reads_nothing_and_stacks_gate_rows_first(tmp_path):
    import torch

    path = folder("qwen3_moe", tmp_path)
    lazy, meta = Checkpoint(path), Checkpoint(path, meta=True)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    stack = lazy[name]
    assert meta[name].device.type == "meta" and meta[name].shape == stack.shape
    from safetensors.torch import load_file

    flat = {}
    for f in path.glob("*.safetensors"):
        flat.update(load_file(str(f)))
    E = stack.shape[0]
    for e in range(E):
        g, u = (flat[f"model.layers.0.mlp.experts.{e}.{w}_proj.weight"] for w in ("gate", "up"))
        assert torch.equal(stack[e], torch.cat([g, u]))
    assert lazy[name] is stack  # kept while asked for in turn


def test_default_streams_and_refusals(tmp_path, monkeypatch):
    path = folder("qwen3_moe", tmp_path)

    def whole(_):
        raise AssertionError("the default loaded the transformers model")
    monkeypatch.setattr(hf_to_gguf, "load_hf", whole)
    convert(path, tmp_path / "d.gguf", "bf16")
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    for f in broken.glob("*.safetensors"):
        ts = {k: v for k, v in load_file(str(f)).items() if k != "model.layers.1.mlp.experts.2.up_proj.weight"}
        save_file(ts, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts: some experts' matrices are missing"):
        Checkpoint(broken)
    last = tmp_path / "last"  # the last expert's matrices all gone: the stacks are one short of config.json's count
    shutil.copytree(path, last)
    import transformers

    E = transformers.AutoConfig.from_pretrained(str(path)).num_experts
    for f in last.glob("*.safetensors"):
        ts = {k: v for k, v in load_file(str(f)).items() if f".mlp.experts.{E - 1}." not in k}
        save_file(ts, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"blk.0.ffn_gate_exps.weight holds {E - 1} experts, config.json says {E}"):
        convert(last, tmp_path / "l.gguf", "bf16")
    fp8 = tmp_path / "fp8"
    shutil.copytree(path, fp8)
    f = next(fp8.glob("*.safetensors"))
    ts = load_file(str(f))
    ts["model.layers.0.self_attn.q_proj.weight_scale_inv"] = ts["model.layers.0.self_attn.q_norm.weight"].clone()
    save_file(ts, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="quantized tensors .* are read through transformers"):
        Checkpoint(fp8)


def test_bf16_checkpoint_is_written_as_its_bits(tmp_path):
    """A bf16 checkpoint's matrices go to a BF16 file as they are, without float32: the bytes that rounding their
    float32 values gives (the whole model's path)."""
    from loader_cases import TINY, write_tiny
    from safetensors import safe_open

    path = write_tiny(tmp_path / "m")
    build_tokenizer(path, vocab_size=TINY["vocab_size"])
    f = next(path.glob("*.safetensors"))
    with safe_open(str(f), "pt") as h:
        assert h.get_tensor(next(iter(h.keys()))).dtype.is_floating_point and "BF16" in {
            h.get_slice(k).get_dtype() for k in h.keys()}
    for qtype in ("bf16", "f16"):
        a = convert(path, tmp_path / f"s-{qtype}.gguf", qtype, stream=True)
        b = convert(path, tmp_path / f"w-{qtype}.gguf", qtype, stream=False)
        assert a.read_bytes() == b.read_bytes(), qtype


def test_other_families_load_the_transformers_model(tmp_path, monkeypatch):
    """Mixtral's checkpoint names its experts otherwise (w1 / w2 / w3): the default loads the transformers model,
    and its expert stacks hold config.json's count."""
    import gguf
    import transformers

    path = folder("mixtral", tmp_path)

    def lazy(*a, **kw):
        raise AssertionError("streamed a family Checkpoint does not read")
    monkeypatch.setattr(hf_to_gguf, "Checkpoint", lazy)
    out = convert(path, tmp_path / "m.gguf", "bf16")
    E = transformers.AutoConfig.from_pretrained(str(path)).num_local_experts
    stacks = [t for t in gguf.GGUFReader(str(out)).tensors if "_exps." in t.name]
    assert stacks and all(int(t.shape[-1]) == E for t in stacks)


def test_random_weights_file_is_the_transformers_model_on_those_weights(tmp_path):
    """write_random (bench.make_checkpoint --gguf) streams a config's random weights into a GGUF file that loads as
    transformers' model on the same weights, and RandomWeights gives a tensor the same values whenever asked."""
    import torch
    import transformers

    from bench.hf_to_gguf import RandomWeights, write_random
    from bench.make_checkpoint import write_tokenizer
    from hybrid.models.gguf import load_gguf
    from tiny_models import hf_config, hf_logits, single_logits

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}  # one mscale, as GGUF says
    cfg = hf_config("deepseek_v3", vocab_size=1100, rope_parameters=rope)  # the generic tokenizer's ~1k tokens fit
    path = write_random(cfg.to_dict(), tmp_path / "r.gguf", write_tokenizer, "f32", seed=7)
    with torch.device("meta"):
        meta = dict(transformers.AutoModelForCausalLM.from_config(cfg).state_dict())
    weights = RandomWeights(meta, seed=7)
    first = weights["model.embed_tokens.weight"].clone()
    assert not torch.equal(weights["lm_head.weight"], first[: weights["lm_head.weight"].shape[0]])
    assert torch.equal(weights["model.embed_tokens.weight"], first)  # drawn again after another: the same
    assert torch.equal(weights["model.norm.weight"], torch.ones_like(weights["model.norm.weight"]))
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.load_state_dict({k: weights[k].float() for k in meta}, strict=True)
    ids = list(range(3, 40, 3))
    with torch.no_grad():
        want = hf_logits(hf, ids)
    assert (single_logits(load_gguf(path, progress=False), ids) - want).abs().max().item() <= 1e-4
