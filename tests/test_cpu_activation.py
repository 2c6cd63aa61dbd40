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


def act_rows():
    """Ragged rows (n below, at and past the vector widths, a padded tail) with the largest magnitude in the
    vector part, in the scalar tail, first and last, negative, tied, all zero; and values that land on x.5."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for n in (1, 7, 8, 15, 16, 17, 31, 33, 64, 100, 127, 128, 129, 191, 192, 255, 256):
        for where in (0, n // 2, n - 1):
            v = torch.randn(n, generator=g)
            v[where] = -9.0 if where % 2 else 9.0
            rows.append((v, 256))
    rows.append((torch.zeros(64), 128))
    rows.append((torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5] + [0.0] * 57), 128))  # inv = 1: half to even
    rows.append((torch.full((128,), -3.0), 128))
    return rows


@pytest.mark.parametrize("isa", [i for i in COMPILED if i != "amx"] + EMU)
@pytest.mark.parametrize("dtype,group,fold", [("int8", 64, None), ("int8", 32, None), ("int4", 64, 1), ("int4", 64, 2),
                                              ("int4", 32, 2), ("int4", 32, "max")])
def test_activation_rows_match_the_reference_bytes(isa, dtype, group, fold):
    """quantize_row (the int8 activations of every quantized kernel, int4's in its stored order) byte for byte
    against reference.activation_row; the scale and group sums the kernels read back included."""
    from cpu_kernels import quant
    from cpu_kernels.moe import DTYPES
    from cpu_kernels.reference import activation_row

    lib = _native.load(isa)
    for v, ldk in act_rows():
        f = quant.int4_fold_groups(ldk, group) if fold == "max" else fold
        nbytes = ldk + 4 + 4 * (ldk // group)
        row = torch.full((nbytes + 64,), 0x5A, dtype=torch.uint8)
        rc = lib.hy_quantize_act(v.contiguous().data_ptr(), v.numel(), DTYPES[dtype], ldk, group, f or 0, row.data_ptr())
        assert rc == 0
        want = activation_row(v, ldk, group, f if dtype == "int4" else None)
        assert row[:nbytes].numpy().tobytes() == want, (dtype, group, f, v.numel(), ldk, float(v.abs().max()))


def test_activation_row_rejects_bad_layouts():
    isa = COMPILED[0] if COMPILED else pytest.skip("no compiled ISA on this machine")
    lib, v, row = _native.load(isa), torch.ones(64), torch.zeros(512, dtype=torch.uint8)
    for args in ((65, 1, 64, 64, 0), (64, 0, 64, 64, 0), (64, 1, 64, 48, 0), (64, 2, 64, 64, 3), (64, 2, 96, 32, 1)):
        n, dt, ldk, group, fold = args
        assert lib.hy_quantize_act(v.data_ptr(), n, dt, ldk, group, fold, row.data_ptr()) == -2, args
