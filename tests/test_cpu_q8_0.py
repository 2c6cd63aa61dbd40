"""The CPU executor's q8_0 dtype (int8 in blocks of 32 along K with an fp16 scale each: llama.cpp's Q8_0) against
the pure-torch reference, for every ISA here and the emulated AMX build, and GGUF Q8_0 blocks packed as they are.

The reference runs reference.moe_forward on the weights de-quantized by quant.dequantize_q8_0, the exact values the
kernels hold: the only approximation left is the kernels' per-token int8 quantization of the activations (x, and h
before down), the one int8 and int4 make, so TOL["int8"] (test_cpu_moe.py) bounds it; a second, tight check
emulates that rounding and leaves only fp32 summation order.

Shapes: D = 160 and F = 224 (5 and 7 blocks, rows padded to 64 values: a lone last block per row) and, for weights
quantized here, D = 131 and F = 97 (no whole block at the end: zero padded before quantizing); F splits into NUMA
slices. Ragged routing (experts with 0, 1, 7, 300 tokens), outputs NaN-filled.
"""

import logging

import pytest
import torch

from cpu_kernels import CpuMoE, _native, moe as moe_mod, quant
from cpu_kernels.reference import moe_forward
from test_cpu_moe import COMPILED, EMU, TOL, ragged_routing, rel_err
from test_cpu_moe_bias import fused_knob  # noqa: F401 (a fixture)
from test_cpu_mxfp4 import biases, both_paths, emulated, topology

E, F, D = 6, 224, 160
ISAS = [i for i in COMPILED if i != "amx"] + EMU
if "amx" in COMPILED:  # declines q8_0 to its AVX-512 path at every knee: covered like the others
    ISAS.append(pytest.param("amx", marks=pytest.mark.amx))


def floats(seed=0, e=E, f=F, d=D, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) * scale / s[2] ** 0.5 for s in ((e, f, d), (e, f, d), (e, d, f))]


def plain(ws):
    """What dtype q8_0 computes with: each matrix quantized to q8_0 (rows zero padded to whole blocks) and back."""
    out = []
    for w in ws:
        K = w.shape[-1]
        wp = torch.nn.functional.pad(w, (0, -K % 32))
        out.append(quant.dequantize_q8_0(*quant.quantize_q8_0(wp))[..., :K])
    return out


def gguf_raw(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q int8 [..., K], d fp16 [..., K/32]) -> GGUF Q8_0 blocks uint8 [..., K/32, 34] (d, then the 32 values)."""
    *lead, K = q.shape
    return torch.cat([d.reshape(*lead, K // 32, 1).view(torch.uint8),
                      q.reshape(*lead, K // 32, 32).view(torch.uint8)], -1).contiguous()


def random_blocks(seed, e=E, f=F, d=D):
    """GGUF Q8_0 blocks with every int8 value, -128 included (llama.cpp's quantizer never writes it, a file may
    hold it), and scales spread over 2^-14 .. 2^-4."""
    g = torch.Generator().manual_seed(seed)
    raws = []
    for shape in ((e, f, d), (e, f, d), (e, d, f)):
        q = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
        dd = (2.0 ** torch.randint(-14, -4, (*shape[:2], shape[2] // 32), generator=g) *
              (1 + torch.rand(*shape[:2], shape[2] // 32, generator=g))).half()
        raws.append(gguf_raw(q, dd))
    return raws


def test_quantize_roundtrip_and_format():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 5, 96, generator=g) * torch.logspace(-3, 1, 96)
    q, d = quant.quantize_q8_0(w)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and d.shape == (3, 5, 3)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    back = quant.dequantize_q8_0(q, d)
    step = d.float().repeat_interleave(32, -1)
    assert ((back - w).abs() <= 0.5 * step * 1.01 + 1e-7).all()  # within half a step of its block's grid
    zero = quant.quantize_q8_0(torch.zeros(1, 64))
    assert not zero[0].any() and not zero[1].float().any()
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        quant.quantize_q8_0(torch.zeros(2, 40))
    # GGUF's block bytes: the parts are the values and scale as written, and de-quantize as gguf-py does
    gguf = pytest.importorskip("gguf")
    raw = random_blocks(2, e=2, f=32, d=64)[0]  # gate: [2, 32, 2, 34]
    qq, dd = quant.q8_0_parts(raw)
    assert torch.equal(gguf_raw(qq, dd), raw)
    ref = gguf.quants.dequantize(raw.numpy().reshape(64, 2 * 34), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(quant.dequantize_q8_0(qq, dd).reshape(64, 64), torch.from_numpy(ref))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("knee", [1, 10**9], ids=["knee1", "vector"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("nodes", [1, 2, "shared"])
@pytest.mark.parametrize("T", [1, 5, 320])
def test_matches_reference(isa, knee, with_bias, nodes, T, fused_knob):
    ws = floats(seed=3, scale=2.0)
    bias = biases() if with_bias else {}
    moe = CpuMoE(*ws, dtype="q8_0", isa=isa, topology=topology(nodes), amx_min_tokens=knee, **bias)
    assert moe.dtype == "q8_0" and moe.group_size == 32 and len(moe.packed_weights()) == (1 if nodes == 1 else 2)
    ids, w = ragged_routing(T, seed=4)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(5)).bfloat16()
    ref = moe_forward(x, *plain(ws), ids, w, **bias)
    fused, phased = both_paths(moe, x, ids, w, fused_knob)
    assert rel_err(fused, ref) < TOL["int8"], rel_err(fused, ref)
    assert rel_err(phased, ref) < TOL["int8"], rel_err(phased, ref)
    assert rel_err(fused, phased) < 1e-2  # two summation orders of the same kernels (bf16 output)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T", [1, 3, 320])
def test_kernel_arithmetic_tight(isa, T, fused_knob):
    """With the activation rounding emulated only fp32 summation order differs: a block scale read for the wrong
    block or row, a lost last block, a wrong +128 correction or a sign error on -128 is far outside the bounds.
    The weights are GGUF blocks with every int8 value and scales spread over 10 octaves."""
    raws = random_blocks(6)
    moe = CpuMoE.from_q8_0(*raws, isa=isa, activation="silu")
    ws = [quant.dequantize_q8_0(*quant.q8_0_parts(r)) for r in raws]
    ids, w = ragged_routing(T, seed=7)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(8))
    ref = emulated(x, ws, ids, w, "silu")
    for y in both_paths(moe, x, ids, w, fused_knob):
        assert rel_err(y, ref) < 1e-2
        assert float((y - ref).abs().mean() / ref.abs().mean()) < 2e-4


@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_ragged_shapes_pad_to_whole_blocks(isa, fused_knob):
    """D and F with no whole last block (131, 97): float weights are zero padded before quantizing."""
    ws = floats(seed=9, f=97, d=131)
    moe = CpuMoE(*ws, dtype="q8_0", isa=isa)
    ids, w = ragged_routing(40, seed=10)
    x = torch.randn(40, 131, generator=torch.Generator().manual_seed(11)).bfloat16()
    ref = moe_forward(x, *plain(ws), ids, w)
    if isa == "ref":
        assert rel_err(moe.forward(x, ids, w), ref) < 1e-2
        return
    for fused in (1, 0):
        fused_knob.append((moe.isa, _native.tune(moe.isa, "fused", fused)))
        for t in (1, 2, 3, 4, 40):
            assert rel_err(moe.forward(x[:t], ids[:t], w[:t]), ref[:t]) < TOL["int8"], (fused, t)


@pytest.mark.parametrize("isa", ISAS + ["ref"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_from_q8_0_is_dtype_q8_0_bit_for_bit(isa, nodes, fused_knob):
    """GGUF blocks packed as they are == the floats they stand for quantized by dtype="q8_0" (which gives back the
    same blocks for llama.cpp-quantized values), and strided views of a fused gate_up == its halves."""
    ws = floats(seed=12)
    qd = [quant.quantize_q8_0(w) for w in ws]
    raws = [gguf_raw(*p) for p in qd]
    vals = [quant.dequantize_q8_0(*p) for p in qd]
    for v, (q, d) in zip(vals, qd):
        q2, d2 = quant.quantize_q8_0(v)
        assert torch.equal(q2, q) and torch.equal(d2, d)
    topo = topology(nodes)
    a = CpuMoE.from_q8_0(*raws, isa=isa, topology=topo)
    b = CpuMoE(*vals, dtype="q8_0", isa=isa, topology=topo)
    assert a.nbytes == b.nbytes
    gu = torch.stack([raws[0], raws[1]], 2).flatten(1, 2)  # gate/up rows interleaved, as a loader may see them
    c = CpuMoE.from_q8_0(gu[:, ::2], gu[:, 1::2], raws[2], isa=isa, topology=topo)
    assert not gu[:, ::2].is_contiguous()
    ids, w = ragged_routing(320, seed=13)
    x = torch.randn(320, D, generator=torch.Generator().manual_seed(14)).bfloat16()
    if isa == "ref":
        assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))
        assert torch.equal(a.forward(x, ids, w), c.forward(x, ids, w))
        return
    for ya, yb, yc in zip(*(both_paths(m, x, ids, w, fused_knob) for m in (a, b, c))):
        assert torch.equal(ya, yb) and torch.equal(ya, yc)


@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_packed_weights_are_the_file_values(isa):
    """What the executor holds (and the GPU lane ships, hybrid.offload.sources): the file's int8 values and fp16
    scales verbatim, zero padded; 1 + 2/32 bytes a padded weight."""
    from hybrid.offload.sources import packed_sources

    raws = random_blocks(15)
    parts = [quant.q8_0_parts(r) for r in raws]
    ws = [quant.dequantize_q8_0(*p) for p in parts]
    moe = CpuMoE.from_q8_0(*raws, isa=isa, topology=topology(2))
    for node, src in zip(moe.packed_weights(), packed_sources(moe)):
        f0, f1 = node["f0"], node["f1"]
        for name, (q, d), full, pm in zip(("gate", "up", "down"), parts, ws, src.mats()):
            p = node[name]
            cut = (slice(None), slice(f0, f1)) if name != "down" else (slice(None), slice(None), slice(f0, f1))
            want = full[cut]
            for e in (0, E - 1):
                s = p["scale"][e] if p["scale"] is not None else None
                assert torch.equal(pm.decode(p["q"][e], s, torch.float32), want[e])
            if isa == "ref":
                assert p["dtype"] == "plain" and torch.equal(p["q"], want)
                continue
            rows, k = p["rows"], p["k"]
            assert p["dtype"] == "q8_0" and p["q"].dtype == torch.int8 and p["scale"].dtype == torch.float16
            assert p["q"].shape[2] == 32 * p["scale"].shape[2] and p["q"].shape[2] % 64 == 0
            assert torch.equal(p["q"][:, :rows, :k], q[cut])
            blocks = (slice(None), slice(None), slice(f0 // 32, f1 // 32))
            assert torch.equal(p["scale"][:, :rows, :k // 32], d[cut if name != "down" else blocks])
            assert not p["q"][:, rows:].any() and not p["q"][:, :, k:].any()  # zero padding
            assert not p["scale"][:, rows:].float().any() and not p["scale"][:, :, k // 32:].float().any()
        if isa != "ref":  # one copy moves an expert (the scales live beside, as int4's)
            assert src.whole_block()
    if isa != "ref":
        mats = [m for n in moe.packed_weights() for m in (n["gate"], n["up"], n["down"])]
        held = sum(m["q"].numel() + 2 * m["scale"].numel() for m in mats)
        assert moe.nbytes == held == 1.0625 * sum(m["q"].numel() for m in mats)


@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_expert_subset_and_mask(isa, fused_knob):
    """A layer's cold experts only (expert_ids of num_experts), with resident ones masked off per call."""
    ws = floats(seed=16)
    held = [0, 2, 5]
    moe = CpuMoE(*(w[held].contiguous() for w in ws), dtype="q8_0", isa=isa, expert_ids=held, num_experts=E)
    ids, w = ragged_routing(320, seed=17)
    x = torch.randn(320, D, generator=torch.Generator().manual_seed(18)).bfloat16()
    mask = torch.tensor([True, True, True, True, True, False])
    only = torch.zeros(E, dtype=torch.bool)
    only[held] = True
    ref = moe_forward(x, *plain(ws), ids, w, expert_mask=only & mask)
    assert rel_err(moe_forward(x, *plain(ws), ids, w, expert_mask=only), ref) > 0.05
    tol = 1e-6 if isa == "ref" else TOL["int8"]
    for T in (1, 9, 320):
        r = moe_forward(x[:T], *plain(ws), ids[:T], w[:T], expert_mask=only & mask)
        assert rel_err(moe.forward(x[:T], ids[:T], w[:T], expert_mask=mask), r) < tol, T


@pytest.mark.parametrize("isa", COMPILED[:1] + ["ref"])
def test_refusals(isa):
    raws = random_blocks(19, e=2)
    with pytest.raises(ValueError, match="pack as dtype 'q8_0'"):
        CpuMoE.from_q8_0(*raws, dtype="int8", isa=isa)
    with pytest.raises(ValueError, match="34"):
        CpuMoE.from_q8_0(raws[0][..., :33], raws[1], raws[2], isa=isa)
    with pytest.raises(ValueError, match="uint8"):
        CpuMoE.from_q8_0(raws[0].view(torch.int8), raws[1], raws[2], isa=isa)
    with pytest.raises(ValueError, match="expected w_gate"):  # down's shape disagrees with gate's
        CpuMoE.from_q8_0(raws[0], raws[1], raws[1], isa=isa)
    with pytest.raises(ValueError, match="all be float tensors"):
        CpuMoE(moe_mod._Q80("gate", raws[0]), *floats(e=2)[1:], dtype="q8_0", isa=isa)
    with pytest.raises(ValueError, match="Q4_0, Q8_0, MXFP4"):
        moe_mod.gguf_blocks("w", raws[0], "Q6_K")


@pytest.mark.parametrize("isa", [i for i in ("amx", "amx_emu") if i in COMPILED + EMU])
def test_amx_declines_q8_0_loudly_once(isa, caplog, monkeypatch):
    monkeypatch.setattr(moe_mod, "_SAID_VECTOR_ONLY", set())
    ws = floats(seed=20, e=2)
    with caplog.at_level(logging.WARNING, logger="cpu_kernels"):
        CpuMoE(*ws, dtype="q8_0", isa=isa, amx_min_tokens=1)
        CpuMoE(*ws, dtype="q8_0", isa=isa)
    said = [r for r in caplog.records if "q8_0 has no AMX kernel" in r.getMessage()]
    assert len(said) == 1 and isa in said[0].getMessage()


def test_planner_prices_q8_0_at_its_bytes():
    """The memory model and the dtype table agree with what the executor holds: 1 + 2/32 bytes a weight."""
    from cpu_kernels.dtypes import CPU_DTYPES
    from placement.memory import packed_matrix_bytes

    assert CPU_DTYPES["q8_0"].bytes_per_weight() == 1.0625
    assert packed_matrix_bytes(64, 2048, "q8_0", 32) == 64 * 2048 * 1.0625
    if COMPILED:
        moe = CpuMoE(*floats(seed=21, e=1, f=64, d=2048), dtype="q8_0", isa=COMPILED[0],
                     topology=topology(1))
        assert moe.nbytes == 3 * packed_matrix_bytes(64, 2048, "q8_0", 32)


@pytest.mark.parametrize("isa", COMPILED)
def test_compiled_packer_refuses_a_non_finite_scale(isa):
    """A GGUF block whose fp16 d is NaN or Inf stops the compiled packer as a non-finite weight of its expert."""
    raws = random_blocks(22, e=3)
    for bad in (0x7E00, 0x7C00, 0xFC00):  # NaN, +Inf, -Inf
        down = raws[2].clone()
        down[1, 5, 2, :2] = torch.tensor([bad & 0xFF, bad >> 8], dtype=torch.uint8)
        with pytest.raises(moe_mod.NonFiniteWeights, match="down weights of expert 1"):
            CpuMoE.from_q8_0(raws[0], raws[1], down, isa=isa)
