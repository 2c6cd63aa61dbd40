"""Edges of the compiled driver (cpu_kernels/csrc/driver.h, api.h) that the layer-level tests do not reach:
the argument checks of hy_forward called directly (CpuMoE validates in Python first, so a wrong check in C
would go unseen), the most NUMA nodes a layer holds (8, HY_MAX_NODES), a call with no expert held here (no
active expert: nothing for the decode phase to run, yet out must be written), and the streaming-read ceiling's
checksum (it must read every byte it times)."""

import ctypes
import os

import pytest
import torch

from cpu_kernels import CpuMoE, _native
from cpu_kernels.reference import moe_forward
from cpu_kernels.topology import Topology
from test_cpu_moe import COMPILED, EMU, TOL, dequantized, rel_err

ISAS = [i for i in COMPILED if i != "amx"] + EMU
HY_EID, HY_EARG = -1, -2


def _moe(isa, e=4, f=96, d=64, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    ws = (torch.randn(e, f, d, generator=g) / d**0.5, torch.randn(e, f, d, generator=g) / d**0.5,
          torch.randn(e, d, f, generator=g) / f**0.5)
    return ws, CpuMoE(*ws, isa=isa, threads=1, **kw)


def _call(moe, layer, x, ids, w, lmap, out, T=None, K=None, n_global=None):
    """hy_forward straight through ctypes (no Python-side validation; bf16 x and out); returns its code."""
    return _native.load(moe.isa).hy_forward(
        ctypes.byref(layer), x.data_ptr(), 1, x.shape[0] if T is None else T, ids.shape[1] if K is None else K,
        ids.data_ptr(), w.data_ptr(), lmap.data_ptr(), moe.num_experts if n_global is None else n_global,
        out.data_ptr(), 1)


@pytest.mark.parametrize("isa", ISAS)
def test_hy_forward_refuses_bad_arguments_and_leaves_out_alone(isa):
    """Each malformed call returns its error code before it writes anything: `out` keeps its NaNs."""
    ws, moe = _moe(isa)
    E, D = moe.E, moe.D
    T, K = 3, 2
    x = torch.randn(T, D).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    w = torch.rand(T, K) + 0.1
    lmap = moe._lmap.clone()
    out = torch.full((T, D), float("nan"), dtype=torch.bfloat16)

    def layer(**fields):
        L = _native.HyLayer.from_buffer_copy(moe._layer)
        for k, v in fields.items():
            setattr(L, k, v)
        return L

    bad_lmap = lmap.clone()
    bad_lmap[2] = E  # a local index one past the experts held
    cases = [
        ("K = 0", dict(K=0), HY_EARG),
        ("T < 0", dict(T=-1), HY_EARG),
        ("no nodes", dict(layer=layer(n_nodes=0)), HY_EARG),
        ("9 nodes", dict(layer=layer(n_nodes=9)), HY_EARG),
        ("n_local < 0", dict(layer=layer(n_local=-1)), HY_EARG),
        ("local index == E", dict(lmap=bad_lmap), HY_EARG),
        ("id == n_global", dict(n_global=3), HY_EID),  # ids hold 3
    ]
    for what, kw, code in cases:
        L = kw.pop("layer", moe._layer)
        lm = kw.pop("lmap", lmap)
        assert _call(moe, L, x, ids, w, lm, out, **kw) == code, what
        assert torch.isnan(out.float()).all(), what
    # the same call, well formed, computes the layer
    assert _call(moe, moe._layer, x, ids, w, lmap, out) == 0
    ref = moe_forward(x.float(), *dequantized(ws, "bf16"), ids.long(), w)
    assert rel_err(out, ref) < TOL["bf16"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fused", [1, 0])
def test_eight_nodes_the_most_a_layer_holds(isa, fused):
    """A fake topology of 8 nodes (HY_MAX_NODES) sharing one cpu: F = 512 splits into 8 slices of 64, every node's
    partial is summed (fused: in the last finisher's reduction; phased: phase 3) and b_down added once."""
    cpu = min(os.sched_getaffinity(0))
    g = torch.Generator().manual_seed(3)
    E, F, D = 3, 512, 72
    ws = (torch.randn(E, F, D, generator=g) / D**0.5, torch.randn(E, F, D, generator=g) / D**0.5,
          torch.randn(E, D, F, generator=g) / F**0.5)
    bd = torch.randn(E, D, generator=g)
    moe = CpuMoE(*ws, isa=isa, topology=Topology(tuple((cpu,) for _ in range(8))), amx_min_tokens=10**9, b_down=bd)
    assert moe._layer.n_nodes == 8
    old = _native.tune(moe.isa, "fused", fused)
    try:
        T = 4
        x = torch.randn(T, D, generator=g).bfloat16()
        ids = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 0]], dtype=torch.int32)
        w = torch.rand(T, 2, generator=g) + 0.1
        out = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
        moe.forward(x, ids, w, out=out)
    finally:
        _native.tune(moe.isa, "fused", old)
    ref = moe_forward(x.float(), *dequantized(ws, "bf16"), ids.long(), w, b_down=bd)
    assert rel_err(out, ref) < TOL["bf16"]


@pytest.mark.parametrize("isa", [i for i in COMPILED if i != "amx"])
def test_stream_read_reads_every_word(isa):
    """The read ceiling's checksum is the sum of every 64-bit word it loaded: with random words, a read that
    skipped any part of the buffer (a lane, a 32-byte load, a chunk's tail) would sum to something else.
    Chunks are 1 MiB, each read in 128-byte steps; the buffer here ends in a partial chunk."""
    lib = _native.load(isa)
    pool = _native.pool(isa, [min(os.sched_getaffinity(0))])
    n = (2 << 20) + 4096  # two whole chunks and a 4 KiB one (a multiple of 128 bytes)
    g = torch.Generator().manual_seed(5)
    buf = torch.randint(-2**62, 2**62, (n // 8,), dtype=torch.int64, generator=g)
    assert buf.data_ptr() % 32 == 0  # the read uses aligned 32-byte loads
    want = sum(buf.tolist()) % 2**64
    want = want - 2**64 if want >= 2**63 else want
    for pf in (0, 256):
        old = _native.tune(isa, "stream_pf", pf)
        try:
            assert lib.hy_stream_read(pool, buf.data_ptr(), n) == want, pf
        finally:
            _native.tune(isa, "stream_pf", old)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_no_expert_held_here_writes_zeros(isa, dtype, out_dtype):
    """A decode step whose every chosen expert runs elsewhere (the GPU holds them: masked off here) still writes
    out, all zeros: no active expert means no task of the decode phase, so the zeros must come from somewhere."""
    ws, moe = _moe(isa, dtype=dtype)
    T = 3
    x = torch.randn(T, moe.D).to(out_dtype)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    w = torch.rand(T, 2) + 0.1
    for mask in (torch.zeros(moe.E, dtype=torch.bool), torch.tensor([False, False, False, True])):
        out = torch.full((T, moe.D), float("nan"), dtype=out_dtype)
        moe.forward(x, ids, w, expert_mask=mask, out=out)
        held = mask[ids.long()]
        ref = moe_forward(x.float(), *dequantized(ws, dtype), ids.long(), torch.where(held, w, 0.0))
        assert torch.isfinite(out).all(), mask
        assert (out[~held.any(1)] == 0).all(), mask  # tokens with no expert here: exactly 0
        if held.any():
            assert rel_err(out, ref) < TOL[dtype], mask
