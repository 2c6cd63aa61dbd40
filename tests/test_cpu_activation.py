"""The compiled expert kernels' gated activation (csrc/hy.h gated_act_row, with fast_exp and fast_erf in place of
libm so the loops vectorize) against torch in float64, in fp32 and over the whole input range: the layer tests
see it only through bf16/int8/int4 rounding, which would hide an exp or erf a hundred times less accurate."""

import pytest
import torch

from cpu_kernels import _native
from cpu_kernels.reference import ACTIVATIONS, gated_activation
from test_cpu_moe import COMPILED, EMU


def inputs():
    g = torch.cat([torch.linspace(-30, 30, 4097),
                   torch.tensor([-200.0, -88.0, -87.0, -1e-30, 0.0, 1e-30, 7.0, 87.0, 88.0, 200.0]),
                   torch.randn(2000, generator=torch.Generator().manual_seed(1)) * 6])
    u = torch.randn(g.numel(), generator=torch.Generator().manual_seed(2)) * 3
    return g.contiguous(), u.contiguous()


@pytest.mark.parametrize("isa", [i for i in COMPILED if i != "amx"] + EMU)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_activation_is_fp32_accurate(isa, activation):
    g, u = inputs()
    out = torch.full_like(g, float("nan"))
    _native.load(isa).hy_gated_act(ACTIVATIONS.index(activation), g.data_ptr(), u.data_ptr(), out.data_ptr(),
                                   g.numel(), 1.702, 7.0)
    ref = gated_activation(g.double(), u.double(), activation)
    assert torch.isfinite(out).all()
    # fast_exp: < 1.3e-7 relative; fast_erf: <= 1.5e-7 absolute (GELU: times |g u| / 2); fp32 rounding on top
    g_eff = g.double().clamp(max=7.0) if activation == "swiglu_oai" else g.double()
    u_eff = u.double().clamp(-7.0, 7.0) + 1 if activation == "swiglu_oai" else u.double()
    allowed = 1e-6 * ref.abs() + 2.5e-7 * (g_eff * u_eff).abs() + 1e-30
    err = (out.double() - ref).abs()
    worst = int(torch.argmax(err / allowed))
    assert bool((err <= allowed).all()), (activation, float(g[worst]), float(u[worst]), float(out[worst]), float(ref[worst]))
