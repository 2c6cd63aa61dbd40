"""The quantized decode GEMV and de-quantizer (hybrid.gpu_kernels.qgemv) against QWeight's own reference, and
QWeight's quantizers themselves. Without CUDA the kernels run in Triton's interpreter on CPU tensors
(tests/conftest.py selects it); on the GPU box the same tests run compiled on CUDA tensors (the `cuda` cases,
marked gpu). Every kind (int8, int4, fp8) at T = 1, 2, 5 and 8; ragged shapes: N not a multiple of the row block
(37, 100, 300: fp8's 128-row scale blocks split inside a program's rows), K not a multiple of 128 nor of the tile
(96, 200, 257; odd K for int4, whose last byte carries a pad nibble), tiles narrower than a scale group, split-K,
the unrolled loop; bias or none; bf16, fp16 and fp32 x. The decoder shapes (q/k/v 5120 x 2048, o_proj 2048 x
4096, DeepSeek's o_proj 7168 x 16384, q_b 24576 x 1536, a 32768 x 2048 head) run at full size on CUDA, as
40-row stand-ins with the full K in the interpreter (it runs programs one by one). Then dequantize_rows against
QWeight.dequantize bit for bit over chunk boundaries, the declines, and the table's configs compiled for sm_90
(no GPU needed) without register spills.

Tolerances (gemv's): the reference is F.linear(x.float(), w.dequantize(torch.float32)) in fp32; fp32 outputs
within 1e-4 (sums in another order), bf16/fp16 outputs rounded once from fp32 (truncated in the interpreter), so
within 1e-2 relative."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject [test]); install it")

from hybrid.gpu_kernels.qgemv import (  # noqa: E402
    TABLE, QGemvConfig, dequantize_rows, pick_config, qlinear_small, qlinear_small_supported)
from hybrid.models import fp8 as fp8_format  # noqa: E402
from hybrid.models.qweight import QWeight  # noqa: E402

DEVICES = ([pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA (GPU box)")])]
           + (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []))
KINDS = ["int8", "int4", "fp8"]


def operands(kind, T, N, K, dtype, bias, seed):
    """x [T, K], W quantized from a [N, K] matrix scaled so outputs are O(1), bias [N] or None (CPU)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    w = QWeight.from_float(torch.randn(N, K, generator=g) / K ** 0.5, kind)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def check(kind, T, N, K, dtype, bias, device, config=None, seed=0):
    x, w, b = operands(kind, T, N, K, dtype, bias, seed)
    ref = F.linear(x.float(), w.dequantize(torch.float32), None if b is None else b.float())
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    xd, wd, bd = on(x), w.to(device), on(b)
    if device == "cuda" and kind == "int4" and dtype == torch.float32:  # declined there: de-quantized instead
        assert not qlinear_small_supported(xd, wd, bd)
        return None
    assert qlinear_small_supported(xd, wd, bd)
    y = qlinear_small(xd, wd, bd, config).cpu()
    assert y.shape == (T, N) and y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    return y


RAGGED = [  # T, N, K, bias, dtype, config
    (1, 37, 257, True, torch.bfloat16, None),  # the table's config; K tail masked
    (2, 100, 200, False, torch.float16, QGemvConfig(block_n=16, block_k=64)),  # tiles of half a scale group
    (5, 300, 95, True, torch.float32, None),  # K < 128, odd; fp8's row blocks split inside programs
    (8, 37, 200, True, torch.bfloat16, QGemvConfig(block_n=32, block_k=32, split=3)),  # split-K, 32-wide tiles
    (3, 100, 257, False, torch.bfloat16, QGemvConfig(block_n=16, block_k=256, unroll=True)),  # unrolled, 2 groups
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,N,K,bias,dtype,config", RAGGED)
@pytest.mark.parametrize("kind", KINDS)
def test_qlinear_small_matches_the_dequantized_reference_on_ragged_shapes(kind, T, N, K, bias, dtype, config,
                                                                         device):
    check(kind, T, N, K, dtype, bias, device, config, seed=T * N + K)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 2, 5, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_at_decode_batch_sizes(kind, T, device):
    """The table's configs at T = 1, 2, 5, 8; fp16 / bf16 in turn, bias on odd T."""
    check(kind, T, 100, 96, torch.float16 if T % 2 else torch.bfloat16, T % 2 == 1, device, seed=T)


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_are_bitwise_repeatable(device):
    """No atomics: the same config gives the same bits on every call, split-K included."""
    x, w, b = operands("int4", 4, 90, 512, torch.bfloat16, True, 5)
    x, w, b = x.to(device), w.to(device), b.to(device)
    for cfg in (QGemvConfig(block_n=16, block_k=128), QGemvConfig(block_n=32, block_k=64, split=4)):
        assert torch.equal(qlinear_small(x, w, b, cfg), qlinear_small(x, w, b, cfg))


DECODER = [  # name, N, K
    ("qkv", 5120, 2048),
    ("o_proj", 2048, 4096),
    ("deepseek_o_proj", 7168, 16384),
    ("q_b", 24576, 1536),
    ("head", 32768, 2048),
]


@pytest.mark.parametrize("device", DEVICES[:1])
@pytest.mark.parametrize("name,N,K", DECODER)
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_decoder_projection_shapes(kind, T, name, N, K, device):
    """Full size, the table's config, on CUDA."""
    check(kind, T, N, K, torch.bfloat16, T == 8, device, seed=N + T)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's stand-ins")
@pytest.mark.parametrize("name,N,K,kind,T", [d + (KINDS[i % 3], (1, 8)[i % 2]) for i, d in enumerate(DECODER)])
def test_decoder_projection_stand_ins(name, N, K, kind, T):
    """In the interpreter (it runs programs one by one): 40 rows of each decoder shape with its full K, 64-row
    and 512-wide blocks (one program, few iterations), one kind and T per shape in turn."""
    check(kind, T, 40, K, torch.bfloat16, T == 8, "cpu", QGemvConfig(block_n=64, block_k=512), seed=K)


DEQUANT_ROWS = [(0, 140), (5, 133), (130, 131), (120, 136)]  # r0 off fp8's 128-row blocks, across them


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_rows_equals_the_reference_bit_for_bit(kind, dtype, device):
    """Row chunks of a [140, 257] weight (odd K: int4's pad nibble; 257 inputs inside a masked 512-wide tile)
    equal QWeight.dequantize exactly: the same fp32 product, one rounding to nearest even."""
    g = torch.Generator().manual_seed(7)
    w = QWeight.from_float(torch.randn(140, 257, generator=g), kind).to(device)
    for r0, r1 in DEQUANT_ROWS:
        got = dequantize_rows(w, r0, r1, dtype)
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), w.dequantize(dtype, slice(r0, r1)).cpu()), (r0, r1)
    assert dequantize_rows(w, 77, 77, dtype).shape == (0, 257)


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_rows_of_fused_views(device):
    """A QWeight pointing into a fused one (QWeight.point_at_) is de-quantized from its own rows."""
    parts = [QWeight.from_float(torch.randn(n, 160), "int8") for n in (48, 80)]
    fused = QWeight.cat(parts).to(device)
    view = QWeight("int8", 80, 160, device=device)
    view.point_at_(fused, 48)
    assert torch.equal(dequantize_rows(view, 3, 80, torch.bfloat16).cpu(), parts[1].dequantize(torch.bfloat16)[3:])


@pytest.mark.parametrize("device", DEVICES[:1])
def test_qweight_routes_cuda_tensors_through_the_kernels(device):
    """On CUDA, qweight.linear sends decode rows to qlinear_small and larger batches through dequantize_rows
    chunks (qweight.dequant_linear), each against the reference."""
    from hybrid.models import qweight

    x, w, b = operands("int4", 3, 300, 512, torch.bfloat16, True, 9)
    x, w, b = x.to(device), w.to(device), b.to(device)
    assert torch.equal(qweight.linear(x[None], w, b)[0], qlinear_small(x, w, b))
    big = torch.randn(20, 512, device=device).bfloat16()
    ref = F.linear(big.float(), w.dequantize(torch.float32), b.float())
    torch.testing.assert_close(qweight.linear(big, w, b).float(), ref, rtol=2e-2, atol=2e-2)


def test_declines_what_it_does_not_take():
    x, w, b = operands("int8", 2, 48, 64, torch.bfloat16, True, 1)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    assert qlinear_small_supported(x, w, b) == interp  # CPU tensors only through the interpreter
    if not interp:
        return
    assert qlinear_small_supported(x, w)
    odd_group = QWeight.from_float(torch.randn(48, 64), "int8", group=48)
    strided_q = QWeight.from_float(torch.randn(48, 64), "int8")
    strided_q.q = torch.empty(64, 48, dtype=torch.int8).t()  # [48, 64], not contiguous
    on_meta = QWeight("int8", 48, 64, device="meta")
    no = [
        (torch.randn(9, 64).bfloat16(), w, None),  # T > 8
        (torch.randn(0, 64).bfloat16(), w, None),  # no rows
        (torch.randn(64).bfloat16(), w, None),  # not [T, K]
        (torch.randn(2, 128).bfloat16()[:, ::2], w, None),  # x not unit-stride along K
        (torch.randn(2, 96).bfloat16(), w, None),  # K does not match
        (x.double(), w, None),  # fp64
        (x, w, b.float()),  # a bias of another dtype
        (x, w, b[:47]),  # a bias of another length
        (x, w.dequantize(torch.bfloat16), None),  # a plain weight: gemv.linear_small's business
        (x, odd_group, None),  # a group that is not a power of two
        (x, strided_q, None),  # q not contiguous
        (x, on_meta, None),  # weights on another device
    ]
    assert [qlinear_small_supported(*c) for c in no] == [False] * len(no)
    with pytest.raises(ValueError, match="dequant_linear"):
        qlinear_small(torch.randn(9, 64).bfloat16(), w)
    with pytest.raises(ValueError, match="outside 48 rows"):
        dequantize_rows(w, 10, 49)
    with pytest.raises(ValueError, match="outside"):
        dequantize_rows(w, 10, 9)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        dequantize_rows(w, 0, 4, torch.float64)


def test_configs_are_checked_and_the_table_fits_the_shapes():
    for bad in (dict(block_n=24), dict(block_k=100), dict(num_warps=3), dict(split=0), dict(block_n=8),
                dict(block_k=16), dict(num_stages=0)):
        with pytest.raises(ValueError):
            QGemvConfig(**bad)
    for T in (1, 8):
        for N, K in [(n, k) for _, n, k in DECODER] + [(37, 96), (1, 32), (300, 257)]:
            cfg = pick_config(T, N, K)
            assert 16 <= cfg.block_n <= max(16, 1 << (N - 1).bit_length())
            assert 32 <= cfg.block_k <= max(32, 1 << (K - 1).bit_length())
            assert cfg.block_n == 16 * cfg.num_warps  # a warp per mma tile of rows
    assert all(-(-n // pick_config(1, n, k).block_n) >= 128 for _, n, k in DECODER)  # enough programs
    assert TABLE[-1][0] >= 1 << 62  # the last row takes every N


def test_qweight_integer_round_trips_stay_within_half_a_step():
    """|w - dq| <= |scale| / 2 per element (int8 everywhere; int4 wherever w / scale <= 7.5: level +7 is the
    top, and the side opposite the group's largest magnitude may reach w / scale = 8, a step at most); int4's
    largest magnitude per group exact (it is level -8) and all 16 levels in use; K = 300: a partial group."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 300, generator=g)
    for kind in ("int8", "int4"):
        qw = QWeight.from_float(w, kind)
        scale = qw.scale.repeat_interleave(128, 1)[:, :300]
        err = (w - qw.dequantize(torch.float32)).abs()
        inside = w / scale <= 7.5 if kind == "int4" else torch.ones_like(w, dtype=torch.bool)
        assert bool((err[inside] <= scale.abs()[inside] / 2 * (1 + 1e-6)).all()), kind
        assert bool((err <= scale.abs() * (1 + 1e-6)).all()), kind
        assert err.max() > 0.3 * scale.abs().max() / 2  # really rounded: not a tautology of a tiny error
    qw = QWeight.from_float(w, "int4")
    nibbles = torch.stack((qw.q & 0xF, qw.q >> 4), -1).view(64, -1)[:, :300]
    assert sorted(nibbles.unique().tolist()) == list(range(16))
    idx = F.pad(w, (0, 84)).view(64, 3, 128).abs().argmax(-1) + torch.arange(3) * 128  # each group's largest
    assert torch.equal(qw.dequantize(torch.float32).gather(1, idx), w.gather(1, idx))  # level -8, exactly
    odd = QWeight.from_float(torch.randn(4, 7, generator=g), "int4")
    assert bool(((odd.q[:, -1] >> 4) == 8).all())  # odd K: the pad nibble de-quantizes to 0


def test_qweight_fp8_round_trip_matches_the_checkpoint_format():
    """fp8 bytes and block scales de-quantize as hybrid.models.fp8 does (DeepSeek-V3's weight_dequant)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 257, generator=g)
    qw = QWeight.from_float(w, "fp8")
    ref = fp8_format.dequantize(qw.q, qw.scale, (128, 128))
    assert torch.equal(qw.dequantize(torch.float32), ref)
    assert torch.equal(qw.dequantize(torch.float32, slice(130, 290)), ref[130:290])
    torch.testing.assert_close(ref, w, rtol=0.07, atol=qw.scale.max().item())  # e4m3: 3 mantissa bits


SM90_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybrid.gpu_kernels import qgemv

def gemv(kind, N, K, dt, cfg):
    split, const = qgemv.kernel_constants(kind, N, K, 128, cfg, True, dt == "fp32")
    names = qgemv._qgemv.arg_names
    sig = {"x": "*" + dt, "q": "*u8", "s": "*fp32", "b": "*" + dt, "y": "*" + dt, "ws": "*fp32"}
    sig.update({a: "i32" for a in names[6:10]})
    sig.update({a: "constexpr" for a in names[10:]})
    aligned = ("x", "q", "s", "b", "y", "ws", "stride_x", "stride_y")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(ASTSource(qgemv._qgemv, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))

def dequant(kind, K, dt):
    const = dict(K=K, KQ=(K + 1) // 2 if kind == "int4" else K, SG=-(-K // 128), KIND=qgemv.KIND_CODE[kind], GROUP=128,
                 BLOCK_R=qgemv.DQ_ROWS, BLOCK_C=qgemv.DQ_COLS, BF16=dt == "bf16")
    sig = {"q": "*u8", "s": "*fp32", "out": "*" + dt, "r0": "i32", "R": "i32"}
    sig.update({a: "constexpr" for a in const})
    return triton.compile(ASTSource(qgemv._dequant, sig, const), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=qgemv.DQ_WARPS))

cases = [(kind, N, K, "bf16") for kind in ("int8", "int4", "fp8") for N, K in ((5120, 2048), (32768, 2048))]
cases += [("int4", 2048, 4096, "fp16"), ("fp8", 7168, 16384, "fp16"), ("int8", 24576, 1536, "fp32")]
for kind, N, K, dt in cases:
    cfg = qgemv.pick_config(1, N, K)
    local, regs = usage(gemv(kind, N, K, dt, cfg))
    print(json.dumps({"case": [kind, N, K, dt], "config": cfg.short(), "local": local, "regs": regs}), flush=True)
for kind, dt in (("int8", "bf16"), ("int4", "bf16"), ("fp8", "fp16")):
    local, regs = usage(dequant(kind, 7168, dt))
    print(json.dumps({"case": ["dequant", kind, dt], "local": local, "regs": regs}), flush=True)
"""


def test_table_configs_compile_for_sm90_without_spills(tmp_path):
    """Triton compiles for a GPU target without a GPU: the table's configs for every kind (bf16; fp16 and fp32
    x once each) and the de-quantizer build for the H200's sm_90 with no local memory (register spills).
    Compiled, not interpreted: a subprocess without TRITON_INTERPRET."""
    import json

    from triton_compile import compile_script

    rows = [json.loads(line) for line in compile_script(SM90_COMPILE, tmp_path) if line.startswith("{")]
    assert len(rows) == 12
    assert all(r["local"] == 0 for r in rows), [r for r in rows if r["local"]]
