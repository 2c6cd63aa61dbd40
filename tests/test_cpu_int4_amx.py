"""int4 on the AMX path (cpu_kernels/csrc/kern_amx.h, amx_gemm_i4): nibbles unpacked to int8 A tiles, each
group's int32 tile products folded into fp32 with the row's group scale. Runs on the real AMX build where
the CPU has it and on amx_emu (the same C++ with the tile instructions emulated) everywhere else.

Groups of 64 and 128 take the tiles above the knee; groups of 32 (half a 64-value K tile) stay on the vector
path and say so once. The AMX and vector paths see the same int8 activations and sum each group exactly in
int32, so they differ only by fp32 summation order (and the odd h value whose int8 rounding that flips)."""

import logging

import pytest
import torch

from cpu_kernels import CpuMoE, _native, moe as moe_mod
from cpu_kernels.reference import moe_forward
from test_cpu_moe import COMPILED, EMU, TOL, dequantized, ragged_routing, rel_err, weights

AMX_ISAS = [i for i in ("amx", "amx_emu") if i in COMPILED + EMU]
pytestmark = pytest.mark.skipif(not AMX_ISAS, reason="neither the AMX build nor amx_emu can run here")


def profiled_call(moe, x, ids, w):
    _native.profile_enable(moe.isa, True)
    try:
        _native.profile_read(moe.isa, reset=True)
        y = moe.forward(x, ids, w)
        return y, _native.profile_read(moe.isa, reset=True)
    finally:
        _native.profile_enable(moe.isa, False)


@pytest.mark.parametrize("isa", AMX_ISAS)
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("shape", [(97, 131), (200, 330)])  # (F, D): K of gate/up and down padded to the group
def test_int4_amx_matches_reference_and_vector_path(isa, group, shape):
    f, d = shape
    ws = weights(seed=21, f=f, d=d)
    ids, w = ragged_routing(513, seed=22)  # experts with 300, 7, 1, 0 and ~200 tokens, plus one with all 513
    x = torch.randn(513, d, generator=torch.Generator().manual_seed(23)).bfloat16()
    ref = moe_forward(x, *dequantized(ws, "int4", group), ids, w)
    amx = CpuMoE(*ws, dtype="int4", group_size=group, isa=isa, amx_min_tokens=1, threads=2)
    vec = CpuMoE(*ws, dtype="int4", group_size=group, isa=isa, amx_min_tokens=10**9, threads=2)
    y, prof = profiled_call(amx, x, ids, w)
    assert prof["pack_x"] > 0 and prof["down"] > 0, prof  # packed B tiles: the experts ran on the tiles
    assert not torch.isnan(y).any()
    assert rel_err(y, ref) < TOL["int4"]
    yv = vec.forward(x, ids, w)
    assert rel_err(y, yv) < 1e-2
    assert float((y.float() - yv.float()).abs().mean() / yv.float().abs().mean()) < 2e-3


@pytest.mark.parametrize("isa", AMX_ISAS)
def test_int4_amx_knee_splits_experts(isa):
    """Knee 8: experts with 300 / 7 / 1 / ~200 / 513 tokens mix both paths in one call; the result still
    matches the all-vector run."""
    ws = weights(seed=24)
    ids, w = ragged_routing(513, seed=25)
    x = torch.randn(513, ws[0].shape[2], generator=torch.Generator().manual_seed(26))
    mixed = CpuMoE(*ws, dtype="int4", group_size=128, isa=isa, amx_min_tokens=8, threads=2).forward(x, ids, w)
    vec = CpuMoE(*ws, dtype="int4", group_size=128, isa=isa, amx_min_tokens=10**9, threads=2).forward(x, ids, w)
    assert rel_err(mixed, vec) < 1e-2


@pytest.mark.parametrize("isa", AMX_ISAS)
def test_int4_group32_stays_on_the_vector_path_loudly_once(isa, caplog, monkeypatch):
    monkeypatch.setattr(moe_mod, "_SAID_VECTOR_ONLY", set())
    ws = weights(seed=27)
    with caplog.at_level(logging.WARNING, logger="cpu_kernels"):
        moe = CpuMoE(*ws, dtype="int4", group_size=32, isa=isa, amx_min_tokens=1, threads=2)
        CpuMoE(*ws, dtype="int4", group_size=32, isa=isa, threads=2)
        CpuMoE(*ws, dtype="int4", group_size=64, isa=isa, threads=2)  # has the tiles: says nothing
    said = [r.getMessage() for r in caplog.records if "no AMX kernel" in r.getMessage()]
    assert len(said) == 1 and "int4 (group 32)" in said[0] and isa in said[0]
    ids, w = ragged_routing(320, seed=28)
    x = torch.randn(320, ws[0].shape[2]).bfloat16()
    y, prof = profiled_call(moe, x, ids, w)
    assert prof["pack_x"] == 0, prof  # no B tiles packed: every expert on the vector kernels
    assert rel_err(y, moe_forward(x, *dequantized(ws, "int4", 32), ids, w)) < TOL["int4"]
