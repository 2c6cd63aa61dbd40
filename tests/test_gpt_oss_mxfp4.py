"""gpt-oss MXFP4 checkpoints as published (experts as `_blocks` + `_scales`, quantization_config mxfp4), written
by our writer (quantize_mxfp4) and read by transformers' own MXFP4 loader (de-quantizing, Mxfp4Config) as the
oracle: fp32 logits within 1e-4 over padded batched prefill and decode, greedy tokens identical; the hybrid
layer with the CPU executor in mxfp4 (packed from the published blocks, no float copy; the default for
MXFP4 checkpoints) and converted to bf16 / int8 gives the same tokens for every schedule; refusals of bad
blocks, scales and configs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hybrid.models import load_model  # noqa: E402
from hybrid.models.errors import ModelLoadError  # noqa: E402
from hybrid.models.writer import write_random_checkpoint  # noqa: E402
from tiny_models import check_hybrid_strategies, check_logits_and_greedy, engine_greedy, hf_config  # noqa: E402

PROMPTS = ([5, 77, 3, 200, 41, 9, 17], [250, 1, 64, 33, 2, 8, 90, 100, 101, 7, 6, 5], [9, 9, 31])


def hf_mxfp4(path):
    """transformers' GptOssForCausalLM from the MXFP4 checkpoint at `path`, de-quantized by transformers
    (integrations/mxfp4.py) to fp32, eager attention."""
    import transformers

    m = transformers.GptOssForCausalLM.from_pretrained(
        str(path), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    m.config._attn_implementation = "eager"
    return m


def write_mxfp4(path, seed=1, **overrides):
    raw = hf_config("gpt_oss", **overrides).to_dict()
    raw.pop("quantization_config", None)
    return write_random_checkpoint(path, raw, seed=seed, dtype=torch.float32, std=0.1, mxfp4=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_mxfp4(tmp_path_factory.mktemp("gpt_oss_mxfp4"), num_hidden_layers=2)
    return path, hf_mxfp4(path)


def test_written_in_the_published_layout(ckpt):
    from safetensors import safe_open

    path, _ = ckpt
    raw = json.loads((path / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "mxfp4"
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    E, D, F_ = raw["num_local_experts"], raw["hidden_size"], raw["intermediate_size"]
    p = "model.layers.1.mlp.experts."
    with safe_open(str(path / index[p + "gate_up_proj_blocks"]), "pt") as f:
        shapes = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys() if k.startswith(p)}
    assert shapes == {p + "gate_up_proj_blocks": ([E, 2 * F_, D // 32, 16], "U8"),
                      p + "gate_up_proj_scales": ([E, 2 * F_, D // 32], "U8"),
                      p + "down_proj_blocks": ([E, D, F_ // 32, 16], "U8"), p + "down_proj_scales": ([E, D, F_ // 32], "U8"),
                      p + "gate_up_proj_bias": ([E, 2 * F_], "F32"), p + "down_proj_bias": ([E, D], "F32")}


def test_logits_and_greedy_match_transformers_dequantized(ckpt):
    path, hf = ckpt
    check_logits_and_greedy(load_model(path, progress=False), hf, PROMPTS, len(PROMPTS), "mxfp4")


@pytest.fixture(scope="module")
def reference_tokens(ckpt):
    from tiny_models import reference_tokens_of

    return reference_tokens_of(*ckpt, PROMPTS)


def _greedy(model, n=10):
    return engine_greedy(model, PROMPTS, n)


@pytest.mark.parametrize("schedule", ["cost", "cpu", "ship"])
@pytest.mark.parametrize("n_resident", [0, 3])
def test_hybrid_mxfp4_executor_identical_across_strategies(ckpt, reference_tokens, schedule, n_resident, monkeypatch):
    """cpu_dtype mxfp4 (reference executor: exact de-quantized values) from the published blocks: the loader
    hands the factory (blocks, scales) pairs and CpuMoE.from_mxfp4 packs them; resident and shipped experts are
    de-quantized from the executor's own codes."""
    import cpu_kernels

    seen = []
    real = cpu_kernels.CpuMoE.from_mxfp4.__func__
    monkeypatch.setattr(cpu_kernels.CpuMoE, "from_mxfp4",
                        classmethod(lambda cls, *a, **kw: seen.append(a[0][0].dtype) or real(cls, *a, **kw)))
    check_hybrid_strategies(ckpt[0], _greedy, reference_tokens, schedule, n_resident, moe_layers=2, cpu_dtype="mxfp4")
    assert seen == [torch.uint8, torch.uint8]  # both layers packed from the published bytes


@pytest.mark.parametrize("cpu_dtype", ["bf16", "int8"])
def test_hybrid_converting_executor_runs(ckpt, cpu_dtype):
    """--cpu-dtype bf16 converts the MXFP4 values exactly (greedy tokens identical); int8 re-quantizes them
    (runs and gives tokens in the vocabulary)."""
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig

    path, hf = ckpt
    model, off = load_hybrid(path, "cpu", torch.float32, HybridConfig(gpu_experts=0, cpu_dtype=cpu_dtype, cpu_isa="ref",
                                                                      profile="ktransformers-paper-amx"), progress=False)
    assert all(layer.cpu_moe.dtype == cpu_dtype for layer in off.layers)
    tokens = _greedy(model)
    if cpu_dtype == "bf16":
        assert tokens == engine_greedy(load_model(path, progress=False), PROMPTS, 10)
    assert all(0 <= t < hf.config.vocab_size for seq in tokens for t in seq)


def test_mxfp4_is_the_default_for_mxfp4_checkpoints(ckpt, caplog):
    """Without --cpu-dtype an MXFP4 checkpoint keeps its experts in mxfp4, with a log line; a given
    --cpu-dtype is kept."""
    import argparse

    from hybrid.loading.parse import add_hybrid_arguments, hybrid_config_from_args
    from hybrid.offload.build import load_hybrid

    p = argparse.ArgumentParser()
    add_hybrid_arguments(p)
    for argv, want in ((["--gpu-experts", "0"], "mxfp4"), (["--gpu-experts", "0", "--cpu-dtype", "int4"], "int4")):
        hcfg = hybrid_config_from_args(p.parse_args(argv + ["--profile", "ktransformers-paper-amx"]))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hybrid.offload"):
            _, off = load_hybrid(ckpt[0], "cpu", torch.float32, hcfg, progress=False)
        assert off.cpu_dtype == want and all(layer.cpu_moe.dtype == want for layer in off.layers)
        assert ("MXFP4 checkpoint: the CPU experts stay mxfp4" in caplog.text) == (want == "mxfp4")


def test_plan_and_checks_price_the_dtype_the_loader_keeps(ckpt, capsys):
    """Without --cpu-dtype, `hybrid plan` prices an MXFP4 checkpoint's experts (and the preset of a model
    published in MXFP4) as mxfp4, the dtype load_hybrid keeps, so the plan file does not tell `--plan` to
    de-quantize them; the checks before loading price that dtype too. A given --cpu-dtype wins everywhere."""
    from hybrid.cli import build_parser, main
    from hybrid.loading.check import check_before_load
    from hybrid.loading.parse import session_config_from_args

    def planned(*argv):
        assert main(["plan", "--profile", "ktransformers-paper-amx", "--reserve", "0", "--json", "--numa-threads", "2",
                     "--gpu-budget", "80GiB", "--cpu-budget", "1024GiB", *argv]) == 0
        return json.loads(capsys.readouterr().out)["settings"]["cpu_dtype"]

    assert planned("--model", str(ckpt[0])) == "mxfp4"
    assert planned("--preset", "gpt-oss-120b") == "mxfp4"
    assert planned("--preset", "gpt-oss-120b", "--cpu-dtype", "int8") == "int8"
    assert planned("--preset", "qwen3-30b-a3b") == "bf16"
    for extra, want in (([], "mxfp4"), (["--cpu-dtype", "int4"], "int4")):
        args = build_parser().parse_args(["generate", "--model", str(ckpt[0]), "--device", "cpu",
                                          "--gpu-experts", "0", *extra])
        _, config = check_before_load(str(ckpt[0]), session_config_from_args(args))
        assert config.hybrid.cpu_dtype == want


def _copy(path: Path, out: Path, config=None, edit=None) -> Path:
    """The checkpoint at `path` re-written into `out` as one file, with config.json fields and tensors edited
    (edit(tensors) changes the dict in place)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    t = {}
    for f in sorted(path.glob("*.safetensors")):
        t.update(load_file(str(f)))
    if edit:
        edit(t)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    raw.update(config or {})
    (out / "config.json").write_text(json.dumps(raw))
    return out


P = "model.layers.0.mlp.experts."


@pytest.mark.parametrize("name,config,edit,match", [
    ("no_quant_config", {"quantization_config": None}, None, "is MXFP4 .* no mxfp4 quantization_config"),
    ("no_scales", None, lambda t: t.pop(P + "down_proj_scales"), "has no scales 'model.layers.0.mlp.experts.down_proj_scales'"),
    ("scales_only", None, lambda t: t.pop(P + "down_proj_blocks"), "MXFP4 scales without their blocks"),
    ("bad_scales_shape", None, lambda t: t.update({P + "down_proj_scales": t[P + "down_proj_scales"][:, :-1]}),
     "expected U8 .* for blocks"),
    ("bad_scales_dtype", None, lambda t: t.update({P + "down_proj_scales": t[P + "down_proj_scales"].float()}),
     "expected U8"),
    ("bad_blocks_shape", None, lambda t: t.update({P + "gate_up_proj_blocks": t[P + "gate_up_proj_blocks"][:, :-2],
                                                   P + "gate_up_proj_scales": t[P + "gate_up_proj_scales"][:, :-2]}),
     "gate_up_proj_blocks': shape mismatch"),
    ("nan_scale", None, lambda t: t[P + "down_proj_scales"].view(-1).__setitem__(3, 255), "NaN"),
])
def test_bad_mxfp4_tensors_are_refused_in_one_line(ckpt, tmp_path, name, config, edit, match):
    bad = _copy(ckpt[0], tmp_path / name, config, edit)
    with pytest.raises(ModelLoadError, match=match) as exc:
        load_model(bad, progress=False)
    assert "\n" not in str(exc.value)


def test_nan_scale_is_refused_on_the_packed_path_too(ckpt, tmp_path):
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig

    bad = _copy(ckpt[0], tmp_path / "nan", edit=lambda t: t[P + "gate_up_proj_scales"].view(-1).__setitem__(0, 255))
    with pytest.raises(ModelLoadError, match="scale\\(s\\) of 255"):
        load_hybrid(bad, "cpu", torch.float32, HybridConfig(gpu_experts=0, cpu_dtype="mxfp4", cpu_isa="ref",
                                                           profile="ktransformers-paper-amx"), progress=False)


def test_writer_refuses_mxfp4_for_other_families(tmp_path):
    with pytest.raises(ValueError, match="mxfp4 checkpoints are gpt-oss's"):
        write_random_checkpoint(tmp_path, hf_config("qwen3_moe").to_dict(), mxfp4=True)


@pytest.mark.parametrize("schedule,n_resident", [("cpu", 0), ("ship", 3)])
def test_hybrid_compiled_mxfp4_kernels_give_the_same_tokens(ckpt, reference_tokens, schedule, n_resident):
    """This machine's compiled mxfp4 kernels (codes and exponents as published, biases, clamped SwiGLU) with
    every cold expert on the CPU lane; and resident / shipped experts de-quantized from the kernels' own packed
    codes (cpu_kernels.quant.dequantize_mxfp4_packed), which the reference executor does not exercise."""
    import cpu_kernels

    isa = cpu_kernels.available_isas()[0]
    if isa == "ref":
        pytest.skip("no compiled ISA on this machine")
    check_hybrid_strategies(ckpt[0], _greedy, reference_tokens, schedule, n_resident, moe_layers=2, cpu_isa=isa,
                            cpu_dtype="mxfp4")
