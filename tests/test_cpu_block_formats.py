"""The CPU executor's block formats of llama.cpp's types against the pure-torch reference, for every ISA here and the
emulated AMX build, and GGUF blocks of those types packed as they are:
  q8_0: int8 in blocks of 32 along K with an fp16 scale each (Q8_0);
  q4_0: 4-bit values in blocks of 32 along K with an fp16 scale each (Q4_0), the file's nibble bytes as they are;
  q4_k: 4-bit values with a 6-bit scale and minimum per 32 and an fp16 d, dmin per 256 (Q4_K);
  q5_k: q4_k with a fifth bit per value (Q5_K);
  q2_k: 2-bit values with a 4-bit scale and minimum per 16 and an fp16 d, dmin per 256 (Q2_K);
  q3_k: 3-bit values (-4..3) with a signed 6-bit scale per 16 and an fp16 d per 256 (Q3_K);
  q6_k: 6-bit values with an int8 scale per 16 and an fp16 d per 256 (Q6_K);
  iq4_xs: 4-bit indices into a 16-value codebook with a 6-bit scale per 32 and an fp16 d per 256 (IQ4_XS);
  iq2_xxs: per 8 values an index into a 256-entry codebook of magnitudes and 7 sign bits, a 4-bit scale per 32 and an
      fp16 d per 256 (IQ2_XXS), the file's blocks only (FILE_ONLY: no quantizer from floats, so the tests that start
      from floats run the others, and the file-only formats have block-based tests of their own);
  iq3_xxs: per 4 values an index into a 256-entry codebook of magnitudes, per 8 values 7 sign bits, a 4-bit scale per
      32 and an fp16 d per 256 (IQ3_XXS), file-only likewise;
  iq3_s: per 4 values a 9-bit index into a 512-entry codebook of odd magnitudes, a sign bit per value, a 4-bit scale
      per 32 and an fp16 d per 256 (IQ3_S), file-only likewise;
  iq1_s: per 8 values an 11-bit index into a 2048-entry codebook of values in {-1, 0, 1}, a 3-bit scale and a delta
      sign per 32 and an fp16 d per 256 (IQ1_S), file-only likewise;
  iq1_m: IQ1_S's codebook indices with a delta sign per 8 values, a 3-bit scale per 16 and an fp16 d per 256 spread
      over the scales words' top nibbles (IQ1_M), file-only likewise.

The reference runs reference.moe_forward on the weights de-quantized by cpu_kernels.quant, the exact values the
kernels hold: the only approximation left is the kernels' per-token int8 quantization of the activations (x, and h
before down), the one int8 and int4 make, so TOL["int8"] (test_cpu_moe.py) bounds it; a second, tight check
emulates that rounding and leaves only fp32 summation order.

Shapes: q8_0 and q4_0 D = 160 and F = 224 (5 and 7 blocks, rows padded to 64 values: a lone last block per row); the K-quants
D = 512 and F = 768 (whole super-blocks; two NUMA slices of 512 + 256); weights quantized here also at D = 131, F = 97 (zero
padded to whole blocks before quantizing). Ragged routing (experts with 0, 1, 7, 300 tokens), outputs NaN-filled.
"""

import logging
from dataclasses import dataclass

import pytest
import torch

from cpu_kernels import CpuMoE, _native, moe as moe_mod, quant
from cpu_kernels.dtypes import FILE_ONLY_DTYPES
from cpu_kernels.reference import moe_forward
from test_cpu_moe import COMPILED, EMU, TOL, ragged_routing, rel_err
from test_cpu_moe_bias import fused_knob  # noqa: F401 (a fixture)
from test_cpu_mxfp4 import biases, both_paths, emulated, topology

E = 6
ISAS = [i for i in COMPILED if i != "amx"] + EMU
if "amx" in COMPILED:  # declines both to its AVX-512 path at every knee: covered like the others
    ISAS.append(pytest.param("amx", marks=pytest.mark.amx))


@dataclass(frozen=True)
class Fmt:
    name: str
    block: int  # values per GGUF block
    block_bytes: int
    F: int
    D: int
    bytes_per_weight: float
    quantize: object  # float [..., K] -> the format's parts
    dequantize: object  # parts -> fp32 [..., K]
    parts: object  # GGUF blocks [..., G, block_bytes] -> parts
    to_raw: object  # parts -> GGUF blocks
    from_blocks: object  # CpuMoE.from_<format>
    gguf_type: str


def q8_raw(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q int8 [..., K], d fp16 [..., K/32]) -> GGUF Q8_0 blocks uint8 [..., K/32, 34] (d, then the 32 values)."""
    *lead, K = q.shape
    return torch.cat([d.reshape(*lead, K // 32, 1).view(torch.uint8),
                      q.reshape(*lead, K // 32, 32).view(torch.uint8)], -1).contiguous()


def q40_raw(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q uint8 [..., K/2], d fp16 [..., K/32]) -> GGUF Q4_0 blocks uint8 [..., K/32, 18] (d, then the block's 16
    bytes of nibbles)."""
    *lead, G = d.shape
    return torch.cat([d.reshape(*lead, G, 1).view(torch.uint8), q.reshape(*lead, G, 16)], -1).contiguous()


def q4k_raw(p: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(nibbles uint8 [..., K/2], heads [..., K/256, 16]) -> GGUF Q4_K blocks uint8 [..., K/256, 144]."""
    return torch.cat([h, p.reshape(*h.shape[:-1], 128)], -1).contiguous()


def q5k_raw(p: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(nibbles uint8 [..., K/2], heads [..., K/256, 48]) -> GGUF Q5_K blocks uint8 [..., K/256, 176]."""
    return torch.cat([h, p.reshape(*h.shape[:-1], 128)], -1).contiguous()


def q2k_raw(v: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., K/4], heads [..., K/256, 20]) -> GGUF Q2_K blocks uint8 [..., K/256, 84] (scales, values,
    d, dmin)."""
    return torch.cat([h[..., :16], v.reshape(*h.shape[:-1], 64), h[..., 16:]], -1).contiguous()


def values_head_raw(v: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., K/256 * value bytes], heads [..., K/256, head bytes]) -> GGUF blocks whose values come
    first and the head last: Q6_K's (192 + 18 bytes), Q3_K's (96 + 14)."""
    return torch.cat([v.reshape(*h.shape[:-1], -1), h], -1).contiguous()


def iq4_raw(p: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(indices uint8 [..., K/2] in int4's chunk layout, heads [..., K/256, 8]) -> GGUF IQ4_XS blocks uint8 [...,
    K/256, 136] (the head, then per 32 values 16 bytes: values j and 16 + j in byte j)."""
    codes = quant.unpack_nibbles(p).reshape(*h.shape[:-1], 8, 32)
    return torch.cat([h, (codes[..., :16] | (codes[..., 16:] << 4)).flatten(-2)], -1).contiguous()


def d_first_raw(v: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., K/256 * n], heads [..., K/256, 2]) -> GGUF blocks uint8 [..., K/256, 2 + n], d then the
    values: IQ2_XXS (n 64: qs), IQ3_XXS (96: qs), IQ3_S (108: qs, qh, signs, scales), IQ1_S (48: qs and qh)."""
    return torch.cat([h, v.reshape(*h.shape[:-1], -1)], -1).contiguous()


def iq1m_raw(v: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., K/256 * 48], heads [..., K/256, 8]) -> GGUF IQ1_M blocks uint8 [..., K/256, 56] (qs and
    qh, then the scales words)."""
    return torch.cat([v.reshape(*h.shape[:-1], 48), h], -1).contiguous()


def set_d(block: torch.Tensor, at, bits: int) -> None:
    """Writes the fp16 bits into one GGUF block's d: its two bytes at `at`, or (at None: IQ1_M, no d field) the top
    nibbles of its 4 scales words, word w's bits 4 w .. 4 w + 3 of d."""
    if at is not None:
        block[at:at + 2] = torch.tensor([bits & 0xFF, bits >> 8], dtype=torch.uint8)
        return
    for w in range(4):
        block[49 + 2 * w] = (int(block[49 + 2 * w]) & 0x0F) | ((bits >> (4 * w)) & 0xF) << 4


FORMATS = {
    "q8_0": Fmt("q8_0", 32, 34, 224, 160, 1.0625, quant.quantize_q8_0, quant.dequantize_q8_0, quant.q8_0_parts,
                q8_raw, CpuMoE.from_q8_0, "Q8_0"),
    "q4_0": Fmt("q4_0", 32, 18, 224, 160, 0.5625, quant.quantize_q4_0, quant.dequantize_q4_0_packed, quant.q4_0_parts,
                q40_raw, CpuMoE.from_q4_0, "Q4_0"),
    "q4_k": Fmt("q4_k", 256, 144, 768, 512, 0.5625, quant.quantize_q4_k, quant.dequantize_q4_k, quant.q4_k_parts,
                q4k_raw, CpuMoE.from_q4_k, "Q4_K"),
    "q5_k": Fmt("q5_k", 256, 176, 768, 512, 0.6875, quant.quantize_q5_k, quant.dequantize_q5_k, quant.q5_k_parts,
                q5k_raw, CpuMoE.from_q5_k, "Q5_K"),
    "q2_k": Fmt("q2_k", 256, 84, 768, 512, 0.328125, quant.quantize_q2_k, quant.dequantize_q2_k, quant.q2_k_parts,
                q2k_raw, CpuMoE.from_q2_k, "Q2_K"),
    "q3_k": Fmt("q3_k", 256, 110, 768, 512, 0.4296875, quant.quantize_q3_k, quant.dequantize_q3_k, quant.q3_k_parts,
                values_head_raw, CpuMoE.from_q3_k, "Q3_K"),
    "q6_k": Fmt("q6_k", 256, 210, 768, 512, 0.8203125, quant.quantize_q6_k, quant.dequantize_q6_k, quant.q6_k_parts,
                values_head_raw, CpuMoE.from_q6_k, "Q6_K"),
    "iq4_xs": Fmt("iq4_xs", 256, 136, 768, 512, 0.53125, quant.quantize_iq4_xs, quant.dequantize_iq4_xs,
                  quant.iq4_xs_parts, iq4_raw, CpuMoE.from_iq4_xs, "IQ4_XS"),
    "iq2_xxs": Fmt("iq2_xxs", 256, 66, 768, 512, 0.2578125, quant.quantize_iq2_xxs, quant.dequantize_iq2_xxs,
                   quant.iq2_xxs_parts, d_first_raw, CpuMoE.from_iq2_xxs, "IQ2_XXS"),
    "iq3_xxs": Fmt("iq3_xxs", 256, 98, 768, 512, 0.3828125, quant.quantize_iq3_xxs, quant.dequantize_iq3_xxs,
                   quant.iq3_xxs_parts, d_first_raw, CpuMoE.from_iq3_xxs, "IQ3_XXS"),
    "iq3_s": Fmt("iq3_s", 256, 110, 768, 512, 0.4296875, quant.quantize_iq3_s, quant.dequantize_iq3_s,
                 quant.iq3_s_parts, d_first_raw, CpuMoE.from_iq3_s, "IQ3_S"),
    "iq1_s": Fmt("iq1_s", 256, 50, 768, 512, 0.1953125, quant.quantize_iq1_s, quant.dequantize_iq1_s,
                 quant.iq1_s_parts, d_first_raw, CpuMoE.from_iq1_s, "IQ1_S"),
    "iq1_m": Fmt("iq1_m", 256, 56, 768, 512, 0.21875, quant.quantize_iq1_m, quant.dequantize_iq1_m_packed,
                 quant.iq1_m_parts, iq1m_raw, CpuMoE.from_iq1_m, "IQ1_M"),
}
FMTS = list(FORMATS)
FLOAT_FMTS = [f for f in FMTS if f not in FILE_ONLY_DTYPES]  # the formats with a quantizer from floats
FILE_FMTS = [f for f in FMTS if f in FILE_ONLY_DTYPES]


def floats(fmt, seed=0, e=E, f=None, d=None, scale=1.0):
    f, d = f or fmt.F, d or fmt.D
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) * scale / s[2] ** 0.5 for s in ((e, f, d), (e, f, d), (e, d, f))]


def plain(fmt, ws):
    """What the dtype computes with: each matrix quantized (rows zero padded to whole blocks) and back."""
    out = []
    for w in ws:
        K = w.shape[-1]
        wp = torch.nn.functional.pad(w, (0, -K % fmt.block))
        out.append(fmt.dequantize(*fmt.quantize(wp))[..., :K])
    return out


def grid_parts(fmt, w, rounds=8):
    """The format's parts of w, re-quantized from their own values until that gives them back: blocks whose values the
    quantizer maps to themselves. q8_0's and q4_k's quantizers do so at once; q6_k's can lower a group's scale once
    or twice first (its scales are rounded up from the group's largest magnitude, which its own values may not
    reach)."""
    parts = fmt.quantize(w)
    for _ in range(rounds):
        again = fmt.quantize(fmt.dequantize(*parts))
        if all(torch.equal(a, b) for a, b in zip(again, parts)):
            return parts
        parts = again
    raise AssertionError(f"{fmt.name}: no fixed point in {rounds} rounds")


def random_blocks(fmt, seed, e=E, f=None, d=None):
    """GGUF blocks of the format with random valid content: q8_0 every int8 value, -128 included (llama.cpp's
    quantizer never writes it, a file may hold it), scales over 2^-14 .. 2^-4; q4_0 every nibble, scales of either
    sign over 2^-14 .. 2^-4; q4_k every nibble and every 6-bit
    scale and minimum, d and dmin over 2^-16 .. 2^-8 (q5_k: and every fifth bit); q6_k every 6-bit value and every int8 scale (-128 included), d
    over 2^-16 .. 2^-8; q2_k every 2-bit value and every 4-bit scale and minimum, d and dmin likewise; q3_k every
    3-bit value (every hmask bit) and every 6-bit scale, d of either sign likewise; iq4_xs every index and every 6-bit
    scale (both signs of ls - 32), d likewise; iq2_xxs random qs bytes (every codebook index, sign index and 4-bit
    scale), d of either sign likewise; iq3_xxs and iq3_s likewise; iq1_s random qs and qh bytes (every codebook index, 3-bit scale and delta
    sign), d of either sign likewise; iq1_m random qs and qh bytes (every codebook index and delta sign), random 3-bit
    scales, d of either sign likewise written into the scales words' top nibbles."""
    f, d = f or fmt.F, d or fmt.D
    g = torch.Generator().manual_seed(seed)
    raws = []
    for shape in ((e, f, d), (e, f, d), (e, d, f)):
        G = shape[2] // fmt.block
        if fmt.name == "q8_0":
            q = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
            dd = (2.0 ** torch.randint(-14, -4, (*shape[:2], G), generator=g) *
                  (1 + torch.rand(*shape[:2], G, generator=g))).half()
            raws.append(q8_raw(q, dd))
        elif fmt.name == "q4_0":
            qs = torch.randint(0, 256, (*shape[:2], G, 16), dtype=torch.uint8, generator=g)
            dd = ((2.0 ** torch.randint(-14, -4, (*shape[:2], G, 1), generator=g) *
                   (1 + torch.rand(*shape[:2], G, 1, generator=g))) *
                  (1 - 2 * torch.randint(0, 2, (*shape[:2], G, 1), generator=g))).half()  # d of either sign
            raws.append(torch.cat([dd.view(torch.uint8), qs], -1).contiguous())
        elif fmt.name == "q2_k":
            v = torch.randint(0, 256, (*shape[:2], G * 64), dtype=torch.uint8, generator=g)
            sc = torch.randint(0, 256, (*shape[:2], G, 16), dtype=torch.uint8, generator=g)
            dd = (2.0 ** torch.randint(-16, -8, (*shape[:2], G, 2), generator=g) *
                  (1 + torch.rand(*shape[:2], G, 2, generator=g))).half()
            raws.append(q2k_raw(v, torch.cat([sc, dd.view(torch.uint8)], -1)))
        elif fmt.name in ("iq2_xxs", "iq3_xxs", "iq3_s", "iq1_s"):  # d, then random bytes
            qs = torch.randint(0, 256, (*shape[:2], G, fmt.block_bytes - 2), dtype=torch.uint8, generator=g)
            dd = ((2.0 ** torch.randint(-16, -8, (*shape[:2], G, 1), generator=g) *
                   (1 + torch.rand(*shape[:2], G, 1, generator=g))) *
                  (1 - 2 * torch.randint(0, 2, (*shape[:2], G, 1), generator=g))).half()  # d of either sign
            raws.append(d_first_raw(qs, dd.view(torch.uint8)))
        elif fmt.name == "iq1_m":
            qs = torch.randint(0, 256, (*shape[:2], G, 48), dtype=torch.uint8, generator=g)
            dd = ((2.0 ** torch.randint(-16, -8, (*shape[:2], G, 1), generator=g) *
                   (1 + torch.rand(*shape[:2], G, 1, generator=g))) *
                  (1 - 2 * torch.randint(0, 2, (*shape[:2], G, 1), generator=g))).half()  # d of either sign
            bits = dd.view(torch.int16).long() & 0xFFFF  # [.., G, 1]
            words = (torch.randint(0, 4096, (*shape[:2], G, 4), generator=g) |
                     ((bits >> torch.tensor([0, 4, 8, 12])) & 0xF) << 12)  # the scales, d's nibbles on top
            sc = torch.stack([words & 0xFF, words >> 8], -1).reshape(*shape[:2], G, 8).to(torch.uint8)
            raws.append(iq1m_raw(qs, sc))
        elif fmt.name == "iq4_xs":
            qs = torch.randint(0, 256, (*shape[:2], G, 128), dtype=torch.uint8, generator=g)
            scales = torch.randint(0, 256, (*shape[:2], G, 6), dtype=torch.uint8, generator=g)  # scales_h, scales_l
            dd = (2.0 ** torch.randint(-16, -8, (*shape[:2], G, 1), generator=g) *
                  (1 + torch.rand(*shape[:2], G, 1, generator=g))).half()
            raws.append(torch.cat([dd.view(torch.uint8), scales, qs], -1).contiguous())
        elif fmt.name == "q6_k":
            v = torch.randint(0, 256, (*shape[:2], G * 192), dtype=torch.uint8, generator=g)
            sc = torch.randint(-128, 128, (*shape[:2], G, 16), dtype=torch.int8, generator=g)
            dd = (2.0 ** torch.randint(-16, -8, (*shape[:2], G, 1), generator=g) *
                  (1 + torch.rand(*shape[:2], G, 1, generator=g))).half()
            raws.append(values_head_raw(v, torch.cat([sc.view(torch.uint8), dd.view(torch.uint8)], -1)))
        elif fmt.name == "q3_k":
            v = torch.randint(0, 256, (*shape[:2], G * 96), dtype=torch.uint8, generator=g)
            sc = torch.randint(0, 256, (*shape[:2], G, 12), dtype=torch.uint8, generator=g)
            dd = ((2.0 ** torch.randint(-16, -8, (*shape[:2], G, 1), generator=g) *
                   (1 + torch.rand(*shape[:2], G, 1, generator=g))) *
                  (1 - 2 * torch.randint(0, 2, (*shape[:2], G, 1), generator=g))).half()  # d of either sign
            raws.append(values_head_raw(v, torch.cat([sc, dd.view(torch.uint8)], -1)))
        else:
            p = torch.randint(0, 256, (*shape[:2], shape[2] // 2), dtype=torch.uint8, generator=g)
            dd, dm = ((2.0 ** torch.randint(-16, -8, (*shape[:2], G), generator=g) *
                       (1 + torch.rand(*shape[:2], G, generator=g))).half() for _ in range(2))
            sc, mn = (torch.randint(0, 64, (*shape[:2], G, 8), generator=g) for _ in range(2))
            head = quant.pack_q4_k_heads(dd, dm, sc, mn)
            if fmt.name == "q5_k":
                qh = torch.randint(0, 256, (*shape[:2], G, 32), dtype=torch.uint8, generator=g)
                raws.append(q5k_raw(p, torch.cat([head, qh], -1)))
            else:
                raws.append(q4k_raw(p, head))
    return raws


def test_q8_0_quantize_roundtrip_and_format():
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


def test_q4_0_quantize_roundtrip_and_format():
    """llama.cpp's Q4_0 rule: each block's value of largest magnitude is -8 steps of its fp16 scale (so a block of
    negatives has a positive scale), every value within half a step of the grid or clipped at +7 steps; a byte holds
    values j and 16 + j of its block; zeros are 0x88 bytes under a +0 scale."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(3, 5, 96, generator=g) * torch.logspace(-3, 1, 96)
    w[0, 0, :32] = -w[0, 0, :32].abs()
    w[0, 1, :32] = w[0, 1, :32].abs()
    q, d = quant.quantize_q4_0(w)
    assert q.dtype == torch.uint8 and d.dtype == torch.float16 and q.shape == (3, 5, 48) and d.shape == (3, 5, 3)
    assert float(d[0, 0, 0]) > 0 > float(d[0, 1, 0])
    u = torch.cat([q.reshape(3, 5, 3, 16) & 15, q.reshape(3, 5, 3, 16) >> 4], -1)  # [.., block, 32] in value order
    b = w.reshape(3, 5, 3, 32)
    first = b.abs().argmax(-1, keepdim=True)
    assert (u.gather(-1, first) == 0).all()  # the largest magnitude at q - 8 = -8
    back = quant.dequantize_q4_0_packed(q, d)
    assert torch.equal(back.reshape(3, 5, 3, 32), (u.float() - 8) * d.float()[..., None])
    step = d.float().abs().repeat_interleave(32, -1)
    top = u.reshape(3, 5, 96) == 15  # +7 steps: the grid's top, where a value of the other sign may clip
    assert ((back - w).abs() <= torch.where(top, 1.0, 0.5) * step * 1.01 + 1e-7).all()
    zq, zd = quant.quantize_q4_0(torch.zeros(1, 64))
    assert (zq == 0x88).all() and not zd.view(torch.int16).any()  # +0, not -0
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        quant.quantize_q4_0(torch.zeros(2, 40))


def test_q4_k_quantize_roundtrip_and_format():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 5, 512, generator=g) * 0.05 + torch.linspace(-0.02, 0.06, 512)  # offsets: minimums matter
    p, h = quant.quantize_q4_k(w)
    assert p.dtype == torch.uint8 and p.shape == (3, 5, 256) and h.shape == (3, 5, 2, 16)
    S, M = quant.q4_k_scales(h)
    assert (S >= 0).all() and (M >= 0).all()
    back = quant.dequantize_q4_k(p, h)
    step = S.reshape(3, 5, 16).repeat_interleave(32, -1)
    # within half a step of the grid, plus the 6-bit rounding of the sub-block's minimum (at most half a dmin)
    dmin = h[..., 2:4].contiguous().view(torch.float16).float().repeat_interleave(256, -1).reshape(3, 5, 512)
    assert ((back - w).abs() <= 0.5 * step + 0.5 * dmin + 1e-6).all()
    assert float((back - w).abs().mean()) < float(step.mean()) / 3
    zero = quant.quantize_q4_k(torch.zeros(1, 256))
    assert not zero[0].any() and not zero[1].any()
    with pytest.raises(ValueError, match="whole 256-value super-blocks"):
        quant.quantize_q4_k(torch.zeros(2, 320))
    sc, mn = torch.randint(0, 64, (2, 7, 8), generator=g), torch.randint(0, 64, (2, 7, 8), generator=g)
    d, dm = torch.rand(2, 7, generator=g).half(), torch.rand(2, 7, generator=g).half()
    S, M = quant.q4_k_scales(quant.pack_q4_k_heads(d, dm, sc, mn))  # the 6-bit packing round-trips
    assert torch.equal(S, d.float()[..., None] * sc.float()) and torch.equal(M, dm.float()[..., None] * mn.float())


def test_q5_k_quantize_roundtrip_and_format():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 5, 512, generator=g) * 0.05 + torch.linspace(-0.02, 0.06, 512)  # offsets: minimums matter
    p, h = quant.quantize_q5_k(w)
    assert p.dtype == h.dtype == torch.uint8 and p.shape == (3, 5, 256) and h.shape == (3, 5, 2, 48)
    high = quant.q5_k_high(h[..., 16:])
    assert high.shape == (3, 5, 2, 256) and int(high.max()) == 1 and int(high.min()) == 0  # the fifth bit is used
    S, _ = quant.q4_k_scales(h[..., :16])
    back = quant.dequantize_q5_k(p, h)
    step = S.reshape(3, 5, 16).repeat_interleave(32, -1)
    # within half a step of the grid, plus the 6-bit rounding of the sub-block's minimum (at most half a dmin)
    dmin = h[..., 2:4].contiguous().view(torch.float16).float().repeat_interleave(256, -1).reshape(3, 5, 512)
    assert ((back - w).abs() <= 0.5 * step + 0.5 * dmin + 1e-6).all()
    assert float((back - w).abs().mean()) < float(step.mean()) / 3
    zero = quant.quantize_q5_k(torch.zeros(1, 256))
    assert not zero[0].any() and not zero[1].any()
    with pytest.raises(ValueError, match="whole 256-value super-blocks"):
        quant.quantize_q5_k(torch.zeros(2, 320))


def test_iq2_xxs_quantizer_picks_the_nearest_codebook_entries():
    """quant.quantize_iq2_xxs: the gguf package reads its bytes as IQ2_XXS blocks giving the values our de-quantizer
    gives; at the stored scales each group of 8 holds the codebook entry nearest its magnitudes; the error is a 2-bit
    format's (below 0.4 of the weights' norm on Gaussian rows, q2_k's 0.33 at 2.63 bits); zeros are zero bytes."""
    import gguf
    import numpy as np

    w = torch.randn(4, 3, 512, generator=torch.Generator().manual_seed(6))
    v, h = quant.quantize_iq2_xxs(w)
    assert v.dtype == h.dtype == torch.uint8 and v.shape == (4, 3, 128) and h.shape == (4, 3, 2, 2)
    back = quant.dequantize_iq2_xxs(v, h)
    raw = torch.cat([h, v.reshape(4, 3, 2, 64)], -1).reshape(12, -1).numpy()
    assert np.array_equal(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.IQ2_XXS), back.reshape(12, -1).numpy())
    assert float((back - w).norm() / w.norm()) < 0.4
    grid = quant._iq_grid("iq2_xxs")
    sub = v.reshape(-1, 8)  # per 32 values: 4 entry indices, then the signs and the scale
    d = h.reshape(-1, 2).contiguous().view(torch.float16).float().repeat_interleave(8)
    ls = (sub[:, 7] >> 4).float()
    db = (d * (0.5 + ls) * 0.25).repeat_interleave(4)  # per group of 8
    t = w.reshape(-1, 8).abs() / db[:, None]
    dist = ((t[:, None, :] - grid[None]) ** 2).sum(-1)  # [groups, 256]
    picked = dist.gather(1, sub[:, :4].reshape(-1, 1).long()).squeeze(1)
    assert (picked <= dist.min(1).values + 1e-4 * dist.min(1).values.clamp(min=1)).all()
    zero = quant.quantize_iq2_xxs(torch.zeros(1, 256))
    assert not zero[0].any() and not zero[1].any()
    with pytest.raises(ValueError, match="whole super-blocks of 256"):
        quant.quantize_iq2_xxs(torch.zeros(2, 320))


def test_q2_k_quantize_roundtrip_and_format():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 5, 512, generator=g) * 0.05 + torch.linspace(-0.02, 0.06, 512)  # offsets: minimums matter
    v, h = quant.quantize_q2_k(w)
    assert v.dtype == h.dtype == torch.uint8 and v.shape == (3, 5, 128) and h.shape == (3, 5, 2, 20)
    q = quant.q2_k_codes(v)
    assert sorted(q.unique().tolist()) == [0, 1, 2, 3]  # every code used
    S, M = quant.q2_k_scales(h)
    assert (S >= 0).all() and (M >= 0).all() and int((h[..., :16] & 15).max()) == 15
    back = quant.dequantize_q2_k(v, h)
    step = S.reshape(3, 5, 32).repeat_interleave(16, -1)
    # within half a step of the grid, plus the 4-bit rounding of the group's minimum (at most half a dmin)
    dmin = h[..., 18:20].contiguous().view(torch.float16).float().repeat_interleave(256, -1).reshape(3, 5, 512)
    assert ((back - w).abs() <= 0.5 * step + 0.5 * dmin + 1e-6).all()
    zero = quant.quantize_q2_k(torch.zeros(1, 256))
    assert not zero[0].any() and not zero[1].any()
    with pytest.raises(ValueError, match="whole 256-value super-blocks"):
        quant.quantize_q2_k(torch.zeros(2, 320))


def test_q3_k_quantize_roundtrip_and_format():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 5, 512, generator=g) * torch.logspace(-3, 1, 512)
    v, h = quant.quantize_q3_k(w)
    assert v.dtype == h.dtype == torch.uint8 and v.shape == (3, 5, 192) and h.shape == (3, 5, 2, 14)
    q = quant.q3_k_codes(v)
    assert sorted(q.unique().tolist()) == list(range(-4, 4))  # every code used
    S = quant.q3_k_scales(h)
    # each super-block's largest scale is -32 steps of d (the largest magnitude maps to -4 of its group's scale)
    assert torch.equal(S.abs().amax(-1), 32 * h[..., 12:14].contiguous().view(torch.float16).float().abs()[..., 0])
    back = quant.dequantize_q3_k(v, h)
    step = S.abs().reshape(3, 5, 32).repeat_interleave(16, -1)
    # within half a step of the grid, plus the 6-bit rounding of the group's scale (half a d a step, up to 4 steps);
    # a value beyond the grid's top (3 steps: the largest magnitude of its group was negative) within a whole step
    d = h[..., 12:14].contiguous().view(torch.float16).float().abs().repeat_interleave(256, -1).reshape(3, 5, 512)
    top = (q * S.sign().reshape(3, 5, 32).repeat_interleave(16, -1) * w.sign()).abs() == 3
    assert ((back - w).abs() <= torch.where(top, 1.0, 0.5) * step + 2 * d + 1e-6).all()
    assert float((back - w).abs().mean()) < float(step.mean()) / 2
    zero = quant.quantize_q3_k(torch.zeros(1, 256))
    assert not quant.dequantize_q3_k(*zero).any() and not zero[1][..., 12:].any()  # d = 0
    with pytest.raises(ValueError, match="whole 256-value super-blocks"):
        quant.quantize_q3_k(torch.zeros(2, 320))
    sc = torch.randint(0, 64, (4, 16), generator=g, dtype=torch.uint8)  # the 6-bit packing round-trips
    heads = torch.cat([quant._q3_k_scale_bytes(sc), torch.ones(4, 1).half().view(torch.uint8)], -1)
    assert torch.equal(quant.q3_k_scales(heads), sc.float() - 32)


def test_q6_k_quantize_roundtrip_and_format():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 5, 512, generator=g) * torch.logspace(-3, 1, 512)
    v, h = quant.quantize_q6_k(w)
    assert v.dtype == h.dtype == torch.uint8 and v.shape == (3, 5, 384) and h.shape == (3, 5, 2, 18)
    q = quant.q6_k_codes(v)
    assert int(q.max()) <= 63 and torch.equal(quant._q6_k_bytes(q), v)  # the 6-bit codes pack back to the bytes
    sc = h[..., :16].contiguous().view(torch.int8)
    assert int(sc.min()) >= 0 and int(sc.amax(-1).min()) == 127  # each super-block's largest scale is 127
    S = quant.q6_k_scales(h).repeat_interleave(16, -1).reshape(w.shape)
    back = quant.dequantize_q6_k(v, h)
    assert ((back - w).abs() <= 0.5 * S * 1.01 + 1e-7).all()  # within half a step of its group's grid
    zero = quant.quantize_q6_k(torch.zeros(1, 256))
    assert not quant.dequantize_q6_k(*zero).any() and not zero[1].any()
    with pytest.raises(ValueError, match="whole 256-value super-blocks"):
        quant.quantize_q6_k(torch.zeros(2, 320))


def test_iq4_xs_quantize_roundtrip_and_format():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 5, 512, generator=g) * torch.logspace(-3, 1, 512)  # sub-blocks of many scales
    w[0, 0, :32] = -w[0, 0, :32].abs()  # a sub-block of negatives: its scale d (ls - 32) is positive
    w[0, 1, :32] = w[0, 1, :32].abs()  # and of positives: negative
    p, h = quant.quantize_iq4_xs(w)
    assert p.dtype == h.dtype == torch.uint8 and p.shape == (3, 5, 256) and h.shape == (3, 5, 2, 8)
    S = quant.iq4_xs_scales(h)
    assert float(S[0, 0, 0, 0]) > 0 > float(S[0, 1, 0, 0])
    ls = (S / h[..., 0:2].contiguous().view(torch.float16).float()).round()
    assert int(ls.abs().amax(-1).min()) == 31  # each super-block's largest scale is 31 steps of d
    back = quant.dequantize_iq4_xs(p, h)
    b = w.reshape(3, 5, 16, 32)
    values = torch.tensor(quant.IQ4_VALUES, dtype=torch.float32)
    grid = S.reshape(3, 5, 16, 1, 1) * values  # every value the codebook offers its sub-block
    best = (b[..., None] - grid).abs().amin(-1)
    assert torch.allclose((back.reshape(3, 5, 16, 32) - b).abs(), best, rtol=1e-6, atol=1e-12)  # the nearest entry
    zero = quant.quantize_iq4_xs(torch.zeros(1, 256))
    assert not zero[0].any() and not zero[1].any()
    with pytest.raises(ValueError, match="whole 256-value super-blocks"):
        quant.quantize_iq4_xs(torch.zeros(2, 320))


@pytest.mark.parametrize("fmt, at", [("q4_0", 0), ("q4_k", 2), ("q5_k", 0), ("q6_k", 208), ("q2_k", 82), ("q3_k", 108),
                                     ("iq4_xs", 0), ("iq2_xxs", 0), ("iq3_xxs", 0), ("iq3_s", 0), ("iq1_s", 0),
                                     ("iq1_m", None)],
                         ids=["q4_0-d", "q4_k-dmin", "q5_k-d", "q6_k-d", "q2_k-dmin", "q3_k-d", "iq4_xs-d", "iq2_xxs-d",
                              "iq3_xxs-d", "iq3_s-d", "iq1_s-d", "iq1_m-d"])
@pytest.mark.parametrize("isa", ISAS)
def test_k_quant_blocks_refuse_a_non_finite_scale_on_the_torch_packer(fmt, at, isa):
    """K-quant blocks copied by the PyTorch packer (packer="torch"; the compiled one is tested above): the same bytes
    as the compiled packer's, and a block whose fp16 d (or dmin) is NaN or Inf stops the packing as a non-finite
    weight of its expert, as the compiled packer does."""
    fm = FORMATS[fmt]
    raws = random_blocks(fm, 23, e=3)
    a, b = (fm.from_blocks(*raws, isa=isa, packer=p).packed_state() for p in ("torch", "native"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same bytes
    for bad in (0x7E00, 0x7C00, 0xFC00):  # NaN, +Inf, -Inf
        down = raws[2].clone()
        set_d(down[1, 5, 0], at, bad)
        with pytest.raises(moe_mod.NonFiniteWeights, match="down weights of expert 1"):
            fm.from_blocks(raws[0], raws[1], down, isa=isa, packer="torch")


@pytest.mark.parametrize("fmt", FMTS)
def test_gguf_bytes_and_gguf_py_dequantization(fmt):
    """The parts of GGUF blocks are the file's bytes (back to the same blocks), and de-quantize as gguf-py does."""
    gguf = pytest.importorskip("gguf")
    fm = FORMATS[fmt]
    raw = random_blocks(fm, 3, e=2, f=256, d=512)[0]  # gate: [2, 256, 512 / block, bytes]
    parts = fm.parts(raw)
    assert torch.equal(fm.to_raw(*parts), raw)
    ref = gguf.quants.dequantize(raw.numpy().reshape(512, -1), getattr(gguf.GGMLQuantizationType, fm.gguf_type))
    assert torch.equal(fm.dequantize(*parts).reshape(512, 512), torch.from_numpy(ref))
    if fmt in FILE_ONLY_DTYPES:
        return
    ours = fm.to_raw(*fm.quantize(torch.randn(4, 512)))  # our quantizer's blocks are valid blocks of the type
    ref = gguf.quants.dequantize(ours.numpy().reshape(4, -1), getattr(gguf.GGMLQuantizationType, fm.gguf_type))
    assert torch.equal(fm.dequantize(*fm.parts(ours)).reshape(4, 512), torch.from_numpy(ref))


IQ_FIELDS = {"iq2_xxs": (("codebook index", 256), ("sign index", 128), ("scale", 16)),
             "iq3_xxs": (("codebook index", 256), ("sign index", 128), ("scale", 16)),
             "iq3_s": (("codebook index", 512), ("sign", 2), ("scale", 16)),
             "iq1_s": (("codebook index", 2048), ("scale", 8), ("delta sign", 2)),
             "iq1_m": (("codebook index", 2048), ("scale", 8), ("delta sign", 2), ("d sign", 2))}


def iq_fields(fmt: str, raw: torch.Tensor) -> list[torch.Tensor]:
    """The fields of an IQ type's blocks, in IQ_FIELDS' order: iq2_xxs each group's codebook index and sign index,
    each sub-block's scale (iq3_xxs likewise, a codebook index per 4 values); iq1_s each group's 11-bit codebook index, each sub-block's scale and delta sign; iq1_m
    each group's 11-bit codebook index, each 16 values' scale, each group's delta sign and d's sign."""
    if fmt == "iq1_m":
        nib = (raw[..., 32:48, None].long() >> torch.tensor([0, 4])).reshape(*raw.shape[:-1], 32)
        sc = raw[..., 48:56].reshape(*raw.shape[:-1], 4, 2).long()
        sc = sc[..., 0] | sc[..., 1] << 8
        return [raw[..., :32].long() | (nib & 7) << 8, (sc[..., None] >> torch.tensor([0, 3, 6, 9])) & 7, nib >> 3 & 1,
                sc[..., 3] >> 15]
    if fmt == "iq1_s":
        qh = raw[..., 34:].reshape(*raw.shape[:-1], 8, 2).long()
        qh = qh[..., 0] | qh[..., 1] << 8
        idx = raw[..., 2:34].reshape(*raw.shape[:-1], 8, 4).long() | ((qh[..., None] >> torch.tensor([0, 3, 6, 9])) & 7) << 8
        return [idx, (qh >> 12) & 7, qh >> 15]
    if fmt == "iq3_s":
        bit8 = torch.arange(8)
        hi = ((raw[..., 66:74, None].long() >> bit8) & 1).reshape(*raw.shape[:-1], 64)
        nib = (raw[..., 106:110, None].long() >> torch.tensor([0, 4])) & 15
        return [raw[..., 2:66].long() | hi << 8, (raw[..., 74:106, None].long() >> bit8) & 1, nib]
    if fmt == "iq3_xxs":
        idx, words = raw[..., 2:66].long(), raw[..., 66:].reshape(*raw.shape[:-1], 8, 4).long()
    else:
        qs = raw[..., 2:].reshape(*raw.shape[:-1], 8, 8).long()
        idx, words = qs[..., :4], qs[..., 4:]
    aux = sum(words[..., i] << (8 * i) for i in range(4))
    return [idx, (aux[..., None] >> torch.tensor([0, 7, 14, 21])) & 127, aux >> 28]


@pytest.mark.parametrize("fmt", FILE_FMTS)
def test_random_blocks_hold_every_codebook_entry_sign_and_scale(fmt):
    """The random blocks the gguf-py comparison and the kernel tests read hold every value each field can take."""
    raw = random_blocks(FORMATS[fmt], 3, e=2, f=256, d=512)[0]
    for (what, n), field in zip(IQ_FIELDS[fmt], iq_fields(fmt, raw)):
        assert sorted(field.unique().tolist()) == list(range(n)), what


@pytest.mark.parametrize("fmt", FILE_FMTS)
@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_file_only_formats_refuse_float_weights(fmt, isa):
    """A file-only format (no quantizer from floats) refuses float weights in any matrix, naming the way to get its
    blocks, on both packers; its blocks beside a float down of another dtype are taken, as floats beside its down."""
    fm = FORMATS[fmt]
    ws = floats(fm, seed=50, e=2)
    raws = random_blocks(fm, 51, e=2)
    gu = [moe_mod.gguf_blocks(n, r, fm.gguf_type) for n, r in (("g", raws[0]), ("u", raws[1]))]
    for packer in ("native", "torch"):
        with pytest.raises(ValueError, match=f"{fmt} holds a GGUF file's {fm.gguf_type} blocks.*llama-quantize"):
            CpuMoE(*ws, dtype=fmt, isa=isa, packer=packer)
        with pytest.raises(ValueError, match="llama-quantize"):  # the blocks' down as floats, in the layer's dtype
            CpuMoE(*gu, ws[2], dtype=fmt, isa=isa, packer=packer)
        with pytest.raises(ValueError, match="llama-quantize"):  # a float down in this dtype beside int8
            CpuMoE(*ws, dtype="int8", down_dtype=fmt, isa=isa, packer=packer)
    with pytest.raises(ValueError, match="llama-quantize"):
        fm.quantize(ws[0])
    assert CpuMoE(*gu, ws[2], dtype=fmt, down_dtype="int8", isa=isa).down_dtype == "int8"
    assert CpuMoE(*ws[:2], moe_mod.gguf_blocks("d", raws[2], fm.gguf_type), dtype="int8", down_dtype=fmt,
                  isa=isa).down_dtype == fmt


@pytest.mark.parametrize("fmt", FILE_FMTS)
@pytest.mark.parametrize("isa", ISAS + ["ref"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_file_only_formats_on_ragged_shapes(fmt, isa, nodes, fused_knob):
    """A file-only format's blocks on shapes no power of two (5 experts, F = 768, D = 1280: three and five
    super-blocks; two NUMA slices of 512 + 256), every token count of the decode kernels and a prefill, a layer's cold
    experts only with resident ones masked off; against the reference on the file's values."""
    fm = FORMATS[fmt]
    e, f, d = 5, 768, 1280
    raws = random_blocks(fm, 52, e=e, f=f, d=d)
    ws = [fm.dequantize(*fm.parts(r)) for r in raws]
    held = [0, 2, 4]
    moe = fm.from_blocks(*(r[held] for r in raws), isa=isa, topology=topology(nodes), expert_ids=held, num_experts=e)
    ids, w = ragged_routing(40, seed=53)
    ids = ids % e
    x = torch.randn(40, d, generator=torch.Generator().manual_seed(54)).bfloat16()
    mask = torch.tensor([True, True, False, True, True])
    only = torch.zeros(e, dtype=torch.bool)
    only[held] = True
    ref = moe_forward(x, *ws, ids, w, expert_mask=only & mask)
    if isa == "ref":
        assert rel_err(moe.forward(x, ids, w, expert_mask=mask), ref) < 1e-2
        return
    for fused in (1, 0):
        fused_knob.append((moe.isa, _native.tune(moe.isa, "fused", fused)))
        for t in (1, 2, 3, 4, 40):
            y = moe.forward(x[:t], ids[:t], w[:t], expert_mask=mask)
            assert rel_err(y, ref[:t]) < TOL["int8"], (fused, t)


@pytest.mark.parametrize("fmt", FLOAT_FMTS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("knee", [1, 10**9], ids=["knee1", "vector"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("nodes", [1, 2, "shared"])
@pytest.mark.parametrize("T", [1, 5, 320])
def test_matches_reference(fmt, isa, knee, with_bias, nodes, T, fused_knob):
    fm = FORMATS[fmt]
    ws = floats(fm, seed=3, scale=2.0)
    bias = biases(e=E, f=fm.F, d=fm.D) if with_bias else {}
    moe = CpuMoE(*ws, dtype=fmt, isa=isa, topology=topology(nodes), amx_min_tokens=knee, **bias)
    assert moe.dtype == fmt and moe.group_size == 32 and len(moe.packed_weights()) == (1 if nodes == 1 else 2)
    ids, w = ragged_routing(T, seed=4)
    x = torch.randn(T, fm.D, generator=torch.Generator().manual_seed(5)).bfloat16()
    ref = moe_forward(x, *plain(fm, ws), ids, w, **bias)
    fused, phased = both_paths(moe, x, ids, w, fused_knob)
    assert rel_err(fused, ref) < TOL["int8"], rel_err(fused, ref)
    assert rel_err(phased, ref) < TOL["int8"], rel_err(phased, ref)
    assert rel_err(fused, phased) < 1e-2  # two summation orders of the same kernels (bf16 output)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T", [1, 3, 320])
def test_kernel_arithmetic_tight(fmt, isa, T, fused_knob):
    """With the activation rounding emulated only fp32 summation order differs: a scale read for the wrong block,
    sub-block or row, a lost last block, a wrong offset or minimum, a sign error on -128, a swapped nibble half
    is far outside the bounds. The weights are GGUF blocks with every value, scales over many octaves."""
    fm = FORMATS[fmt]
    raws = random_blocks(fm, 6)
    moe = fm.from_blocks(*raws, isa=isa, activation="silu")
    ws = [fm.dequantize(*fm.parts(r)) for r in raws]
    ids, w = ragged_routing(T, seed=7)
    x = torch.randn(T, fm.D, generator=torch.Generator().manual_seed(8))
    ref = emulated(x, ws, ids, w, "silu")
    for y in both_paths(moe, x, ids, w, fused_knob):
        assert rel_err(y, ref) < 1e-2
        assert float((y - ref).abs().mean() / ref.abs().mean()) < 2e-4


@pytest.mark.parametrize("fmt", FLOAT_FMTS)
@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_ragged_shapes_pad_to_whole_blocks(fmt, isa, fused_knob):
    """D and F with no whole last block (131, 97): float weights are zero padded before quantizing."""
    fm = FORMATS[fmt]
    ws = floats(fm, seed=9, f=97, d=131)
    moe = CpuMoE(*ws, dtype=fmt, isa=isa)
    ids, w = ragged_routing(40, seed=10)
    x = torch.randn(40, 131, generator=torch.Generator().manual_seed(11)).bfloat16()
    ref = moe_forward(x, *plain(fm, ws), ids, w)
    if isa == "ref":
        assert rel_err(moe.forward(x, ids, w), ref) < 1e-2
        return
    for fused in (1, 0):
        fused_knob.append((moe.isa, _native.tune(moe.isa, "fused", fused)))
        for t in (1, 2, 3, 4, 40):
            assert rel_err(moe.forward(x[:t], ids[:t], w[:t]), ref[:t]) < TOL["int8"], (fused, t)


@pytest.mark.parametrize("fmt", FLOAT_FMTS)
@pytest.mark.parametrize("isa", ISAS + ["ref"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_gguf_blocks_are_the_dtype_bit_for_bit(fmt, isa, nodes, fused_knob):
    """GGUF blocks packed as they are == the floats they stand for quantized by the dtype (which gives back the same
    blocks for values it quantized itself), and strided views of a fused gate_up == its halves."""
    fm = FORMATS[fmt]
    ws = floats(fm, seed=12)
    parts = [grid_parts(fm, w) for w in ws]
    raws = [fm.to_raw(*p) for p in parts]
    vals = [fm.dequantize(*p) for p in parts]
    for v, p in zip(vals, parts):
        assert all(torch.equal(a, b) for a, b in zip(fm.quantize(v), p))
    topo = topology(nodes)
    a = fm.from_blocks(*raws, isa=isa, topology=topo)
    b = CpuMoE(*vals, dtype=fmt, isa=isa, topology=topo)
    assert a.nbytes == b.nbytes
    gu = torch.stack([raws[0], raws[1]], 2).flatten(1, 2)  # gate/up rows interleaved, as a loader may see them
    c = fm.from_blocks(gu[:, ::2], gu[:, 1::2], raws[2], isa=isa, topology=topo)
    assert not gu[:, ::2].is_contiguous()
    ids, w = ragged_routing(320, seed=13)
    x = torch.randn(320, fm.D, generator=torch.Generator().manual_seed(14)).bfloat16()
    if isa == "ref":
        assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))
        assert torch.equal(a.forward(x, ids, w), c.forward(x, ids, w))
        return
    for ya, yb, yc in zip(*(both_paths(m, x, ids, w, fused_knob) for m in (a, b, c))):
        assert torch.equal(ya, yb) and torch.equal(ya, yc)


@pytest.mark.parametrize("fmt", FLOAT_FMTS)
@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_a_layer_of_blocks_and_floats(fmt, isa, fused_knob):
    """A GGUF layer whose down is of a type the dtype does not hold: gate and up packed as the file's blocks, down
    quantized from its values; the same bytes and outputs as the whole layer quantized from the values the blocks
    stand for (which the dtype gives back exactly)."""
    fm = FORMATS[fmt]
    ws = floats(fm, seed=23)
    parts = [grid_parts(fm, w) for w in ws]
    vals = [fm.dequantize(*p) for p in parts]
    raws = [fm.to_raw(*p) for p in parts]
    down = moe_mod.ExpertChunks(lambda e0, e1: vals[2][e0:e1], vals[2].shape)
    mixed = CpuMoE(moe_mod.gguf_blocks("gate", raws[0], fm.gguf_type), moe_mod.gguf_blocks("up", raws[1], fm.gguf_type),
                   down, dtype=fmt, isa=isa, topology=topology(2))
    whole = CpuMoE(*vals, dtype=fmt, isa=isa, topology=topology(2))
    ids, w = ragged_routing(40, seed=24)
    x = torch.randn(40, fm.D, generator=torch.Generator().manual_seed(25))
    if isa != "ref":
        a, b = mixed.packed_state(), whole.packed_state()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(mixed.forward(x, ids, w), whole.forward(x, ids, w))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_packed_weights_are_the_file_values(fmt, isa):
    """What the executor holds (and the GPU lane ships, hybrid.offload.sources): the file's values and scales
    verbatim, zero padded, at the format's bytes a padded weight."""
    from hybrid.offload.sources import packed_sources

    fm = FORMATS[fmt]
    raws = random_blocks(fm, 15)
    ws = [fm.dequantize(*fm.parts(r)) for r in raws]
    moe = fm.from_blocks(*raws, isa=isa, topology=topology(2))
    for node, src in zip(moe.packed_weights(), packed_sources(moe)):
        f0, f1 = node["f0"], node["f1"]
        for name, raw, full, pm in zip(("gate", "up", "down"), raws, ws, src.mats()):
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
            assert p["dtype"] == fmt
            held = fm.dequantize(p["q"], p["scale"])
            assert torch.equal(held[:, :rows, :k], want) and not held[:, rows:].any() and not held[:, :, k:].any()
            blocks = raw[cut] if name != "down" else raw[:, :, f0 // fm.block:f1 // fm.block]
            cols = {"q4_0": k // 2, "q4_k": k // 2, "q5_k": k // 2, "iq4_xs": k // 2, "q6_k": k // 4 * 3, "q2_k": k // 4,
                    "q3_k": k // 256 * 96, "iq2_xxs": k // 4, "iq3_xxs": k // 256 * 96, "iq3_s": k // 256 * 108,
                    "iq1_s": k // 256 * 48,
                    "iq1_m": k // 256 * 48}.get(fmt, k)  # the q bytes of k values
            got = fm.to_raw(p["q"][:, :rows, :cols], p["scale"][:, :rows, :k // fm.block])
            assert torch.equal(got, blocks)  # the file's bytes, regrouped
        if isa != "ref":  # one copy moves an expert (the scales live beside, as int4's)
            assert src.whole_block()
    if isa != "ref":
        mats = [m for n in moe.packed_weights() for m in (n["gate"], n["up"], n["down"])]
        held = sum(m["q"].numel() * m["q"].element_size() + m["scale"].numel() * m["scale"].element_size()
                   for m in mats)
        padded = sum(m["q"].shape[1] * m["scale"].shape[2] * fm.block for m in mats) * E
        assert moe.nbytes == held == fm.bytes_per_weight * padded


@pytest.mark.parametrize("fmt", FLOAT_FMTS)
@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_expert_subset_and_mask(fmt, isa, fused_knob):
    """A layer's cold experts only (expert_ids of num_experts), with resident ones masked off per call."""
    fm = FORMATS[fmt]
    ws = floats(fm, seed=16)
    held = [0, 2, 5]
    moe = CpuMoE(*(w[held].contiguous() for w in ws), dtype=fmt, isa=isa, expert_ids=held, num_experts=E)
    ids, w = ragged_routing(320, seed=17)
    x = torch.randn(320, fm.D, generator=torch.Generator().manual_seed(18))  # fp32: ref's sums, not a bf16 flip
    mask = torch.tensor([True, True, True, True, True, False])
    only = torch.zeros(E, dtype=torch.bool)
    only[held] = True
    ref = moe_forward(x, *plain(fm, ws), ids, w, expert_mask=only & mask)
    assert rel_err(moe_forward(x, *plain(fm, ws), ids, w, expert_mask=only), ref) > 0.05
    tol = 1e-5 if isa == "ref" else TOL["int8"]
    for T in (1, 9, 320):
        r = moe_forward(x[:T], *plain(fm, ws), ids[:T], w[:T], expert_mask=only & mask)
        assert rel_err(moe.forward(x[:T], ids[:T], w[:T], expert_mask=mask), r) < tol, T


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("isa", COMPILED[:1] + ["ref"])
def test_refusals(fmt, isa):
    fm = FORMATS[fmt]
    raws = random_blocks(fm, 19, e=2)
    with pytest.raises(ValueError, match=f"pack as dtype '{fmt}'"):
        fm.from_blocks(*raws, dtype="int8", isa=isa)
    with pytest.raises(ValueError, match=str(fm.block_bytes)):
        fm.from_blocks(raws[0][..., :-1], raws[1], raws[2], isa=isa)
    with pytest.raises(ValueError, match="uint8"):
        fm.from_blocks(raws[0].view(torch.int8), raws[1], raws[2], isa=isa)
    with pytest.raises(ValueError, match="expected w_gate"):  # down's shape disagrees with gate's
        fm.from_blocks(raws[0], raws[1], raws[1], isa=isa)
    src = moe_mod.gguf_blocks("gate", raws[0], fm.gguf_type)
    other = moe_mod._Mx4("up", torch.zeros(2, fm.F, fm.D // 32, 16, dtype=torch.uint8),
                         torch.zeros(2, fm.F, fm.D // 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="one kind of blocks"):  # two block kinds in one layer
        CpuMoE(src, other, floats(fm, e=2)[2], dtype=fmt, isa=isa)
    with pytest.raises(ValueError, match=f"on {fm.block}-value blocks"):
        src[:, :, fm.block // 2:]
    with pytest.raises(ValueError, match="Q4_0, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, MXFP4"):
        moe_mod.gguf_blocks("w", raws[0], "Q5_1")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("isa", [i for i in ("amx", "amx_emu") if i in COMPILED + EMU])
def test_amx_declines_loudly_once(fmt, isa, caplog, monkeypatch):
    monkeypatch.setattr(moe_mod, "_SAID_VECTOR_ONLY", set())
    fm = FORMATS[fmt]
    ws = [moe_mod.gguf_blocks(n, r, fm.gguf_type) for n, r in zip("gud", random_blocks(fm, 20, e=2))] \
        if fmt in FILE_ONLY_DTYPES else floats(fm, seed=20, e=2)
    with caplog.at_level(logging.WARNING, logger="cpu_kernels"):
        CpuMoE(*ws, dtype=fmt, isa=isa, amx_min_tokens=1)
        CpuMoE(*ws, dtype=fmt, isa=isa)
    said = [r for r in caplog.records if f"{fmt} has no AMX kernel" in r.getMessage()]
    assert len(said) == 1 and isa in said[0].getMessage()


@pytest.mark.parametrize("fmt", FMTS)
def test_planner_prices_the_format_at_its_bytes(fmt):
    """The memory model and the dtype table agree with what the executor holds."""
    from cpu_kernels.dtypes import CPU_DTYPES
    from placement.memory import packed_matrix_bytes

    fm = FORMATS[fmt]
    assert CPU_DTYPES[fmt].bytes_per_weight() == fm.bytes_per_weight
    assert packed_matrix_bytes(64, 2048, fmt, 32) == 64 * 2048 * fm.bytes_per_weight
    if COMPILED:
        if fmt in FILE_ONLY_DTYPES:
            moe = fm.from_blocks(*random_blocks(fm, 21, e=1, f=256, d=2048), isa=COMPILED[0], topology=topology(1))
        else:
            moe = CpuMoE(*floats(fm, seed=21, e=1, f=256, d=2048), dtype=fmt, isa=COMPILED[0], topology=topology(1))
        assert moe.nbytes == 2 * packed_matrix_bytes(256, 2048, fmt, 32) + packed_matrix_bytes(2048, 256, fmt, 32)


@pytest.mark.parametrize("fmt, at", [("q8_0", 0), ("q4_0", 0), ("q4_k", 0), ("q4_k", 2), ("q5_k", 0), ("q5_k", 2),
                                     ("q6_k", 208), ("q2_k", 80), ("q2_k", 82), ("q3_k", 108), ("iq4_xs", 0),
                                     ("iq2_xxs", 0), ("iq3_xxs", 0), ("iq3_s", 0), ("iq1_s", 0), ("iq1_m", None)],
                         ids=["q8_0-d", "q4_0-d", "q4_k-d", "q4_k-dmin", "q5_k-d", "q5_k-dmin", "q6_k-d", "q2_k-d", "q2_k-dmin",
                              "q3_k-d", "iq4_xs-d", "iq2_xxs-d", "iq3_xxs-d", "iq3_s-d", "iq1_s-d", "iq1_m-d"])
@pytest.mark.parametrize("isa", COMPILED)
def test_compiled_packer_copies_blocks_and_refuses_a_non_finite_scale(fmt, at, isa):
    """GGUF blocks go through the compiled packer (a copy on the node's threads), and a block whose fp16 d (q4_k:
    or dmin, q5_k likewise; q6_k: the block's last two bytes; q2_k: d, dmin its last four; q3_k: d its last two;
    iq4_xs: its first two; iq1_m: the top nibbles of its scales words) is NaN or Inf stops it as a non-finite weight of
    its expert."""
    fm = FORMATS[fmt]
    raws = random_blocks(fm, 22, e=3)
    moe = fm.from_blocks(*raws, isa=isa)
    assert moe._packs_natively(moe_mod.gguf_blocks("g", raws[0], fm.gguf_type)) == _native.has_packer(isa)
    for bad in (0x7E00, 0x7C00, 0xFC00):  # NaN, +Inf, -Inf
        down = raws[2].clone()
        set_d(down[1, 5, 0], at, bad)
        with pytest.raises(moe_mod.NonFiniteWeights, match="down weights of expert 1"):
            fm.from_blocks(raws[0], raws[1], down, isa=isa)


@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_a_down_of_its_own_dtype(isa, fused_knob):
    """A layer whose down has a dtype of its own (down_dtype): Q4_K gate and up kept as q4_k beside a Q8_0 down kept
    as q8_0, every matrix the file's values; the kernels (tight, activation rounding emulated) and the packed views
    (per-matrix dtypes, bytes) follow each matrix's format; from_packed gives the same executor back."""
    q4k, q8 = FORMATS["q4_k"], FORMATS["q8_0"]
    g, u, _ = random_blocks(q4k, 26)
    _, _, d = random_blocks(q8, 27, f=q4k.F, d=q4k.D)  # down [E, D, F] in Q8_0 blocks
    mats = (moe_mod.gguf_blocks("g", g, "Q4_K"), moe_mod.gguf_blocks("u", u, "Q4_K"), moe_mod.gguf_blocks("d", d, "Q8_0"))
    one = CpuMoE(*mats, dtype="q4_k", down_dtype="q8_0", isa=isa, topology=topology(1))
    moe = CpuMoE(*mats, dtype="q4_k", down_dtype="q8_0", isa=isa, topology=topology(2))
    ws = [q4k.dequantize(*q4k.parts(g)), q4k.dequantize(*q4k.parts(u)), q8.dequantize(*q8.parts(d))]
    ids, w = ragged_routing(320, seed=28)
    x = torch.randn(320, q4k.D, generator=torch.Generator().manual_seed(29))
    if isa == "ref":
        assert rel_err(one.forward(x, ids, w), moe_forward(x, *ws, ids, w)) < 1e-5
        return
    ref = emulated(x, ws, ids, w, "silu")  # (one node: the activations rounded per whole row, as emulated)
    for y in both_paths(one, x, ids, w, fused_knob):
        assert rel_err(y, ref) < 1e-2 and float((y - ref).abs().mean() / ref.abs().mean()) < 2e-4
    assert rel_err(moe.forward(x, ids, w), moe_forward(x, *ws, ids, w)) < TOL["int8"]  # two nodes' slices
    nodes = moe.packed_weights()
    assert [n[m]["dtype"] for n in nodes for m in ("gate", "up", "down")] == ["q4_k", "q4_k", "q8_0"] * 2
    held = sum(n[m]["q"].numel() * n[m]["q"].element_size() + n[m]["scale"].numel() * n[m]["scale"].element_size()
               for n in nodes for m in ("gate", "up", "down"))
    assert moe.nbytes == held and moe.layout["down_dtype"] == "q8_0" and moe.layout["kpad"] == 256
    back = CpuMoE.from_packed(moe.packed_state(), (E, q4k.F, q4k.D), moe.layout, dtype="q4_k", down_dtype="q8_0",
                              isa=isa, topology=topology(2))
    assert torch.equal(back.forward(x, ids, w), moe.forward(x, ids, w))


def check_down_beside(moe, ws, fd, gate, down, isa, fused_knob, D, seed):
    """A layer with a down of its own dtype against its de-quantized weights ws (gate, up, down): exact on ref,
    the kernels tight (activation rounding emulated) on the compiled ISAs; the packed views name each matrix's
    dtype and the down's hold the file's values. -> the first node's packed views (None on ref)."""
    ids, w = ragged_routing(320, seed=seed)
    x = torch.randn(320, D, generator=torch.Generator().manual_seed(seed + 1))
    if isa == "ref":
        assert rel_err(moe.forward(x, ids, w), moe_forward(x, *ws, ids, w)) < 1e-5
        return None
    ref = emulated(x, ws, ids, w, "silu")
    for y in both_paths(moe, x, ids, w, fused_knob):
        assert rel_err(y, ref) < 1e-2 and float((y - ref).abs().mean() / ref.abs().mean()) < 2e-4
    node = moe.packed_weights()[0]
    assert [node[m]["dtype"] for m in ("gate", "up", "down")] == [gate, gate, down]
    assert torch.equal(fd.dequantize(node["down"]["q"], node["down"]["scale"]), ws[2])
    return node


@pytest.mark.parametrize("down, gate", [("q3_k", "q2_k"), ("q3_k", "q4_k"), ("iq4_xs", "q4_k"), ("iq4_xs", "q8_0"),
                                        ("iq4_xs", "int8"), ("iq2_xxs", "q2_k"), ("q4_k", "iq2_xxs"),
                                        ("iq2_xxs", "int8"), ("iq2_xxs", "iq1_s"), ("q4_k", "iq1_s"), ("q2_k", "iq1_s"),
                                        ("iq1_s", "int8"), ("iq2_xxs", "iq1_m"), ("q4_k", "iq1_m"), ("iq1_m", "int8"),
                                        ("iq1_m", "iq1_s"), ("iq3_xxs", "iq2_xxs"), ("iq2_xxs", "iq3_xxs"),
                                        ("q4_k", "iq3_xxs"), ("iq3_xxs", "int8"), ("iq3_s", "iq3_xxs"),
                                        ("iq3_xxs", "iq3_s"), ("q4_k", "iq3_s")])
@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_a_super_block_down_beside_other_gates_and_ups(down, gate, isa, fused_knob):
    """A layer whose down is GGUF blocks kept in a format of their own (a Q3_K down as Q2_K and Q3_K_M files have
    them beside Q2_K or Q4_K, an IQ4_XS one, an IQ2_XXS one as unsloth's UD-IQ1 files have them, beside their IQ1_S
    gates and ups too; a Q4_K down beside IQ2_XXS gates and ups, a Q4_K or Q2_K one beside IQ1_S ones) beside a gate and up of another dtype (their file's blocks as they are, or floats quantized
    to int8): the kernels (tight, activation rounding emulated) on the file's values, and the
    packed views per matrix, the down's holding the file's values."""
    fd, fm = FORMATS[down], FORMATS.get(gate)
    _, _, d = random_blocks(fd, 40)
    if fm is not None:
        g, u, _ = random_blocks(fm, 41, f=fd.F, d=fd.D)
        mats = [moe_mod.gguf_blocks(n, r, fm.gguf_type) for n, r in (("g", g), ("u", u))]
        ws = [fm.dequantize(*fm.parts(g)), fm.dequantize(*fm.parts(u))]
    else:
        mats = floats(fd, seed=41)[:2]
        ws = [quant.dequantize_int8(*quant.quantize_int8(m)) for m in mats]
    moe = CpuMoE(*mats, moe_mod.gguf_blocks("d", d, fd.gguf_type), dtype=gate, down_dtype=down, isa=isa,
                 topology=topology(1))
    ws.append(fd.dequantize(*fd.parts(d)))
    check_down_beside(moe, ws, fd, gate, down, isa, fused_knob, fd.D, seed=42)


@pytest.mark.parametrize("gate", ["q4_k", "q8_0", "int4"])
@pytest.mark.parametrize("isa", ISAS + ["ref"])
def test_a_q4_0_down_beside_other_gates_and_ups(gate, isa, fused_knob):
    """A layer whose down is GGUF Q4_0 blocks kept as q4_0 (the file's bytes) beside a gate and up of another dtype:
    a Q4_K or Q8_0 file's blocks as they are, or floats in int4 groups of 128 (a layer's int4 stays its gate's and
    up's): the kernels (tight, activation rounding emulated) on the file's values, the packed views per matrix."""
    fd = FORMATS["q4_0"]
    F = D = 512
    _, _, d = random_blocks(fd, 44, f=F, d=D)
    kw = {"group_size": 128} if gate == "int4" else {}
    if gate in FORMATS:
        fm = FORMATS[gate]
        g, u, _ = random_blocks(fm, 45, f=F, d=D)
        mats = [moe_mod.gguf_blocks(n, r, fm.gguf_type) for n, r in (("g", g), ("u", u))]
        ws = [fm.dequantize(*fm.parts(g)), fm.dequantize(*fm.parts(u))]
    else:
        mats = floats(fd, seed=45, f=F, d=D)[:2]
        ws = [quant.dequantize_int4(*quant.quantize_int4(m, 128), 128) for m in mats]
    moe = CpuMoE(*mats, moe_mod.gguf_blocks("d", d, "Q4_0"), dtype=gate, down_dtype="q4_0", isa=isa,
                 topology=topology(1), **kw)
    ws.append(fd.dequantize(*fd.parts(d)))
    node = check_down_beside(moe, ws, fd, gate, "q4_0", isa, fused_knob, D, seed=46)
    if node is not None:
        assert torch.equal(fd.to_raw(node["down"]["q"], node["down"]["scale"]), d)  # the file's bytes


@pytest.mark.parametrize("isa", COMPILED[:1] + ["ref"])
def test_a_float_down_in_int8_beside_q4_k(isa):
    """A GGUF layer's down of a type no format holds (Q6_K in Q4_K_M files) quantized to int8 beside the kept q4_k
    gate and up: the reference on the q4_k values and the down's int8 values."""
    q4k = FORMATS["q4_k"]
    g, u, _ = random_blocks(q4k, 30)
    down = floats(q4k, seed=31)[2]
    moe = CpuMoE(moe_mod.gguf_blocks("g", g, "Q4_K"), moe_mod.gguf_blocks("u", u, "Q4_K"), down, dtype="q4_k",
                 down_dtype="int8", isa=isa)
    ws = [q4k.dequantize(*q4k.parts(g)), q4k.dequantize(*q4k.parts(u)), quant.dequantize_int8(*quant.quantize_int8(down))]
    ids, w = ragged_routing(40, seed=32)
    x = torch.randn(40, q4k.D, generator=torch.Generator().manual_seed(33))
    assert rel_err(moe.forward(x, ids, w), moe_forward(x, *ws, ids, w)) < (1e-5 if isa == "ref" else TOL["int8"])


def test_down_dtype_refusals():
    q4k, q8 = FORMATS["q4_k"], FORMATS["q8_0"]
    ws = floats(q4k, seed=34, e=2)
    for dtype, down in (("q4_k", "bf16"), ("q4_k", "int4"), ("bf16", "q8_0")):
        with pytest.raises(ValueError, match="a down of its own dtype"):
            CpuMoE(*ws, dtype=dtype, down_dtype=down)
    _, _, d = random_blocks(q8, 35, e=2, f=q4k.F, d=q4k.D)
    with pytest.raises(ValueError, match="Q8_0 blocks pack as dtype 'q8_0', not 'q4_k'"):
        CpuMoE(*ws[:2], moe_mod.gguf_blocks("d", d, "Q8_0"), dtype="q4_k")


@pytest.mark.parametrize("isa", ISAS)
def test_an_amx_dtype_with_a_down_of_its_own_runs_the_vector_path(isa, fused_knob):
    """int8 gate and up (AMX tiles above the knee) beside a q8_0 down (none): with every expert above the knee the
    layer still computes the reference (the tiles would read the down's bytes as int8's), on both paths."""
    fm = FORMATS["q8_0"]
    ws = floats(fm, seed=36)
    moe = CpuMoE(*ws, dtype="int8", down_dtype="q8_0", isa=isa, amx_min_tokens=1)
    plain_ws = [quant.dequantize_int8(*quant.quantize_int8(ws[0])), quant.dequantize_int8(*quant.quantize_int8(ws[1])),
                plain(fm, ws[2:])[0]]
    ids, w = ragged_routing(320, seed=37)
    x = torch.randn(320, fm.D, generator=torch.Generator().manual_seed(38)).bfloat16()
    ref = moe_forward(x, *plain_ws, ids, w)
    for y in both_paths(moe, x, ids, w, fused_knob):
        assert rel_err(y, ref) < TOL["int8"]


@pytest.mark.parametrize("dtype", sorted(quant.packed_dequantizers()))
def test_packed_dequantizers_keep_to_their_inputs_device(dtype):
    """The GPU ship lane de-quantizes packed bytes where they were staged (CUDA): every helper tensor a de-quantizer
    makes (shift tables, codebooks) must be on its inputs' device. Checked without a GPU on the meta device, where a
    CPU-made table raises as it would beside CUDA tensors."""
    g = torch.Generator().manual_seed(7)
    w = [torch.randn(2, 64, 256, generator=g), torch.randn(2, 64, 256, generator=g), torch.randn(2, 256, 64, generator=g)]
    if dtype in FILE_ONLY_DTYPES:
        fm = FORMATS[dtype]
        m = fm.from_blocks(*random_blocks(fm, 7, e=2, f=256, d=256), isa=COMPILED[0]).packed_weights()[0]["gate"]
    else:
        m = CpuMoE(*w, dtype=dtype, isa=COMPILED[0]).packed_weights()[0]["gate"]
    assert m["dtype"] == dtype
    fn = quant.packed_dequantizers()[dtype]
    out = fn(m["q"].to("meta"), m["scale"].to("meta"))
    assert out.device.type == "meta" and out.shape == fn(m["q"], m["scale"]).shape
