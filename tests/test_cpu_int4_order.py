"""int4's group-interleaved stored order (cpu_kernels/quant.py int4_order, csrc/hy.h i4_for_each_word): the packer,
the activation reorder (driver.h quantize_row), the vector kernels of every ISA, the AMX unpacking and B-tile
packing (amx_emu) must all agree on it, for every fold (groups per block: 1, 2, 4, 8, 16) and group size.

The reference here is built without the stored order (per-group fake quantization in natural order), so a
kernel that read the wrong word of a row, the wrong group sum or the wrong scale lane fails by far more than the
int8 activation rounding the tolerance allows."""

import pytest
import torch

from cpu_kernels import CpuMoE, quant
from cpu_kernels.reference import moe_forward
from test_cpu_moe import COMPILED, EMU, TOL, rel_err

# (K, group) -> fold: the largest of 16, 8, 4, 2, 1 dividing K / group
FOLDS = {(192, 64): 1, (384, 128): 1, (128, 64): 2, (768, 128): 2, (256, 64): 4, (1536, 128): 4, (512, 64): 8,
         (1024, 128): 8, (2048, 128): 16, (4096, 64): 16, (64, 32): 2, (128, 32): 4, (768, 32): 8, (512, 32): 16}


def natural_fake_quant(w: torch.Tensor, group: int) -> torch.Tensor:
    """int4 quantize-dequantize per row and group, in natural order, without any packing."""
    *lead, K = w.shape
    wg = w.float().reshape(*lead, K // group, group)
    s = wg.abs().amax(-1, keepdim=True) / 7.0
    q = torch.where(s > 0, torch.round(wg / torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(wg))
    return (q.clamp(-8, 7) * s).reshape(*lead, K)


@pytest.mark.parametrize("K,group", sorted(FOLDS))
def test_fold_rule_and_order_is_a_permutation(K, group):
    assert quant.int4_fold_groups(K, group) == FOLDS[(K, group)]
    order = quant.int4_order(K, group)
    assert sorted(order.tolist()) == list(range(K))
    assert torch.equal(order.reshape(-1, 4) - order.reshape(-1, 4)[:, :1], torch.arange(4).expand(K // 4, 4))


@pytest.mark.parametrize("K,group", sorted(FOLDS))
def test_each_lane_holds_one_group_per_block(K, group):
    """What the kernels rely on: in a fold block, word l of every unpacked chunk (stored values 4l .. 4l+3 of the
    chunk) comes from one group, group l // (16 / fold) of the block, and the block's chunks cover its groups."""
    fold = quant.int4_fold_groups(K, group)
    B = fold * group // 64
    g = (quant.int4_order(K, group) // group).reshape(K // (64 * B), B, 16, 4)  # block, chunk, word, value
    assert bool((g == g[:, :1, :, :1]).all())  # one group per word across the block's chunks
    blocks = torch.arange(K // (64 * B))[:, None] * fold + torch.arange(16) // (16 // fold)
    assert torch.equal(g[:, 0, :, 0], blocks)
    if fold == 1 or fold * group == 64:  # the natural order: the kernels' pre-layout path
        assert torch.equal(quant.int4_order(K, group), torch.arange(K))


@pytest.mark.parametrize("K,group", [(2048, 128), (768, 128), (512, 64), (128, 32), (192, 64)])
def test_round_trip_is_natural_order_fake_quant(K, group):
    w = torch.randn(3, 5, K, generator=torch.Generator().manual_seed(K + group))
    packed, scale = quant.quantize_int4(w, group)
    assert packed.shape == (3, 5, K // 2) and scale.shape == (3, 5, K // group)
    assert torch.equal(quant.dequantize_int4(packed, scale, group), natural_fake_quant(w, group))


def test_stored_order_really_interleaves():
    """A row whose value is its group index: in a 2048-value row of groups of 128 (fold 16), the first unpacked
    chunk holds every group once per word, not group 0 throughout."""
    K, group = 2048, 128
    w = (torch.arange(K) // group + 1).float()[None] * torch.tensor([[1.0]])
    packed, _ = quant.quantize_int4(w, group)
    first = quant.unpack_nibbles(packed)[0, :64].reshape(16, 4)
    assert bool((first == 15).all())  # each value is its group's max: 7 + 8
    nat = quant.int4_order(K, group)[:64].reshape(16, 4) // group
    assert nat[:, 0].tolist() == list(range(16))


ISAS = [i for i in COMPILED if i != "amx"] + EMU + ["ref"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group,d,f", [(128, 2048, 768), (128, 1000, 1536), (64, 512, 320), (64, 4096, 192),
                                       (32, 768, 136), (32, 96, 512)])
def test_kernels_match_natural_reference_for_every_fold(isa, group, d, f):
    """gate/up reduce over D, down over F: between them the shapes give folds 1, 2, 4, 8 and 16 (D and F padded to
    the group); 1-5 tokens per expert (the decode kernels' 4-row x 1-4 token blocks and a remainder) and, on
    amx_emu, the tiles for groups >= 64 (knee 1) next to the vector path."""
    E, K = 4, 2
    g = torch.Generator().manual_seed(group + d + f)
    ws = (torch.randn(E, f, d, generator=g) / d**0.5, torch.randn(E, f, d, generator=g) / d**0.5,
          torch.randn(E, d, f, generator=g) / f**0.5)
    ref_w = []
    for w in ws:
        k = w.shape[-1]
        kp = -(-k // max(64, group)) * max(64, group)
        ref_w.append(natural_fake_quant(torch.nn.functional.pad(w, (0, kp - k)), group)[..., :k])
    knees = (1, 10**9) if isa == "amx_emu" else (16,)
    for knee in knees:
        moe = CpuMoE(*ws, dtype="int4", group_size=group, isa=isa, threads=2, amx_min_tokens=knee,
                     int4_order="interleaved")
        for T in (1, 2, 3, 4, 5):
            x = torch.randn(T, d, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            ids[:, 0] = 1  # expert 1 gets every token: T tokens per expert
            ids[:, 1] = torch.where(ids[:, 1] == 1, 0, ids[:, 1])
            wts = torch.rand(T, K, generator=g) + 0.1
            y = moe.forward(x, ids, wts)
            ref = moe_forward(x, *ref_w, ids, wts)
            assert rel_err(y, ref) < TOL["int4"], (knee, T)


@pytest.mark.parametrize("isa", [i for i in COMPILED if i != "amx"] + EMU)
def test_forward_refuses_a_fold_the_kernels_cannot_read(isa):
    ws = (torch.randn(2, 64, 256), torch.randn(2, 64, 256), torch.randn(2, 256, 64))
    moe = CpuMoE(*ws, dtype="int4", group_size=64, isa=isa, threads=1, int4_order="interleaved")
    ids, wts = torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])
    moe.forward(torch.randn(1, 256), ids, wts)
    assert moe._layer.nodes[0].gate.fold == 4
    moe._layer.nodes[0].gate.fold = 3  # not a power of two
    with pytest.raises(RuntimeError, match="code -2"):
        moe.forward(torch.randn(1, 256), ids, wts)
    moe._layer.nodes[0].gate.fold = 8  # does not divide the 4 groups of a row
    with pytest.raises(RuntimeError, match="code -2"):
        moe.forward(torch.randn(1, 256), ids, wts)


@pytest.mark.parametrize("isa", [i for i in COMPILED if i != "amx"])
def test_natural_order_option_and_the_gpu_side_decoder(isa):
    """CpuMoE(int4_order="natural") packs the pre-interleave layout (for benchmarks): other bytes, the same
    results; and the GPU lane's decoder (hybrid.offload.sources, run here on the CPU) un-does either order."""
    from hybrid.offload.sources import expert_weights, packed_sources

    g = torch.Generator().manual_seed(5)
    E, F, D, group = 3, 256, 1024, 64
    ws = (torch.randn(E, F, D, generator=g), torch.randn(E, F, D, generator=g), torch.randn(E, D, F, generator=g))
    inter = CpuMoE(*ws, dtype="int4", group_size=group, isa=isa, threads=2, int4_order="interleaved")
    nat = CpuMoE(*ws, dtype="int4", group_size=group, isa=isa, threads=2, int4_order="natural")
    assert (inter._layer.nodes[0].gate.fold, inter._layer.nodes[0].down.fold) == (16, 4)
    assert (nat._layer.nodes[0].gate.fold, nat._layer.nodes[0].down.fold) == (1, 1)
    pi, pn = inter.packed_weights()[0]["gate"], nat.packed_weights()[0]["gate"]
    assert torch.equal(pi["scale"], pn["scale"]) and not torch.equal(pi["q"], pn["q"])
    want = [natural_fake_quant(w, group) for w in ws]
    for moe in (inter, nat):
        for e in range(E):
            got = expert_weights(packed_sources(moe), e, "cpu", torch.float32)
            for a, b in zip(got, want):
                assert torch.equal(a, b[e])
    x = torch.randn(4, D, generator=g)
    ids, wts = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 0]]), torch.rand(4, 2, generator=g)
    ref = moe_forward(x, *want, ids, wts)
    yi, yn = inter.forward(x, ids, wts), nat.forward(x, ids, wts)
    assert rel_err(yi, ref) < TOL["int4"] and rel_err(yn, ref) < TOL["int4"]
    with pytest.raises(ValueError, match="int4_order"):
        CpuMoE(*ws, dtype="int4", isa=isa, int4_order="sorted")


def test_default_order_follows_the_isa_and_group():
    """Interleaved where the vector kernels are AVX-512 (and amx_emu, which stands in for the AMX build) in groups of
    64 and 128; natural in groups of 32 (read twice as fast at 1-4 tokens on AVX-512) and on AVX2 and ref, whose
    kernels gain nothing from it (DESIGN.md, CPU kernels). The packed layout (a packed cache's key) says the same."""
    from cpu_kernels.moe import packed_layout

    ws = (torch.randn(2, 64, 1024), torch.randn(2, 64, 1024), torch.randn(2, 1024, 64))
    for isa in [i for i in COMPILED if i != "amx"] + EMU + ["ref"]:
        for group in (32, 64, 128):
            moe = CpuMoE(*ws, dtype="int4", group_size=group, isa=isa, threads=1)
            want = "interleaved" if isa in ("avx512_bf16", "amx_emu") and group >= 64 else "natural"
            assert moe.int4_order == want, (isa, group)
            assert packed_layout(64, "int4", group, isa=isa, threads=1)["int4_order"] == want, (isa, group)


def test_explicit_order_wins():
    """An explicit int4_order is kept both ways, whatever the ISA's default."""
    ws = (torch.randn(2, 64, 1024), torch.randn(2, 64, 1024), torch.randn(2, 1024, 64))
    isa = (COMPILED + ["ref"])[0]
    for order in ("natural", "interleaved"):
        assert CpuMoE(*ws, dtype="int4", group_size=64, isa=isa, threads=1, int4_order=order).int4_order == order
