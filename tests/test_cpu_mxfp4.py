"""The CPU executor's native mxfp4 dtype (gpt-oss's published experts kept 4-bit: e2m1 codes + one shared
exponent per 32 values) against the pure-torch reference, for every ISA here and the emulated AMX build.

The reference runs reference.moe_forward on the weights de-quantized by quant.dequantize_mxfp4, i.e. the exact
values the kernels hold: the only approximation left is the kernels' per-token int8 quantization of the
activations (x, and h before down), the same one int8 and int4 make, so TOL["int4"] (test_cpu_moe.py) is
the bound here too, not a looser one. A second, tight check emulates that activation rounding in the
reference and leaves only fp32 summation order (the bounds of test_cpu_moe.test_kernel_arithmetic_tight).

Layout requirement (cpu_kernels/quant.py): D and F multiples of 32 (the format's block); rows are padded to
64 values, so D = 160 and F = 224 (5 and 7 blocks, neither a multiple of 64) exercise the padding, and F
splits into NUMA slices of 128 + 96. Ragged routing (experts with 0, 1, 7, 300 tokens), outputs NaN-filled.
"""

import logging
import os

import pytest
import torch

from cpu_kernels import CpuMoE, _native, moe as moe_mod, quant
from cpu_kernels.reference import gated_activation, moe_forward
from cpu_kernels.topology import Topology
from test_cpu_moe import COMPILED, EMU, TOL, ragged_routing, rel_err
from test_cpu_moe_bias import biases as bias_tensors, fused_knob  # noqa: F401 (fused_knob: a fixture)

E, F, D = 6, 224, 160
TOL_MX = TOL["int4"]  # int8 activations, exact weights: the int8/int4 bound
ISAS = [i for i in COMPILED if i != "amx"] + EMU
if "amx" in COMPILED:  # declines mxfp4 to its AVX-512 path at every knee: covered like the others
    ISAS.append(pytest.param("amx", marks=pytest.mark.amx))


def published(seed=0, e=E, f=F, d=D, scale=1.0):
    """mxfp4 experts as a checkpoint holds them: (blocks, scales) for gate, up [E, F, D] and down [E, D, F]."""
    g = torch.Generator().manual_seed(seed)
    mats = (torch.randn(e, f, d, generator=g) / d**0.5, torch.randn(e, f, d, generator=g) / d**0.5,
            torch.randn(e, d, f, generator=g) / f**0.5)
    return [quant.quantize_mxfp4(w * scale) for w in mats]


def plain(pub):
    return [quant.dequantize_mxfp4(b, s) for b, s in pub]


def biases(seed=20, e=E, f=F, d=D):
    return dict(zip(("b_gate", "b_up", "b_down"), bias_tensors(seed, e, f, d)))


def topology(nodes):
    """1 node; 2 nodes with a pool each (one cpu each, the same cpu on a 1-cpu machine); "shared": 2 nodes
    whose slices one pool runs one after the other."""
    cpus = sorted(os.sched_getaffinity(0))
    return {1: Topology(((cpus[0],),)), 2: Topology(((cpus[0],), (cpus[-1],))),
            "shared": Topology(((cpus[0],), (cpus[0],)))}[nodes]


def both_paths(moe, x, ids, w, fused_knob):
    """forward on the fused (decode) and the phased path; NaN-prefilled outputs."""
    outs = []
    for fused in (1, 0):
        fused_knob.append((moe.isa, _native.tune(moe.isa, "fused", fused)))
        out = torch.full(x.shape, float("nan"), dtype=x.dtype)
        assert moe.forward(x, ids, w, out=out).data_ptr() == out.data_ptr()
        assert torch.isfinite(out).all(), fused
        outs.append(out)
    return outs


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("knee", [1, 10**9], ids=["knee1", "vector"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("nodes", [1, 2, "shared"])
@pytest.mark.parametrize("T", [1, 5, 320])
def test_matches_reference(isa, knee, with_bias, activation, nodes, T, fused_knob):
    pub = published(seed=1, scale=3.0)  # pre-activations of order 3: the SwiGLU clamp (7) is reached
    bias = biases() if with_bias else {}
    moe = CpuMoE.from_mxfp4(*pub, isa=isa, topology=topology(nodes), activation=activation, amx_min_tokens=knee,
                            **bias)
    assert moe.dtype == "mxfp4" and len(moe.packed_weights()) == (1 if nodes == 1 else 2)
    ids, w = ragged_routing(T, seed=2)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = moe_forward(x, *plain(pub), ids, w, activation=activation, **bias)
    fused, phased = both_paths(moe, x, ids, w, fused_knob)
    assert rel_err(fused, ref) < TOL_MX, rel_err(fused, ref)
    assert rel_err(phased, ref) < TOL_MX, rel_err(phased, ref)
    assert rel_err(fused, phased) < 1e-2  # two summation orders of the same kernels (bf16 output)


def _quant_rows(v):
    """The kernels' per-token activation quantization, de-quantized again."""
    amax = v.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(v * inv).clamp(-127, 127) * (amax / 127.0)


def emulated(x, ws, ids, w, activation, b_gate=None, b_up=None, b_down=None):
    """moe_forward with the kernels' int8 rounding of x and h (fp32 everywhere else)."""
    wg, wu, wd = ws
    out = torch.zeros(x.shape[0], wd.shape[1])
    for e in torch.unique(ids).tolist():
        tok, kk = (ids == e).nonzero(as_tuple=True)
        xe = _quant_rows(x[tok].float())
        g, u = xe @ wg[e].T, xe @ wu[e].T
        if b_gate is not None:
            g, u = g + b_gate[e], u + b_up[e]
        h = _quant_rows(gated_activation(g, u, activation))
        y = h @ wd[e].T
        if b_down is not None:
            y = y + b_down[e]
        out.index_add_(0, tok, y * w[tok, kk][:, None])
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("T", [3, 320])
def test_kernel_arithmetic_tight(isa, activation, T, fused_knob):
    """With the activation rounding emulated only fp32 summation order differs (bounds as for int8/int4): a
    wrong block exponent, a swapped nibble half, a lost padding block or a wrong offset correction is far
    outside them."""
    pub = published(seed=4, scale=2.0)
    bias = biases(seed=5)
    moe = CpuMoE.from_mxfp4(*pub, isa=isa, activation=activation, **bias)
    ids, w = ragged_routing(T, seed=6)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(7))
    ref = emulated(x, plain(pub), ids, w, activation, **bias)
    for y in both_paths(moe, x, ids, w, fused_knob):
        assert rel_err(y, ref) < 1e-2
        assert float((y - ref).abs().mean() / ref.abs().mean()) < 2e-4


@pytest.mark.parametrize("isa", ISAS)
def test_wide_exponents(isa, fused_knob):
    """Each block its own exponent, drawn over 2^-17 .. 2^+15 around the weights' scale (published weights
    sit near 2^-5): the per-block scaling is exact in fp32 whatever e (0..255 are all finite scales), so the
    bound is the usual one."""
    g = torch.Generator().manual_seed(8)
    pub = []
    for shape in ((E, F, D), (E, F, D), (E, D, F)):
        blocks = torch.randint(0, 256, (*shape[:2], shape[2] // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(110, 143, (*shape[:2], shape[2] // 32), dtype=torch.uint8, generator=g)
        pub.append((blocks, scales))
    moe = CpuMoE.from_mxfp4(*pub, isa=isa)
    ids, w = ragged_routing(40, seed=9)
    x = torch.randn(40, D, generator=g) * 1e-3
    ref = moe_forward(x, *plain(pub), ids, w)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    for y in both_paths(moe, x, ids, w, fused_knob):
        assert rel_err(y, ref) < TOL_MX


@pytest.mark.parametrize("isa", ISAS + ["ref"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_from_mxfp4_is_dtype_mxfp4_bit_for_bit(isa, nodes, fused_knob):
    """Published blocks packed as they are == the float weights they stand for quantized by dtype="mxfp4":
    same outputs bit for bit (on both paths), though quantize_mxfp4 may pick other (code, exponent) pairs
    for the same values (a block whose largest value is 3 takes the next smaller exponent)."""
    pub = published(seed=10)
    bias = biases(seed=11)
    topo = topology(nodes)
    a = CpuMoE.from_mxfp4(*pub, isa=isa, topology=topo, activation="swiglu_oai", **bias)
    b = CpuMoE(*plain(pub), dtype="mxfp4", isa=isa, topology=topo, activation="swiglu_oai", **bias)
    assert a.nbytes == b.nbytes
    # strided views as a loader's row de-interleave makes them (gate/up rows interleaved in one tensor)
    (gb, gs), (ub, us), down = pub
    gu_b, gu_s = torch.stack([gb, ub], 2).flatten(1, 2), torch.stack([gs, us], 2).flatten(1, 2)
    c = CpuMoE.from_mxfp4((gu_b[:, ::2], gu_s[:, ::2]), (gu_b[:, 1::2], gu_s[:, 1::2]), down, isa=isa, topology=topo,
                          activation="swiglu_oai", **bias)
    assert not gu_b[:, ::2].is_contiguous()
    ids, w = ragged_routing(320, seed=12)
    x = torch.randn(320, D, generator=torch.Generator().manual_seed(13)).bfloat16()
    if isa == "ref":
        assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))
        assert torch.equal(a.forward(x, ids, w), c.forward(x, ids, w))
        return
    for ya, yb, yc in zip(*(both_paths(m, x, ids, w, fused_knob) for m in (a, b, c))):
        assert torch.equal(ya, yb) and torch.equal(ya, yc)
        assert torch.equal(a.forward(x[:2], ids[:2], w[:2]), b.forward(x[:2], ids[:2], w[:2]))


@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_packed_weights_are_the_published_codes(isa):
    """What the executor holds (and the GPU lane ships, hybrid.offload.sources): from_mxfp4 keeps the published
    codes and exponents verbatim in the kernels' layout, zero padded, and de-quantizes to the plain weights."""
    from hybrid.offload.sources import packed_sources

    pub = published(seed=14)
    ws = plain(pub)
    moe = CpuMoE.from_mxfp4(*pub, isa=isa, topology=topology(2))
    for node, src in zip(moe.packed_weights(), packed_sources(moe)):
        f0, f1 = node["f0"], node["f1"]
        for name, (blocks, scales), full, pm in zip(("gate", "up", "down"), pub, ws, src.mats()):
            p = node[name]
            want = full[:, f0:f1, :] if name != "down" else full[:, :, f0:f1]
            rows, k = p["rows"], p["k"]
            for e in (0, E - 1):
                assert torch.equal(pm.decode(p["q"][e], p["scale"][e] if p["scale"] is not None else None,
                                             torch.float32), want[e])
            if isa == "ref":
                assert p["dtype"] == "plain" and torch.equal(p["q"], want)
                continue
            assert p["dtype"] == "mxfp4" and p["q"].dtype == torch.uint8 and p["scale"].dtype == torch.uint8
            assert p["q"].shape[2] == 16 * p["scale"].shape[2] and p["q"].shape[2] % 32 == 0  # rows of 64 values
            w = quant.dequantize_mxfp4_packed(p["q"], p["scale"])
            assert torch.equal(w[:, :rows, :k], want)
            assert not w[:, rows:, :].any() and not w[:, :, k:].any()  # zero padding
            got_b, got_s = quant.unpack_mxfp4(p["q"], p["scale"])
            sub_b, sub_s = (blocks[:, f0:f1], scales[:, f0:f1]) if name != "down" else \
                (blocks[:, :, f0 // 32:-(-f1 // 32)], scales[:, :, f0 // 32:-(-f1 // 32)])
            assert torch.equal(got_b[:, :rows, :k // 32], sub_b) and torch.equal(got_s[:, :rows, :k // 32], sub_s)
        if isa != "ref":  # one copy moves an expert (the exponents live beside, as int4's scales)
            assert src.whole_block()
    if isa != "ref":
        mats = [m for n in moe.packed_weights() for m in (n["gate"], n["up"], n["down"])]
        held = sum(m["q"].numel() + m["scale"].numel() for m in mats)
        assert moe.nbytes == held == 0.53125 * sum(m["q"].numel() * 2 for m in mats)  # per padded weight


@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_expert_subset_and_mask(isa, fused_knob):
    """A layer's cold experts only (expert_ids of num_experts), with resident ones masked off per call."""
    pub = published(seed=19, e=E)
    held = [0, 2, 5]
    sub = [tuple(t[held].contiguous() for t in p) for p in pub]
    moe = CpuMoE.from_mxfp4(*sub, isa=isa, expert_ids=held, num_experts=E, activation="swiglu_oai")
    ids, w = ragged_routing(320, seed=20)
    x = torch.randn(320, D, generator=torch.Generator().manual_seed(21)).bfloat16()
    mask = torch.tensor([True, True, True, True, True, False])
    only = torch.zeros(E, dtype=torch.bool)
    only[held] = True
    ref = moe_forward(x, *plain(pub), ids, w, expert_mask=only & mask, activation="swiglu_oai")
    assert rel_err(moe_forward(x, *plain(pub), ids, w, expert_mask=only, activation="swiglu_oai"), ref) > 0.05
    if isa == "ref":
        assert rel_err(moe.forward(x, ids, w, expert_mask=mask), ref) < 1e-6
        return
    for fused in (1, 0):
        fused_knob.append((moe.isa, _native.tune(moe.isa, "fused", fused)))
        for T in (1, 9, 320):  # decode-sized and prefill-sized calls
            r = moe_forward(x[:T], *plain(pub), ids[:T], w[:T], expert_mask=only & mask, activation="swiglu_oai")
            assert rel_err(moe.forward(x[:T], ids[:T], w[:T], expert_mask=mask), r) < TOL_MX, (fused, T)


def test_pack_layout_roundtrip():
    g = torch.Generator().manual_seed(15)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (3, 5, 4), dtype=torch.uint8, generator=g)
    q, e = quant.pack_mxfp4(blocks, scales)
    assert q.shape == (3, 5, 64) and torch.equal(e, scales)
    b2, s2 = quant.unpack_mxfp4(q, e)
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)
    assert torch.equal(quant.dequantize_mxfp4_packed(q, e), quant.dequantize_mxfp4(blocks, scales))
    # the layout itself: byte i of chunk c = code i of block 2c (low nibble) | code i of block 2c+1 (high)
    codes = torch.stack([blocks & 15, blocks >> 4], -1).reshape(3, 5, 4, 32)
    assert torch.equal(q[..., :32], codes[:, :, 0] | (codes[:, :, 1] << 4))
    assert torch.equal(q[..., 32:], codes[:, :, 2] | (codes[:, :, 3] << 4))
    with pytest.raises(ValueError, match="even"):
        quant.pack_mxfp4(blocks[:, :, :3].contiguous(), scales[:, :, :3].contiguous())


@pytest.mark.parametrize("isa", COMPILED[:1] + ["ref"])
def test_layout_refusals(isa):
    pub = published(seed=16)
    ws = plain(pub)
    with pytest.raises(ValueError, match="multiples of 32"):  # D not a multiple of 32
        CpuMoE(ws[0][:, :, :150].contiguous(), ws[1][:, :, :150].contiguous(), ws[2][:, :150].contiguous(),
               dtype="mxfp4", isa=isa)
    with pytest.raises(ValueError, match="multiples of 32"):  # F not a multiple of 32
        CpuMoE(ws[0][:, :97].contiguous(), ws[1][:, :97].contiguous(), ws[2][:, :, :97].contiguous(),
               dtype="mxfp4", isa=isa)
    (gb, gs), up, down = pub
    with pytest.raises(ValueError, match="pack as dtype 'mxfp4'"):
        CpuMoE.from_mxfp4((gb, gs), up, down, dtype="int8", isa=isa)
    with pytest.raises(ValueError, match="uint8"):
        CpuMoE.from_mxfp4((gb.to(torch.int8), gs), up, down, isa=isa)
    with pytest.raises(ValueError, match="K/32"):
        CpuMoE.from_mxfp4((gb, gs[..., :-1].contiguous()), up, down, isa=isa)
    with pytest.raises(ValueError, match="pair"):
        CpuMoE.from_mxfp4(gb, up, down, isa=isa)
    with pytest.raises(ValueError, match="expected w_gate"):  # down's shape disagrees with gate's
        CpuMoE.from_mxfp4((gb, gs), up, up, isa=isa)
    with pytest.raises(ValueError, match="one kind of blocks"):  # two block kinds in one layer
        CpuMoE(moe_mod._Mx4("gate", gb, gs), moe_mod._Q40("up", torch.zeros(E, F, D // 32, 18, dtype=torch.uint8)),
               ws[2], dtype="mxfp4", isa=isa)


@pytest.mark.parametrize("isa", [i for i in ("amx", "amx_emu") if i in COMPILED + EMU])
def test_amx_declines_mxfp4_loudly_once(isa, caplog, monkeypatch, fused_knob):
    """No AMX kernel for mxfp4: the AMX builds run it on their vector path at every knee (the results match
    the reference above with knee 1) and say so once."""
    monkeypatch.setattr(moe_mod, "_SAID_VECTOR_ONLY", set())
    pub = published(seed=17)
    with caplog.at_level(logging.WARNING, logger="cpu_kernels"):
        CpuMoE.from_mxfp4(*pub, isa=isa, amx_min_tokens=1)
        CpuMoE.from_mxfp4(*pub, isa=isa)
    said = [r for r in caplog.records if "mxfp4 has no AMX kernel" in r.getMessage()]
    assert len(said) == 1 and isa in said[0].getMessage()
    fused_knob.append((isa, _native.tune(isa, "fused", 1)))
    _native.profile_enable(isa, True)
    try:  # no AMX expert even with every expert above the knee: the call takes the fused (vector-only) path,
        # whose profile has no separate down phase (an AMX expert sends a call down the phased path)
        moe = CpuMoE.from_mxfp4(*pub, isa=isa, amx_min_tokens=1)
        ids, w = ragged_routing(320, seed=18)
        _native.profile_read(isa, reset=True)
        moe.forward(torch.randn(320, D).bfloat16(), ids, w)
        p = _native.profile_read(isa, reset=True)
        assert p["calls"] == 1 and p["gate_up"] > 0 and p["down"] == 0, p
    finally:
        _native.profile_enable(isa, False)


def test_bench_cpu_moe_prices_mxfp4_at_its_bytes(tmp_path):
    """bench.cpu_moe --dtypes mxfp4: the DRAM-% of a decode row counts 0.53125 bytes a weight (the tiny shape
    needs no padding), and the pool is sized by the same figure."""
    import json

    from bench.cpu_moe import BYTES_PER_WEIGHT, main, pool_size

    isa = COMPILED[0] if COMPILED else "ref"
    out = tmp_path / "cpu_moe.json"
    assert main(["--quick", "--isas", isa, "--dtypes", "mxfp4", "--threads", "1", "--scaling", "", "--prefill", "",
                 "--dram-bytes", str(64 << 20), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["dtype"] == "mxfp4" for r in rows)
    for r in rows:
        per_expert = r["pool_bytes"] / r["pool_experts"]
        if isa != "ref":
            assert per_expert == 0.53125 * 3 * r["D"] * r["F"]
        assert r["weight_gbps"] == pytest.approx(r["experts"] * per_expert / (r["ms"] / 1e3) / 1e9)
    assert BYTES_PER_WEIGHT["mxfp4"] == 0.53125 and pool_size(2048, 768, "mxfp4") % 64 == 0
