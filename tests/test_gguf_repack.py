"""GGUF experts handed to the CPU executor as the file's own blocks: Q4_0 as q4_0 (and as int4 in groups of 32),
MXFP4 as mxfp4.

The packed bytes are checked against gguf-py's de-quantization of the same blocks (every value exactly, padding
zero), the executor's output against the PyTorch reference on those values, and a whole tiny model loaded through
the hybrid runtime against the same file loaded de-quantized with fp32 experts, while a re-quantizing load (int4 in
groups of 64) differs. Ragged shapes (F = 96, not a multiple of 64; several experts; two NUMA slices), fused
gate_up tensors, layers of mixed block types (de-quantized, and the log line says why) and the default CPU dtype.
"""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

import cpu_kernels  # noqa: E402
from cpu_kernels import CpuMoE, quant  # noqa: E402
from cpu_kernels.moe import gguf_blocks  # noqa: E402
from cpu_kernels.reference import moe_forward  # noqa: E402
from cpu_kernels.topology import Topology  # noqa: E402
from bench.hf_to_gguf import add_metadata, gguf_tensors  # noqa: E402
from hybrid.models.errors import ModelLoadError  # noqa: E402
from hybrid.models.gguf import load_gguf  # noqa: E402
from test_gguf import FP16_AT, PROMPT, hf_model, valid_blocks  # noqa: E402
from tiny_models import single_logits  # noqa: E402

COMPILED = [i for i in cpu_kernels.available_isas() if i != "ref"]
BYTES = {Q.Q4_0: quant.Q4_0_BLOCK_BYTES, Q.MXFP4: quant.GGUF_MXFP4_BLOCK_BYTES}
PROFILE = "ktransformers-paper-amx"


def blocks(shape, t, seed):
    """(raw blocks uint8 [*shape[:-1], K/32, bytes], gguf-py's de-quantization fp32 [*shape]) of random values."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])
    b = gguf.quants.quantize(x, t)
    raw = torch.from_numpy(b.copy()).reshape(*shape[:-1], shape[-1] // 32, BYTES[t])
    return raw, torch.from_numpy(gguf.quants.dequantize(b, t).reshape(shape).copy())


def expert_blocks(t, E=3, F=96, D=64):
    """A layer's gate, up [E, F, D] and down [E, D, F] as (raw, values) pairs."""
    return [blocks(s, t, seed) for seed, s in enumerate(((E, F, D), (E, F, D), (E, D, F)))]


def two_nodes() -> Topology:
    cpus = sorted(os.sched_getaffinity(0))
    return Topology(((cpus[0],), (cpus[-1],)))


def held_values(moe: CpuMoE, name: str) -> list[torch.Tensor]:
    """The values the kernels read for matrix `name`, one [E, rows_p, ldk] per node slice, padding included."""
    parts = []
    for node in moe.packed_weights():
        m = node[name]
        if m["dtype"] == "int4":
            parts.append(quant.dequantize_int4(m["q"], m["scale"], m["group"], m["fold"]))
        else:
            parts.append(quant.packed_dequantizers()[m["dtype"]](m["q"], m["scale"]))
    return parts


def check_held(moe: CpuMoE, values) -> None:
    """Each node slice of gate, up and down holds exactly the file's values, and zeros in its padding."""
    for n, node in enumerate(moe.packed_weights()):
        f0, f1 = node["f0"], node["f1"]
        for name, want in zip(("gate", "up", "down"), values):
            got = held_values(moe, name)[n]
            rows, k = node[name]["rows"], node[name]["k"]
            part = want[:, f0:f1] if name != "down" else want[:, :, f0:f1]
            assert torch.equal(got[:, :rows, :k], part), (name, n)
            assert not got[:, rows:].any() and not got[:, :, k:].any(), (name, n)


def rounded_reference(x, values, ids, w):
    """moe_forward with the kernels' per-token int8 rounding of x and h (cpu_kernels' int4 / mxfp4 paths)."""
    def q(v):
        amax = v.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        return torch.round(v * inv).clamp(-127, 127) * (amax / 127.0)

    wg, wu, wd = values
    out = torch.zeros(x.shape[0], wd.shape[1])
    for e in torch.unique(ids).tolist():
        tok, kk = (ids == e).nonzero(as_tuple=True)
        xe = q(x[tok].float())
        h = q(torch.nn.functional.silu(xe @ wg[e].T) * (xe @ wu[e].T))
        out.index_add_(0, tok, (h @ wd[e].T) * w[tok, kk][:, None])
    return out


def routing(T, E, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, E, (T, 2), generator=g), torch.rand(T, 2, generator=g) + 0.1


def rel_err(y, r):
    return float((y - r).abs().max() / r.abs().max())


# -- the executor over Q4_0 blocks ------------------------------------------------------------------------------
@pytest.mark.parametrize("isa", COMPILED)
@pytest.mark.parametrize("nodes", [1, 2])
def test_q4_0_holds_the_files_blocks_at_their_size(isa, nodes):
    """q4_0 (from_q4_0's default) holds the file's 16 bytes of nibbles and fp16 scale per block as they are: its
    state de-quantizes to gguf-py's values exactly (padding zero) and regroups into the file's blocks, across NUMA
    slices, at 4.5 bits a weight where int4 in groups of 32 holds the same values at 5."""
    pairs = expert_blocks(Q.Q4_0)
    raws, values = [p[0] for p in pairs], [p[1] for p in pairs]
    topo = two_nodes() if nodes == 2 else None
    moe = CpuMoE.from_q4_0(*raws, isa=isa, topology=topo)
    assert (moe.dtype, moe.group_size, len(moe.packed_weights())) == ("q4_0", 32, nodes)
    check_held(moe, values)
    for node in moe.packed_weights():
        f0, f1 = node["f0"], node["f1"]
        for name, raw in zip(("gate", "up", "down"), raws):
            m = node[name]
            rows, k = m["rows"], m["k"]
            blocks = raw[:, f0:f1] if name != "down" else raw[:, :, f0 // 32:f1 // 32]
            held = torch.cat([m["scale"][:, :rows, :k // 32, None].contiguous().view(torch.uint8),
                              m["q"][:, :rows, :k // 2].reshape(*m["q"].shape[:1], rows, k // 32, 16)], -1)
            assert torch.equal(held, blocks), (name, f0)
    int4 = CpuMoE.from_q4_0(*raws, dtype="int4", isa=isa, topology=topo)
    assert moe.nbytes / int4.nbytes == pytest.approx(4.5 / 5, rel=0.01)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    ids, w = routing(9, 3)
    torch.testing.assert_close(moe(x, ids, w), int4(x, ids, w), rtol=1e-4, atol=1e-6)  # the same values


@pytest.mark.parametrize("isa", COMPILED)
@pytest.mark.parametrize("order", ["natural", "interleaved"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_q4_0_packs_the_files_nibbles_and_scales(isa, order, nodes):
    """As int4 in groups of 32: the packed state de-quantizes to gguf-py's values of the blocks exactly (padding
    zero), in both stored orders and across NUMA slices; re-quantizing those values in groups of 32 does not give
    them back."""
    pairs = expert_blocks(Q.Q4_0)
    raws, values = [p[0] for p in pairs], [p[1] for p in pairs]
    topo = two_nodes() if nodes == 2 else None
    moe = CpuMoE.from_q4_0(*raws, dtype="int4", isa=isa, int4_order=order, topology=topo)
    assert (moe.dtype, moe.group_size, moe.int4_order, len(moe.packed_weights())) == ("int4", 32, order, nodes)
    check_held(moe, values)
    again = CpuMoE(*values, dtype="int4", group_size=32, isa=isa, int4_order=order, topology=topo)
    assert not torch.equal(held_values(again, "gate")[0], held_values(moe, "gate")[0])


@pytest.mark.parametrize("isa", COMPILED)
@pytest.mark.parametrize("dtype, order", [("q4_0", None), ("int4", "natural"), ("int4", "interleaved")])
def test_q4_0_compiled_packer_writes_the_reference_bytes(isa, dtype, order):
    """The compiled packer (csrc/pack.h, Q4_0 source) writes the PyTorch path's bytes, scales and padding, from
    contiguous blocks and from strided views (a fused gate_up's row halves), across NUMA slices; F = 96 (three
    blocks a down row: a lone block in its last 64 values)."""
    F, D = 96, 128
    (fused, _), (down, _) = blocks((4, 2 * F, D), Q.Q4_0, 7), blocks((4, D, F), Q.Q4_0, 8)
    gate, up = gguf_blocks("g", fused, "Q4_0")[:, :F], gguf_blocks("u", fused, "Q4_0")[:, F:]
    assert not gate.raw.is_contiguous()  # strided rows
    for topo in (None, two_nodes()):
        native = CpuMoE.from_q4_0(gate, up, down, dtype=dtype, isa=isa, int4_order=order, topology=topo)
        torch_ = CpuMoE.from_q4_0(gate, up, down, dtype=dtype, isa=isa, int4_order=order, topology=topo,
                                  packer="torch")
        assert native._packs_natively(gate) and not torch_._packs_natively(gate)
        a, b = native.packed_state(), torch_.packed_state()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype, packer", [("q4_0", "native"), ("q4_0", "torch"), ("int4", "native")])
def test_q4_0_packers_refuse_a_nan_scale(dtype, packer):
    """A block whose fp16 d is NaN stops the packer as a non-finite weight of its expert."""
    from cpu_kernels.moe import NonFiniteWeights

    if not COMPILED:
        pytest.skip("no compiled ISA on this machine")
    raw, _ = blocks((3, 64, 64), Q.Q4_0, 9)
    raw = raw.clone()
    raw[1, 5, 0, :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # fp16 0x7E00: NaN
    with pytest.raises(NonFiniteWeights, match="expert 1"):  # (square experts: down has gate's shape)
        CpuMoE.from_q4_0(raw, raw, raw, dtype=dtype, isa=COMPILED[0], packer=packer)


@pytest.mark.parametrize("isa", cpu_kernels.available_isas())
@pytest.mark.parametrize("dtype", ["q4_0", "int4"])
def test_q4_0_forward_is_the_reference_on_the_files_values(isa, dtype):
    """ref: the PyTorch reference on gguf-py's de-quantized values, to float rounding; compiled kernels: that
    reference with their int8 activation rounding emulated (only summation order differs)."""
    pairs = expert_blocks(Q.Q4_0, E=4, F=96, D=128)
    raws, values = [p[0] for p in pairs], [p[1] for p in pairs]
    moe = CpuMoE.from_q4_0(*raws, dtype=dtype, isa=isa)
    x = torch.randn(33, 128, generator=torch.Generator().manual_seed(2))
    ids, w = routing(33, 4)
    y = moe(x, ids, w)
    if isa == "ref":
        torch.testing.assert_close(y, moe_forward(x, *values, ids, w), rtol=0, atol=1e-6)
    else:
        ref = rounded_reference(x, values, ids, w)
        assert rel_err(y, ref) < 1e-2 and float((y - ref).abs().mean() / ref.abs().mean()) < 2e-4


def test_q4_0_sources_slice_and_refuse():
    """A fused gate_up's row halves are views of the file; other dtypes and groups are refused."""
    (raw, values), up, down = expert_blocks(Q.Q4_0)
    fused = torch.cat([raw, up[0]], dim=1)
    src = gguf_blocks("gate_up", fused, "Q4_0")
    gate = src[:, :96]
    assert gate.raw.data_ptr() == fused.data_ptr() and tuple(gate.shape) == (3, 96, 64)
    assert torch.equal(gate.dequantized(), values) and torch.equal(src[:, 96:].dequantized(), up[1])
    assert torch.equal(src[1:2, 5:9, 32:64].dequantized(), torch.cat([values, up[1]], 1)[1:2, 5:9, 32:64])
    with pytest.raises(ValueError, match="on 32-value blocks"):
        src[:, :, 16:48]
    with pytest.raises(ValueError, match="group_size 32"):
        CpuMoE.from_q4_0(raw, up[0], down[0], dtype="int4", group_size=64)
    with pytest.raises(ValueError, match="int4"):
        CpuMoE(gate, src[:, 96:], gguf_blocks("d", down[0], "Q4_0"), dtype="int8")
    with pytest.raises(ValueError, match="no CPU executor format holds GGUF Q5_1"):
        gguf_blocks("x", raw, "Q5_1")
    with pytest.raises(ValueError, match=r"Q5_0 blocks must be uint8 \[\.\.\., 22\]"):
        gguf_blocks("x", raw, "Q5_0")  # Q4_0's 18-byte blocks are not Q5_0's


# -- the executor over GGUF MXFP4 blocks ------------------------------------------------------------------------
@pytest.mark.parametrize("isa", COMPILED)
def test_gguf_mxfp4_is_the_published_format_re_paired(isa):
    """GGUF MXFP4 (values j and j + 16 in byte j) packs to the same bytes as the OCP layout of the same values
    (from_mxfp4), which de-quantize to gguf-py's values exactly."""
    pairs = expert_blocks(Q.MXFP4)
    raws, values = [p[0] for p in pairs], [p[1] for p in pairs]
    topo = two_nodes()
    moe = CpuMoE(*(gguf_blocks(n, r, "MXFP4") for n, r in zip("gud", raws)), dtype="mxfp4", isa=isa, topology=topo)
    check_held(moe, values)
    ocp = [quant.quantize_mxfp4(v) for v in values]  # the same values in the published layout
    assert all(torch.equal(quant.dequantize_mxfp4(*p), v) for p, v in zip(ocp, values))
    published = CpuMoE.from_mxfp4(*ocp, isa=isa, topology=topo)
    a, b = moe.packed_state(), published.packed_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    ids, w = routing(9, 3)
    assert torch.equal(moe(x, ids, w), published(x, ids, w))


def test_gguf_mxfp4_nibble_order_by_hand():
    """One block written by hand: byte j's low nibble is value j, its high nibble value j + 16."""
    raw = torch.zeros(1, 1, 1, 17, dtype=torch.uint8)
    raw[..., 0] = 127  # 2^0
    raw[..., 1] = 0x2 | (0x7 << 4)  # value 0: 1.0, value 16: 6.0
    raw[..., 2] = 0x9  # value 1: -0.5
    got = gguf_blocks("m", raw, "MXFP4").dequantized()[0, 0]
    want = torch.from_numpy(gguf.quants.dequantize(raw.reshape(1, 17).numpy(), Q.MXFP4)).reshape(32)
    assert torch.equal(got, want) and (got[0], got[1], got[16]) == (1.0, -0.5, 6.0) and got.abs().sum() == 7.5


# -- whole models through the hybrid runtime --------------------------------------------------------------------
def write_typed(path, model_type, hf, types, tensors=None) -> None:
    """The GGUF of `hf` (test_gguf's miniature converter) with each expert weight stored in types(name) (F32 for
    None) and every other tensor F32; tensors: name -> replacement (None drops one)."""
    ts = gguf_tensors(model_type, hf)
    ts.update(tensors or {})
    w = gguf.GGUFWriter(str(path), {"qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}[model_type])
    add_metadata(w, model_type, hf.config)
    for name, t in ts.items():
        if t is None:
            continue
        kind = types(name) if "_exps.weight" in name else None
        if kind is None:
            w.add_tensor(name, t.numpy())
        elif kind in FP16_AT or kind == Q.IQ1_M:  # a K-quant or IQ type (gguf-py has no quantizer for it): valid
            # random blocks
            block, size = gguf.GGML_QUANT_SIZES[kind]
            data = valid_blocks(kind, t.numel() // block, np.random.default_rng(len(name)))
            w.add_tensor(name, data.reshape(*t.shape[:-1], t.shape[-1] // block * size), raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(t.numpy(), kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def fused(hf) -> dict:
    """Every layer's gate and up stacks as one ffn_gate_up_exps [E, 2F, D] (gate rows first)."""
    ts, out = gguf_tensors("qwen3_moe", hf), {}
    for i in range(hf.config.num_hidden_layers):
        g, u = ts[f"blk.{i}.ffn_gate_exps.weight"], ts[f"blk.{i}.ffn_up_exps.weight"]
        out |= {f"blk.{i}.ffn_gate_exps.weight": None, f"blk.{i}.ffn_up_exps.weight": None,
                f"blk.{i}.ffn_gate_up_exps.weight": torch.cat([g, u], dim=1)}
    return out


def hybrid_logits(path, caplog=None, **kw):
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig

    hcfg = HybridConfig(gpu_experts=0, schedule="cpu", profile=PROFILE, packed_cache=False, **kw)
    with caplog.at_level(logging.INFO, "hybrid.models") if caplog is not None else contextlib.nullcontext():
        model, off = load_hybrid(str(path), "cpu", torch.float32, hcfg, progress=False)
    return single_logits(model, PROMPT), off


@pytest.fixture(scope="module")
def qwen3_ragged(tmp_path_factory):
    """Tiny Qwen3-MoE with experts of F = 96 (not a multiple of 64), 8 experts, 3 layers."""
    return hf_model("qwen3_moe", tmp_path_factory, moe_intermediate_size=96)[0]


@pytest.mark.parametrize("kind, dtype, fuse", [(Q.Q4_0, "q4_0", False), (Q.Q4_0, "q4_0", True),
                                              (Q.Q4_0, "int4", False), (Q.Q4_0, "int4", True),
                                              (Q.Q8_0, "q8_0", False), (Q.Q8_0, "q8_0", True),
                                              (Q.MXFP4, "mxfp4", False), (Q.MXFP4, "mxfp4", True)],
                         ids=["q4_0", "q4_0-fused", "q4_0-int4", "q4_0-int4-fused", "q8_0", "q8_0-fused", "mxfp4",
                              "mxfp4-fused"])
def test_hybrid_load_computes_the_files_values(tmp_path, qwen3_ragged, caplog, kind, dtype, fuse):
    """The hybrid runtime's logits equal those of the same file loaded de-quantized with fp32 experts (ref ISA:
    no activation rounding), while int4 in groups of 64 (re-quantized) differs; with the compiled kernels the
    packed bytes hold the file's values exactly."""
    files_values_are_computed(tmp_path, qwen3_ragged, caplog, kind, dtype, fuse)


@pytest.mark.parametrize("kind, dtype", [(Q.Q4_K, "q4_k"), (Q.IQ4_XS, "iq4_xs"), (Q.IQ2_XXS, "iq2_xxs"),
                                         (Q.IQ3_XXS, "iq3_xxs"), (Q.IQ3_S, "iq3_s"), (Q.IQ1_S, "iq1_s"),
                                         (Q.IQ1_M, "iq1_m")],
                         ids=["q4_k", "iq4_xs", "iq2_xxs", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"])
@pytest.mark.parametrize("fuse", [False, True], ids=["split", "fused"])
def test_hybrid_load_computes_the_files_super_block_values(tmp_path, qwen3_256, caplog, kind, dtype, fuse):
    """As above for Q4_K, IQ4_XS, IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M blocks (valid random super-blocks: every nibble,
    scale and minimum; every codebook index, sign index, delta sign and scale), on experts 256 wide; the IQ types
    re-quantized into int4 go through the reference de-quantizer (cpu_kernels.quant)."""
    files_values_are_computed(tmp_path, qwen3_256, caplog, kind, dtype, fuse)


@pytest.mark.parametrize("isa", ["ref", *COMPILED])
def test_a_q4_0_file_gives_the_logits_it_gave_in_int4(tmp_path, qwen3_ragged, caplog, isa):
    """A Q4_0 file's experts in q4_0 (its default now: the file's blocks, 4.5 bits a weight) and in int4 groups of 32
    (its default before, 5 bits) hold the same values, so give the same logits (ref: exactly; the kernels: to their
    summation order) at 0.9 x the expert bytes."""
    path = tmp_path / "q40.gguf"
    write_typed(path, "qwen3_moe", qwen3_ragged, lambda n: Q.Q4_0)
    got, off = hybrid_logits(path, caplog, cpu_dtype="q4_0", cpu_isa=isa)
    assert "GGUF experts for the CPU executor (q4_0): layers 0-2 repacked losslessly" in caplog.text
    before, off4 = hybrid_logits(path, cpu_dtype="int4", cpu_group=32, cpu_isa=isa)
    assert {layer.cpu_moe.dtype for layer in off.layers} == {"q4_0"}
    assert {layer.cpu_moe.dtype for layer in off4.layers} == {"int4"}
    if isa == "ref":
        assert torch.equal(got, before)
        return
    assert (got - before).abs().max().item() <= 1e-4 * before.abs().max().item()
    q40, int4 = (sum(layer.cpu_moe.nbytes for layer in o.layers) for o in (off, off4))
    assert q40 / int4 == pytest.approx(4.5 / 5, rel=0.02)


def files_values_are_computed(tmp_path, hf, caplog, kind, dtype, fuse):
    F = hf.config.moe_intermediate_size
    path = tmp_path / "m.gguf"
    write_typed(path, "qwen3_moe", hf, lambda n: kind, fused(hf) if fuse else None)
    plain = single_logits(load_gguf(path, progress=False), PROMPT)
    got, off = hybrid_logits(path, caplog, cpu_dtype=dtype, cpu_group=32, cpu_isa="ref")
    assert "layers 0-2 repacked losslessly" in caplog.text and "de-quantized" not in caplog.text
    assert (got - plain).abs().max().item() <= 1e-5
    requantized, _ = hybrid_logits(path, cpu_dtype="int4", cpu_group=64, cpu_isa="ref")
    assert (requantized - plain).abs().max().item() > 1e-3
    if COMPILED:
        from hybrid.models.gguf import open_gguf
        from hybrid.models.gguf.dequant import dequantize

        _, off = hybrid_logits(path, cpu_dtype=dtype, cpu_group=32, cpu_isa=COMPILED[0])
        ckpt = open_gguf(path)
        for layer in off.layers:
            t = {n: ckpt.tensors[f"blk.{layer.layer}.ffn_{n}_exps.weight"] for n in ("down", "gate_up", "gate", "up")
                 if f"blk.{layer.layer}.ffn_{n}_exps.weight" in ckpt.tensors}
            v = {n: dequantize(x.raw(), x.ggml_type, x.shape) for n, x in t.items()}
            if fuse:
                v["gate"], v["up"] = v["gate_up"][:, :F], v["gate_up"][:, F:]
            check_held(layer.cpu_moe, (v["gate"], v["up"], v["down"]))


def test_gpt_oss_mxfp4_experts_with_biases(tmp_path, tmp_path_factory, caplog):
    """gpt-oss (clamped SwiGLU, expert biases as F32 tensors) with MXFP4 expert blocks: mxfp4 repacks them and
    computes the de-quantized model."""
    hf = hf_model("gpt_oss", tmp_path_factory, swiglu_limit=7.0)[0]
    path = tmp_path / "g.gguf"
    write_typed(path, "gpt_oss", hf, lambda n: Q.MXFP4)
    plain = single_logits(load_gguf(path, progress=False), PROMPT)
    got, off = hybrid_logits(path, caplog, cpu_dtype="mxfp4", cpu_isa="ref")
    assert "repacked losslessly" in caplog.text
    assert off.layers[0].cpu_moe._bias[0] is not None
    assert (got - plain).abs().max().item() <= 1e-5


def file_values(path, layer: int) -> dict:
    """name ("gate", "up", "down") -> the file's de-quantized values of one layer's expert tensors."""
    from hybrid.models.gguf import open_gguf
    from hybrid.models.gguf.dequant import dequantize

    ckpt = open_gguf(path)
    return {n: dequantize(t.raw(), t.ggml_type, t.shape) for n in ("gate", "up", "down")
            for t in [ckpt.tensors[f"blk.{layer}.ffn_{n}_exps.weight"]]}


def held(moe, name: str) -> torch.Tensor:
    """What a one-node executor holds for matrix `name`, cut to the plain matrix."""
    node = moe.packed_weights()[0][name]
    return held_values(moe, name)[0][:, :node["rows"], :node["k"]]


@pytest.mark.parametrize("dtype", ["q4_0", "int4"])
def test_mixed_layers_keep_what_the_formats_hold_and_the_log_says_why(tmp_path, qwen3_ragged, caplog, dtype):
    """A layer whose down is Q8_0 among Q4_0 gates and ups: under q4_0, or int4 in groups of 32 (both hold Q4_0
    exactly), its gate and up are the file's blocks and its down too, in q8_0 (a down may have a dtype of its own);
    under int8, which holds neither type, the gates and ups are re-quantized and the downs still kept, the Q8_0 one
    as q8_0, the Q4_0 ones as q4_0. The one log line names the layers and weights each way and why."""
    path = tmp_path / "mixed.gguf"
    write_typed(path, "qwen3_moe", qwen3_ragged, lambda n: Q.Q8_0 if n == "blk.1.ffn_down_exps.weight" else Q.Q4_0)
    _, off = hybrid_logits(path, caplog, cpu_dtype=dtype, cpu_group=32, cpu_isa="ref")
    lines = [r.getMessage() for r in caplog.records if "GGUF experts" in r.getMessage()]
    name = "int4 group 32" if dtype == "int4" else dtype
    assert lines == [f"GGUF experts for the CPU executor ({name}): layers 0, 2 repacked losslessly (the file's "
                     "blocks as they are); layers 1 repacked losslessly (the file's blocks as they are; w_down in "
                     "q8_0)"]
    assert [layer.cpu_moe.down_dtype for layer in off.layers] == [dtype, "q8_0", dtype]
    if COMPILED:
        _, off = hybrid_logits(path, cpu_dtype=dtype, cpu_group=32, cpu_isa=COMPILED[0])
        values = file_values(path, 1)
        for name in ("gate", "up", "down"):
            assert torch.equal(held(off.layers[1].cpu_moe, name), values[name])
    caplog.clear()
    _, off = hybrid_logits(path, caplog, cpu_dtype="int8", cpu_isa="ref")
    why = "(Q4_0 blocks are held exactly by --cpu-dtype q4_0 or int4 group 32 only; w_down in"
    assert f"layers 0, 2: w_down repacked losslessly, w_gate Q4_0, w_up Q4_0 de-quantized and re-quantized {why} " \
           "q4_0); layers 1: w_down repacked losslessly, w_gate Q4_0, w_up Q4_0 de-quantized and re-quantized " \
           f"{why} q8_0)" in caplog.text
    assert [layer.cpu_moe.down_dtype for layer in off.layers] == ["q4_0", "q8_0", "q4_0"]


@pytest.mark.parametrize("main, down_kind, down, dtype, said", [
    (Q.Q4_K, Q.Q6_K, "blk.1.ffn_down_exps.weight", "q4_k", "layers 0, 2 repacked losslessly (the file's blocks as "
     "they are); layers 1 repacked losslessly (the file's blocks as they are; w_down in q6_k)"),
    (Q.Q5_K, Q.Q6_K, "ffn_down", "q5_k", "layers 0-2 repacked losslessly (the file's blocks as they are; w_down in q6_k)"),
    (Q.Q2_K, Q.Q3_K, "ffn_down", "q2_k", "layers 0-2 repacked losslessly (the file's blocks as they are; w_down in q3_k)"),
    (Q.Q3_K, Q.Q4_K, "ffn_down", "q3_k", "layers 0-2 repacked losslessly (the file's blocks as they are; w_down in q4_k)"),
    (Q.Q4_K, Q.IQ4_XS, "ffn_down", "q4_k",
     "layers 0-2 repacked losslessly (the file's blocks as they are; w_down in iq4_xs)"),
    (Q.Q4_K, Q.Q4_0, "blk.1.ffn_down_exps.weight", "q4_k", "layers 0, 2 repacked losslessly (the file's blocks as "
     "they are); layers 1 repacked losslessly (the file's blocks as they are; w_down in q4_0)"),
    (Q.IQ2_XXS, Q.Q4_K, "ffn_down", "iq2_xxs",
     "layers 0-2 repacked losslessly (the file's blocks as they are; w_down in q4_k)"),
    (Q.IQ2_XXS, Q.Q2_K, "blk.1.ffn_down_exps.weight", "iq2_xxs", "layers 0, 2 repacked losslessly (the file's "
     "blocks as they are); layers 1 repacked losslessly (the file's blocks as they are; w_down in q2_k)"),
    (Q.IQ1_S, Q.IQ2_XXS, "ffn_down", "iq1_s",
     "layers 0-2 repacked losslessly (the file's blocks as they are; w_down in iq2_xxs)"),
    (Q.IQ1_S, Q.Q4_K, "blk.1.ffn_down_exps.weight", "iq1_s", "layers 0, 2 repacked losslessly (the file's "
     "blocks as they are); layers 1 repacked losslessly (the file's blocks as they are; w_down in q4_k)"),
    (Q.IQ1_M, Q.IQ2_XXS, "ffn_down", "iq1_m",
     "layers 0-2 repacked losslessly (the file's blocks as they are; w_down in iq2_xxs)"),
    (Q.IQ1_M, Q.Q4_K, "blk.1.ffn_down_exps.weight", "iq1_m", "layers 0, 2 repacked losslessly (the file's "
     "blocks as they are); layers 1 repacked losslessly (the file's blocks as they are; w_down in q4_k)"),
    (Q.IQ3_XXS, Q.Q4_K, "ffn_down", "iq3_xxs",
     "layers 0-2 repacked losslessly (the file's blocks as they are; w_down in q4_k)"),
    (Q.IQ2_XXS, Q.IQ3_XXS, "blk.1.ffn_down_exps.weight", "iq2_xxs", "layers 0, 2 repacked losslessly (the file's "
     "blocks as they are); layers 1 repacked losslessly (the file's blocks as they are; w_down in iq3_xxs)"),
    (Q.IQ3_S, Q.IQ3_XXS, "ffn_down", "iq3_s",
     "layers 0-2 repacked losslessly (the file's blocks as they are; w_down in iq3_xxs)")],
    ids=["q4_k_m", "q5_k_m", "q2_k", "q3_k_m", "iq4_xs-downs", "q4_0-down", "iq2_xxs-q4_k-downs", "iq2_xxs-q2_k-down",
         "iq1_s-iq2_xxs-downs", "iq1_s-q4_k-down", "iq1_m-iq2_xxs-downs", "iq1_m-q4_k-down", "iq3_xxs-q4_k-downs",
         "iq2_xxs-iq3_xxs-down", "iq3_s-iq3_xxs-downs"])
def test_a_k_m_like_file_keeps_every_weight_as_the_files_blocks(tmp_path, qwen3_256, caplog, main, down_kind, down,
                                                               dtype, said):
    """Q4_K (Q5_K) gates and ups with downs in Q6_K, one layer's as Q4_K_M files keep some (every layer's, as Q5_K_M
    files keep many), Q2_K ones with downs in Q3_K as Q2_K files keep them, Q3_K ones with downs in Q4_K as Q3_K_M
    files, Q4_K ones with downs in IQ4_XS, or one layer's in Q4_0, IQ2_XXS ones with downs in Q4_K or one in Q2_K, IQ1_S
    (IQ1_M) ones with downs in IQ2_XXS or one in Q4_K (as unsloth's UD-IQ files mix them): by default the gates' and ups' format with those downs in theirs, every
    weight the file's values and bytes; the load's line says so."""
    path = tmp_path / f"{dtype}m.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, lambda n: down_kind if down in n else main)
    _, off = hybrid_logits(path, caplog, cpu_dtype=dtype, cpu_isa=COMPILED[0] if COMPILED else "ref")
    assert f"GGUF experts for the CPU executor ({dtype}): {said}" in caplog.text
    moe = off.layers[1].cpu_moe
    assert (moe.dtype, moe.down_dtype) == (dtype, down_kind.name.lower())
    if COMPILED:
        values = file_values(path, 1)
        for name in ("gate", "up", "down"):
            assert torch.equal(held(moe, name), values[name])


@pytest.mark.parametrize("down_kind", [Q.Q5_0, Q.IQ4_NL], ids=lambda t: t.name)
def test_a_fallback_down_is_held_exactly_in_q8_0(tmp_path, qwen3_256, caplog, down_kind):
    """The 32-value types llama-quantize falls back to for a down whose rows are not whole 256-value blocks (Q4_K ->
    Q5_0, IQ4_XS -> IQ4_NL) beside Q4_K gates and ups: their blocks converted to q8_0's, which hold their values
    exactly (the same fp16 d, an int8 per value), not re-quantized into q4_k; the load's line says so."""
    path = tmp_path / "fallback.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, lambda n: down_kind if n == "blk.1.ffn_down_exps.weight" else Q.Q4_K)
    _, off = hybrid_logits(path, caplog, cpu_dtype="q4_k", cpu_isa=COMPILED[0] if COMPILED else "ref")
    assert ("layers 0, 2 repacked losslessly (the file's blocks as they are); layers 1 repacked losslessly (the "
            f"file's blocks as they are; w_down in q8_0, its {down_kind.name} values as q8_0 blocks)") in caplog.text
    moe = off.layers[1].cpu_moe
    assert (moe.dtype, moe.down_dtype) == ("q4_k", "q8_0")
    if COMPILED:
        values = file_values(path, 1)
        for name in ("gate", "up", "down"):
            assert torch.equal(held(moe, name), values[name])


@pytest.mark.parametrize("kind, convert", [(Q.Q5_0, quant.q8_0_blocks_from_q5_0),
                                           (Q.IQ4_NL, quant.q8_0_blocks_from_iq4_nl)], ids=["Q5_0", "IQ4_NL"])
def test_fallback_blocks_convert_to_q8_0_blocks_of_the_same_values(kind, convert):
    raw = valid_blocks(kind, 40, np.random.default_rng(int(kind)))
    q8 = convert(torch.from_numpy(raw.copy()))
    assert q8.shape == (40, quant.Q8_0_BLOCK_BYTES)
    want = gguf.quants.dequantize(raw, kind)
    assert np.array_equal(gguf.quants.dequantize(q8.numpy(), Q.Q8_0), want) and np.abs(want).sum() > 0


def test_a_down_of_a_type_no_down_format_holds_is_re_quantized_into_the_layers(tmp_path, qwen3_256, caplog):
    """An F32 down beside Q4_K gates and ups: no format holds F32 blocks, so it is quantized into the layer's q4_k;
    the load's line says so."""
    path = tmp_path / "f32down.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, lambda n: None if n == "blk.1.ffn_down_exps.weight" else Q.Q4_K)
    _, off = hybrid_logits(path, caplog, cpu_dtype="q4_k", cpu_isa=COMPILED[0] if COMPILED else "ref")
    assert ("layers 1: w_gate, w_up repacked losslessly, w_down F32 de-quantized and re-quantized (no CPU format "
            "holds F32 as stored)") in caplog.text
    moe = off.layers[1].cpu_moe
    assert (moe.dtype, moe.down_dtype) == ("q4_k", "q4_k")
    if COMPILED:
        want = file_values(path, 1)["down"]
        assert torch.equal(held(moe, "down"), quant.dequantize_q4_k(*quant.quantize_q4_k(want)))


def test_mxfp4_cpu_dtype_is_refused_for_a_file_without_mxfp4_experts(tmp_path, qwen3_ragged):
    from hybrid.models import load_model

    path = tmp_path / "q.gguf"
    write_typed(path, "qwen3_moe", qwen3_ragged, lambda n: Q.Q4_0)
    with pytest.raises(ModelLoadError, match="this file's experts are Q4_0, which would be de-quantized") as exc:
        load_model(path, experts_factory=lambda *a, **k: None, mxfp4_experts=True, progress=False)
    assert "\n" not in str(exc.value)


# -- the default CPU dtype --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_256(tmp_path_factory):
    """Tiny Qwen3-MoE whose expert matrices are 256 wide both ways (K-quants' super-blocks)."""
    return hf_model("qwen3_moe", tmp_path_factory, hidden_size=256, moe_intermediate_size=256)[0]


@pytest.mark.parametrize("kind, argv, want", [
    (Q.Q4_0, [], ("q4_0", 128)), (Q.MXFP4, [], ("mxfp4", 128)), (Q.Q8_0, [], ("q8_0", 128)),
    (Q.Q4_K, [], ("q4_k", 128)), (Q.Q5_K, [], ("q5_k", 128)), (Q.Q6_K, [], ("q6_k", 128)),
    (Q.Q2_K, [], ("q2_k", 128)), (Q.Q3_K, [], ("q3_k", 128)), (Q.IQ4_XS, [], ("iq4_xs", 128)),
    (Q.IQ2_XXS, [], ("iq2_xxs", 128)), (Q.IQ3_XXS, [], ("iq3_xxs", 128)), (Q.IQ3_S, [], ("iq3_s", 128)),
    (Q.IQ1_S, [], ("iq1_s", 128)),
    (Q.IQ1_M, [], ("iq1_m", 128)),
    ("mixed", [], ("q4_k", 128)), (Q.F32, [], ("bf16", 128)),
    (Q.Q4_0, ["--cpu-dtype", "int8"], ("int8", 128)), (Q.Q4_0, ["--cpu-dtype", "int4", "--int4-group", "32"], ("int4", 32)),
    (Q.Q4_K, ["--cpu-dtype", "bf16"], ("bf16", 128))],
    ids=["q4_0", "mxfp4", "q8_0", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_xs", "iq2_xxs", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "mixed", "f32", "asked-int8",
         "asked-group", "asked-bf16"])
def test_default_cpu_dtype_follows_the_files_blocks(tmp_path, qwen3_256, caplog, kind, argv, want):
    """Without --cpu-dtype a GGUF file's CPU experts take the format nearest the type of most of its expert bytes
    (all Q4_0: q4_0, all Q8_0: q8_0, all Q4_K: q4_k and all MXFP4: mxfp4, the file's values exactly; all Q5_K, Q6_K, Q2_K, Q3_K or IQ4_XS: q5_k, q6_k, q2_k, q3_k or iq4_xs, exactly too; Q4_K_M-like mixes of Q4_K and a few Q6_K tensors: q4_k), kept through the checks before
    loading, and one line says so; a dtype or group the user gives stands."""
    from hybrid.cli import build_parser
    from hybrid.loading.check import check_before_load
    from hybrid.loading.parse import session_config_from_args

    path = tmp_path / "m.gguf"
    # mixed: layer 0's gate in Q6_K (Q4_K_M files keep some tensors in Q6_K; the first one met here), the rest Q4_K
    types = (lambda n: Q.Q6_K if n == "blk.0.ffn_gate_exps.weight" else Q.Q4_K) if kind == "mixed" else \
        (lambda n: None) if kind == Q.F32 else (lambda n: kind)
    write_typed(path, "qwen3_moe", qwen3_256, types)
    args = build_parser().parse_args(["generate", "--model", str(path), "--device", "cpu", "--gpu-experts", "0",
                                      *argv])
    with caplog.at_level(logging.WARNING, "hybrid.offload"):
        _, config = check_before_load(str(path), session_config_from_args(args))
    assert (config.hybrid.cpu_dtype, config.hybrid.cpu_group) == want
    said = [r.getMessage() for r in caplog.records if "GGUF file whose experts are" in r.getMessage()]
    if "--cpu-dtype" in argv or kind == Q.F32:
        assert not said  # the user's choice, or bf16 as for any checkpoint: nothing to say
    else:  # (the file's blocks kept where all are of one type: every block type here has a format of its own)
        exact = kind in (Q.Q4_0, Q.MXFP4, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ3_XXS,
                        Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)
        how = "the file's blocks as they are" if exact else "re-quantized from the file's values"
        fmt = f"int4 group {want[1]}" if want[0] == "int4" else want[0]
        what = "mostly Q4_K" if kind == "mixed" else f"all {kind.name}"
        own = "; layers of other types keep formats of their own where one holds their blocks" if kind == "mixed" else ""
        assert said == [f"GGUF file whose experts are {what}: the CPU experts default to {fmt}, {how}{own} "
                        "(--cpu-dtype chooses one for all)"]
        assert config.hybrid.layer_formats == (kind == "mixed")


# the GGUF types no CPU format holds -> the format a file of them defaults to (repack.NEAREST: the smallest of at
# least their bits with a quantizer from floats)
UNHELD = {Q.IQ2_XS: "q2_k", Q.IQ2_S: "q2_k", Q.TQ2_0: "iq2_xxs", Q.TQ1_0: "iq2_xxs"}


@pytest.mark.parametrize("kind", list(UNHELD), ids=lambda t: t.name)
def test_a_type_no_format_holds_defaults_to_its_nearest_format(tmp_path, qwen3_256, caplog, kind):
    """Without --cpu-dtype a file whose experts are all of a type no CPU format holds (IQ2_XS, IQ2_S, TQ2_0, TQ1_0)
    takes repack.NEAREST's format for it, and the line before loading says the values are re-quantized."""
    from hybrid.cli import build_parser
    from hybrid.loading.check import check_before_load
    from hybrid.loading.parse import session_config_from_args

    path = tmp_path / "m.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, lambda n: kind)
    args = build_parser().parse_args(["generate", "--model", str(path), "--device", "cpu", "--gpu-experts", "0"])
    with caplog.at_level(logging.WARNING, "hybrid.offload"):
        _, config = check_before_load(str(path), session_config_from_args(args))
    assert (config.hybrid.cpu_dtype, config.hybrid.cpu_group) == (UNHELD[kind], 128)
    said = [r.getMessage() for r in caplog.records if "GGUF file whose experts are" in r.getMessage()]
    assert said == [f"GGUF file whose experts are all {kind.name}: the CPU experts default to {UNHELD[kind]}, "
                    "re-quantized from the file's values (--cpu-dtype chooses one for all)"]


@pytest.mark.parametrize("kind", [Q.IQ2_S, Q.IQ2_XS, Q.TQ1_0], ids=lambda t: t.name)
def test_a_type_no_format_holds_loads_re_quantized_into_its_nearest_format(tmp_path, qwen3_256, caplog, kind):
    """IQ2_S (IQ2_XS, TQ1_0) experts (valid random blocks) load into their default format, q2_k (q2_k, iq2_xxs): every
    layer de-quantized (bit for bit gguf-py's values) and re-quantized, the load's line naming why; the executor holds
    the format's quantization of the file's values."""
    from hybrid.models.gguf.repack import NEAREST

    dtype = UNHELD[kind]
    assert NEAREST[kind.name][0] == dtype
    path = tmp_path / "m.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, lambda n: kind)
    logits, off = hybrid_logits(path, caplog, cpu_dtype=dtype, cpu_isa=COMPILED[0] if COMPILED else "ref")
    assert (f"GGUF experts for the CPU executor ({dtype}): layers 0-2 de-quantized and re-quantized (no CPU format "
            f"holds {kind.name} as stored)") in caplog.text
    assert torch.isfinite(logits).all()
    moe = off.layers[1].cpu_moe
    assert (moe.dtype, moe.down_dtype) == (dtype, dtype)
    want = file_values(path, 1)
    quantize, dequantize = getattr(quant, f"quantize_{dtype}"), quant.packed_dequantizers()[dtype]
    for name in ("gate", "up", "down"):
        assert torch.equal(held(moe, name), dequantize(*quantize(want[name]))), name


def test_plan_prices_a_q4_0_file_as_the_runtime_loads_it(tmp_path, qwen3_ragged, capsys):
    """`hybrid plan --model X.gguf` without --cpu-dtype prices the experts in the dtype the runtime will give them:
    a Q4_0 file's as q4_0 (its blocks kept, 4.5 bits a weight), so a plan matches the load; int4 in groups of 32,
    which holds the same values, at 5 bits, in the group the plan records."""
    import json as _json

    from hybrid.cli import main

    path = tmp_path / "m.gguf"
    write_typed(path, "qwen3_moe", qwen3_ragged, lambda n: Q.Q4_0)
    argv = ["plan", "--model", str(path), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--profile",
            "ktransformers-paper-amx", "--json"]
    assert main(argv) == 0
    plan = _json.loads(capsys.readouterr().out)
    assert main([*argv, "--cpu-dtype", "int4", "--int4-group", "32"]) == 0
    asked = _json.loads(capsys.readouterr().out)
    assert plan["settings"]["cpu_dtype"] == "q4_0" and "int4_group" not in plan["settings"]
    assert asked["settings"]["cpu_dtype"] == "int4" and asked["settings"]["int4_group"] == 32
    from placement.memory import packed_expert_bytes

    cfg, threads = qwen3_ragged.config, plan["settings"]["node_threads"]
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    q40, int4 = (p["memory"]["cpu"]["per_expert"] for p in (plan, asked))
    assert q40 == packed_expert_bytes(D, F, "q4_0", threads) and int4 == packed_expert_bytes(D, F, "int4", threads, 32)
    assert q40 / int4 == pytest.approx(4.5 / 5)  # (F = 96 pads to 128 in both)


@pytest.mark.parametrize("kind, dtype", [(Q.Q8_0, "q8_0"), (Q.Q4_0, "q4_0"), (Q.Q4_K, "q4_k")])
def test_plan_prices_a_files_exact_format(tmp_path, qwen3_256, capsys, kind, dtype):
    """`hybrid plan --model X.gguf` of a Q8_0, Q4_0 or Q4_K file prices its experts in the format the runtime keeps
    them in, at the file's 8.5 / 4.5 / 4.5 bits a weight, and predicts the load with that format's (default) pack rate."""
    import json as _json

    from hybrid.cli import main
    from placement.memory import packed_expert_bytes

    path = tmp_path / "m.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, lambda n: kind)
    assert main(["plan", "--model", str(path), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--profile",
                 "ktransformers-paper-amx", "--json"]) == 0
    plan = _json.loads(capsys.readouterr().out)
    cfg, threads = qwen3_256.config, plan["settings"]["node_threads"]
    assert plan["settings"]["cpu_dtype"] == dtype and "int4_group" not in plan["settings"]
    per = packed_expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, dtype, threads)
    assert plan["memory"]["cpu"]["per_expert"] == per == 3 * 256 * 256 * {"q8_0": 1.0625, "q4_0": 0.5625, "q4_k": 0.5625}[dtype]


def test_plan_prices_the_downs_of_their_own_dtype(tmp_path, qwen3_256, capsys):
    """A Q4_K_M-like file (one layer's down in Q6_K): the plan prices that down in q6_k, as the load packs it, and
    records it; its expert DRAM is that much above the all-q4_k figure."""
    import json as _json

    from hybrid.cli import main
    from placement.memory import down_bytes, packed_expert_bytes

    path = tmp_path / "m.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, lambda n: Q.Q6_K if n == "blk.1.ffn_down_exps.weight" else Q.Q4_K)
    assert main(["plan", "--model", str(path), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--profile",
                 "ktransformers-paper-amx", "--json"]) == 0
    plan = _json.loads(capsys.readouterr().out)
    cfg, threads = qwen3_256.config, plan["settings"]["node_threads"]
    assert plan["settings"]["cpu_dtype"] == "q4_k" and plan["settings"]["down_dtypes"] == ["q6_k"]
    D, F, E, L = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_hidden_layers
    extra = E * (down_bytes(D, F, "q6_k", threads) - down_bytes(D, F, "q4_k", threads))
    assert extra > 0
    assert plan["memory"]["cpu"]["experts"] == L * E * packed_expert_bytes(D, F, "q4_k", threads) + extra


def mixed_layers(name: str):
    """A file whose layers differ as dynamic quantizations' do: layers 0 and 2 Q4_K (layer 2's down Q6_K), layer 1
    Q2_K throughout."""
    return Q.Q2_K if name.startswith("blk.1.") else Q.Q6_K if name == "blk.2.ffn_down_exps.weight" else Q.Q4_K


def test_a_file_of_mixed_layers_keeps_each_layers_blocks(tmp_path, qwen3_256, caplog):
    """Without --cpu-dtype a file whose layers hold different types keeps each layer in the format of its own gate
    and up blocks (q2_k for the Q2_K layer among q4_k ones) with its down in its own: every weight the file's values,
    no layer re-quantized into the main format; asked for one format (--cpu-dtype q4_k), the Q2_K layer is
    de-quantized and re-quantized into it, as before. The packed cache keys the two apart."""
    path = tmp_path / "mixed_layers.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, mixed_layers)
    plain = single_logits(load_gguf(path, progress=False), PROMPT)
    got, off = hybrid_logits(path, caplog, cpu_dtype="q4_k", layer_formats=True, cpu_isa="ref")
    assert [(m.cpu_moe.dtype, m.cpu_moe.down_dtype) for m in off.layers] == [("q4_k", "q4_k"), ("q2_k", "q2_k"),
                                                                              ("q4_k", "q6_k")]
    assert ("GGUF experts for the CPU executor (q4_k): layers 0 repacked losslessly (the file's blocks as they are); "
            "layers 1 repacked losslessly (the file's blocks as they are; in q2_k); layers 2 repacked losslessly (the "
            "file's blocks as they are; w_down in q6_k)") in caplog.text
    assert "de-quantized" not in caplog.text
    assert (got - plain).abs().max().item() <= 1e-5
    caplog.clear()
    one, off1 = hybrid_logits(path, caplog, cpu_dtype="q4_k", cpu_isa="ref")
    assert [m.cpu_moe.dtype for m in off1.layers] == ["q4_k"] * 3
    assert "layers 1: w_down repacked losslessly, w_gate Q2_K, w_up Q2_K de-quantized and re-quantized" in caplog.text
    assert (one - plain).abs().max().item() > 1e-4  # Q2_K values re-rounded to q4_k's grid (30x the exact path's)
    if COMPILED:
        _, off = hybrid_logits(path, cpu_dtype="q4_k", layer_formats=True, cpu_isa=COMPILED[0])
        values = file_values(path, 1)
        for name in ("gate", "up", "down"):
            assert torch.equal(held(off.layers[1].cpu_moe, name), values[name])
    from hybrid.models.checkpoints import read_config
    from hybrid.offload.packed_cache import LoadTimes, open_for_load

    cfg = read_config(str(path))[1]
    keys = {open_for_load(path, cfg, off, LoadTimes(), own).key for own in (False, True)}
    assert len(keys) == 2
    # the q2_k layer's splits are priced at q2_k's bytes (and kernel), the others at the load's q4_k
    main, own = off.scheduler_of("q4_k"), off.scheduler_of("q2_k")
    assert main is off.scheduler and own is not main and own.strategy == main.strategy
    assert own.shape.bytes_per_weight < main.shape.bytes_per_weight
    assert off.scheduler_of("q2_k") is own  # built once


def test_a_layer_of_another_type_in_an_iq_file_loads_in_its_own_format(tmp_path, qwen3_256, caplog):
    """IQ1_S gates and ups with IQ2_XXS downs and one layer's gate and up in Q2_K (as UD-IQ1 files mix them): in one
    format (--cpu-dtype iq1_s) the Q2_K layer would need a quantizer iq1_s does not have and the load is refused;
    in the file's own formats (the default) that layer is q2_k and the model computes the file's values."""
    path = tmp_path / "ud.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, lambda n: Q.IQ2_XXS if "ffn_down" in n else
                Q.Q2_K if n.startswith("blk.1.") else Q.IQ1_S)
    plain = single_logits(load_gguf(path, progress=False), PROMPT)
    with pytest.raises(ValueError, match="iq1_s holds a GGUF file's IQ1_S blocks as they are; it has no quantizer"):
        hybrid_logits(path, cpu_dtype="iq1_s", cpu_isa="ref")
    got, off = hybrid_logits(path, caplog, cpu_dtype="iq1_s", layer_formats=True, cpu_isa="ref")
    assert [(m.cpu_moe.dtype, m.cpu_moe.down_dtype) for m in off.layers] == [("iq1_s", "iq2_xxs"), ("q2_k", "iq2_xxs"),
                                                                              ("iq1_s", "iq2_xxs")]
    assert "de-quantized" not in caplog.text
    assert (got - plain).abs().max().item() <= 1e-5


def test_plan_and_dram_price_a_mixed_file_as_it_loads(tmp_path, qwen3_256, capsys):
    """`hybrid plan --model X.gguf` of a file of mixed layers prices each layer in the format the runtime gives it
    (its gate and up, its down), recorded in the plan; the DRAM check prices the same bytes."""
    import json as _json

    from hybrid.cli import main
    from hybrid.loading.dram import model_dram
    from hybrid.models.checkpoints import read_config
    from placement.memory import down_bytes, packed_expert_bytes

    path = tmp_path / "mixed_layers.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, mixed_layers)
    assert main(["plan", "--model", str(path), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--profile",
                 "ktransformers-paper-amx", "--json"]) == 0
    plan = _json.loads(capsys.readouterr().out)
    st = plan["settings"]
    assert (st["cpu_dtype"], st["layer_dtypes"], st["down_dtypes"]) == ("q4_k", ["q2_k"], ["q2_k", "q6_k"])
    cfg, threads = qwen3_256.config, st["node_threads"]
    D, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts

    def per(d):
        return packed_expert_bytes(D, F, d, threads)

    # layers 0 and 2 in q4_k, layer 2's down in q6_k instead, layer 1 all in q2_k
    want = E * (2 * per("q4_k") + per("q2_k") + down_bytes(D, F, "q6_k", threads) - down_bytes(D, F, "q4_k", threads))
    assert plan["memory"]["cpu"]["experts"] == want
    assert main(["plan", "--model", str(path), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--profile",
                 "ktransformers-paper-amx"]) == 0
    assert "; own formats: gates and ups q2_k x1, downs q2_k x1, q6_k x1)" in capsys.readouterr().out
    need = model_dram(read_config(str(path))[1], False, 4, "q4_k", 64, 1, ("q2_k", "q6_k"), ("q2_k",))
    experts = [b for name, b in need.parts if "expert" in name]
    assert want in experts, need.parts


def test_a_plans_int4_group_is_what_the_run_loads(tmp_path):
    """A plan made with --int4-group 64 loads its int4 experts in groups of 64 under --plan; a different
    --int4-group beside it is refused (the plan priced the other one)."""
    import json as _json

    from hybrid.cli import build_parser, main
    from hybrid.loading.parse import hybrid_config_from_args
    from placement.errors import UsageError

    out = tmp_path / "plan.json"
    assert main(["plan", "--gpu-budget", "2GiB", "--cpu-budget", "4GiB", "--profile", "ktransformers-paper-amx",
                 "--cpu-dtype", "int4", "--int4-group", "64", "--out", str(out)]) == 0
    assert _json.loads(out.read_text())["settings"]["int4_group"] == 64
    parse = build_parser().parse_args
    assert hybrid_config_from_args(parse(["generate", "--plan", str(out)])).cpu_group == 64
    with pytest.raises(UsageError, match="--int4-group 32 differs from the plan's 64"):
        hybrid_config_from_args(parse(["generate", "--plan", str(out), "--int4-group", "32"]))


# -- the packed-expert cache ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, cpu_dtype, group, model", [(Q.Q4_0, "q4_0", 128, "qwen3_ragged"),
                                                            (Q.Q8_0, "q8_0", 128, "qwen3_ragged"),
                                                            (Q.Q4_K, "q4_k", 128, "qwen3_256"),
                                                            (Q.Q8_0, "int8", 128, "qwen3_ragged")],
                         ids=["q4_0-kept", "q8_0-kept", "q4_k-kept", "q8_0-dequantized"])
def test_a_gguf_restart_copies_the_packed_cache(tmp_path, request, monkeypatch, kind, cpu_dtype, group, model):
    """A GGUF file's packed experts are cached like a folder's (keyed by its parts' names, sizes and mtimes): the
    second load converts nothing and holds the first's bytes; a file changed in place is another key."""
    from test_packed_cache import folders, load, no_conversion, outputs, same_bytes

    from hybrid.offload import packed_cache as pc

    monkeypatch.setenv("HYBRID_CACHE", str(tmp_path / "hycache"))
    cpu_kernels.knobs.reset()
    cache = tmp_path / "hycache" / "packed"
    path = tmp_path / "m.gguf"
    write_typed(path, "qwen3_moe", request.getfixturevalue(model), lambda n: kind)
    first = load(path, cpu_dtype, cpu_group=group)
    (key,) = folders(cache)
    assert first.load_times.convert_s > 0 and pc.read_manifest(cache / key)["dtype"] == cpu_dtype
    from hybrid.models.gguf import load as gguf_load, repack

    def biases_only(ckpt, stack, tensors):  # the layers the cache holds: their expert weights are not even read
        assert not any(e.which in repack.WEIGHTS for e in tensors), "read the experts of a layer the cache holds"
        return real(ckpt, stack, tensors)

    real = gguf_load.fill_experts
    with monkeypatch.context() as m:
        no_conversion(m)
        m.setattr(gguf_load, "fill_experts", biases_only)
        m.setattr(repack, "sources", None)  # (the file's blocks are not taken either)
        second = load(path, cpu_dtype, cpu_group=group)
    assert second.load_times.convert_s == 0 and second.load_times.cache_bytes > 0
    assert all(same_bytes(a, b) for a, b in zip(first.layers, second.layers))
    for a, b in zip(outputs(first), outputs(second)):
        assert torch.equal(a, b)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # rewritten: converted again
    again = load(path, cpu_dtype, cpu_group=group)
    assert again.load_times.convert_s > 0 and folders(cache) != [key]  # (the stale copy of the same file goes)
    cpu_kernels.knobs.reset()


def test_a_dequantized_gguf_layer_is_read_a_chunk_of_experts_at_a_time(tmp_path, tmp_path_factory, monkeypatch):
    """A layer whose blocks the CPU format does not hold (Q4_0 into bf16, beside which no down has a format of its own) is
    de-quantized a chunk of experts at a time as it is packed (never the whole layer in floats), into the bytes
    that packing the whole de-quantized layer gives."""
    from hybrid.models.gguf import load as gguf_load, open_gguf
    from hybrid.models.gguf.names import expert_tensors

    hf = hf_model("qwen3_moe", tmp_path_factory, moe_intermediate_size=96, num_experts=12)[0]
    path = tmp_path / "m.gguf"
    write_typed(path, "qwen3_moe", hf, lambda n: Q.Q4_0)
    real, reads = gguf_load.dequantize, []

    def spy(raw, t, shape):
        if len(shape) == 3:  # an expert stack's experts
            reads.append(shape[0])
        return real(raw, t, shape)

    monkeypatch.setattr(gguf_load, "dequantize", spy)
    _, off = hybrid_logits(path, cpu_dtype="bf16")
    E = hf.config.num_experts
    assert reads and max(reads) <= CpuMoE._PACK_CHUNK < E and sum(reads) % E == 0
    monkeypatch.undo()
    ckpt = open_gguf(path)
    cfg = ckpt.config
    for layer in off.layers:
        stack = [torch.empty(E, cfg.expert_intermediate_size, cfg.hidden_size),
                 torch.empty(E, cfg.expert_intermediate_size, cfg.hidden_size),
                 torch.empty(E, cfg.hidden_size, cfg.expert_intermediate_size)]
        gguf_load.fill_experts(ckpt, stack, expert_tensors(cfg, layer.layer, ckpt.tensors.__contains__))
        whole = CpuMoE(*stack, dtype="bf16", isa=layer.cpu_moe.isa, topology=layer.cpu_moe.topology)
        a, b = layer.cpu_moe.packed_state(), whole.packed_state()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind, dtype, at", [(Q.Q4_0, "q4_0", 0), (Q.Q8_0, "q8_0", 0), (Q.Q4_K, "q4_k", 0),
                                             (Q.Q4_K, "q4_k", 2), (Q.Q5_K, "q5_k", 2), (Q.Q6_K, "q6_k", 208),
                                             (Q.Q2_K, "q2_k", 82), (Q.Q3_K, "q3_k", 108), (Q.IQ4_XS, "iq4_xs", 0),
                                             (Q.IQ2_XXS, "iq2_xxs", 0), (Q.IQ3_XXS, "iq3_xxs", 0), (Q.IQ1_S, "iq1_s", 0),
                                             (Q.IQ3_S, "iq3_s", 0), (Q.IQ1_M, "iq1_m", None), (Q.MXFP4, "mxfp4", 0)],
                         ids=["q4_0-d", "q8_0-d", "q4_k-d", "q4_k-dmin", "q5_k-dmin", "q6_k-d", "q2_k-dmin", "q3_k-d",
                              "iq4_xs-d", "iq2_xxs-d", "iq3_xxs-d", "iq1_s-d", "iq3_s-d", "iq1_m-d",
                              "mxfp4-exponent"])
def test_blocks_kept_as_they_are_refuse_a_non_finite_scale(tmp_path, qwen3_256, kind, dtype, at):
    """A file whose expert blocks would be repacked as they are, with one block's scale made NaN (Q4_K: its d or its
    dmin, Q5_K likewise; Q6_K: its d, the block's last two bytes; Q2_K: its dmin, the last two; Q3_K: its d, the last two; IQ4_XS: its d, the first two; IQ1_M: its d, the top nibbles of its
    scales words; MXFP4: exponent 255) is refused with one line naming the tensor, as a de-quantizing load refuses it."""
    from gguf import GGML_QUANT_SIZES, GGUFReader

    path = tmp_path / "m.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, lambda n: kind)
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_up_exps.weight")
    with open(path, "r+b") as f:
        if at is None:  # IQ1_M: d's nibbles on top of the 4 scales words, word w's bits 4 w .. 4 w + 3
            f.seek(int(t.data_offset) + 5 * GGML_QUANT_SIZES[kind][1] + 48)
            sc = bytearray(f.read(8))
            for w in range(4):
                sc[2 * w + 1] = (sc[2 * w + 1] & 0x0F) | ((0x7E00 >> (4 * w)) & 0xF) << 4
            f.seek(int(t.data_offset) + 5 * GGML_QUANT_SIZES[kind][1] + 48)
            f.write(bytes(sc))
        else:
            f.seek(int(t.data_offset) + 5 * GGML_QUANT_SIZES[kind][1] + at)  # block 5
            f.write(bytes([0xFF]) if kind == Q.MXFP4 else bytes([0x00, 0x7E]))  # fp16 0x7E00: NaN
    with pytest.raises(ModelLoadError, match=r"'blk.1.ffn_up_exps.weight' in m.gguf: 1 block\(s\) with a NaN/Inf") as exc:
        hybrid_logits(path, cpu_dtype=dtype, cpu_group=32, cpu_isa="ref")
    assert "\n" not in str(exc.value)


def test_a_mixed_files_restart_copies_each_layers_own_format(tmp_path, qwen3_256, monkeypatch):
    """A file of mixed layers in its own formats restarts from the packed cache: each layer comes back in its own
    format (the Q2_K layer as q2_k among q4_k ones), nothing converted, the same bytes and outputs; the same file in
    one format is another cache."""
    from test_packed_cache import folders, load, no_conversion, outputs, same_bytes

    monkeypatch.setenv("HYBRID_CACHE", str(tmp_path / "hycache"))
    cpu_kernels.knobs.reset()
    path = tmp_path / "mixed_layers.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, mixed_layers)
    first = load(path, "q4_k", layer_formats=True)
    with monkeypatch.context() as m:
        no_conversion(m)
        second = load(path, "q4_k", layer_formats=True)
    assert second.load_times.convert_s == 0 and second.load_times.cache_bytes > 0
    assert [layer.cpu_moe.dtype for layer in second.layers] == ["q4_k", "q2_k", "q4_k"]
    assert [layer.cpu_moe.down_dtype for layer in second.layers] == ["q4_k", "q2_k", "q6_k"]
    assert all(same_bytes(a, b) for a, b in zip(first.layers, second.layers))
    for a, b in zip(outputs(first), outputs(second)):
        assert torch.equal(a, b)
    one = load(path, "q4_k")
    assert [layer.cpu_moe.dtype for layer in one.layers] == ["q4_k"] * 3
    assert len(folders(tmp_path / "hycache" / "packed")) == 2


@pytest.mark.parametrize("down", [Q.IQ2_S, Q.F32], ids=["iq2_s", "f32"])
def test_a_down_no_format_holds_beside_file_only_gates_takes_a_format_with_a_quantizer(tmp_path, qwen3_256, caplog,
                                                                                      down):
    """IQ3_XXS gates and ups (iq3_xxs: the file's blocks only, no quantizer) with one layer's down of a type no format
    holds (IQ2_S) or in floats: that down is re-quantized into its type's nearest format (q2_k; q8_0 for floats)
    instead of the layer's, which would refuse it; every other weight stays the file's blocks: the executor holds the
    file's values, and that down's quantization of them."""
    path = tmp_path / "iq3.gguf"
    write_typed(path, "qwen3_moe", qwen3_256, lambda n: (down if down != Q.F32 else None)
                if n == "blk.1.ffn_down_exps.weight" else Q.IQ3_XXS)
    got, off = hybrid_logits(path, caplog, cpu_dtype="iq3_xxs", cpu_isa=COMPILED[0] if COMPILED else "ref")
    want = "q2_k" if down == Q.IQ2_S else "q8_0"
    assert [(m.cpu_moe.dtype, m.cpu_moe.down_dtype) for m in off.layers] == [("iq3_xxs", "iq3_xxs"), ("iq3_xxs", want),
                                                                              ("iq3_xxs", "iq3_xxs")]
    kind = down.name
    assert (f"(iq3_xxs): layers 0, 2 repacked losslessly (the file's blocks as they are); layers 1: w_gate, w_up "
            f"repacked losslessly, w_down {kind} de-quantized and re-quantized (no CPU format holds {kind} as stored; "
            f"w_down in {want})") in caplog.text
    assert torch.isfinite(got).all()
    want_values = file_values(path, 1)
    moe = off.layers[1].cpu_moe
    quantize, dequantize = getattr(quant, f"quantize_{want}"), quant.packed_dequantizers()[want]
    assert torch.equal(held(moe, "down"), dequantize(*quantize(want_values["down"])))
    for name in ("gate", "up"):  # the file's blocks, as they are
        assert torch.equal(held(moe, name), want_values[name]), name
