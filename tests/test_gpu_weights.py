"""Quantized GPU-side weights (hybrid.models.qweight, hybrid.models.gpu_weights) on the CPU: every family's tiny
checkpoint loaded with each GPU dtype computes exactly the model whose matrices are the de-quantized ones (fp32
logits within 1e-4 of it), which differs from the full-precision model (so the weights really were quantized);
each part alone is read from its QWeight; the config's matrix list is the model's; the planner's byte formula is
the QWeights' own; the quantizer rounds to nearest; a block-FP8 checkpoint's bytes are kept as they are.

How far quantized logits may drift from full precision is a property of the format and of the model (a
routing decision near a tie flips on a tiny change, and the tiny random models here have many), so it is
measured on a trained model (BENCHMARKS.md, quality), not bounded here; what is bounded is the quantizer's own
error (half a step per weight)."""

from __future__ import annotations

import pytest
import torch

from tiny_models import FAMILIES, deepseek_raw, hf_config, make_checkpoint, single_logits

from hybrid.models import load_model
from hybrid.models.gpu_weights import PARTS, dtypes_of, matrices, quantized
from hybrid.models.loader import build_empty
from hybrid.models.qweight import QWeight, quantize_rows
from placement.memory import gpu_weight_bytes

PROMPT = [3, 17, 42, 99, 5, 250, 7, 64]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        make_checkpoint(family, path)
        out[family] = path
    return out


def dequantized_reference(path, dtypes: dict[str, str]):
    """The full-precision model with each quantized part's matrices replaced by their de-quantized values."""
    model = load_model(path, progress=False)
    with torch.no_grad():
        for module, attr, _, part in matrices(model):
            kind = dtypes.get(part, "bf16")
            if kind != "bf16":
                w = getattr(module, attr)
                w.copy_(QWeight.from_float(w, kind).dequantize(torch.float32))
    return model


def close(a, b) -> float:
    return float((a - b).abs().max() / b.std())


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_quantized_model_is_the_dequantized_model(checkpoints, family, kind):
    path = checkpoints[family]
    dtypes = {p: kind for p in PARTS}
    model = load_model(path, progress=False, gpu_dtypes=dtypes)
    assert set(dtypes_of(model).values()) == {kind}
    got = single_logits(model, PROMPT)
    assert close(got, single_logits(dequantized_reference(path, dtypes), PROMPT)) < 1e-4
    assert close(got, single_logits(load_model(path, progress=False), PROMPT)) > 1e-3  # it was quantized


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_one_part_at_a_time(checkpoints, family):
    """Each part quantized alone is read from its QWeight: the logits are the de-quantized model's, not the
    full-precision one's."""
    path = checkpoints[family]
    full = single_logits(load_model(path, progress=False), PROMPT)
    for part in PARTS:
        dtypes = {part: "int4"}
        model = load_model(path, progress=False, gpu_dtypes=dtypes)
        if not quantized(model):
            continue  # e.g. no dense layer, or a tied head (then "embed" holds it)
        got = single_logits(model, PROMPT)
        assert close(got, single_logits(dequantized_reference(path, dtypes), PROMPT)) < 1e-4, part
        assert close(got, full) > 1e-3, part


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_matrices_are_the_models(family):
    """ModelConfig.gpu_matrices (what the planner prices) lists exactly the model's quantizable matrices."""
    from hybrid.models.families import family_for

    raw = hf_config(family).to_dict()
    raw["model_type"] = family
    cfg = family_for(raw).parse_config(raw)
    model = build_empty(cfg, "meta", torch.float32, build_experts=False)
    want: dict[str, dict] = {p: {} for p in PARTS}
    for module, attr, _, part in matrices(model):
        shape = tuple(getattr(module, attr).shape)
        want[part][shape] = want[part].get(shape, 0) + 1
    got: dict[str, dict] = {p: {} for p in PARTS}
    for part, mats in cfg.gpu_matrices().items():
        for n, k, count in mats:
            if count:
                got[part][(n, k)] = got[part].get((n, k), 0) + count
    assert got == want


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("n,k", [(37, 96), (300, 257), (256, 128)])
def test_planner_bytes_are_the_weights(kind, n, k):
    assert QWeight(kind, n, k).nbytes == gpu_weight_bytes(kind, n, k)


def test_quantize_rows_is_round_to_nearest():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 300, generator=g)
    for kind, levels in (("int8", 255), ("int4", 16)):
        qw = QWeight.from_float(w, kind)
        err = (qw.dequantize(torch.float32) - w).abs()
        step = qw.scale.abs().repeat_interleave(128, 1)[:, :300]
        inside = (w / step).abs() <= (127 if kind == "int8" else 7.5)  # int4: beyond +7.5 steps clips to 7
        assert bool((err[inside] <= step[inside] / 2 + 1e-6).all()), kind
        assert bool((err <= step + 1e-6).all()), kind  # the clipped side: at most one step (|w| <= 8 steps)
        assert float(err.max()) > 0
        q, _ = quantize_rows(w, kind)
        if kind == "int4":
            nib = torch.stack((q & 0xF, q >> 4), -1).view(40, -1)[:, :300]
            assert set(nib.unique().tolist()) == set(range(levels))  # the -8 level is used
            assert bool((nib.view(40, -1)[:, :300].float() - 8).abs().max() <= 8)


def test_rows_and_permute_keep_values():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 160, generator=g)
    for kind in ("int8", "int4", "fp8"):
        qw = QWeight.from_float(w, kind)
        dq = qw.dequantize(torch.float32)
        ids = torch.tensor([[0, 255, 130], [7, 7, 128]])
        assert torch.equal(qw.rows(ids, torch.float32), dq[ids])
        perm = torch.arange(256)
        perm[64:128] = perm[64:128].flip(0)  # inside one 128-row block: exact for fp8 too
        qw.permute_rows_(perm)
        assert torch.equal(qw.dequantize(torch.float32), dq[perm])


def test_fp8_checkpoint_bytes_kept(tmp_path):
    """A block-FP8 DeepSeek checkpoint loaded with fp8 GPU weights keeps the file's bytes and scales."""
    from safetensors.torch import load_file

    from hybrid.models.writer import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "fp8", deepseek_raw(), seed=5, dtype=torch.float32, std=0.1,
                                   fp8_block=(128, 128))
    model = load_model(path, progress=False, gpu_dtypes={p: "fp8" for p in PARTS})
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    qws = quantized(model)
    w = qws["layers.0.attn.kv_b_proj.weight"]
    assert torch.equal(w.q.view(torch.uint8), tensors["model.layers.0.self_attn.kv_b_proj.weight"].view(torch.uint8))
    assert torch.equal(w.scale, tensors["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"].float())


def test_dequant_linear_in_row_chunks(monkeypatch):
    """Larger batches read a quantized matrix through de-quantized row chunks: every chunk's rows and bias."""
    import hybrid.models.qweight as qweight

    g = torch.Generator().manual_seed(2)
    w, b, x = torch.randn(300, 96, generator=g), torch.randn(300, generator=g), torch.randn(5, 96, generator=g)
    real = qweight.dequantize_on_device
    for kind in ("int8", "int4", "fp8"):
        qw = QWeight.from_float(w, kind)
        ref = torch.nn.functional.linear(x, qw.dequantize(torch.float32), b)
        # 96 * 200 values: 200 rows would fit, a chunk takes 128 (whole multiples of 128): 3 chunks, the last ragged
        monkeypatch.setattr(qweight, "DEQUANT_CHUNK_VALUES", 96 * 200)
        rows = []
        monkeypatch.setattr(qweight, "dequantize_on_device", lambda w_, dt, r0, r1: rows.append(r1 - r0) or real(w_, dt, r0, r1))
        torch.testing.assert_close(qweight.dequant_linear(x, qw, b), ref, rtol=1e-5, atol=1e-5)
        assert rows == [128, 128, 44], rows


def test_fp8_bytes_never_requantized(tmp_path, monkeypatch):
    """fp8 parts of a block-FP8 checkpoint take the file's bytes: QWeight.quantize_ is never called for them
    (re-quantizing would often give the same bytes, so the bytes alone cannot tell)."""
    from hybrid.models.writer import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "fp8", deepseek_raw(), seed=5, dtype=torch.float32, std=0.1,
                                   fp8_block=(128, 128))
    calls = []
    real = QWeight.quantize_
    monkeypatch.setattr(QWeight, "quantize_", lambda self, w, *a, **k: calls.append(self.kind) or real(self, w, *a, **k))
    load_model(path, progress=False, gpu_dtypes={p: "fp8" for p in PARTS})
    assert calls == ["fp8", "fp8"]  # the two matrices the file holds in bf16: the embedding and the head
