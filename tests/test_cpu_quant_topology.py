"""Exact checks of the weight quantization formats and of NUMA topology discovery."""

import pytest
import torch

from cpu_kernels import Topology, quant
from cpu_kernels.topology import parse_cpulist


def test_int8_roundtrip_exact():
    g = torch.Generator().manual_seed(0)
    s = 2.0 ** torch.randint(-8, 0, (5, 1), generator=g)  # power-of-two scales: q * s is exact
    q = torch.randint(-127, 128, (5, 200), generator=g)
    q[:, 0] = 127
    w = q.float() * s
    qq, ss = quant.quantize_int8(w)
    assert torch.equal(ss, s[:, 0]) and torch.equal(qq.long(), q)
    assert torch.equal(quant.dequantize_int8(qq, ss), w)
    assert int(quant.quantize_int8(torch.full((1, 64), -3.0))[0].min()) == -127  # never -128


@pytest.mark.parametrize("group", quant.GROUP_SIZES)
def test_int4_roundtrip_exact(group):
    g = torch.Generator().manual_seed(group)
    K = 256
    s = 2.0 ** torch.randint(-6, 2, (3, K // group), generator=g)
    q = torch.randint(-7, 8, (3, K), generator=g)
    q[:, ::group] = 7  # every group reaches amax = 7 * s
    w = q.float() * s.repeat_interleave(group, -1)
    packed, ss = quant.quantize_int4(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (3, K // 2)
    assert torch.equal(ss, s)
    assert torch.equal(quant.dequantize_int4(packed, ss, group), w)


def test_int4_nibble_layout():
    u = torch.arange(128, dtype=torch.uint8).remainder(16).reshape(1, 128)
    p = quant.pack_nibbles(u)
    # chunk c, byte j: low nibble = value c*64 + j, high nibble = value c*64 + 32 + j
    for c in range(2):
        for j in range(32):
            assert int(p[0, c * 32 + j]) == int(u[0, c * 64 + j]) | (int(u[0, c * 64 + 32 + j]) << 4)
    assert torch.equal(quant.unpack_nibbles(p), u)


def test_quantize_rejects_bad_shapes():
    with pytest.raises(ValueError):
        quant.quantize_int4(torch.zeros(2, 96), 32)  # K not a multiple of 64
    with pytest.raises(ValueError):
        quant.quantize_int4(torch.zeros(2, 128), 48)


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_discover_fake_sysfs(tmp_path):
    for n, cl in ((0, "0-3,8-11"), (1, "4-7,12-15"), (2, "")):
        (tmp_path / f"node{n}").mkdir()
        (tmp_path / f"node{n}" / "cpulist").write_text(cl + "\n")
    (tmp_path / "possible").write_text("0-2\n")  # not a node directory
    topo = Topology.discover(tmp_path, allowed=range(16))
    assert topo.nodes == ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))
    part = Topology.discover(tmp_path, allowed={1, 2, 5})
    assert part.nodes == ((1, 2), (5,))
    assert Topology.discover(tmp_path / "missing", allowed={3, 1}).nodes == ((1, 3),)
    assert topo.limit(3).nodes == ((0, 1), (4,))
    assert topo.limit(None) is topo and topo.threads == 16


def test_topology_validation():
    with pytest.raises(ValueError):
        Topology(())
    with pytest.raises(ValueError):
        Topology(((0,), ()))
    with pytest.raises(ValueError):
        Topology(((0,),)).limit(0)
    # the executor's layer holds at most 8 nodes (csrc HY_MAX_NODES): 8 are accepted, 9 refused
    assert len(Topology(tuple((i,) for i in range(8))).nodes) == 8
    with pytest.raises(ValueError, match="at most 8"):
        Topology(tuple((i,) for i in range(9)))


def test_topology_limit_gives_the_bigger_node_the_odd_thread():
    """Round robin from the biggest node: 3 of a 4 + 2 split keep 2 + 1 (in proportion), and 5 keep 3 + 2."""
    topo = Topology(((4, 5), (0, 1, 2, 3)))
    assert topo.limit(3).nodes == ((4,), (0, 1))
    assert topo.limit(5).nodes == ((4, 5), (0, 1, 2))
    assert topo.limit(1).nodes == ((0,),)  # a node that gets no thread is dropped


def test_mxfp4_dequantize_matches_transformers_and_round_trips():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from cpu_kernels.quant import dequantize_mxfp4, quantize_mxfp4
    torch.manual_seed(3)
    w = torch.randn(3, 40, 96) * torch.logspace(-3, 1, 40)[:, None]  # rows over four decades of scale
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 40, 3, 16) and scales.shape == (3, 40, 3)
    d = dequantize_mxfp4(blocks, scales)
    # transformers' own unpacking of the published layout ([E, R, G, 16] -> [E, K, R])
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2), d)
    # within half a step of the 4-bit grid: |w - d| <= 1 * 2^(e-127) (the widest gap, 4 -> 6, halved)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert ((w - d).abs() <= step + 1e-30).all()
    b2, s2 = quantize_mxfp4(d)
    assert torch.equal(dequantize_mxfp4(b2, s2), d)
    with pytest.raises(ValueError):
        quantize_mxfp4(torch.randn(2, 48))


def test_int4_zero_group_stores_code_zero():
    """An all-zero group (pruned or padded weights) has scale 0 and every value stored as q = 0, the nibble 8:
    not 0 / 0, whose NaN the uint8 cast turns into whatever the platform gives."""
    w = torch.zeros(2, 128)
    w[0, 64:] = torch.arange(64.0) - 32  # row 0: group 0 zero, group 1 not; row 1 zero throughout
    packed, scale = quant.quantize_int4(w, 64)
    assert scale[0, 0] == 0 and scale[1].tolist() == [0.0, 0.0] and scale[0, 1] == 32 / 7
    nib = quant.unpack_nibbles(packed)  # stored order: where each natural value went is int4_order
    group0 = quant.int4_order(128, 64) < 64
    assert nib[0, group0].tolist() == [8] * 64 and nib[1].tolist() == [8] * 128
    assert torch.equal(quant.dequantize_int4(packed, scale, 64)[:, :64], torch.zeros(2, 64))


def test_int4_fold_block_smaller_than_a_chunk_refused():
    # a fold block is whole 64-value chunks: one group of 32 per block is half a chunk
    for bad in (lambda: quant.int4_order(128, 32, fold=1), lambda: quant.quantize_int4(torch.zeros(1, 128), 32, fold=1)):
        with pytest.raises(ValueError, match="does not fit"):
            bad()
    assert torch.equal(quant.int4_order(128, 32, fold=2), torch.arange(128))  # two groups a chunk: natural


def test_mxfp4_lowest_exponent_round_trips():
    """Published mxfp4 with the smallest exponent (scale byte 0: 2^-127, fp32 subnormals) comes back unchanged:
    the exponent may not be floored above -127, or 0.5 x 2^-127 rounds away."""
    from cpu_kernels.quant import dequantize_mxfp4, quantize_mxfp4

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (4, 2, 32), generator=g, dtype=torch.uint8)
    codes[..., 0], codes[..., 1] = 7, 1  # every block holds 6 (its largest) and 0.5 (its smallest step)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    scales = torch.tensor([[0, 0], [0, 1], [1, 2], [127, 0]], dtype=torch.uint8)
    w = dequantize_mxfp4(blocks, scales)
    assert w[0, 1] == 0.5 * 2.0 ** -127 and w[0, 0] == 6 * 2.0 ** -127
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w)), w)
