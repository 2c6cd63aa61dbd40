"""Per-expert biases (gpt-oss: b_gate, b_up [E, F], b_down [E, D], fp32) in the CPU executor, against the
reference, for every ISA here (and the emulated AMX path) x bf16/int8/int4 x {no bias, biases} x
{silu, swiglu_oai}, on the fused (decode) and phased paths, with one and two NUMA nodes (two node slices
of F: each holds its rows of b_gate/b_up, b_down is added once). Ragged routing (experts with 0, 1, 7,
300 tokens), outputs NaN-prefilled. Then the clamped SwiGLU + biases against transformers' GptOssExperts.

The biases are drawn large (gate/up order 2 against GEMM results of order 3, down order 8 as the expert
outputs), so that dropping any one of them, or
adding b_down once per node, moves the output far beyond the tolerances (asserted on the reference below).
"""

import os

import pytest
import torch

from cpu_kernels import CpuMoE, _native
from cpu_kernels.reference import moe_forward
from cpu_kernels.topology import Topology
from test_cpu_moe import COMPILED, D, E, EMU, F, TOL, dequantized, ragged_routing, rel_err, weights

GROUP = 64  # int4 group: K padding 64, so F = 97 splits into two node slices (64 + 33)
CASES = [pytest.param(i, 16, id=i) for i in COMPILED if i != "amx"]
if "amx" in COMPILED:
    CASES += [pytest.param("amx", k, id=f"amx-knee{k}", marks=pytest.mark.amx) for k in (1, 10**9)]
# The AMX driver path with emulated tiles: every expert on AMX (knee 1), or mixed with the vector path (16).
CASES += [pytest.param("amx_emu", k, id=f"amx_emu-knee{k}") for k in (1, 16) if EMU]


def biases(seed=20, e=E, f=F, d=D):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(e, f, generator=g), 2 * torch.randn(e, f, generator=g), 8 * torch.randn(e, d, generator=g)


@pytest.fixture
def fused_knob():
    saved = []
    yield saved
    for isa, value in reversed(saved):
        _native.tune(isa, "fused", value)


@pytest.mark.parametrize("isa,knee", CASES)
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("T", [1, 320])
def test_biases_match_reference(isa, knee, dtype, with_bias, activation, nodes, T, fused_knob):
    ws = [w * 3 for w in weights(seed=21)]  # pre-activations of order 3: the SwiGLU clamp (7) is reached
    bg, bu, bd = biases() if with_bias else (None, None, None)
    cpus = sorted(os.sched_getaffinity(0))
    topo = Topology(((cpus[0],), (cpus[-1],))) if nodes == 2 else Topology(((cpus[0],),))
    moe = CpuMoE(*ws, dtype=dtype, group_size=GROUP, isa=isa, amx_min_tokens=knee, topology=topo,
                 activation=activation, b_gate=bg, b_up=bu, b_down=bd)
    slices = moe.packed_weights()
    assert len(slices) == nodes
    for n, s in enumerate(slices):  # what the executor holds: each slice's rows of b_gate/b_up, b_down on node 0
        for name, b in (("gate", bg), ("up", bu)):
            if b is None:
                assert s[name]["bias"] is None
            else:
                assert torch.equal(s[name]["bias"][:, :s["f1"] - s["f0"]], b[:, s["f0"]:s["f1"]])
                assert not s[name]["bias"][:, s["f1"] - s["f0"]:].any()
        if bd is None or n > 0:
            assert s["down"]["bias"] is None
        else:
            assert torch.equal(s["down"]["bias"][:, :D], bd)
    ids, w = ragged_routing(T, seed=22)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(23)).bfloat16()
    ref_w = dequantized(ws, dtype, GROUP)
    ref = moe_forward(x, *ref_w, ids, w, activation=activation, b_gate=bg, b_up=bu, b_down=bd)
    if with_bias:  # each bias matters (so a kernel that drops one, or adds b_down per node, fails below)
        wrong = [dict(b_up=bu, b_down=bd), dict(b_gate=bg, b_down=bd), dict(b_gate=bg, b_up=bu),
                 dict(b_gate=bg, b_up=bu, b_down=2 * bd)]
        for kw in wrong:
            assert rel_err(moe_forward(x, *ref_w, ids, w, activation=activation, **kw), ref) > 3 * TOL[dtype]
    outs = []
    for fused in (1, 0):
        fused_knob.append((isa, _native.tune(isa, "fused", fused)))
        out = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
        y = moe.forward(x, ids, w, out=out)
        assert y.data_ptr() == out.data_ptr()
        assert torch.isfinite(out).all(), fused
        assert rel_err(out, ref) < TOL[dtype], (fused, rel_err(out, ref))
        outs.append(out.float())
    assert rel_err(outs[0], outs[1]) < 1e-2  # two summation orders of the same kernels


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_ref_isa_biases(activation):
    ws = [w * 3 for w in weights(seed=24)]
    bg, bu, bd = biases(seed=25)
    ids, w = ragged_routing(320, seed=26)
    x = torch.randn(320, D, generator=torch.Generator().manual_seed(27))
    moe = CpuMoE(*ws, isa="ref", activation=activation, b_gate=bg, b_up=bu, b_down=bd)
    ref = moe_forward(x, *dequantized(ws, "bf16"), ids, w, activation=activation, b_gate=bg, b_up=bu, b_down=bd)
    assert rel_err(moe.forward(x, ids, w), ref) < 1e-6
    plain = moe.packed_weights()[0]
    assert plain["gate"]["bias"] is not None and plain["down"]["bias"] is not None


def test_bias_validation():
    ws = weights()
    bg, bu, bd = biases()
    with pytest.raises(ValueError, match="b_gate"):
        CpuMoE(*ws, isa="ref", b_gate=bg[:, :-1].contiguous())
    with pytest.raises(ValueError, match="b_down"):
        CpuMoE(*ws, isa="ref", b_down=bu)
    with pytest.raises(ValueError, match="b_up"):
        moe_forward(torch.zeros(1, D), *ws, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), b_up=bd)


def _gpt_oss_experts(E_, D_, F_, seed):
    """transformers' GptOssExperts with random weights and biases, and its weights in CpuMoE's layout."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=D_, intermediate_size=F_, num_local_experts=E_, num_experts_per_tok=4,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       vocab_size=32)
    cfg._experts_implementation = "eager"
    experts = GptOssExperts(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E_, D_, 2 * F_, generator=g) * 3 / D_**0.5)
        experts.gate_up_proj_bias.copy_(torch.randn(E_, 2 * F_, generator=g))
        experts.down_proj.copy_(torch.randn(E_, F_, D_, generator=g) / F_**0.5)
        experts.down_proj_bias.copy_(torch.randn(E_, D_, generator=g))
    gu, gub = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    ours = dict(w_gate=gu[..., ::2].transpose(1, 2).contiguous(), w_up=gu[..., 1::2].transpose(1, 2).contiguous(),
                w_down=experts.down_proj.detach().transpose(1, 2).contiguous(),
                b_gate=gub[:, ::2].contiguous(), b_up=gub[:, 1::2].contiguous(),
                b_down=experts.down_proj_bias.detach().contiguous())
    return experts, cfg, ours


@pytest.mark.parametrize("isa", ["ref"] + COMPILED[:1])
@pytest.mark.parametrize("T", [1, 40])
def test_matches_transformers_gpt_oss_experts(isa, T):
    E_, D_, F_, K_ = 8, 96, 80, 4
    experts, cfg, ours = _gpt_oss_experts(E_, D_, F_, seed=30 + T)
    g = torch.Generator().manual_seed(31)
    x = torch.randn(T, D_, generator=g)
    logits = torch.randn(T, E_, generator=g)
    top, ids = torch.topk(logits, K_, dim=-1)
    w = torch.softmax(top, dim=-1)
    with torch.no_grad():
        want = experts(x, router_indices=ids, routing_weights=w)
    bias = {k: ours[k] for k in ("b_gate", "b_up", "b_down")}
    mats = (ours["w_gate"], ours["w_up"], ours["w_down"])
    kw = dict(activation="swiglu_oai", alpha=experts.alpha, limit=experts.limit)  # 5.17 has no config.swiglu_alpha
    # the fp32 reference is transformers' expert layer
    ref = moe_forward(x, *mats, ids, w, **kw, **bias)
    assert rel_err(ref, want) < 1e-5
    for drop in bias:  # without any one bias it is not
        assert rel_err(moe_forward(x, *mats, ids, w, **kw, **{k: v for k, v in bias.items() if k != drop}), want) > 0.05
    # the executor (bf16 weights): the ref ISA and a compiled one
    moe = CpuMoE(*mats, dtype="bf16", isa=isa, **kw, **bias)
    out = torch.full((T, D_), float("nan"))
    moe.forward(x, ids, w, out=out)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < TOL["bf16"], rel_err(out, want)
