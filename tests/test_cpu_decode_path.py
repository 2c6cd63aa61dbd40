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


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "amx_emu"])
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_prefetch_changes_nothing(isa, dtype, knobs):
    moe = CpuMoE(*weights(1), dtype=dtype, isa=isa, threads=2)
    x = torch.randn(3, D).bfloat16()
    ids, w = routing(3, seed=1)
    outs = []
    for pf in (0, 1):
        turn(knobs, moe.isa, "prefetch", pf)
        outs.append(moe.forward(x, ids, w).clone())
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,x_dtype", [("bf16", torch.bfloat16), ("bf16", torch.float32), ("int8", torch.bfloat16),
                                           ("int8", torch.float32), ("int4", torch.bfloat16)])
def test_token_rows_as_fused_tasks_change_nothing(isa, dtype, x_dtype, knobs):
    """fused_prep 1 writes the token rows as the fused phase's first tasks (one token a task up to 64 tokens, 8
    past it) and each gate/up task waits for its own expert's tokens; 0 writes them on the caller first. The rows
    are the same bytes either way, so the outputs are bit-identical; D = 136 pads bf16 rows (no in-place use)."""
    moe = CpuMoE(*weights(4), dtype=dtype, isa=isa, threads=2, amx_min_tokens=10**9)
    ref_w = dequantized(weights(4), dtype, moe.group_size)
    turn(knobs, moe.isa, "spin_us", 0)  # workers sleep between calls: a waiting gate/up task may start first
    for T in (1, 3, 9, 64, 65, 70):
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(50 + T)).to(x_dtype)
        ids, w = routing(T, seed=50 + T)
        outs = []
        for prep in (1, 0):
            turn(knobs, moe.isa, "fused_prep", prep)
            out = torch.full((T, D), float("nan"), dtype=x_dtype)  # out takes x's dtype
            moe.forward(x, ids, w, out=out)
            assert rel_err(out, moe_forward(x.float(), *ref_w, ids.long(), w)) < TOL[dtype], (prep, T)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), T


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


# Decode task knobs (fused.h, hy.h): (task_rows, task_min, pf_first, pf_rows, byte_tasks, pf_l1). The first is run
# 11's old default, the second the new one; the shape gives gate/up rows past 256 and down rows past 512, both with
# ragged tails; byte_tasks widens int8 tasks 2x and int4 ones 4x (512 int4 rows: 2048, past every matrix here);
# pf_l1 adds int4's L1 prefetch at 3-4 tokens (the test's 5 tokens run a 4-token and a 1-token block).
TASK_KNOBS = [(64, 6, 0, 8, 0, 0), (256, 2, 1, 8, 0, 0), (512, 1, 1, 32, 0, 1), (128, 3, 0, 64, 0, 0),
              (64, 1, 1, 16, 0, 1), (512, 1, 1, 16, 1, 0), (192, 2, 1, 16, 1, 1), (64, 6, 0, 8, 1, 0)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_task_size_and_first_block_prefetch_change_nothing(isa, dtype, knobs):
    """Task boundaries fall on 16-row multiples of the kernels' 4-row blocks and every block and token sum is
    made in one fixed order, so any task size gives bit-identical outputs (and they match the reference); the
    prefetch knobs touch no value either (a prefetch past a matrix's last row reads nothing)."""
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
    for rows, least, pf, ahead, by_bytes, l1 in TASK_KNOBS:
        turn(knobs, moe.isa, "task_rows", rows)
        turn(knobs, moe.isa, "task_min", least)
        turn(knobs, moe.isa, "pf_first", pf)
        turn(knobs, moe.isa, "pf_rows", ahead)
        turn(knobs, moe.isa, "byte_tasks", by_bytes)
        turn(knobs, moe.isa, "pf_l1", l1)
        out = torch.full((T, Dt), float("nan"), dtype=torch.bfloat16)
        moe.forward(x, ids, w, out=out)
        assert rel_err(out, ref) < TOL[dtype], (rows, least, pf, ahead, by_bytes, l1)
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
def test_block_sums_transposed_or_one_by_one(isa, dtype, knobs):
    """hsum 1 ends each AVX-512 4-row block with one transposing sum of its 4 x MT accumulators, hsum 0 with a reduce
    per accumulator. int8 sums integers and then does the same fp32 operations: bit-identical. bf16 and int4 add fp32
    lanes in another order: within rounding of each other, both within the reference's tolerance. Either way a
    token's output does not depend on the tokens computed beside it: each token alone gives its row of the batch bit
    for bit (every expert gets 1..4 tokens, so blocks of MT = 1, 2, 3 and 4 tokens all run; D = 136: a ragged
    last block)."""
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
    outs = {}
    for hs in (1, 0):
        turn(knobs, moe.isa, "hsum", hs)
        out = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
        moe.forward(x, ids, w, out=out)
        assert rel_err(out, ref) < TOL[dtype], (hs, rel_err(out, ref))
        outs[hs] = out
        for t in (0, 4, 8):  # alone: every block of this token's experts has MT = 1
            one = torch.full((1, D), float("nan"), dtype=torch.bfloat16)
            moe.forward(x[t:t + 1], ids[t:t + 1], w[t:t + 1], out=one)
            assert torch.equal(one[0], out[t]), (hs, t)
    if dtype == "int8":
        assert torch.equal(outs[1], outs[0])
    else:
        assert rel_err(outs[1].float(), outs[0].float()) < 1e-2


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
    for asked, kept in ((5, 2), (-1, 0), (0, 0), (1, 1), (2, 2)):  # i4_wide: 0, 1 or 2
        turn(knobs, isa, "i4_wide", asked)
        assert _native.tune(isa, "i4_wide", asked) == kept, asked
    for name in ("byte_tasks", "pf_l1"):
        for asked, kept in ((5, 1), (-1, 1), (0, 0), (1, 1)):
            turn(knobs, isa, name, asked)
            assert _native.tune(isa, name, asked) == kept, (name, asked)
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
def test_int4_three_and_four_token_blocks_are_bit_identical_every_way(isa, group, order, knobs):
    """int4 at 3 and 4 tokens per expert, each 4-row block run three ways (i4_wide 2: one pass with the fp32 sums in
    memory, the default; 1: two passes over token pairs; 0: two 2-row passes) forms every token's sums in the same
    order, so the outputs are bit-identical, in both stored orders and every group size, and match the reference.
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
        outs = []
        for wide in (2, 1, 0):
            turn(knobs, moe.isa, "i4_wide", wide)
            out = torch.full((T, Dt), float("nan"), dtype=torch.bfloat16)
            moe.forward(x, ids, w, out=out)
            outs.append(out)
        assert rel_err(outs[0], moe_forward(x.float(), *ref_w, ids.long(), w)) < TOL["int4"], T
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), T
