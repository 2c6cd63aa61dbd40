"""K blocking of the AMX kernels (cpu_kernels/csrc/kern_amx.h): K is walked in blocks of amx_kblock 64-byte
chunks (the run-time knob; default 16), the partial C tiles parked in a per-thread buffer between blocks, int4's
blocks rounded to whole groups (and whole fold blocks of the stored order). At the default, every K here fits one
block, so the parking and the block ends run only when the knob is turned down. Runs on the real AMX build where
the CPU has it and on amx_emu (the same C++, tiles emulated) everywhere else.

Parked partial sums are stored exactly (fp32 tiles, int32 for int8) and every (row, token) sum runs over K in
the same order whatever the blocking, so any K block gives bit-identical outputs."""

import pytest
import torch

from cpu_kernels import CpuMoE, _native
from cpu_kernels.reference import moe_forward
from test_cpu_int4_amx import profiled_call
from test_cpu_moe import COMPILED, EMU, TOL, dequantized, rel_err

AMX_ISAS = [i for i in ("amx", "amx_emu") if i in COMPILED + EMU]
pytestmark = pytest.mark.skipif(not AMX_ISAS, reason="neither the AMX build nor amx_emu can run here")
DEFAULT_KBLOCK = 16  # hy.h Knobs::amx_kblock


@pytest.mark.parametrize("isa", AMX_ISAS)
@pytest.mark.parametrize("dtype,group,order", [("bf16", 128, None), ("int8", 128, None), ("int4", 64, "natural"),
                                               ("int4", 128, "natural"), ("int4", 64, None)])
def test_amx_k_blocks_change_nothing(isa, dtype, group, order):
    E, F, D, T = 4, 96, 360, 40  # gate/up K: 360 -> 384 (6 chunks of int8, 12 of bf16; int4 g64: fold 2, 3 blocks)
    g = torch.Generator().manual_seed(31)
    ws = (torch.randn(E, F, D, generator=g) / D**0.5, torch.randn(E, F, D, generator=g) / D**0.5,
          torch.randn(E, D, F, generator=g) / F**0.5)
    kw = dict(int4_order=order) if order else {}
    moe = CpuMoE(*ws, dtype=dtype, group_size=group, isa=isa, amx_min_tokens=1, threads=2, **kw)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, 2, generator=g) + 0.1
    ref = moe_forward(x.float(), *dequantized(ws, dtype, group), ids.long(), w)
    outs = {}
    old = _native.tune(moe.isa, "amx_kblock", DEFAULT_KBLOCK)
    try:
        for kb in (DEFAULT_KBLOCK, 1, 3, 4):
            _native.tune(moe.isa, "amx_kblock", kb)
            out = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
            moe.forward(x, ids, w, out=out)
            assert rel_err(out, ref) < TOL[dtype], kb
            outs[kb] = out
    finally:
        _native.tune(moe.isa, "amx_kblock", old)
    for kb, out in outs.items():
        assert torch.equal(out, outs[DEFAULT_KBLOCK]), kb


@pytest.mark.parametrize("isa", AMX_ISAS)
@pytest.mark.parametrize("knee", [1, 3])
def test_an_expert_of_exactly_knee_tokens_takes_the_tiles(isa, knee):
    """amx_min_tokens is the count FROM which an expert runs on AMX: every expert here has exactly `knee` tokens,
    so all take the tiles (the phased path: packed x, a down phase); one token fewer each, and none does."""
    E, F, D = 4, 64, 128
    g = torch.Generator().manual_seed(32)
    ws = (torch.randn(E, F, D, generator=g) / D**0.5, torch.randn(E, F, D, generator=g) / D**0.5,
          torch.randn(E, D, F, generator=g) / F**0.5)
    moe = CpuMoE(*ws, isa=isa, amx_min_tokens=knee, threads=1)
    for m, tiles in ((knee, True), (knee - 1, False)):
        if m == 0:
            continue
        ids = torch.arange(E, dtype=torch.int32).repeat_interleave(m)[:, None]  # expert e: exactly m tokens
        x = torch.randn(ids.shape[0], D, generator=g).bfloat16()
        w = torch.rand(ids.shape[0], 1, generator=g) + 0.1
        y, prof = profiled_call(moe, x, ids, w)
        assert (prof["pack_x"] > 0 and prof["down"] > 0) == tiles, (m, prof)
        assert rel_err(y, moe_forward(x.float(), *dequantized(ws, "bf16"), ids.long(), w)) < TOL["bf16"], m
