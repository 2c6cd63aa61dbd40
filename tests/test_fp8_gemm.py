"""The FP8 prefill GEMM (hybrid.gpu_kernels.fp8_gemm): e4m3 activations per token and 128-input block against
FP8 weights' bytes and 128 x 128 block scales. Without CUDA the kernel runs in Triton's interpreter on CPU tensors
(tests/conftest.py selects it), on the GPU box compiled (the `cuda` cases, marked gpu).

Against fp8_linear_reference (the same activation quantization, fp32 matmuls per 128-input block): ragged shapes
(M not a multiple of the row tile, N not of 128 so a tile's rows cross a weight scale block, K not a multiple of
128), bias or none, bf16 and fp16; within one rounding of the output dtype (the sums run in another order). The
activation quantizer against its definition, exactly. Against the de-quantizing path (x in bf16, W de-quantized):
within the e4m3 rounding of the activations, the error this path adds. The declines, the knob, and
qweight.linear's routing: decode rows to the GEMV, prefill rows here, HYBRID_FP8_GEMM=0 to the de-quantizing
GEMMs (on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject [test]); install it")

from hybrid.gpu_kernels.fp8_gemm import (  # noqa: E402
    E4M3_MAX, fp8_gemm_supported, fp8_linear, fp8_linear_reference, quantize_activations)
from hybrid.models import qweight  # noqa: E402
from hybrid.gpu_kernels.qformat import FP8_BLOCK  # noqa: E402
from hybrid.models.qweight import QWeight  # noqa: E402

DEVICES = ([pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA (GPU box)")])]
           + (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []))


def operands(M, N, K, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4).to(dtype)  # rows of unlike scale
    w = QWeight.from_float(torch.randn(N, K, generator=g) / K ** 0.5, "fp8")
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.fixture
def knob(set_knob):
    """Set HYBRID_FP8_GEMM for one test."""
    return lambda value: set_knob("HYBRID_FP8_GEMM", value)


def test_activations_quantize_per_token_and_block():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 3
    x[2, 128:256] = 0  # an all-zero block: scale 1, zeros
    q, s = quantize_activations(x.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 300) and s.shape == (5, 3)
    xb = torch.nn.functional.pad(x.to(torch.bfloat16).float(), (0, 84)).view(5, 3, 128)
    amax = xb.abs().amax(-1)
    assert torch.equal(s, torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)))
    assert s[2, 1] == 1 and torch.all(q[2, 128:256].float() == 0)
    # each block's largest magnitude lands on 448; every value is the e4m3 rounding of x / scale
    qb = torch.nn.functional.pad(q.float(), (0, 84)).view(5, 3, 128)
    assert torch.all((qb.abs().amax(-1) == E4M3_MAX) | (amax == 0))
    want = (xb / s[..., None]).to(torch.float8_e4m3fn).float()
    assert torch.equal(qb, want)
    deq = (qb * s[..., None]).view(5, 384)[:, :300]
    assert float((deq - x.to(torch.bfloat16).float()).abs().max()) <= float(amax.max()) / 16  # e4m3: 3 mantissa bits


def test_activations_quantize_the_same_a_slice_of_rows_at_a_time(monkeypatch):
    from hybrid.gpu_kernels import fp8_gemm

    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = quantize_activations(x)
    monkeypatch.setattr(fp8_gemm, "QUANT_CHUNK_VALUES", 500)  # one row (384 padded values) a slice
    sliced = quantize_activations(x)
    assert torch.equal(whole[0].float(), sliced[0].float()) and torch.equal(whole[1], sliced[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M, N, K", [(9, 128, 128), (70, 100, 200), (130, 300, 257), (16, 256, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_its_reference(M, N, K, dtype, bias, device):
    x, w, b = operands(M, N, K, dtype, bias)
    ref = fp8_linear_reference(x, w, b)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    xd, wd, bd = on(x), w.to(device), on(b)
    assert fp8_gemm_supported(xd, wd, bd)
    y = fp8_linear(xd, wd, bd).cpu()
    assert y.shape == (M, N) and y.dtype == dtype
    if device == "cpu":  # the interpreter's IEEE fp32 dots: the reference's sum up to order and the output rounding
        torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)
        return
    # e4m3 tensor cores sum each 32-input instruction in a narrower format than fp32 (about 14 bits kept, relative
    # to the instruction's largest product: DeepSeek-V3's report, 3.3.2); 2^-12 of that per instruction bounds it.
    # A wrong scale, block or step is an error of the outputs' own size, far above.
    err = (y.float() - ref.float()).abs()
    bound = mma_rounding_bound(x, w) + 1e-2 * ref.float().abs() + 1e-2
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(bound.max()) < 0.1 * float(ref.float().abs().max())  # the allowance stays far below an O(1) error


def mma_rounding_bound(x, w):
    """[M, N]: sum over 32-input steps of 2^-12 x 32 x the step's largest |activation level| x |weight level|,
    scaled by both blocks' scales: what the tensor cores' narrower sum within one instruction can lose."""
    q, sx = quantize_activations(x)
    qa, qw = q.float().abs(), w.q.float().abs()
    sw = w.scale.float().repeat_interleave(FP8_BLOCK[0], dim=0)[: w.n]
    M, K = x.shape
    out = torch.zeros(M, w.n)
    for k0 in range(0, K, 32):
        k1 = min(K, k0 + 32)
        j = k0 // 128
        out += (qa[:, k0:k1].amax(1) * sx[:, j])[:, None] * (qw[:, k0:k1].amax(1) * sw[:, j])[None, :]
    return out * 32 * 2.0 ** -12


@pytest.mark.parametrize("device", DEVICES)
def test_error_against_the_dequantizing_path_is_the_activations_rounding(device):
    """The de-quantizing path keeps bf16 activations; this one rounds them to e4m3 per 128-input block. The
    difference is that rounding's: a few percent of the outputs' scale, far below an error of the weights'
    bytes or scales (a transposed scale block or a dropped K step is O(1))."""
    x, w, b = operands(64, 256, 1024, torch.bfloat16, True, seed=3)
    dequant = F.linear(x.float(), w.dequantize(torch.float32), b.float())
    y = fp8_linear(x.to(device), w.to(device), b.to(device)).cpu().float()
    rel = (y - dequant).norm() / dequant.norm()
    assert 1e-4 < rel < 0.05, float(rel)  # not zero: the activations were rounded


def test_declines_and_knob(knob):
    x, w, b = operands(16, 128, 256, torch.bfloat16, True)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    knob("auto")
    assert fp8_gemm_supported(x, w, b) == interp
    assert not fp8_gemm_supported(x[:8], w, b)  # decode rows: the GEMV's
    assert not fp8_gemm_supported(x.float(), w, b)  # fp32 activations
    assert not fp8_gemm_supported(x[:, :128], w, b)  # K mismatch
    assert not fp8_gemm_supported(x, QWeight.from_float(torch.randn(128, 256), "int8"), b)  # not fp8
    assert not fp8_gemm_supported(x, w, b[:64])  # bias of another width
    knob("0")
    assert not fp8_gemm_supported(x, w, b)
    with pytest.raises(ValueError, match="declines"):
        fp8_linear(x, w, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (GPU box)")
def test_linear_routes_prefill_rows_here_and_decode_rows_to_the_gemv(knob):
    """qweight.linear on an fp8 weight on CUDA: prefill rows give fp8_linear's output (on a GPU with e4m3 dots),
    decode rows the GEMV's, and with HYBRID_FP8_GEMM=0 prefill gives the de-quantizing path's."""
    from hybrid.gpu_kernels.qgemv import qlinear_small

    x, w, b = operands(64, 384, 512, torch.bfloat16, True)
    x, w, b = x.cuda(), w.cuda(), b.cuda()
    knob("auto")
    e4m3 = torch.cuda.get_device_capability() >= (8, 9)
    want = fp8_linear(x, w, b) if e4m3 else qweight.dequant_linear(x, w, b)
    assert torch.equal(qweight.linear(x, w, b), want)
    assert torch.equal(qweight.linear(x[:4], w, b), qlinear_small(x[:4], w, b))
    knob("0")
    assert torch.equal(qweight.linear(x, w, b), qweight.dequant_linear(x, w, b))


SM_COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybrid.gpu_kernels import fp8_gemm

names = fp8_gemm._fp8_gemm.arg_names
for arch in (89, 90):
    for M, dt in ((64, "bf16"), (8192, "bf16"), (8192, "fp16")):
        bm, bn, warps, stages = fp8_gemm.pick_blocks(M, 7168)
        const = dict(SK=56, BLOCK_M=bm, BLOCK_N=bn, KB=128, STEPS=56, EVEN_K=True, HAS_BIAS=False, F32=False)
        sig = {"xq": "*u8", "sx": "*fp32", "wq": "*u8", "sw": "*fp32", "b": "*" + dt, "y": "*" + dt}
        sig.update({a: "i32" for a in ("M", "N", "K", "stride_y")})
        sig.update({a: "constexpr" for a in const})
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("xq", "sx", "wq", "sw", "b", "y", "K", "stride_y")}
        k = triton.compile(ASTSource(fp8_gemm._fp8_gemm, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=warps, num_stages=stages))
        local, regs = usage(k)
        e4m3 = bool(re.search(r"mma[^\n]*e4m3", k.asm["ptx"]))  # mma.sync (sm_89) or wgmma (sm_90) on e4m3
        print(json.dumps({"arch": arch, "M": M, "dt": dt, "local": local, "regs": regs, "e4m3_mma": e4m3,
                          "shared": k.metadata.shared}), flush=True)
"""


def test_kernel_compiles_for_sm89_and_sm90_with_e4m3_dots(tmp_path):
    """Triton compiles the tensor-core path (not the interpreter's fp32 one) for Ada's sm_89 and Hopper's sm_90
    without a GPU: e4m3 MMA instructions in the PTX, no local memory (register spills) and shared memory within
    the 99 KiB a block may take on Ada (an RTX 4090), at the tile sizes prefill uses. A subprocess without
    TRITON_INTERPRET."""
    import json

    from triton_compile import compile_script

    rows = [json.loads(line) for line in compile_script(SM_COMPILE, tmp_path) if line.startswith("{")]
    assert len(rows) == 6
    assert all(r["e4m3_mma"] for r in rows), rows
    assert all(r["local"] == 0 for r in rows), [r for r in rows if r["local"]]
    assert all(r["shared"] <= 99 * 1024 for r in rows), [r for r in rows if r["shared"] > 99 * 1024]
