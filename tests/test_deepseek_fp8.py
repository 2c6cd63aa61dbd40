"""Block-FP8 DeepSeek-V3 checkpoints (float8_e4m3fn + weight_scale_inv, as published) written by our writer:
loaded directly, they match transformers run on the de-quantized weights (fp32 logits within 1e-4, greedy
tokens identical); the hybrid layer gives the same greedy tokens for every schedule and resident count;
malformed FP8 checkpoints fail with the tensor's name."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from hybrid.models import load_model  # noqa: E402
from hybrid.models.errors import ModelLoadError  # noqa: E402
from hybrid.models.writer import write_random_checkpoint  # noqa: E402
from hybrid.offload.build import load_hybrid  # noqa: E402
from hybrid.offload.config import HybridConfig  # noqa: E402
from hybrid.runtime import Engine  # noqa: E402
from tiny_models import check_hybrid_strategies, deepseek_raw, engine_greedy, hf_greedy, hf_logits  # noqa: E402

BLOCK = (16, 16)  # several blocks per tiny matrix, and partial ones (q_lora_rank 24, kv_lora_rank + rope 40)
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [200, 1, 64], [9] * 12]


def block_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Independent of hybrid.models.fp8: block by block."""
    out = q.float().clone()
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            out[bi * BLOCK[0]:(bi + 1) * BLOCK[0], bj * BLOCK[1]:(bj + 1) * BLOCK[1]] *= s[bi, bj]
    return out


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    path = write_random_checkpoint(root / "fp8", deepseek_raw(), seed=5, dtype=torch.float32, std=0.1, fp8_block=BLOCK)
    return path


@pytest.fixture(scope="module")
def dequantized_hf(fp8_ckpt, tmp_path_factory):
    """transformers' model from a de-quantized copy of the FP8 checkpoint (same names, fp32, no quantization)."""
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("deq")
    raw = json.loads((fp8_ckpt / "config.json").read_text())
    assert raw.pop("quantization_config")["weight_block_size"] == list(BLOCK)
    n_fp8 = 0
    for shard in sorted(fp8_ckpt.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as fh:
            t = {k: fh.get_tensor(k) for k in fh.keys()}
        deq = {}
        for k, v in t.items():
            if k.endswith("_scale_inv"):
                continue
            if v.dtype == torch.float8_e4m3fn:
                v, n_fp8 = block_dequantize(v, t[k + "_scale_inv"]), n_fp8 + 1
            deq[k] = v
        save_file(deq, str(out / shard.name))
    assert n_fp8 > 50  # attention, dense, shared and expert matrices are all FP8
    idx = json.loads((fp8_ckpt / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if not k.endswith("_scale_inv")}
    (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    (out / "config.json").write_text(json.dumps(raw))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    return hf


def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(fp8_ckpt, dequantized_hf):
    model = load_model(fp8_ckpt, progress=False)
    engine = Engine(model, max_batch=2, max_context=48)
    for p in PROMPTS[:2]:
        slot = engine.allocate_slot()
        ours = engine.forward(torch.tensor([p]), torch.arange(len(p))[None], torch.tensor([slot]))[0]
        assert (ours - hf_logits(dequantized_hf, p)).abs().max().item() <= 1e-4
        engine.free_slot(slot)
    results = Engine(model, max_batch=2, max_context=48).generate(PROMPTS[:2], max_new_tokens=10, stop_token_ids=[])
    for p, r in zip(PROMPTS, results):
        assert r.token_ids == hf_greedy(dequantized_hf, p, 10)


def greedy(model, n=10):
    return engine_greedy(model, PROMPTS, n)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    # bf16 weights: the CPU executor's bf16 packing is exact, so tokens must equal the fp32 reference's
    return write_random_checkpoint(tmp_path_factory.mktemp("bf16") / "c", deepseek_raw(), seed=3, std=0.1)


@pytest.fixture(scope="module")
def reference_tokens(bf16_ckpt):
    return greedy(load_model(bf16_ckpt, progress=False))


@pytest.mark.parametrize("schedule", ["cost", "cpu", "ship", "threshold:8"])
@pytest.mark.parametrize("n_resident", [0, 3, 8])
def test_hybrid_greedy_identical_across_strategies(bf16_ckpt, reference_tokens, schedule, n_resident):
    check_hybrid_strategies(bf16_ckpt, greedy, reference_tokens, schedule, n_resident)


@pytest.mark.parametrize("cpu_dtype", ["bf16", "int8"])
def test_fp8_into_cpu_executor_formats(fp8_ckpt, cpu_dtype):
    """FP8 -> de-quantized per tensor -> packed for the CPU executor: logits close to the fp32 model's."""
    ref = load_model(fp8_ckpt, progress=False)
    hcfg = HybridConfig(gpu_experts=2, cpu_isa="ref", cpu_dtype=cpu_dtype, profile="ktransformers-paper-amx")
    model, off = load_hybrid(fp8_ckpt, "cpu", torch.float32, hcfg, progress=False)
    assert off.cpu_dtype == cpu_dtype
    p = PROMPTS[0]
    args = (torch.tensor([p]), torch.arange(len(p))[None], torch.tensor([0]))
    a = Engine(ref, None, max_batch=1, max_context=16, eager=True).forward(*args)
    b = Engine(model, None, max_batch=1, max_context=16, eager=True).forward(*args)
    rel = ((a - b).abs().max() / a.abs().max()).item()
    assert 0 < rel < 2e-2  # bf16 / int8 rounding of the experts, nothing more


def _rewrite(src, dst, edit):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for shard in src.glob("*.safetensors"):
        t = load_file(str(shard))
        edit(t)
        save_file(t, str(dst / shard.name))
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_malformed_fp8_checkpoints_are_refused(fp8_ckpt, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"

    def drop_scale(t):
        t.pop(name + "_scale_inv", None)

    def bad_scale(t):
        if name + "_scale_inv" in t:
            t[name + "_scale_inv"] = torch.ones(1, 1)

    _rewrite(fp8_ckpt, tmp_path / "a", drop_scale)
    with pytest.raises(ModelLoadError, match=f"fp8 tensor '{name}' has no block scale"):
        load_model(tmp_path / "a", progress=False)
    _rewrite(fp8_ckpt, tmp_path / "b", bad_scale)
    with pytest.raises(ModelLoadError, match="expected \\[4, 3\\] F32 block scales"):
        load_model(tmp_path / "b", progress=False)
    (tmp_path / "c").mkdir()
    for f in fp8_ckpt.iterdir():
        (tmp_path / "c" / f.name).write_bytes(f.read_bytes())
    raw = json.loads((fp8_ckpt / "config.json").read_text())
    raw.pop("quantization_config")
    (tmp_path / "c" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="float8_e4m3fn but config.json has no fp8 quantization_config"):
        load_model(tmp_path / "c", progress=False)
    raw["quantization_config"] = {"quant_method": "compressed-tensors"}
    (tmp_path / "c" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="quant_method 'compressed-tensors' is not supported"):
        load_model(tmp_path / "c", progress=False)


@pytest.mark.parametrize("block", [(4, 3), (3, 4), (1, 5)])
@pytest.mark.parametrize("shape", [(12, 12), (10, 7), (12, 7), (10, 12)])
def test_non_square_blocks_at_ragged_edges(block, shape):
    """Blocks of b0 rows x b1 columns, the last ones cut short where b0 or b1 does not divide the matrix (both
    dividing: the broadcast path). The reference is w[r, c] = q[r, c] * scale_inv[r // b0, c // b1], element by
    element."""
    from hybrid.models.fp8 import dequantize, quantize, scale_shape

    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g) * torch.linspace(0.1, 3.0, shape[1])  # block scales differ by column
    q, s = quantize(w, block)
    assert tuple(s.shape) == scale_shape(shape, block) == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    want = torch.empty(shape)
    for r in range(shape[0]):
        for c in range(shape[1]):
            want[r, c] = q[r, c].float() * s[r // block[0], c // block[1]]
    assert torch.equal(dequantize(q, s, block), want)
    assert torch.allclose(want, w, rtol=0.07, atol=1e-3)  # e4m3 keeps 3 mantissa bits: within 1/16 of each value


@pytest.mark.parametrize("kind", ["param", "int4", "int8"])
@pytest.mark.parametrize("rows", [256, 300, 1000])
def test_matrices_bound_for_the_gpu_fill_a_slice_at_a_time(kind, rows, monkeypatch):
    """hybrid.models.loader._fill_on_device: an FP8 matrix crosses in its own bytes and is de-quantized slice by slice
    (whole 128-row scale blocks, a ragged last one) into a parameter or a quantized weight, giving exactly what
    de-quantizing it whole does; a NaN in any slice is refused with the tensor's name. (Device-agnostic: on the dev
    box the slices stay on the CPU; the GPU box runs the same code with the destination on CUDA.)"""
    from pathlib import Path

    from hybrid.models import loader
    from hybrid.models.fp8 import dequantize, quantize
    from hybrid.models.qweight import QWeight

    torch.manual_seed(rows)
    w = torch.randn(rows, 384)
    q, s = quantize(w, (128, 128))
    whole = dequantize(q, s, (128, 128))
    monkeypatch.setattr(loader, "DEVICE_SLICE_VALUES", 128 * 384)  # one scale block of rows a slice
    if kind == "param":
        dst, want = torch.empty(rows, 384, dtype=torch.bfloat16), whole.to(torch.bfloat16)
    else:
        dst, want = QWeight(kind, rows, 384), QWeight.from_float(whole, kind)
    loader._fill_on_device("m.weight", Path("x.safetensors"), dst, q, s, (128, 128))
    if kind == "param":
        assert torch.equal(dst, want)
    else:
        assert torch.equal(dst.q, want.q) and torch.equal(dst.scale, want.scale)
    bad = q.clone()
    bad[rows - 1, 5] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    with pytest.raises(ModelLoadError, match="'m.weight' in x.safetensors: 1 NaN"):
        loader._fill_on_device("m.weight", Path("x.safetensors"), dst, bad, s, (128, 128))
