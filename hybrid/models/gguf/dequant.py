"""De-quantizers for the GGML tensor types the GGUF loader reads, as torch operations over whole tensors.

Each block type is a fixed number of bytes (`type_size`) holding `block_size` values; a tensor's rows are whole
blocks along its fastest axis (the last torch dim). The formulas are ggml's (ggml-quants.c, dequantize_row_*)
written the way gguf-py's numpy reference (gguf.quants) writes them, operation for operation in float32, so the
results are bit-identical to that reference (tests/test_gguf.py checks every type against it). No Python loop
runs over blocks: a tensor is reshaped to [n_blocks, type_size] and unpacked with shifts, masks and gathers.

`dequantize` returns a new float32 tensor; `dequantize_into` fills an existing tensor a leading-dim slice at a
time, so that a layer's expert stack is never materialised twice in float32.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

QK_K = 256  # values per super-block of the K-quants and IQ4_XS
# IQ4_NL / IQ4_XS non-linear 4-bit codebook (ggml-common.h kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4's e2m1 values, doubled (ggml-common.h kvalues_mxfp4); the scale is halved to match
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
CHUNK_VALUES = 1 << 24  # values de-quantized at once by dequantize_into (64 MiB of float32)


def _u8(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=like.device)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row (little-endian fp16) -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float32).clone()


def _f16_values(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float()


def _bf16(raw: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of a float32: a shift, exact for every code (NaN payloads included)
    return (raw.contiguous().view(torch.int16).int() << 16).view(torch.float32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    """34 bytes: fp16 d, 32 int8 q; x = q * d."""
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    """18 bytes: fp16 d, 16 bytes of nibbles (low nibbles: values 0-15, high: 16-31); x = (q - 8) * d."""
    n = b.shape[0]
    qs = b[:, 2:].reshape(n, 1, 16) >> _u8([0, 4], b).reshape(1, 2, 1)
    q = ((qs & 0x0F).reshape(n, 32).view(torch.int8) - 8).float()
    return _f16(b[:, :2]) * q


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per row -> 32 nibbles (the low nibbles are values 0-15, the high ones 16-31), uint8."""
    n = qs.shape[0]
    return ((qs.reshape(n, 1, 16) >> _u8([0, 4], qs).reshape(1, 2, 1)) & 0x0F).reshape(n, 32)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes per row (a little-endian uint32: bit j is value j's fifth bit) -> 32 bits, uint8."""
    n = qh.shape[0]
    return ((qh.reshape(n, 4, 1) >> _u8(range(8), qh).reshape(1, 1, 8)) & 0x01).reshape(n, 32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    """20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; x = d * q + m."""
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    """22 bytes: fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles; x = d * (q - 16): Q8_0's values of the blocks
    the CPU executor converts it to (cpu_kernels.quant.q8_0_blocks_from_q5_0)."""
    from cpu_kernels import quant

    return _q8_0(quant.q8_0_blocks_from_q5_0(b))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    """24 bytes: fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of nibbles; x = d * q + m."""
    q = _nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """18 bytes: fp16 d, 16 bytes of codebook nibbles; x = d * IQ4_VALUES[q]: Q8_0's values of the blocks the CPU
    executor converts it to (cpu_kernels.quant.q8_0_blocks_from_iq4_nl)."""
    from cpu_kernels import quant

    return _q8_0(quant.q8_0_blocks_from_iq4_nl(b))


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """17 bytes: e8m0 exponent e, 16 bytes of e2m1 nibbles (low: 0-15, high: 16-31); x = value * 2^(e-127)
    (the doubled codebook times half the scale, as ggml_e8m0_to_fp32_half)."""
    n = b.shape[0]
    e = b[:, :1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    qs = (b[:, 1:].reshape(n, 1, 16) >> _u8([0, 4], b).reshape(1, 2, 1)) & 0x0F
    values = torch.tensor(MXFP4_VALUES, dtype=torch.int8, device=b.device)[qs.long()].reshape(n, 32)
    return d * values.float()


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """84 bytes: 16 scale bytes (low nibble scale, high nibble min, per 16 values), 64 bytes of 2-bit codes,
    fp16 d, fp16 dmin; x = d * scale * q - dmin * min."""
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (qs.reshape(n, -1, 1, 32) >> _u8([0, 2, 4, 6], b).reshape(1, 1, 4, 1)) & 3
    q = q.reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """110 bytes: 32 bytes of high bits (hmask), 64 bytes of 2-bit codes, 12 bytes of 6-bit scales, fp16 d;
    x = d * (scale - 32) * (q - 4 * !high)."""
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    low = (scales[:, :8].reshape(n, 1, 8) >> _u8([0, 4], b).reshape(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> _u8([0, 2, 4, 6], b).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).view(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 16, 1)
    ql = (qs.reshape(n, -1, 1, 32) >> _u8([0, 2, 4, 6], b).reshape(1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> _u8(range(8), b).reshape(1, 1, 8, 1)).reshape(n, 16, 16) & 1
    q = (ql.view(torch.int8) - ((qh ^ 1) << 2).view(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """144 bytes: fp16 d, fp16 dmin, 12 scale bytes, 128 bytes of nibbles (per 64 values: 32 low, 32 high);
    x = d * scale * q - dmin * min, per 32 values."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dd = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    q = (b[:, 16:].reshape(n, -1, 1, 32) >> _u8([0, 4], b).reshape(1, 1, 2, 1)) & 0x0F
    return (dd * q.reshape(n, -1, 32).float() - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """176 bytes: Q4_K's fields plus 32 bytes of fifth bits before the nibbles."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dd = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = ((qs.reshape(n, -1, 1, 32) >> _u8([0, 4], b).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, -1, 32)
    qh = ((qh.reshape(n, -1, 1, 32) >> _u8(range(8), b).reshape(1, 1, 8, 1)) & 0x01).reshape(n, -1, 32)
    q = (ql | (qh << 4)).float()
    return (dd * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d;
    x = d * scale * (q - 32), per 16 values."""
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = _f16(b[:, 208:210])
    dd = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    ql = ((ql.reshape(n, -1, 1, 64) >> _u8([0, 4], b).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, -1, 32)
    qh = ((qh.reshape(n, -1, 1, 32) >> _u8([0, 2, 4, 6], b).reshape(1, 1, 4, 1)) & 0x03).reshape(n, -1, 32)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).reshape(n, 16, -1).float()
    return (dd * q).reshape(n, QK_K)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """136 bytes: fp16 d, 16 bits of scale high bits, 4 bytes of scale low nibbles, 128 bytes of codebook
    nibbles (per 32 values: 16 low, 16 high); x = d * (scale - 32) * IQ4_VALUES[q]."""
    n = b.shape[0]
    d = _f16(b[:, :2])
    high = b[:, 2].int() | (b[:, 3].int() << 8)  # a little-endian uint16
    high = ((high.reshape(n, 1) >> torch.arange(0, 16, 2, device=b.device).reshape(1, 8)) & 0x03).to(torch.uint8)
    low = ((b[:, 4:8].reshape(n, -1, 1) >> _u8([0, 4], b).reshape(1, 1, 2)) & 0x0F).reshape(n, 8)
    sc = (low | (high << 4)).view(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, -1, 1)
    qs = (b[:, 8:].reshape(n, -1, 1, 16) >> _u8([0, 4], b).reshape(1, 1, 2, 1)) & 0x0F
    values = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=b.device)[qs.long()].reshape(n, -1, 32)
    return (dl * values.float()).reshape(n, QK_K)


def _grid(kind: str, like: torch.Tensor) -> torch.Tensor:
    """The codebook of IQ type `kind` as the gguf package ships it (cpu_kernels.quant reads it): float32 [entries,
    values per entry], on like's device."""
    from cpu_kernels import quant

    return quant._iq_grid(kind.lower()).to(like.device)


def _sign_bits(signs: torch.Tensor) -> torch.Tensor:
    """uint8 [...] -> +1.0 / -1.0 [..., 8]: bit j of each byte set is value j negative."""
    bits = (signs[..., None] >> _u8(range(8), signs)) & 1
    return torch.where(bits == 0, 1.0, -1.0)


def _iq2_scales(d: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """IQ2_XS / IQ2_S: fp32 d [n, 1] and 8 scale bytes (a 4-bit ls per 16 values, low nibble first) ->
    d (0.5 + ls) / 4 as [n, 16, 1, 1]."""
    n = scales.shape[0]
    ls = ((scales.reshape(n, -1, 1) >> _u8([0, 4], scales).reshape(1, 1, 2)) & 0x0F).reshape(n, -1)
    return (d * (0.5 + ls.float()) * 0.25).reshape(n, -1, 1, 1)


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    """74 bytes: fp16 d, 32 little-endian uint16 (per 8 values a 9-bit index into a 512-entry codebook of
    magnitudes and a 7-bit sign index, KSIGNS), 8 scale bytes; x = d (0.5 + ls) / 4 x magnitude x sign."""
    from cpu_kernels.quant import KSIGNS

    n = b.shape[0]
    db = _iq2_scales(_f16(b[:, :2]), b[:, 66:74])
    qs = b[:, 2:66].reshape(n, 32, 2).long()
    qs = qs[..., 0] | (qs[..., 1] << 8)  # [n, 32]
    signs = _sign_bits(torch.tensor(KSIGNS, dtype=torch.uint8, device=b.device)[qs >> 9]).reshape(n, -1, 2, 8)
    grid = _grid("IQ2_XS", b)[qs & 511].reshape(n, -1, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    """82 bytes: fp16 d, 32 low bytes of 10-bit indices into a 1024-entry codebook of magnitudes (per 8 values),
    32 sign bytes (a bit a value), 8 bytes of the indices' top 2 bits, 8 scale bytes;
    x = d (0.5 + ls) / 4 x magnitude x sign."""
    n = b.shape[0]
    db = _iq2_scales(_f16(b[:, :2]), b[:, 74:82])
    qh = ((b[:, 66:74].reshape(n, 8, 1) >> _u8([0, 2, 4, 6], b).reshape(1, 1, 4)) & 0x03).reshape(n, 32)
    idx = b[:, 2:34].long() | (qh.long() << 8)
    signs = _sign_bits(b[:, 34:66]).reshape(n, -1, 2, 8)
    grid = _grid("IQ2_S", b)[idx].reshape(n, -1, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    """IQ3_S (110 bytes per 256 values: d, then qs, qh, signs and scales) by the CPU executor's reference,
    cpu_kernels.quant (gguf-py's formula; its codebook from the gguf package)."""
    from cpu_kernels import quant

    return quant.dequantize_iq3_s(b[:, 2:], b[:, None, :2])


def _tq1_0(b: torch.Tensor) -> torch.Tensor:
    """54 bytes: 48 bytes of 5 base-3 digits each (the first 32 bytes' i-th digits are values 32 i .. 32 i + 31,
    then the next 16 bytes' 16 at a time), 4 bytes of 4 digits each, fp16 d last; a digit is the top of byte x 3^i
    (mod 256) x 3 / 256; x = d (digit - 1)."""
    n = b.shape[0]
    pow3 = _u8([1, 3, 9, 27, 81], b)
    q = torch.cat([(b[:, :32].reshape(n, 1, 32) * pow3.reshape(1, 5, 1)).reshape(n, 160),
                   (b[:, 32:48].reshape(n, 1, 16) * pow3.reshape(1, 5, 1)).reshape(n, 80),
                   (b[:, 48:52].reshape(n, 1, 4) * pow3[:4].reshape(1, 4, 1)).reshape(n, 16)], dim=-1)
    q = ((q.int() * 3) >> 8) - 1
    return _f16(b[:, 52:54]) * q.float()


def _tq2_0(b: torch.Tensor) -> torch.Tensor:
    """66 bytes: 64 bytes of 2-bit codes (per 128 values: 32 bytes, bits 2 i of them values 32 i .. 32 i + 31),
    fp16 d last; x = d (q - 1)."""
    n = b.shape[0]
    q = (b[:, :64].reshape(n, 2, 1, 32) >> _u8([0, 2, 4, 6], b).reshape(1, 1, 4, 1)) & 0x03
    return _f16(b[:, 64:66]) * (q.reshape(n, QK_K).int() - 1).float()


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    """IQ2_XXS (66 bytes per 256 values: d, then qs) by the CPU executor's reference, cpu_kernels.quant (gguf-py's
    formula; its codebook from the gguf package)."""
    from cpu_kernels import quant

    return quant.dequantize_iq2_xxs(b[:, 2:], b[:, None, :2])


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    """IQ3_XXS (98 bytes per 256 values: d, then qs) by the CPU executor's reference, cpu_kernels.quant (gguf-py's
    formula; its codebook from the gguf package)."""
    from cpu_kernels import quant

    return quant.dequantize_iq3_xxs(b[:, 2:], b[:, None, :2])


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    """IQ1_S (50 bytes per 256 values: d, qs, qh) by the CPU executor's reference, cpu_kernels.quant (gguf-py's
    formula; its codebook from the gguf package)."""
    from cpu_kernels import quant

    return quant.dequantize_iq1_s(b[:, 2:], b[:, None, :2])


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    """IQ1_M (56 bytes per 256 values: qs, qh, scales words holding d's nibbles) by the CPU executor's reference,
    cpu_kernels.quant (gguf-py's formula; its codebook from the gguf package)."""
    from cpu_kernels import quant

    return quant.dequantize_iq1_m(b)


# ggml type -> (whole-tensor float decoder | per-block decoder). Float types read the raw bytes as they are.
_FLOAT = {T.F32: _f32, T.F16: _f16_values, T.BF16: _bf16}
_BLOCK = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.MXFP4: _mxfp4, T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k,
          T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.IQ4_XS: _iq4_xs, T.IQ2_XXS: _iq2_xxs, T.IQ3_XXS: _iq3_xxs,
          T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m,
          T.IQ3_S: _iq3_s,
          # no CPU format holds these: the loader de-quantizes them and packs the floats (repack.NEAREST)
          T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s, T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0,
          # the legacy 32-value types llama-quantize falls back to where a row is not whole 256-value blocks (a
          # K-type file's MLA attn_k_b of 128 columns: Q4_K -> Q5_0, Q5_K -> Q5_1, Q2_K / Q3_K / IQ4_XS -> IQ4_NL)
          T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.IQ4_NL: _iq4_nl}
SUPPORTED = tuple(_FLOAT) + tuple(_BLOCK)


def type_name(ggml_type) -> str:
    try:
        return T(int(ggml_type)).name
    except ValueError:
        return f"unknown type {int(ggml_type)}"


def nbytes(ggml_type, shape) -> int:
    """Bytes a tensor of `shape` (torch order) takes in `ggml_type`; ValueError if its rows are not whole blocks."""
    block, size = GGML_QUANT_SIZES[T(int(ggml_type))]
    values = 1
    for d in shape:
        values *= int(d)
    if shape and int(shape[-1]) % block:
        raise ValueError(f"rows of {shape[-1]} values are not whole {type_name(ggml_type)} blocks of {block}")
    return values // block * size


def dequantize(raw: torch.Tensor, ggml_type, shape) -> torch.Tensor:
    """The raw bytes `raw` (uint8, any shape, C order) of a tensor of ggml type `ggml_type` and logical shape
    `shape` (torch order: the last dim is ggml's ne[0]) -> a new float32 tensor of that shape.
    ValueError for a type without a de-quantizer here or bytes that do not match the shape."""
    t = T(int(ggml_type))
    shape = tuple(int(d) for d in shape)
    raw = raw.reshape(-1)
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw bytes must be uint8, got {raw.dtype}")
    if raw.numel() != nbytes(t, shape):
        raise ValueError(f"{t.name} {list(shape)} needs {nbytes(t, shape)} bytes, got {raw.numel()}")
    if t in _FLOAT:
        return _FLOAT[t](raw).reshape(shape)
    if t not in _BLOCK:
        raise ValueError(f"no de-quantizer for {t.name} (supported: {', '.join(x.name for x in SUPPORTED)})")
    size = GGML_QUANT_SIZES[t][1]
    return _BLOCK[t](raw.reshape(-1, size)).reshape(shape)


def chunks(raw: torch.Tensor, ggml_type, shape, max_values: int | None = None):
    """Yields (start, stop, float32 values of rows start:stop of the leading dim) of the tensor of `shape` whose
    bytes are `raw`, about max_values (default CHUNK_VALUES) values at a time (one chunk for a tensor of fewer
    than two dims)."""
    shape = tuple(int(d) for d in shape)
    raw = raw.reshape(-1)
    if len(shape) < 2:
        yield 0, shape[0] if shape else 1, dequantize(raw, ggml_type, shape)
        return
    row_values = 1
    for d in shape[1:]:
        row_values *= d
    row_bytes = nbytes(ggml_type, shape[1:])
    if raw.numel() != row_bytes * shape[0]:
        raise ValueError(f"{type_name(ggml_type)} {list(shape)} needs {row_bytes * shape[0]} bytes, got {raw.numel()}")
    step = max(1, (max_values or CHUNK_VALUES) // max(row_values, 1))
    for start in range(0, shape[0], step):
        stop = min(shape[0], start + step)
        yield start, stop, dequantize(raw[start * row_bytes: stop * row_bytes], ggml_type, (stop - start, *shape[1:]))


def dequantize_into(dst: torch.Tensor, raw: torch.Tensor, ggml_type, check=None) -> None:
    """dst[...] = dequantize(raw, ggml_type, dst.shape), a slice of dst's leading dim at a time (chunks), cast to
    dst's dtype and device: a layer's expert stack is never held twice in float32. check(values) runs on each
    float32 chunk before it is stored (the loader's NaN/Inf check)."""
    for start, stop, values in chunks(raw, ggml_type, dst.shape):
        if check is not None:
            check(values)
        if dst.dim() < 2:
            dst.copy_(values)
        else:
            dst[start:stop].copy_(values)
