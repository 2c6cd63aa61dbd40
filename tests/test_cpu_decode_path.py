"""The decode path of the CPU executor (cpu_kernels/csrc/fused.h: gate/up and down in one barrier-free
phase, expert-major down outputs, one weighted sum per token) against the phased path and the reference.

Decode-shaped routing: T = 1..9 tokens each choosing K = 8 of E experts, some experts masked off (the
resident ones), some tokens with no local expert at all; several NUMA nodes (a fake topology whose nodes
share one pool, so the last-finisher reductions run across nodes); outputs pre-filled with NaN. The fused
and phased paths run the same vector kernels on the same quantized activations, so they agree to fp32
summation order; the reference bounds both.
"""

import os

import pytest
import torch

import cpu_kernels
from cpu_kernels import CpuMoE, _native
from cpu_kernels.reference import moe_forward
from cpu_kernels.topology import Topology
from test_cpu_moe import COMPILED, EMU, TOL, dequantized, rel_err

E, F, D, K = 12, 200, 136, 8
ISAS = [i for i in COMPILED if i != "amx"] + EMU  # real AMX runs decode on its AVX-512 path: covered by avx512


def routing(T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g) + 0.05
    return ids, w


@pytest.fixture
def knobs():
    """Restore every ISA library's knobs after a test that turns them."""
    saved = []
    yield saved
    for isa, name, value in reversed(saved):
        _native.tune(isa, name, value)


def turn(knobs, isa, name, value):
    knobs.append((isa, name, _native.tune(isa, name, value)))


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, F, D, generator=g) / D**0.5, torch.randn(E, F, D, generator=g) / D**0.5,
            torch.randn(E, D, F, generator=g) / F**0.5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,group", [("bf16", 128), ("int8", 128), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("nodes", ["one", "two", "shared"])
def test_fused_matches_phased_and_reference(isa, dtype, group, nodes, knobs):
    ws = weights()
    cpus = sorted(os.sched_getaffinity(0))
    topo = {"one": None, "two": Topology(((cpus[0],), (cpus[-1],))),  # two pools (one if a single cpu)
            "shared": Topology(((cpus[0],), (cpus[0],)))}[nodes]  # one pool: the nodes run one after the other
    moe = CpuMoE(*ws, dtype=dtype, group_size=group, isa=isa, amx_min_tokens=10**9, topology=topo,
                 threads=None if topo else 2)
    ref_w = dequantized(ws, dtype, group)
    mask = torch.ones(E, dtype=torch.bool)
    mask[[1, 4, 7]] = False  # resident experts: skipped here
    for T in (1, 2, 5, 9):
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).bfloat16()
        ids, w = routing(T, seed=T)
        if T == 5:  # a token none of whose experts is held here: its output row must be exactly 0
            ids[3] = torch.tensor([1, 4, 7, 1, 4, 7, 1, 4], dtype=torch.int32)
        held = mask[ids.long()]
        ref = moe_forward(x.float(), *ref_w, ids.long(), torch.where(held, w, 0.0))
        outs = {}
        for fused in (1, 0):
            turn(knobs, moe.isa, "fused", fused)
            out = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
            moe.forward(x, ids, w, expert_mask=mask, out=out)
            assert torch.isfinite(out).all(), (fused, T)
            assert rel_err(out, ref) < TOL[dtype], (fused, T, rel_err(out, ref))
            outs[fused] = out.float()
        if T == 5:
            assert (outs[1][3] == 0).all()
        assert rel_err(outs[1], outs[0]) < 1e-2, T  # bf16 output rounding of two fp32 summation orders


def test_many_calls_reuse_state(knobs):
    """Back-to-back decode calls of different shapes reuse the per-call counters: stale state would make a
    call wait forever or skip a reduction (NaN rows)."""
    isa = ISAS[0] if ISAS else pytest.skip("no compiled ISA on this machine")
    turn(knobs, isa, "spin_us", 0)  # workers sleep between calls: the wake-up path runs too
    ws = weights(2)
    moe = CpuMoE(*ws, isa=isa, threads=2)
    ref_w = dequantized(ws, "bf16")
    for i in range(40):
        T = 1 + i % 7
        x = torch.randn(T, D).bfloat16()
        ids, w = routing(T, seed=100 + i)
        out = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
        moe.forward(x, ids, w, out=out)
        assert rel_err(out, moe_forward(x.float(), *ref_w, ids.long(), w)) < TOL["bf16"], i


def test_unknown_knob():
    isa = COMPILED[0] if COMPILED else pytest.skip("no compiled ISA on this machine")
    with pytest.raises(ValueError, match="unknown knob"):
        _native.tune(isa, "bogus", 1)
    assert cpu_kernels._native.load(isa).hy_tune(b"bogus", 1) == -1


@pytest.mark.parametrize("isa", ISAS)
def test_decode_calls_take_the_fused_path(isa, knobs):
    """The profile tells the paths apart: the fused phase counts as gate_up with no separate down phase."""
    moe = CpuMoE(*weights(3), isa=isa, threads=2, amx_min_tokens=10**9)
    x = torch.randn(2, D).bfloat16()
    ids, w = routing(2, seed=3)
    _native.profile_enable(moe.isa, True)
    try:
        for fused in (1, 0):
            turn(knobs, moe.isa, "fused", fused)
            _native.profile_read(moe.isa, reset=True)
            moe.forward(x, ids, w)
            p = _native.profile_read(moe.isa, reset=True)
            assert p["calls"] == 1 and p["gate_up"] > 0
            assert (p["down"] == 0) == bool(fused), p
    finally:
        _native.profile_enable(moe.isa, False)


# Decode task knobs (hy.h Knobs): (task_rows, task_min, pf_rows). The shape gives gate/up rows past 256 and down rows
# past 512, both with ragged tails; the test's 5 tokens run a 4-token and a 1-token block.
TASK_KNOBS = [(64, 6, 8), (256, 2, 8), (512, 1, 32), (128, 3, 64), (64, 1, 16), (512, 1, 16), (192, 2, 16)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_task_size_and_prefetch_distance_change_nothing(isa, dtype, knobs):
    """Task boundaries fall on 16-row multiples of the kernels' 4-row blocks and every block and token sum is
    made in one fixed order, so any task size gives bit-identical outputs (and they match the reference); the
    prefetch distance touches no value either (a prefetch past a matrix's last row reads nothing)."""
    Ft, Dt, Et = 300, 520, 6
    g = torch.Generator().manual_seed(7)
    ws = (torch.randn(Et, Ft, Dt, generator=g) / Dt**0.5, torch.randn(Et, Ft, Dt, generator=g) / Dt**0.5,
          torch.randn(Et, Dt, Ft, generator=g) / Ft**0.5)
    moe = CpuMoE(*ws, dtype=dtype, isa=isa, threads=2, amx_min_tokens=10**9)
    ref_w = dequantized(ws, dtype, moe.group_size)
    T, Kt = 5, 3
    x = torch.randn(T, Dt, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(Et, generator=g)[:Kt] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, Kt, generator=g) + 0.05
    ref = moe_forward(x.float(), *ref_w, ids.long(), w)
    outs = []
    for rows, least, ahead in TASK_KNOBS:
        turn(knobs, moe.isa, "task_rows", rows)
        turn(knobs, moe.isa, "task_min", least)
        turn(knobs, moe.isa, "pf_rows", ahead)
        out = torch.full((T, Dt), float("nan"), dtype=torch.bfloat16)
        moe.forward(x, ids, w, out=out)
        assert rel_err(out, ref) < TOL[dtype], (rows, least, ahead)
        outs.append(out)
    for o, k in zip(outs[1:], TASK_KNOBS[1:]):
        assert torch.equal(o, outs[0]), k


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("nodes", ["one", "two"])
def test_tail_tasks_cut_in_parts_change_nothing(isa, dtype, nodes, knobs):
    """tail_split cuts the last down tasks (one per thread) into parts of 16-row multiples, each counted towards its
    block's last-finisher sum: every split (down blocks with ragged ends, parts past a block's end that are empty,
    one expert whose every down task is in the tail, a token with no local expert, two nodes' counts) gives the
    whole tasks' output bit for bit."""
    Ft, Dt, Et = 300, 520, 6
    g = torch.Generator().manual_seed(11)
    ws = (torch.randn(Et, Ft, Dt, generator=g) / Dt**0.5, torch.randn(Et, Ft, Dt, generator=g) / Dt**0.5,
          torch.randn(Et, Dt, Ft, generator=g) / Ft**0.5)
    cpus = sorted(os.sched_getaffinity(0))
    topo = Topology(((cpus[0],), (cpus[-1],))) if nodes == "two" else None
    moe = CpuMoE(*ws, dtype=dtype, isa=isa, threads=None if topo else 2, topology=topo, amx_min_tokens=10**9)
    ref_w = dequantized(ws, dtype, moe.group_size)
    mask = torch.ones(Et, dtype=torch.bool)
    mask[5] = False
    splits = (1, 2, 3, 8)  # 1 (every task whole) first: the others must equal it
    for T, Kt, rows in ((1, 1, 256), (1, 3, 64), (5, 3, 128), (4, 2, 512)):
        x = torch.randn(T, Dt, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(Et, generator=g)[:Kt] for _ in range(T)]).to(torch.int32)
        if T == 5:
            ids[2] = 5  # no local expert: its row must come out 0 every way
        w = torch.rand(T, Kt, generator=g) + 0.05
        ref = moe_forward(x.float(), *ref_w, ids.long(), torch.where(mask[ids.long()], w, 0.0))
        turn(knobs, moe.isa, "task_rows", rows)
        outs = []
        for parts in splits:
            turn(knobs, moe.isa, "tail_split", parts)
            moe.forward(-x, ids, w, expert_mask=mask)  # other values in the workspace: a sum made early reads them
            out = torch.full((T, Dt), float("nan"), dtype=torch.bfloat16)
            moe.forward(x, ids, w, expert_mask=mask, out=out)
            assert rel_err(out, ref) < TOL[dtype], (T, Kt, rows, parts)
            outs.append(out)
        for parts, o in zip(splits[1:], outs[1:]):
            assert torch.equal(o, outs[0]), (T, Kt, rows, parts)
        if T == 5:
            assert (outs[0][2] == 0).all()


@pytest.mark.parametrize("isa", [i for i in COMPILED if i in ("avx512_bf16", "amx")] or ["none"])
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_block_sums_do_not_depend_on_the_tokens_beside(isa, dtype):
    """Each AVX-512 4-row block ends with one transposing sum of its 4 x MT accumulators (kern_avx512.h hsum16): the
    outputs are within the reference's tolerance, and a token's output does not depend on the tokens computed beside
    it: each token alone gives its row of the batch bit for bit (every expert gets 1..4 tokens, so blocks of MT = 1,
    2, 3 and 4 tokens all run; D = 136: a ragged last block)."""
    if isa == "none":
        pytest.skip("no AVX-512 library on this machine")
    ws = weights(6)
    moe = CpuMoE(*ws, dtype=dtype, isa=isa, threads=2, amx_min_tokens=10**9)
    ref_w = dequantized(ws, dtype, moe.group_size)
    g = torch.Generator().manual_seed(60)
    T = 9
    x = torch.randn(T, D, generator=g).bfloat16()
    ids = torch.tensor([[t % 5, 5 + t % 3, 8 + t % 4] for t in range(T)], dtype=torch.int32)  # 1..4 tokens an expert
    w = torch.rand(T, 3, generator=g) + 0.05
    ref = moe_forward(x.float(), *ref_w, ids.long(), w)
    out = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
    moe.forward(x, ids, w, out=out)
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    for t in (0, 4, 8):  # alone: every block of this token's experts has MT = 1
        one = torch.full((1, D), float("nan"), dtype=torch.bfloat16)
        moe.forward(x[t:t + 1], ids[t:t + 1], w[t:t + 1], out=one)
        assert torch.equal(one[0], out[t]), t


def test_task_knobs_are_clamped(knobs):
    isa = COMPILED[0] if COMPILED else pytest.skip("no compiled ISA on this machine")
    for asked, kept in ((1000, 512), (100, 64), (0, 64), (192, 192)):
        turn(knobs, isa, "task_rows", asked)
        assert _native.tune(isa, "task_rows", asked) == kept, asked
    for asked, kept in ((0, 1), (-5, 1), (3, 3)):
        turn(knobs, isa, "task_min", asked)
        assert _native.tune(isa, "task_min", asked) == kept, asked
    for asked, kept in ((1000, 64), (0, 8), (13, 12), (16, 16)):
        turn(knobs, isa, "pf_rows", asked)
        assert _native.tune(isa, "pf_rows", asked) == kept, asked
    for asked, kept in ((0, 1), (-2, 1), (3, 3), (64, 64), (100, 64)):  # amx_kblock: 1..64 chunks
        turn(knobs, isa, "amx_kblock", asked)
        assert _native.tune(isa, "amx_kblock", asked) == kept, asked
    for asked, kept in ((-5, 0), (0, 0), (1, 1), (120, 120)):  # spin_us: microseconds, never negative
        turn(knobs, isa, "spin_us", asked)
        assert _native.tune(isa, "spin_us", asked) == kept, asked
    for asked, kept in ((0, 1), (-3, 1), (3, 3), (8, 8), (100, 8)):  # tail_split: 1..8 parts
        turn(knobs, isa, "tail_split", asked)
        assert _native.tune(isa, "tail_split", asked) == kept, asked
    for asked, kept in ((-64, 0), (63, 0), (100, 64), (4096, 4096)):  # stream_pf: whole 64-byte lines, >= 0
        turn(knobs, isa, "stream_pf", asked)
        assert _native.tune(isa, "stream_pf", asked) == kept, asked


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("order", ["interleaved", "natural"])
def test_int4_three_and_four_token_blocks_match_the_reference(isa, group, order):
    """int4 at 3 and 4 tokens per expert (the interleaved order: one 4-row pass with the fp32 sums in memory; the
    natural order: two passes over token pairs) matches the reference in both stored orders and every group size.
    Rows 512 wide (gate/up: one fold block of 4 groups of 128 up to 16 of 32) and a ragged F of 748 (down rows padded
    to 768: 3 fold blocks in every group size, so the in-memory sums carry across blocks); every expert gets exactly
    3 or 4 tokens, plus the 1- and 2-token tails of 5 and 6."""
    Ft, Dt = 748, 512
    g = torch.Generator().manual_seed(11)
    ws = (torch.randn(4, Ft, Dt, generator=g) / Dt**0.5, torch.randn(4, Ft, Dt, generator=g) / Dt**0.5,
          torch.randn(4, Dt, Ft, generator=g) / Ft**0.5)
    moe = CpuMoE(*ws, dtype="int4", group_size=group, isa=isa, threads=2, amx_min_tokens=10**9, int4_order=order)
    ref_w = dequantized(ws, "int4", moe.group_size)
    for T, ids in ((3, [[0, 1]] * 3), (4, [[1, 2]] * 4), (5, [[0, 3]] * 5), (6, [[2, 3]] * 6)):
        x = torch.randn(T, Dt, generator=g).bfloat16()
        ids = torch.tensor(ids, dtype=torch.int32)
        w = torch.rand(T, 2, generator=g) + 0.05
        out = torch.full((T, Dt), float("nan"), dtype=torch.bfloat16)
        moe.forward(x, ids, w, out=out)
        assert rel_err(out, moe_forward(x.float(), *ref_w, ids.long(), w)) < TOL["int4"], T
