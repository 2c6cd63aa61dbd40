"""Resident experts held as int8 / int4 in VRAM (hybrid.offload.resident) and the gathered GEMV that reads them
(hybrid.gpu_kernels.expert_qgemv). Without CUDA the kernel runs in Triton's interpreter on CPU tensors
(tests/conftest.py selects it); the `cuda` cases run compiled on the GPU box.

The kernel against F.linear per row on the slot's de-quantized matrix, over ragged shapes (N not a multiple of the
row block, K not a multiple of the tile or of the scale group), cold rows (slot >= R) that must come back zero,
repeated slots; the hybrid layer with quantized residents against the reference MoE whose resident experts carry
the same rounding, on every strategy and through both resident paths (routed rows, de-quantized chunks); the
captured merge against the bf16 residents' one; the bytes; re-placement into a quantized slot."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject [test]); install it")

from cpu_kernels.reference import moe_forward  # noqa: E402
from hybrid.gpu_kernels import expert_qgemv  # noqa: E402
from hybrid.models.qweight import quantize_rows  # noqa: E402
from hybrid.offload import HybridExperts, Offload  # noqa: E402
from hybrid.offload import resident as resident_mod  # noqa: E402
from hybrid.offload.experts import add_resident_captured, add_resident_routed  # noqa: E402
from hybrid.offload.resident import QuantResidents, QuantStack  # noqa: E402
from hybrid.models.moe import SILU  # noqa: E402
from placement.cost_model import ExpertShape  # noqa: E402
from placement.hardware import BUILTIN_PROFILES  # noqa: E402
from placement.schedule import LayerScheduler  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ([pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA (GPU box)")])]
           + (["cpu"] if INTERPRETED else []))
E_, D, F_, K = 6, 96, 80, 2


def stack_of(kind, R, N, Kin, seed):
    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(N, Kin, generator=g) / Kin ** 0.5 for _ in range(R)]
    st = QuantStack(kind, R, N, Kin, "cpu", group=64 if Kin % 64 == 0 and seed % 2 else 128)
    for r, m in enumerate(mats):
        st.set_(r, m)
    return st


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("N,Kin", [(37, 96), (100, 200), (300, 257), (64, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_kernel_matches_each_rows_slot(device, kind, N, Kin, dtype):
    R = 3
    st = stack_of(kind, R, N, Kin, seed=N + Kin)
    g = torch.Generator().manual_seed(7)
    M = 11
    x = torch.randn(M, Kin, generator=g).to(dtype)
    slot = torch.tensor([0, 2, R, 1, 1, R + 0, 2, 0, R, 1, 2])  # repeats and cold rows
    ref = torch.stack([F.linear(x[m].float(), st.dequantize(int(s), torch.float32)) if s < R else torch.zeros(N)
                       for m, s in enumerate(slot.tolist())])
    q, sc, xd = st.q.to(device), st.scale.to(device), x.to(device)
    if device == "cuda" and kind == "int4" and dtype == torch.float32:
        assert not expert_qgemv.supported(xd, q, sc, kind, st.group)
        return
    assert expert_qgemv.supported(xd, q, sc, kind, st.group)
    y = expert_qgemv.gathered_qlinear(xd, slot.to(device), q, sc, kind, st.group, N).cpu()
    assert y.shape == (M, N) and y.dtype == dtype
    assert (y[slot == R] == 0).all()  # cold rows read nothing and come back zero
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)


def test_gathered_kernel_declines():
    st = stack_of("int8", 2, 40, 128, seed=1)
    x = torch.randn(3, 128)
    assert not expert_qgemv.supported(torch.randn(128, 3).T, st.q, st.scale, "int8", 128)  # strided along K
    assert not expert_qgemv.supported(x, st.q, st.scale, "fp8", 128)
    assert not expert_qgemv.supported(x, st.q, st.scale, "int8", 48)  # group not a power of two
    assert not expert_qgemv.supported(x.to(torch.int32), st.q, st.scale, "int8", 128)
    assert expert_qgemv.supported(x, st.q, st.scale, "int8", 128) == (INTERPRETED or x.is_cuda)
    with pytest.raises(ValueError, match="one slot per row"):
        expert_qgemv.gathered_qlinear(x, torch.zeros(2, dtype=torch.long), st.q, st.scale, "int8", 128, 40)


def test_quant_stack_rounds_as_qweight_and_counts_its_bytes():
    w = torch.randn(40, 256)
    st = QuantStack("int4", 2, 40, 256, "cpu")
    st.set_(1, w)
    q, s = quantize_rows(w, "int4")
    assert torch.equal(st.q[1], q) and torch.equal(st.scale[1], s)
    assert st.nbytes == 2 * (40 * 128 + 40 * 2 * 4)
    # half a level, or a whole one where +max clamps to level 7 (the group's -max sets the scale)
    assert (st.dequantize(1, torch.float32) - w).abs().max() <= w.abs().max() / 8 + 1e-6
    with pytest.raises(ValueError, match="int8 or int4"):
        QuantStack("fp8", 1, 8, 8, "cpu")


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(torch.bfloat16).float()  # noqa: E731
    return mk(E_, F_, D), mk(E_, F_, D), mk(E_, D, F_)


def rounded(w, kind):
    q, s = quantize_rows(w, kind, 128)
    st = QuantStack(kind, 1, *w.shape, "cpu")
    st.q[0], st.scale[0] = q, s
    return st.dequantize(0, torch.float32)


def layer_of(kind, strategy, resident):
    shape = ExpertShape("test", hidden=4096, intermediate=1536, num_experts=E_, topk=K)
    off = Offload("cpu", torch.float32, LayerScheduler(shape, BUILTIN_PROFILES["ktransformers-paper-amx"], strategy),
                  cpu_isa="ref", staging_slots=2, ship_chunk=2, resident_dtype=kind)
    wg, wu, wd = weights()
    layer = HybridExperts(0, wg, wu, wd, off)
    layer.set_resident(resident)
    return layer, (wg, wu, wd)


def routing(T, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E_, generator=g)
    logits[:, :2] += 2.0
    w, ids = torch.softmax(logits, -1).topk(K, -1)
    return ids, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("strategy", ["cpu", "ship"])
@pytest.mark.parametrize("T", [1, 7, 50])  # 50 x 2 rows: past GATHER_ROWS, the de-quantized chunks
@pytest.mark.parametrize("gather", [True, False], ids=["kernel", "no-kernel"])
def test_layer_with_quantized_residents_is_the_reference_with_their_rounding(kind, strategy, T, gather, monkeypatch):
    if gather and not INTERPRETED:
        pytest.skip("the gathered kernel runs on CPU tensors only in Triton's interpreter")
    if not gather:
        monkeypatch.setattr(expert_qgemv, "supported", lambda *a: False)
    resident = (0, 1, 4)
    layer, (wg, wu, wd) = layer_of(kind, strategy, resident)
    rg, ru, rd = wg.clone(), wu.clone(), wd.clone()
    for e in resident:  # the reference's resident experts carry the residents' rounding (gate and up as one matrix)
        gu = rounded(torch.cat([wg[e], wu[e]]), kind)
        rg[e], ru[e], rd[e] = gu[:F_], gu[F_:], rounded(wd[e], kind)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).float()
    ids, w = routing(T, seed=T)
    out = layer(x, ids, w)
    torch.testing.assert_close(out, moe_forward(x, rg, ru, rd, ids, w), atol=2e-5, rtol=1e-4)
    plain = moe_forward(x, wg, wu, wd, ids, w)
    rel = float((out - plain).norm() / plain.norm())
    assert rel > 0  # the residents' rounding is really in
    assert rel < (0.02 if kind == "int8" else 0.25), rel  # weight-only rounding: about 1% int8, 17% int4 here


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_routed_merge_is_the_sorted_merge_of_the_same_weights(kind):
    """add_resident_routed (quantized, no sort) against add_resident_captured over the same residents' de-quantized
    weights: the same rows kept, cold ones dropped."""
    layer, _ = layer_of(kind, "cpu", (5, 2))
    g = torch.Generator().manual_seed(3)
    T = 4
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E_, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    got = torch.zeros(T, D)
    add_resident_routed(got, x, ids, w, layer.rank_dev, layer.quant, SILU, None)
    deq = [layer.quant.weights(r, torch.float32) for r in range(2)]
    stacks = [torch.stack(t) for t in zip(*deq)]
    expect = torch.zeros(T, D)
    add_resident_captured(expect, x, ids, w, layer.rank_dev, 2,
                          lambda rows, offs: _looped(rows, offs, stacks))
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    assert got.abs().sum() > 0


def _looped(rows, offs, stacks):
    out = torch.zeros_like(rows)
    a = 0
    for r, b in enumerate(offs.tolist()):
        if b > a:
            out[a:b] = F.linear(F.silu(F.linear(rows[a:b], stacks[0][r])) * F.linear(rows[a:b], stacks[1][r]),
                                stacks[2][r])
        a = b
    return out


def test_quantized_residents_hold_fewer_bytes_and_swap_in_place():
    bf16, _ = layer_of("bf16", "cpu", (0, 1))
    int4, (wg, wu, wd) = layer_of("int4", "cpu", (0, 1))
    assert int4.quant is not None and bf16.quant is None
    assert int4.resident_bytes < bf16.resident_bytes  # fp32 model here: int4 + scales vs 4-byte copies
    assert int4.resident_bytes == 2 * (2 * F_ * D // 2 + 2 * F_ * 4 + D * F_ // 2 + D * 4)
    int4.swap_resident(1, 3, int4.expert_weights(3))
    assert sorted(int4.resident_ids.tolist()) == [0, 3]
    gu = rounded(torch.cat([wg[3], wu[3]]), "int4")
    torch.testing.assert_close(int4.quant.weights(1, torch.float32)[0], gu[:F_])
    with pytest.raises(ValueError, match="resident experts' dtype"):
        Offload("cpu", torch.float32, None, resident_dtype="fp8")


@pytest.mark.parametrize("f, d, views", [(F_, D, True), (5, 6, False)])
def test_grouped_chunks_cover_every_expert(monkeypatch, f, d, views):
    """Past GATHER_ROWS the residents are de-quantized a chunk at a time: with one expert per chunk every
    expert's rows still go through its own weights, its gate and up as views of one de-quantized tensor where the
    up half stays 16-byte aligned (F x D x 4 bytes a multiple of 16), else copies."""
    monkeypatch.setattr(resident_mod, "DEQUANT_CHUNK_VALUES", 1)
    q = QuantResidents("int8", 3, f, d, "cpu")
    torch.manual_seed(0)
    ws = torch.randn(3, f, d) / d ** 0.5, torch.randn(3, f, d) / d ** 0.5, torch.randn(3, d, f) / f ** 0.5
    for r in range(3):
        q.set_(r, ws[0][r], ws[1][r], ws[2][r])
    rows = torch.randn(70, d)
    counts, slots = np.array([30, 0, 40]), np.array([0, 1, 2])
    calls = []

    def run(r, c, g, u, d_, fn, b):
        calls.append((g.shape[0], g.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()))
        assert g.is_contiguous() and u.is_contiguous() and u.data_ptr() % 16 == 0
        offs = torch.from_numpy(np.cumsum(c).astype(np.int32))
        return _looped(r, offs, (g, u, d_))

    out = q.grouped(rows, counts, slots, SILU, None, run)
    assert calls == [(1, views), (1, views)]  # the expert without rows is skipped
    for a, b, r in ((0, 30, 0), (30, 70, 2)):
        g, u, d = q.weights(r, torch.float32)
        torch.testing.assert_close(out[a:b], F.linear(F.silu(rows[a:b] @ g.T) * (rows[a:b] @ u.T), d))


SM90_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybrid.gpu_kernels import expert_qgemv as eq

for kind, N, K, dt in (("int8", 1536, 7168, "bf16"), ("int4", 1536, 7168, "bf16"), ("int4", 7168, 2048, "bf16"),
                       ("int8", 1536, 2048, "fp16"), ("int4", 768, 2048, "bf16")):
    const = eq.constants(kind, N, K, 128)
    names = eq._gathered.arg_names
    sig = {"x": "*" + dt, "slot": "*i64", "q": "*u8", "s": "*fp32", "y": "*" + dt}
    sig.update({a: "i32" for a in names[5:11]})
    sig.update({a: "constexpr" for a in names[11:]})
    const["F32"] = False
    k = triton.compile(ASTSource(eq._gathered, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=eq.NUM_WARPS, num_stages=eq.NUM_STAGES))
    local, regs = usage(k)
    print(json.dumps({"case": [kind, N, K, dt], "local": local, "regs": regs}), flush=True)
"""


def test_gathered_kernel_compiles_for_sm90_without_spills(tmp_path):
    """The gathered GEMV on the decoder shapes (DeepSeek-V3's gate+up [4096, 7168] halves, Qwen3's [1536, 2048])
    builds for sm_90 with no local memory (register spills); compiled, not interpreted."""
    import json

    from triton_compile import compile_script

    rows = [json.loads(line) for line in compile_script(SM90_COMPILE, tmp_path) if line.startswith("{")]
    assert len(rows) == 5
    assert all(r["local"] == 0 for r in rows), rows
