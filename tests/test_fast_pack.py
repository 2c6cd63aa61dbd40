"""The compiled packer (csrc/pack.h hy_pack_mat, CpuMoE packer="native") against the PyTorch reference packing
(cpu_kernels/quant.py, packer="torch"): every packed byte, scale and row sum identical, over ragged shapes (rows
and K padding), every int4 group and both int4 orders, every compiled ISA's layout, fp32 / bf16 / fp16 sources,
block-FP8 (cpu_kernels.moe.ExpertRows: fp32 or bf16 block scales, partial blocks, F slices of NUMA nodes), strided
views; a NaN or Inf is refused naming the expert. Then the loader's expert views (hybrid.models.loader
expert_views, hybrid.offload.build.load_hybrid): the bytes of a hybrid load equal the reference packing of the
same checkpoint's stacks, for per-expert, fused and gpt-oss interleaved layouts and for block-FP8, with no
layer staged; a NaN in a checkpoint's expert is refused naming its tensor."""

from __future__ import annotations

import pytest
import torch

import cpu_kernels
from cpu_kernels import Topology
from cpu_kernels.moe import CpuMoE, ExpertRows, NonFiniteWeights
from hybrid.models import fp8
from hybrid.models.errors import ModelLoadError
from hybrid.models.presets import hf_config
from hybrid.models.writer import write_random_checkpoint

COMPILED = [i for i in cpu_kernels.available_isas() if i != "ref"]
if cpu_kernels._native.why_unavailable("amx_emu") is None:
    COMPILED.append("amx_emu")
TWO_NODES = Topology(((0,), (1,)))


def assert_same_bytes(a: CpuMoE, b: CpuMoE) -> None:
    sa, sb = a.packed_state(), b.packed_state()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k}: {int((sa[k] != sb[k]).sum())} bytes differ"
    assert a.nbytes == b.nbytes


def both(g, u, d, **kw) -> tuple[CpuMoE, CpuMoE]:
    return CpuMoE(g, u, d, packer="native", **kw), CpuMoE(g, u, d, packer="torch", **kw)


def weights(E, F, D, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in ((E, F, D), (E, F, D), (E, D, F))]


LAYOUTS = [("bf16", 128, None), ("int8", 128, None), ("q8_0", 32, None), ("q4_0", 32, None), ("iq4_xs", 32, None)] + [
    ("int4", g, o) for g in (32, 64, 128) for o in (None, "natural", "interleaved")]


@pytest.mark.parametrize("isa", COMPILED)
@pytest.mark.parametrize("dtype,group,order", LAYOUTS)
def test_native_packing_equals_the_reference(isa, dtype, group, order):
    for E, F, D, wdt in ((3, 100, 70, torch.float32), (2, 256, 384, torch.bfloat16), (4, 96, 130, torch.float16)):
        a, b = both(*weights(E, F, D, wdt, seed=E + F), dtype=dtype, group_size=group, isa=isa, int4_order=order)
        assert_same_bytes(a, b)


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4", "q8_0", "q4_0", "iq4_xs"])
def test_special_values_round_like_torch(dtype):
    """Exact ties, values that round past the clamp, zero rows, subnormal and the largest fp16, tiny and huge
    scales (q8_0, q4_0: fp16 block scales that are subnormal, or saturate at 65504): every rounding step is torch's."""
    E, F, D = 2, 64, 128
    g, u, d = weights(E, F, D, torch.float32, seed=3)
    g[0, 0] = torch.arange(D) * 0.5 - 32  # ties at every half
    g[0, 1] = 0.0
    g[1, 2] = torch.linspace(-1e-30, 1e-30, D)
    g[1, 3] = torch.linspace(-1, 1, D) * 3e38
    g[1, 4] = torch.linspace(-1, 1, D) * torch.logspace(-9, -2, D)  # blocks whose max / 127 is an fp16 subnormal
    u[0, :, :8] = torch.tensor([127.5, -127.5, 7.5, -8.5, 1e-45, -1e-45, 6.5, -6.5])
    # q4_0: a block whose largest magnitude is -8 steps and every other value a tie (+7.5 past the clamp), and one
    # whose largest is positive (a negative scale)
    g[0, 5, :17] = torch.cat([torch.tensor([-8.0]), torch.arange(-7.5, 8.0, 1.0)])
    g[0, 5, 32:64] = torch.arange(32) * 0.5
    h = torch.tensor([6.1e-5, 5.96e-8, 65504.0, -65504.0, -6e-8, 1.0, -0.0, 3.0]).half()
    assert_same_bytes(*both(g, u, d, dtype=dtype, group_size=32))
    gh = g.clamp(-65504, 65504).half()
    gh[0, 4, :8] = h
    assert_same_bytes(*both(gh, u.half(), d.half(), dtype=dtype, group_size=32))


def fp8_rows(E, R, C, block, seed, bf16_scales=False):
    """ExpertRows of E block-FP8 matrices [R, C] and the same experts de-quantized by hybrid.models.fp8."""
    gen = torch.Generator().manual_seed(seed)
    qs, ss, dense = [], [], []
    for e in range(E):
        q, s = fp8.quantize(torch.randn(R, C, generator=gen) * (0.05 + e), block)
        s = s.bfloat16() if bf16_scales else s
        qs.append(q)
        ss.append(s)
        dense.append(fp8.dequantize(q, s, block))
    return ExpertRows(qs, ss, block), torch.stack(dense)


@pytest.mark.parametrize("isa", COMPILED)
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4", "q8_0", "q4_0", "iq4_xs"])
@pytest.mark.parametrize("block,bf16_scales", [((128, 128), False), ((16, 24), True), ((32, 16), False)])
def test_fp8_experts_pack_like_their_dequantized_stack(isa, dtype, block, bf16_scales):
    """FP8 de-quantized row by row (partial blocks at the edges, F sliced across two nodes so windows start
    mid-block) gives the bytes of the reference packing of hybrid.models.fp8.dequantize's fp32 stack."""
    E, F, D = 3, 200, 136
    rows = [fp8_rows(E, *s, block, seed=i, bf16_scales=bf16_scales) for i, s in enumerate(((F, D), (F, D), (D, F)))]
    for topo in (None, TWO_NODES):
        kw = dict(dtype=dtype, group_size=64, isa=isa, topology=topo)
        native = CpuMoE(*(r for r, _ in rows), **kw)
        assert_same_bytes(native, CpuMoE(*(t for _, t in rows), packer="torch", **kw))
        assert_same_bytes(native, CpuMoE(*(r for r, _ in rows), packer="torch", **kw))


def test_strided_and_mixed_expert_rows():
    """Transposed views (a fused checkpoint's column-interleaved gate), and a layer whose experts are stored
    differently (strides; bf16, fp32, FP8) pack like their dense stack."""
    E, F, D = 4, 96, 64
    gen = torch.Generator().manual_seed(7)
    gate = [torch.randn(D, 2 * F, generator=gen).bfloat16()[:, 0::2].t() for _ in range(E - 2)]
    gate += [torch.randn(F, D, generator=gen).bfloat16() for _ in range(2)]  # same dtype, other strides
    up = [torch.randn(F, D, generator=gen).to(dt) for dt in (torch.bfloat16, torch.float32, torch.bfloat16, torch.float16)]
    q, s = fp8.quantize(torch.randn(D, F, generator=gen), (32, 32))
    down_mats = [torch.randn(D, F, generator=gen).bfloat16() for _ in range(E - 1)] + [q]
    down = ExpertRows(down_mats, [None] * (E - 1) + [s], (32, 32))
    ref = [torch.stack([t.float() for t in gate]), torch.stack([t.float() for t in up]), down.dense()]
    assert ref[2].dtype == torch.float32 and torch.equal(ref[2][3], fp8.dequantize(q, s, (32, 32)))
    for dtype in ("bf16", "int8", "int4"):
        native = CpuMoE(ExpertRows(gate), ExpertRows(up), down, dtype=dtype, group_size=32, topology=TWO_NODES)
        assert_same_bytes(native, CpuMoE(*ref, dtype=dtype, group_size=32, topology=TWO_NODES, packer="torch"))


def test_expert_rows_slice_and_check():
    rows, dense = fp8_rows(5, 40, 70, (16, 16), seed=1)
    part = rows[1:4, 3:35, 17:]
    assert part.shape == (3, 32, 53)
    assert torch.equal(part.dense(), dense[1:4, 3:35, 17:])
    with pytest.raises(ValueError, match=r"scales are \(3, 4\)"):
        ExpertRows([torch.zeros(40, 70, dtype=torch.float8_e4m3fn)], [torch.ones(3, 4)], (16, 16))
    with pytest.raises(ValueError, match=r"ExpertRows\[1\] is \(4, 4\)"):
        ExpertRows([torch.zeros(4, 5), torch.zeros(4, 4)])
    with pytest.raises(TypeError):
        rows[::2]


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4", "q8_0", "q4_0", "iq4_xs"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_expert(dtype, bad):
    E, F, D = 4, 64, 64
    g, u, d = weights(E, F, D, torch.bfloat16, seed=2)
    bad_d = d.clone()
    bad_d[2, 63, 5] = bad
    with pytest.raises(NonFiniteWeights, match="down weights of expert 2") as info:
        CpuMoE(g, u, bad_d, dtype=dtype, topology=TWO_NODES)
    assert (info.value.matrix, info.value.expert) == ("down", 2)
    q, s = fp8.quantize(torch.randn(F, D), (32, 32))
    s[1, 0] = 3e38  # finite scale, 448 * 3e38 overflows fp32: Inf only after de-quantization
    rows = ExpertRows([q] * E, [torch.ones_like(s)] * (E - 1) + [s], (32, 32))
    with pytest.raises(NonFiniteWeights, match="up weights of expert 3"):
        CpuMoE(g, rows, d, dtype=dtype)


def test_ref_isa_takes_expert_rows():
    rows, dense = fp8_rows(2, 64, 64, (32, 32), seed=4)
    a = CpuMoE(rows, rows, rows, dtype="int8", isa="ref")
    b = CpuMoE(dense, dense, dense, dtype="int8", isa="ref")
    for x, y in zip(a.packed_weights()[0].values(), b.packed_weights()[0].values()):
        if isinstance(x, dict):
            assert torch.equal(x["q"], y["q"])


# ---- the loader's expert views, end to end -----------------------------------------------------------------------
SMALL = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             eos_token_id=None, pad_token_id=None)


def qwen_raw():
    return dict(hf_config("demo", layers=2), **SMALL, moe_intermediate_size=96, intermediate_size=128, num_experts=4,
                num_experts_per_tok=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fastpack")
    from tiny_models import deepseek_raw

    out = {"qwen": write_random_checkpoint(root / "qwen", qwen_raw(), seed=1, std=0.1),
           "fp8": write_random_checkpoint(root / "fp8", deepseek_raw(), seed=5, dtype=torch.float32, std=0.1,
                                          fp8_block=(16, 16))}
    gpt = dict(hf_config("gpt-oss-120b", layers=2), **SMALL, intermediate_size=64, num_local_experts=4,
               num_experts_per_tok=2, experts_per_token=2, sliding_window=8)
    out["gpt_oss"] = write_random_checkpoint(root / "gpt_oss", gpt, seed=2, std=0.1)  # bf16, [E, D, 2F] fused
    out["fused"] = fuse_experts(out["qwen"], root / "fused")
    return out


def fuse_experts(src, dst):
    """The Qwen3 checkpoint with each layer's experts as transformers 5 stacks them: gate_up [E, 2F, D], down
    [E, D, F] (one file)."""
    import json
    import re
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    out, per = {}, {}
    for k, v in tensors.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", k)
        if m:
            per.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = v
        else:
            out[k] = v
    for prefix, kinds in per.items():
        stack = {n: torch.stack([kinds[n][e] for e in sorted(kinds[n])]) for n in kinds}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], 1).contiguous()
        out[f"{prefix}.down_proj"] = stack["down"].contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    json.loads((dst / "config.json").read_text())
    return dst


def reference_executors(path, moes):
    """Each layer's CpuMoE packed by the PyTorch reference from the loader's fp32 stacks (the path before views)."""
    from hybrid.models import load_model

    out = {}

    def capture(i, g, u, d, biases=None):
        m = moes[i]
        b = {} if biases is None else dict(zip(("b_gate", "b_up", "b_down"), biases))
        out[i] = CpuMoE(g, u, d, dtype=m.dtype, group_size=m.group_size, topology=m.topology, isa=m.isa,
                        activation=m.activation, alpha=m.alpha, limit=m.limit, int4_order=m.int4_order,
                        packer="torch", **b)
        return torch.nn.Identity()

    load_model(path, device="cpu", dtype=torch.float32, expert_device="cpu", expert_dtype=torch.float32,
               experts_factory=capture, progress=False)
    return out


@pytest.mark.parametrize("name", ["qwen", "fp8", "gpt_oss", "fused"])
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4", "q8_0", "q4_0", "iq4_xs"])
def test_hybrid_load_packs_views_like_the_reference(checkpoints, name, dtype):
    from hybrid.offload.build import load_hybrid, packs_views
    from hybrid.offload.config import HybridConfig

    path = checkpoints[name]
    assert packs_views(path, dtype, None)
    _, offload = load_hybrid(path, "cpu", torch.float32, HybridConfig(cpu_dtype=dtype, cpu_group=64,
                                                                      packed_cache=False), progress=False)
    moes = {layer.layer: layer.cpu_moe for layer in offload.layers}
    ref = reference_executors(path, moes)
    assert sorted(ref) == sorted(moes) and moes
    for i in moes:
        assert_same_bytes(moes[i], ref[i])


def test_views_stage_no_layer(checkpoints, monkeypatch):
    """With views, the factory gets ExpertRows over the checkpoint's own tensors: nothing is allocated for a stack."""
    from hybrid.models import load_model

    seen = []

    def capture(i, g, u, d, biases=None):
        seen.append((type(g), g.shape, {t.dtype for t in g.mats}, {None if s is None else s.dtype for s in g.scales}))
        return torch.nn.Identity()

    load_model(checkpoints["fp8"], device="cpu", dtype=torch.float32, experts_factory=capture, progress=False,
               expert_views=True)
    assert seen and all(t is ExpertRows and dts == {torch.float8_e4m3fn} and sc == {torch.float32}
                        for t, _, dts, sc in seen)


def test_nan_in_a_viewed_expert_is_refused_naming_the_tensor(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig
    from loader_cases import clone

    p = clone(checkpoints["fused"], tmp_path / "m")
    f = p / "model.safetensors"
    t = load_file(str(f))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    t[name][2, 100, 7] = float("nan")  # expert 2, an up row (F = 96)
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"NaN/Inf") as info:
        load_hybrid(p, "cpu", torch.float32, HybridConfig(cpu_dtype="int8", packed_cache=False), progress=False)
    assert name in str(info.value) and "1 NaN/Inf value(s)" in str(info.value) and "\n" not in str(info.value)


def test_nan_code_in_a_viewed_fp8_expert_is_refused_naming_the_tensor(checkpoints, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig
    from loader_cases import clone

    p = clone(checkpoints["fp8"], tmp_path / "m")
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    shard = p / json.loads((p / "model.safetensors.index.json").read_text())["weight_map"][name]
    t = load_file(str(shard))
    t[name].view(torch.uint8)[3, 4] = 0xFF  # e4m3fn NaN
    save_file(t, str(shard), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"1 NaN value\(s\)") as info:
        load_hybrid(p, "cpu", torch.float32, HybridConfig(cpu_dtype="int4", packed_cache=False), progress=False)
    assert name in str(info.value)
