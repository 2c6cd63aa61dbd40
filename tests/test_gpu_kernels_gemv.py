"""The decode GEMV (hybrid.gpu_kernels.gemv.linear_small) against F.linear in fp32. Without CUDA it runs in
Triton's interpreter on CPU tensors (tests/conftest.py selects it); on the GPU box the same tests run compiled on
CUDA tensors (the `cuda` cases, marked gpu). Ragged shapes: T from 1 to 8, N and K that are not powers of two
nor multiples of the blocks, K narrower than a block, every multiply-add kind (FMA at T = 1 and T > 1,
tensor-core dot), rolled and unrolled K loops, and split-K with slices that do not divide K; bias or none;
fp32, bf16 and fp16. Then the declines, and the decoder shapes the kernel is for (q/k/v 5120 x 2048, o_proj
2048 x 4096, router 128 x 2048): compiled on CUDA at full size with the table's configs; in the interpreter the
router at full size, q/k/v and o_proj at full size with wide blocks (few programs: the interpreter runs them
one by one) and as narrower stand-ins with the table's. Last, the table's configs compiled for sm_90 (no GPU
needed) without register spills.

Tolerances: fp32 1e-4 (K up to 4096, summed in another order than F.linear's); bf16/fp16 outputs are rounded
once from fp32, to nearest on CUDA and truncated in the interpreter (Triton 3.6's numpy cast), so within 1e-2
relative of the fp32 reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject [test]); install it")

from hybrid.gpu_kernels.gemv import TABLE, GemvConfig, linear_small, linear_small_supported, pick_config  # noqa: E402

DEVICES = ([pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA (GPU box)")])]
           + (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []))


def operands(T, N, K, dtype, bias, seed):
    """x [T, K], w [N, K] scaled so outputs are O(1), bias [N] or None (CPU tensors)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def check(T, N, K, dtype, bias, device, config=None, seed=0):
    x, w, b = operands(T, N, K, dtype, bias, seed)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    assert linear_small_supported(on(x), on(w), on(b))
    y = linear_small(on(x), on(w), on(b), config).cpu()
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.shape == (T, N) and y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    return y


RAGGED = [  # T, N, K, bias, dtype, config
    (1, 37, 96, True, torch.float32, GemvConfig(block_n=8, block_k=64)),  # FMA at T=1, K masked in the last tile
    (3, 37, 96, False, torch.float32, GemvConfig(block_n=8, block_k=64)),  # FMA over T padded to 4
    (5, 100, 160, True, torch.float32, GemvConfig(block_n=16, block_k=32, dot=True)),  # dot, IEEE fp32
    (8, 50, 176, True, torch.bfloat16, GemvConfig(block_n=16, block_k=32, split=3)),  # split, uneven slices
    (1, 50, 176, False, torch.bfloat16, GemvConfig(block_n=4, block_k=32, split=2)),
    (2, 77, 48, True, torch.bfloat16, GemvConfig(block_n=16, block_k=64, dot=True)),  # K narrower than a tile
    (6, 200, 320, False, torch.float16, GemvConfig(block_n=8, block_k=128, num_warps=8)),
    (4, 33, 208, True, torch.bfloat16, GemvConfig(block_n=32, block_k=64, num_stages=3, split=2, dot=True)),
    (1, 90, 272, True, torch.bfloat16, GemvConfig(block_n=8, block_k=64, unroll=False)),  # the rolled FMA loop
    (3, 70, 272, False, torch.bfloat16, GemvConfig(block_n=16, block_k=64, dot=True, unroll=True)),  # unrolled dot
    (7, 1, 16, True, torch.float32, None),  # one output row
    (8, 600, 64, True, torch.bfloat16, None),  # the table's dense-projection row (dot), a short K
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,N,K,bias,dtype,config", RAGGED)
def test_linear_small_matches_f_linear_on_ragged_shapes(T, N, K, bias, dtype, config, device):
    check(T, N, K, dtype, bias, device, config, seed=T * N + K)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", range(1, 9))
def test_every_batch_size_with_the_table_configs(T, dtype, device):
    """T = 1..8 on a router-sized and a projection-sized stand-in (not powers of two), bias on odd T."""
    check(T, 72, 112, dtype, T % 2 == 1, device, seed=T)
    check(T, 520, 48, dtype, T % 2 == 1, device, seed=T + 10)


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_are_bitwise_repeatable(device):
    """No atomics: the same config gives the same bits on every call, split-K included."""
    x, w, b = (t.to(device) for t in operands(4, 90, 256, torch.bfloat16, True, 5))
    for cfg in (GemvConfig(block_n=8, block_k=64), GemvConfig(block_n=16, block_k=32, split=4, dot=True)):
        first = linear_small(x, w, b, cfg)
        assert torch.equal(first, linear_small(x, w, b, cfg))


DECODER = [  # name, N, K, the interpreter's config at full size (None: the table's)
    ("router", 128, 2048, None),
    ("qkv", 5120, 2048, GemvConfig(block_n=64, block_k=2048)),
    ("o_proj", 2048, 4096, GemvConfig(block_n=64, block_k=2048)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("name,N,K,interp_config", DECODER)
def test_decoder_projection_shapes(name, N, K, interp_config, T, device):
    cfg = None if device == "cuda" else interp_config
    if cfg is not None and T > 1:
        cfg = GemvConfig(block_n=64, block_k=1024, dot=True)
    check(T, N, K, torch.bfloat16, False, device, cfg, seed=N + T)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("N,K", [(640, 2048), (576, 4096)])
def test_projection_stand_ins_with_the_table_configs(N, K, T, device):
    """q/k/v's and o_proj's K with an eighth-ish of their N (not a multiple of the blocks), the table's configs."""
    check(T, N, K, torch.bfloat16, T == 8, device, seed=N * T)


def test_declines_what_it_does_not_take():
    x, w, b = operands(2, 48, 64, torch.bfloat16, True, 1)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    assert linear_small_supported(x, w, b) == interp  # CPU tensors only through the interpreter
    if not interp:
        return
    assert linear_small_supported(x, w)
    no = [
        (torch.randn(9, 64).bfloat16(), w, None),  # T > 8
        (torch.randn(0, 64).bfloat16(), w, None),  # no rows
        (torch.randn(64).bfloat16(), w, None),  # not [T, K]
        (x[:, :48], w[:, :48].contiguous(), None),  # K = 48 fine, x's rows strided too ...
        (torch.randn(2, 40).bfloat16(), torch.randn(48, 40).bfloat16(), None),  # ... K = 40 is not a multiple of 16
        (x, torch.randn(64, 48).bfloat16().t(), None),  # w not contiguous
        (x, w.float(), None),  # mixed dtypes
        (x.to(torch.float64), w.to(torch.float64), None),  # fp64
        (x, w, b.float()),  # a bias of another dtype
        (x, w, b[:47]),  # a bias of another length
        (torch.randn(2, 128).bfloat16()[:, ::2], w, None),  # x not unit-stride along K
    ]
    verdicts = [linear_small_supported(*c) for c in no]
    assert verdicts == [False, False, False, True] + [False] * 7
    xs, ws = x[:, :48], w[:, :48].contiguous()  # x's rows 64 apart
    torch.testing.assert_close(linear_small(xs, ws).float(), F.linear(xs.float(), ws.float()), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="use F.linear"):
        linear_small(torch.randn(9, 64).bfloat16(), w)


def test_configs_are_checked_and_the_table_fits_the_shapes():
    for bad in (dict(block_n=3), dict(block_k=100), dict(num_warps=6), dict(split=0), dict(block_n=8, dot=True)):
        with pytest.raises(ValueError):
            GemvConfig(**bad)
    assert TABLE[-1][0] == 8  # the last row takes every T the kernel takes
    for T in range(1, 9):
        for N, K in ((5120, 2048), (2048, 4096), (128, 2048), (1, 16), (37, 96)):
            cfg = pick_config(T, N, K)
            assert cfg.block_k <= max(16, 1 << (K - 1).bit_length())
            assert cfg.block_n <= max(16 if cfg.dot else 1, 1 << (N - 1).bit_length())


SM90_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybrid.gpu_kernels import gemv

cases = [(T, N, K, "bf16") for T in (1, 8) for N, K in ((5120, 2048), (2048, 4096), (128, 2048), (600, 96))]
cases += [(3, 600, 96, "fp32"), (2, 5120, 2048, "fp16")]
for T, N, K, dt in cases:
    cfg = gemv.pick_config(T, N, K)
    split, const = gemv.kernel_constants(T, N, K, cfg, True, dt == "fp32")
    names = gemv._gemv.arg_names
    sig = {a: ("*fp32" if a == "ws" else "*" + dt) for a in names[:5]}
    sig.update({a: "i32" for a in names[5:9]})
    sig.update({a: "constexpr" for a in names[9:]})
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("x", "w", "b", "y", "ws", "stride_x", "stride_y")}
    k = triton.compile(ASTSource(gemv._gemv, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    local, regs = usage(k)
    print(json.dumps({"case": [T, N, K, dt], "config": cfg.short(), "local": local, "regs": regs}), flush=True)
names = gemv._split_sum.arg_names  # the split-K sum compiles too
sig = {"ws": "*fp32", "b": "*bf16", "y": "*bf16", "T": "i32", "N": "i32", "stride_y": "i32",
       "SPLIT": "constexpr", "BLOCK": "constexpr", "HAS_BIAS": "constexpr"}
triton.compile(ASTSource(gemv._split_sum, sig, dict(SPLIT=3, BLOCK=1024, HAS_BIAS=True)), target=GPUTarget("cuda", 90, 32))
"""


def test_table_configs_compile_for_sm90_without_spills(tmp_path):
    """Triton compiles for a GPU target without a GPU: every table config the decoder shapes (and a ragged one,
    fp32 and fp16 once) take builds for the H200's sm_90 with no local memory (register spills). Compiled, not
    interpreted: a subprocess without TRITON_INTERPRET."""
    import json

    from triton_compile import compile_script

    rows = [json.loads(line) for line in compile_script(SM90_COMPILE, tmp_path) if line.startswith("{")]
    assert len(rows) == 10
    assert all(r["local"] == 0 for r in rows), [r for r in rows if r["local"]]
