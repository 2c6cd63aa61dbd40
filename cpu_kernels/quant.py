"""Weight quantization for the CPU executor (pure torch; the packed formats the kernels read).

int8: per output channel (row) symmetric: q = round(w / s), s = max|w_row| / 127, q in [-127, 127]
      (never -128, so the AVX2 sign trick and VNNI sums stay exact); w ~ q * s.
int4: per row and group of `group` reduction values (32, 64 or 128): s = max|w_group| / 7,
      q = clamp(round(w / s), -8, 7), stored as the nibble q + 8; w ~ (nibble - 8) * s. Within each 64-value
      chunk of a stored row the 32 bytes hold stored values 0..31 in their low nibbles and 32..63 in their high
      nibbles, so one 32-byte load unpacks to 64 values (16 words of 4) with one AND and one shift.
      The stored order is group-interleaved (int4_order): a row is cut into fold blocks of `fold` groups
      (int4_fold_groups: the largest of 16, 8, 4, 2, 1 that divides the row's group count), and in each
      unpacked chunk of a block word l (4 consecutive values) belongs to group l // (16 / fold) of the block.
      So each of the 16 int32 lanes of a dot-product vector only ever sums one group's values across the block,
      and a kernel converts and scales once per block and row, not once per group and row (a 2048-value row in
      groups of 128: once instead of 16 times). Group s of a block is, in its natural order, the words
      [s L, s L + L) (L = 16 / fold) of the block's chunks one after another. The kernels read the activations
      in the same stored order (the executor reorders each token's quantized row once per call); fold = 1 (an
      odd group count) is the natural order.
mxfp4: the OCP microscaling format gpt-oss checkpoints are published in: blocks uint8 [..., R, K/32, 16] and
      scales uint8 [..., R, K/32]. Each byte holds two FP4 (e2m1) codes, the low nibble first (value 2j), the
      high nibble second (value 2j+1); a code maps through FP4_VALUES and the block of 32 is multiplied by
      2^(scale - 127). w = FP4_VALUES[code] * 2^(e - 127), exactly representable in fp32 (and in bf16 for
      exponents in bf16's range).
      The executor's packed mxfp4 (CpuMoE dtype "mxfp4"; pack_mxfp4 / unpack_mxfp4 below): per row, the codes
      in int4's chunk layout: per 64 K values (two 32-value blocks) 32 bytes, byte i holding block 2c's value
      i in its low nibble and block 2c+1's value i in its high nibble (so one 32-byte load unpacks to 64
      consecutive codes with one AND and one shift, exactly as int4); plus the uint8 exponents [R, K/32] as
      published, one per block. 16 + 1 bytes per 32 weights = 0.53125 bytes a weight. Rows are zero padded
      to a multiple of 64 values (a zero code is 0.0 whatever the exponent), so the format asks K % 32 == 0
      (D and F of an expert, the reduction lengths of gate/up and down) and the executor refuses other shapes.
q8_0: int8 in blocks of 32 values along K with an fp16 scale each, llama.cpp's Q8_0: per block d = fp16(max|w| / 127),
      q = clamp(round(w / d), -127, 127) (0 where d is 0); w ~ q * d. Packed as values int8 [..., R, K] (rows as
      int8's) and scales fp16 [..., R, K/32]: 1 + 2/32 bytes a weight. Rows are zero padded (scale 0) to a multiple
      of 64 values; the kernels read any q in [-128, 127], so a GGUF file's blocks are held as they are.
q4_0: llama.cpp's Q4_0 values: in blocks of 32 values along K, 4-bit q in 0..15 with an fp16 scale d each, w = (q - 8) d.
      Packed as the file holds a block's values: q uint8 [..., R, K/2], per block 16 bytes whose byte j holds value j's
      q in its low nibble and value 16 + j's in its high one, a row's blocks back to back; and scales fp16 [..., R,
      K/32] as q8_0's: 0.5 + 2/32 bytes a weight, the file's 4.5 bits (int4 in groups of 32 holds the same values at 5
      bits, its scales fp32). quantize_q4_0 is llama.cpp's rule, rounded to nearest against the scale the block holds:
      d = fp16(m / -8), m the block's value of largest magnitude (the first one; d = +0 where that is zero), q =
      clamp(round(w / d), -8, 7) + 8 (8 where d is 0). Rows are padded (the byte 0x88, q = 8, under a zero scale: what
      an all-zero block quantizes to) to a multiple of 64 values.
q4_k: llama.cpp's Q4_K values: rows in super-blocks of 256 values, each 8 sub-blocks of 32 with a 6-bit scale sc
      and a 6-bit minimum m, and per super-block an fp16 d and dmin: w = (d sc) q - (dmin m), q in 0..15. Packed as
      nibbles [..., R, K/2] in int4's natural chunk layout (which is Q4_K's own: per 64 values 32 bytes, low nibbles
      the first 32, high nibbles the next) and heads uint8 [..., R, K/256, 16]: a super-block's d, dmin (fp16) and
      its 12 bytes of packed 6-bit scales and minimums (ggml's get_scale_min_k4 layout), 4.5 bits a weight as the
      file's. Rows are zero padded to a multiple of 256 values (an all-zero head: d = dmin = 0). quantize_q4_k is a
      round-to-nearest quantizer (per sub-block the range [min(w, 0), max(w)] over 15 steps, then the scales and
      minimums to 6 bits against the super-block's largest), not llama.cpp's search for the best scales.
q5_k: llama.cpp's Q5_K values: q4_k's with a fifth bit per value, q = nibble + 16 x bit in 0..31: nibbles as q4_k's
      and heads uint8 [..., R, K/256, 48]: q4_k's 16-byte head, then the 32 bytes qh of fifth bits as the file holds
      them (value 64 j + l, l < 32, takes bit 2 j of qh[l]; value 64 j + 32 + l bit 2 j + 1), 5.5 bits a weight as
      the file's. quantize_q5_k rounds as quantize_q4_k does, over 31 steps.
q2_k: llama.cpp's Q2_K values: rows in super-blocks of 256 values, each 16 groups of 16 with a 4-bit scale sc and a
      4-bit minimum m, and per super-block an fp16 d and dmin: w = (d sc) q - (dmin m), q in 0..3. Packed as values
      uint8 [..., R, K/4] as the file holds them (in each half of 128 values, 32 bytes: value 32 j + l is bits 2 j,
      2 j + 1 of byte l) and heads uint8 [..., R, K/256, 20]: the 16 scale bytes (sc low nibble, m high), then d
      and dmin; 2.625 bits a weight as the file's. quantize_q2_k rounds as quantize_q4_k does, over 3 steps.
q3_k: llama.cpp's Q3_K values: rows in super-blocks of 256 values, each 16 groups of 16 with a signed 6-bit scale sc
      (-32..31), and per super-block an fp16 d: w = d sc q, q in -4..3 (low2 - 4 where the value's high bit is clear).
      Packed as the file holds a super-block: values uint8 [..., R, K/256 * 96] (per super-block 32 bytes hmask, value
      32 b + l's high bit being bit b of hmask[l], then q2_k's 64 bytes of low bit pairs) and heads uint8 [..., R,
      K/256, 14]: the 12 bytes of scales as ggml packs them (sc + 32: scale i < 8 the low nibble of byte i, i >= 8 the
      high nibble of byte i - 8; scale 4 g + i's top two bits bits 2 g, 2 g + 1 of byte 8 + i), then d; 3.4375 bits a
      weight as the file's. Rows are zero padded to a multiple of 256 values (zero bytes: d = 0). quantize_q3_k rounds
      to nearest as llama.cpp's reference does without its search: per group the scale that maps the value of
      largest magnitude to -4, per super-block d that maps the scale of largest magnitude to -32 (both may be
      negative), each value rounded against the scale the head holds.
q6_k: llama.cpp's Q6_K values: rows in super-blocks of 256 values, each 16 groups of 16 with an int8 scale sc, and
      per super-block an fp16 d: w = d sc (q - 32), q in 0..63. Packed as the file holds a super-block: values uint8
      [..., R, K/256 * 192] (per super-block 128 bytes ql of low nibbles, then 64 bytes qh of high bit pairs; in each
      half of 128 values, value l < 32 is ql[l]'s low nibble under qh[l]'s bits 0-1, l + 32 ql[l + 32]'s low nibble
      under bits 2-3, l + 64 ql[l]'s high nibble under bits 4-5, l + 96 ql[l + 32]'s high nibble under bits 6-7) and
      heads uint8 [..., R, K/256, 18]: the 16 scales, then d; 6.5625 bits a weight as the file's. Rows are zero padded
      to a multiple of 256 values (an all-zero head). quantize_q6_k rounds to nearest (per group the scale
      max|w| / 31, rounded up to an int8 multiple of the super-block's d = the largest / 127, so no value clips), not
      llama.cpp's search for the best scales.
iq4_xs: llama.cpp's IQ4_XS values: rows in super-blocks of 256 values, each 8 sub-blocks of 32 with a 6-bit scale
      ls, and per super-block an fp16 d: w = d (ls - 32) IQ4_VALUES[q], q in 0..15 an index into the non-uniform
      codebook IQ4_VALUES (llama.cpp's kvalues_iq4nl). Packed as indices [..., R, K/2] in int4's natural chunk layout
      (per 64 values 32 bytes, values 0..31 in the low nibbles, 32..63 in the high ones) and heads uint8 [..., R,
      K/256, 8], the file's own: fp16 d, uint16 scales_h (bits 2 i, 2 i + 1: sub-block i's top two scale bits), uint8
      scales_l[4] (byte i / 2, nibble i % 2: its low four); 4.25 bits a weight as the file's. quantize_iq4_xs rounds
      to nearest: per sub-block the value of largest magnitude m (the first one) sets s = m / -127 (so m is the
      codebook's -127 entry times s), d = max|s| / 31 in fp16, ls = round(s / d) + 32 clamped to 0..63 (0 where d
      is 0: zeros are all zero bytes, as the padding), and each value takes its nearest codebook entry on the grid
      d (ls - 32) (index 0 where that is 0); not llama.cpp's search for the best scales. Rows are zero padded to a
      multiple of 256 values.
iq2_xxs: llama.cpp's IQ2_XXS values: rows in super-blocks of 256 values with an fp16 d, each 8 sub-blocks of 32 with a
      4-bit scale ls, each 4 groups of 8 values with an 8-bit index into a 256-entry codebook of 8 magnitudes (8, 25 or
      43; IQ2_XXS_GRID, the gguf package's table) and a 7-bit sign index (its 7 bits the signs of values 0-6, an 8th
      making the count of negatives even: KSIGNS): w = d (0.5 + ls) / 4 x magnitude x sign. Packed as the file holds a
      super-block's 64 bytes of qs: values uint8 [..., R, K/256 * 64] (per sub-block 8 bytes: the 4 group indices, then
      a little-endian uint32 of the 4 sign indices at bits 7 l and ls at bits 28-31) and heads uint8 [..., R, K/256,
      2], d; 2.0625 bits a weight as the file's. Rows are zero padded to a multiple of 256 values (d = 0).
      quantize_iq2_xxs rounds floats to the nearest codebook entry at a least-squares scale per 32 values, not
      llama.cpp's importance-weighted search (which llama-quantize's IQ2_XXS files come from).
iq3_xxs: llama.cpp's IQ3_XXS values: rows in super-blocks of 256 values with an fp16 d, each 8 sub-blocks of 32 with a
      4-bit scale ls, each 8 groups of 4 values with an 8-bit index into a 256-entry codebook of 4 magnitudes (4 to 62;
      the gguf package's table), and per 8 values a 7-bit sign index as iq2_xxs's (KSIGNS): w = d (0.5 + ls) / 2 x
      magnitude x sign. Packed as the file holds a super-block's 96 bytes of qs: values uint8 [..., R, K/256 * 96]
      (64 bytes of group indices, 8 per sub-block, then per sub-block a little-endian uint32 of its 4 sign indices at
      bits 7 l and ls at bits 28-31) and heads uint8 [..., R, K/256, 2], d; 3.0625 bits a weight as the file's. Rows
      are zero padded to a multiple of 256 values (d = 0). A GGUF file's blocks only: no quantizer from floats.
iq3_s: llama.cpp's IQ3_S values: rows in super-blocks of 256 values with an fp16 d, each 8 sub-blocks of 32 with a
      4-bit scale ls, each 8 groups of 4 values with a 9-bit index into a 512-entry codebook of 4 odd magnitudes (1 to
      15; the gguf package's table), and a sign bit per value: w = d (1 + 2 ls) x magnitude x sign. Packed as the file
      holds a super-block's 108 bytes after d: values uint8 [..., R, K/256 * 108] (64 bytes of the indices' low 8
      bits, then 8 bytes of their 9th bits, bit j of byte ib for group 8 ib + j; 32 bytes of sign bits, bit j of byte
      i for value 8 i + j; 4 bytes of scales, sub-block 2 i's in byte i's low nibble, 2 i + 1's in its high one) and
      heads uint8 [..., R, K/256, 2], d; 3.4375 bits a weight as the file's. Rows are zero padded to a multiple of 256
      values (d = 0). A GGUF file's blocks only: no quantizer from floats.
iq1_s: llama.cpp's IQ1_S values: rows in super-blocks of 256 values with an fp16 d, each 8 sub-blocks of 32 with a
      3-bit scale ls and a delta sign, each 4 groups of 8 values with an 11-bit index into a 2048-entry codebook of 8
      values in {-1, 0, 1} (IQ1_GRID, the gguf package's table, which IQ1_M shares): w = d (2 ls + 1) (g + delta),
      delta = +-IQ1_DELTA (-0.125 where the sub-block's sign bit is set). Packed as the file holds a super-block's
      48 bytes after d: values uint8 [..., R, K/256 * 48] (qs, 32 bytes: the low 8 bits of group l's index; then qh,
      8 little-endian uint16, one per sub-block: bits 3 i .. 3 i + 2 the top 3 bits of its group i's index, bits 12-14
      ls, bit 15 the delta sign) and heads uint8 [..., R, K/256, 2], d; 1.5625 bits a weight as the file's. Rows are
      zero padded to a multiple of 256 values (d = 0). No quantizer from floats: a GGUF file's blocks only.
iq1_m: llama.cpp's IQ1_M values: rows in super-blocks of 256 values, 56 bytes each: qs (32 bytes, the low 8 bits of
      group l's 11-bit codebook index), qh (16 bytes, byte j's low nibble for group 2 j, high nibble for 2 j + 1: bits
      0-2 the index's top 3 bits, bit 3 the delta sign) and 4 little-endian uint16 scales words (word w's bits
      3 i .. 3 i + 2 the 3-bit scale ls of 16-value piece 4 w + i, its bits 12-15 bits 4 w .. 4 w + 3 of the
      super-block's fp16 d, which has no field of its own: iq1_m_d): w = d (2 ls + 1) (g + delta), g from IQ1_S's
      codebook, delta +-IQ1_DELTA per 8 values. Packed as the file holds them: values uint8 [..., R, K/256 * 48] (qs,
      then qh) and heads uint8 [..., R, K/256, 8] (the scales words, d's nibbles among them); 1.75 bits a weight as
      the file's. Rows are zero padded to a multiple of 256 values (d = 0). No quantizer from floats, as iq1_s.
      dequantize_iq1_m takes the raw blocks, dequantize_iq1_m_packed the packed bytes.
GGUF blocks held exactly (a GGUF file's experts repacked without de-quantizing them):
  Q4_0: 18 bytes per 32 values, fp16 d then 16 bytes whose low nibbles are values 0-15 and high nibbles
      values 16-31; x = (q - 8) * d. That is q4_0 above exactly (q4_0_parts: the 16 bytes and d apart), and int4 in
      groups of 32 with the nibble q and the scale d (fp16 is exact in fp32; d may be negative): q4_0_nibbles gives
      the nibbles in natural order and pack_int4 stores them. Re-quantizing the values into int4 instead is not
      lossless: Q4_0 maps a block's largest magnitude to -8, quantize_int4 to +-7.
  Q8_0: 34 bytes per 32 values, fp16 d then 32 int8 values; x = q * d. That is q8_0 above exactly (q8_0_parts).
  Q4_K: 144 bytes per 256 values, the 16-byte head then 128 bytes of nibbles: q4_k above exactly (q4_k_parts).
  Q2_K: 84 bytes per 256 values, the 16 scale bytes, 64 bytes of values, then d and dmin: q2_k above exactly
      (q2_k_parts moves d and dmin beside the scales).
  Q3_K: 110 bytes per 256 values, hmask, the 2-bit values, the scales, then d: q3_k above exactly (q3_k_parts).
  Q5_K: 176 bytes per 256 values, q5_k's 48-byte head, then 128 bytes of nibbles: q5_k above exactly (q5_k_parts).
  Q6_K: 210 bytes per 256 values, ql, qh, the scales, then d: q6_k above exactly (q6_k_parts).
  IQ4_XS: 136 bytes per 256 values, the 8-byte head then 16 bytes of indices per 32 values, whose low nibbles are
      values 0-15 and high nibbles 16-31: iq4_xs above exactly (iq4_xs_parts re-pairs the nibbles into int4's chunk
      layout, values j and 32 + j of each 64 in byte j).
  IQ2_XXS: 66 bytes per 256 values, d then the 64 bytes of qs: iq2_xxs above exactly (iq2_xxs_parts).
  IQ3_XXS: 98 bytes per 256 values, d then the 96 bytes of qs: iq3_xxs above exactly (iq3_xxs_parts).
  IQ3_S: 110 bytes per 256 values, d then qs, qh, the signs and the scales: iq3_s above exactly (iq3_s_parts).
  IQ1_S: 50 bytes per 256 values, d then qs and qh: iq1_s above exactly (iq1_s_parts).
  IQ1_M: 56 bytes per 256 values, qs, qh, then the scales words: iq1_m above exactly (iq1_m_parts).
  MXFP4: 17 bytes per 32 values, the e8m0 exponent then 16 bytes whose low nibbles are values 0-15 and high
      nibbles 16-31 (the published OCP layout pairs values 2j, 2j+1 in byte j instead); the e2m1 codes and the
      exponent mean what they mean in mxfp4 above. mxfp4_pairs_from_gguf re-pairs the nibbles.
Rounding is round-half-to-even, as in the kernels' on-the-fly activation quantization.
"""

from __future__ import annotations

import functools

import torch

from .dtypes import CPU_DTYPES

GROUP_SIZES = CPU_DTYPES["int4"].group_sizes  # (32, 64, 128)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] -> (q int8 [..., R, K], scale fp32 [..., R])."""
    wf = w.float()
    amax = wf.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(wf * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """u uint8 [..., R, K] with values 0..15, K % 64 == 0 -> [..., R, K/2] (layout in the module doc)."""
    *lead, K = u.shape
    c = u.reshape(*lead, K // 64, 2, 32)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*lead, K // 2).contiguous()


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    *lead, H = p.shape
    c = p.reshape(*lead, H // 32, 32)
    return torch.stack([c & 0x0F, c >> 4], dim=-2).reshape(*lead, H * 2)


def _check_int4_shape(K: int, group: int) -> None:
    if group not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group}")
    if K % 64 or K % group:
        raise ValueError(f"int4: reduction length {K} must be a multiple of 64 and of the group {group}")


def int4_fold_groups(K: int, group: int) -> int:
    """Groups per fold block of a K-value int4 row (module doc): the largest of 16, 8, 4, 2, 1 dividing K / group.
    K % 64 == 0, so groups of 32 always give at least 2 (a chunk's two halves)."""
    _check_int4_shape(K, group)
    G = K // group
    return next(f for f in (16, 8, 4, 2, 1) if G % f == 0)


def int4_natural_fold(group: int) -> int:
    """The fold whose stored order is the natural one (one group per chunk, or a chunk's two halves)."""
    return 1 if group >= 64 else 2


def _fold(K: int, group: int, fold: int | None) -> int:
    _check_int4_shape(K, group)
    if fold is None:
        return int4_fold_groups(K, group)
    if fold not in (1, 2, 4, 8, 16) or (K // group) % fold or fold * group % 64:
        raise ValueError(f"int4: fold {fold} does not fit rows of {K} values in groups of {group}")
    return fold


def _reorder(v: torch.Tensor, group: int, fold: int | None, to_stored: bool) -> torch.Tensor:
    """v [..., K] between natural and stored order. Within a fold block the natural order is [group s][chunk c]
    [word r of the group's run][value] and the stored one [chunk c][group s][word r][value] (word l = s L + r of
    the chunk): one transpose, no index tensor (so it runs on any device and stream)."""
    K = v.shape[-1]
    fold = _fold(K, group, fold)
    L, B = 16 // fold, fold * group // 64  # words a group in one chunk, chunks a block
    shape = (fold, B, L, 4) if to_stored else (B, fold, L, 4)
    return v.reshape(*v.shape[:-1], K // (64 * B), *shape).transpose(-4, -3).reshape(v.shape)


def int4_order(K: int, group: int, fold: int | None = None) -> torch.Tensor:
    """order [K] int64: stored value i of an int4 row is natural value order[i] (module doc); fold: groups per
    block (default int4_fold_groups; int4_natural_fold gives the natural order)."""
    return _reorder(torch.arange(K), group, fold, to_stored=True)


def quantize_int4(w: torch.Tensor, group: int, fold: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 64 == 0, K % group == 0) -> (packed uint8 [..., R, K/2] in the stored order of
    int4_order(K, group, fold), scale [..., R, K/group] in natural group order)."""
    *lead, R, K = w.shape
    _check_int4_shape(K, group)
    wg = w.float().reshape(*lead, R, K // group, group)
    amax = wg.abs().amax(-1)
    inv = torch.where(amax > 0, 7.0 / amax, torch.zeros_like(amax))
    q = torch.round(wg * inv[..., None]).clamp(-8, 7)
    u = (q + 8).to(torch.uint8).reshape(*lead, R, K)
    return pack_int4(u, group, fold), amax / 7.0


def pack_int4(u: torch.Tensor, group: int, fold: int | None = None) -> torch.Tensor:
    """Nibbles u uint8 [..., R, K] (values 0..15 in natural order, K % 64 == 0) -> packed [..., R, K/2] in the
    stored order of int4_order(K, group, fold): quantize_int4's packing, for nibbles that come as they are
    (a GGUF file's Q4_0 blocks)."""
    return pack_nibbles(_reorder(u, group, fold, to_stored=True))


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int, fold: int | None = None) -> torch.Tensor:
    """(packed, scale) of quantize_int4 (with the same fold) -> fp32 [..., R, K] in natural order."""
    q = _reorder(unpack_nibbles(packed).float() - 8.0, group, fold, to_stored=False)
    return q * scale.repeat_interleave(group, dim=-1)


Q4_0_BLOCK = 32  # values per q4_0 / GGUF Q4_0 block (one fp16 scale each)
Q4_0_BLOCK_BYTES = 18  # GGUF Q4_0: fp16 d + 16 bytes of nibbles, 32 values
GGUF_MXFP4_BLOCK_BYTES = 17  # GGUF MXFP4: e8m0 exponent + 16 bytes of e2m1 codes, 32 values


def _check_q4_0(raw: torch.Tensor) -> None:
    if raw.dtype != torch.uint8 or raw.dim() < 2 or raw.shape[-1] != Q4_0_BLOCK_BYTES:
        raise ValueError(f"Q4_0 blocks must be uint8 [..., K/32, 18], got {raw.dtype} {tuple(raw.shape)}")


def q4_0_nibbles(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 blocks raw uint8 [..., R, G, 18] (any strides) -> (nibbles uint8 [..., R, G * 32] in natural
    order, scales d fp32 [..., R, G]) with x = (nibble - 8) * d exactly: int4's parts in groups of 32 (module doc)."""
    _check_q4_0(raw)
    *lead, G, _ = raw.shape
    d = raw[..., :2].contiguous().view(torch.float16)[..., 0].float()
    qs = raw[..., 2:]
    u = torch.stack([qs & 0x0F, qs >> 4], dim=-2)  # [..., G, 2, 16]: values 0-15, then 16-31
    return u.reshape(*lead, G * 32), d


def q4_0_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 blocks raw uint8 [..., R, G, 18] (any strides) -> (q uint8 [..., R, G * 16], d fp16 [..., R, G]),
    the q4_0 format's values and scales as the file holds them (module doc)."""
    _check_q4_0(raw)
    *lead, G, _ = raw.shape
    return raw[..., 2:].reshape(*lead, G * 16).contiguous(), raw[..., :2].contiguous().view(torch.float16)[..., 0]


def dequantize_q4_0_packed(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q uint8 [..., R, K/2], d fp16 [..., R, K/32]) -> fp32 [..., R, K]: (q - 8) d, on q's device."""
    *lead, H = q.shape
    b = q.reshape(*lead, H // 16, 16)
    u = torch.cat([b & 0x0F, b >> 4], -1)  # [..., K/32, 32] in value order
    return ((u.float() - 8.0) * d.float()[..., None]).reshape(*lead, H * 2)


def dequantize_q4_0(raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 blocks raw uint8 [..., R, G, 18] -> fp32 [..., R, G * 32], as gguf.quants.dequantize."""
    return dequantize_q4_0_packed(*q4_0_parts(raw))


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 32 == 0) -> (q uint8 [..., R, K/2], d fp16 [..., R, K/32]) (module doc: llama.cpp's scale,
    the block's value of largest magnitude over -8, each value rounded to nearest against the fp16 scale the block
    holds; a block whose scale is beyond fp16's range saturates at its largest finite value)."""
    *lead, K = w.shape
    if K % Q4_0_BLOCK:
        raise ValueError(f"q4_0 needs rows of whole {Q4_0_BLOCK}-value blocks, got K={K}")
    b = w.float().reshape(*lead, K // Q4_0_BLOCK, Q4_0_BLOCK)
    d = (_signed_absmax(b) / -8.0).clamp(-65504.0, 65504.0).to(torch.float16)
    d = torch.where(d != 0, d, torch.zeros_like(d))  # +0, not the -0 of a positive zero over -8
    df = d.float()[..., None]
    q = torch.where(df != 0, torch.round(b / torch.where(df != 0, df, 1.0)), 0.0).clamp(-8, 7) + 8
    q = q.to(torch.uint8)
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(*lead, K // 2), d


Q8_0_BLOCK = 32  # values per q8_0 / GGUF Q8_0 block (one fp16 scale each)
Q8_0_BLOCK_BYTES = 34  # GGUF Q8_0: fp16 d + 32 int8 values


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 32 == 0) -> (q int8 [..., R, K], d fp16 [..., R, K/32]) (module doc). The values are
    rounded against the stored fp16 scale, so q * d is the nearest grid point the file holds; a block whose
    max / 127 is beyond fp16's range saturates at its largest finite value."""
    *lead, K = w.shape
    if K % Q8_0_BLOCK:
        raise ValueError(f"q8_0 needs rows of whole {Q8_0_BLOCK}-value blocks, got K={K}")
    b = w.float().reshape(*lead, K // Q8_0_BLOCK, Q8_0_BLOCK)
    d = (b.abs().amax(-1) / 127.0).clamp(max=65504.0).to(torch.float16)
    df = d.float()
    q = torch.where(df[..., None] > 0, torch.round(b / df.clamp(min=1e-30)[..., None]), torch.zeros_like(b))
    return q.clamp(-127, 127).to(torch.int8).reshape(*lead, K), d


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q int8 [..., R, K], d fp16 [..., R, K/32]) -> fp32 [..., R, K]."""
    *lead, K = q.shape
    return (q.float().reshape(*lead, K // Q8_0_BLOCK, Q8_0_BLOCK) * d.float()[..., None]).reshape(*lead, K)


def q8_0_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 blocks raw uint8 [..., R, G, 34] (any strides) -> (q int8 [..., R, G * 32], d fp16 [..., R, G]),
    the q8_0 format's values and scales as the file holds them (module doc)."""
    if raw.dtype != torch.uint8 or raw.dim() < 2 or raw.shape[-1] != Q8_0_BLOCK_BYTES:
        raise ValueError(f"Q8_0 blocks must be uint8 [..., K/32, {Q8_0_BLOCK_BYTES}], got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    *lead, G, _ = raw.shape
    d = raw[..., :2].contiguous().view(torch.float16)[..., 0]
    return raw[..., 2:].contiguous().view(torch.int8).reshape(*lead, G * Q8_0_BLOCK), d



Q5_0_BLOCK_BYTES = 22  # GGUF Q5_0: fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles per 32 values
IQ4_NL_BLOCK_BYTES = 18  # GGUF IQ4_NL: fp16 d, 16 bytes of codebook indices per 32 values


def _low_high_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] uint8: value j < 16 in byte j's low nibble, value j + 16 in its high one (the
    32-value GGUF blocks' order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0_blocks(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """fp16 d bytes [..., 2] and int8 values [..., 32] -> GGUF Q8_0 blocks uint8 [..., 34]."""
    return torch.cat([d.contiguous(), q.contiguous().view(torch.uint8)], dim=-1)


def q8_0_blocks_from_q5_0(raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q5_0 blocks uint8 [..., 22] (any strides) -> the Q8_0 blocks [..., 34] holding the same values: Q5_0's
    w = d (q - 16), q in 0..31 (nibble j | fifth bit j << 4), is Q8_0's d times the int8 q - 16, exactly (q8_0 holds a
    Q5_0 tensor without error at 34 bytes a block for 22)."""
    if raw.dtype != torch.uint8 or raw.shape[-1] != Q5_0_BLOCK_BYTES:
        raise ValueError(f"Q5_0 blocks must be uint8 [..., {Q5_0_BLOCK_BYTES}], got {raw.dtype} {tuple(raw.shape)}")
    bits = (raw[..., 2:6, None] >> torch.arange(8, dtype=torch.uint8, device=raw.device)) & 1  # bit j of the little-endian uint32
    q = _low_high_nibbles(raw[..., 6:]) | (bits.flatten(-2) << 4)
    return _q8_0_blocks(raw[..., :2], (q.to(torch.int16) - 16).to(torch.int8))


def q8_0_blocks_from_iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    """GGUF IQ4_NL blocks uint8 [..., 18] (any strides) -> the Q8_0 blocks [..., 34] holding the same values: w =
    d IQ4_VALUES[i] is Q8_0's d times the int8 IQ4_VALUES[i] (all in -127..113), exactly."""
    if raw.dtype != torch.uint8 or raw.shape[-1] != IQ4_NL_BLOCK_BYTES:
        raise ValueError(f"IQ4_NL blocks must be uint8 [..., {IQ4_NL_BLOCK_BYTES}], got {raw.dtype} {tuple(raw.shape)}")
    values = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=raw.device)[_low_high_nibbles(raw[..., 2:]).long()]
    return _q8_0_blocks(raw[..., :2], values)


QK_K = 256  # values per q4_k / GGUF K-quant super-block
Q4_K_HEAD_BYTES = 16  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums
Q4_K_BLOCK_BYTES = 144  # GGUF Q4_K: the head, then 128 bytes of nibbles


def q4_k_scales(heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """heads uint8 [..., 16] -> (d * sc, dmin * m) fp32 [..., 8]: each sub-block's scale and minimum (ggml's
    get_scale_min_k4 on bytes 4..15), the products exact in fp32."""
    d = heads[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    dmin = heads[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    q = heads[..., 4:16].int()
    lo, mid, hi = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], -1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1)
    return d[..., None] * sc.float(), dmin[..., None] * m.float()


def dequantize_q4_k(packed: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(nibbles uint8 [..., R, K/2], heads uint8 [..., R, K/256, 16]) -> fp32 [..., R, K], as gguf.quants.dequantize
    computes Q4_K: (d sc) q - (dmin m) per 32 values."""
    *lead, H = packed.shape
    S, M = q4_k_scales(heads)  # [..., R, K/256, 8]
    q = unpack_nibbles(packed).float().reshape(*lead, H * 2 // 32, 32)
    return (S.reshape(*lead, -1, 1) * q - M.reshape(*lead, -1, 1)).reshape(*lead, H * 2)


def pack_q4_k_heads(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp16 d, dmin [...] and 6-bit sc, m [..., 8] (0..63) -> heads uint8 [..., 16] (the inverse of q4_k_scales)."""
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    lo = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    dd = torch.stack([d.to(torch.float16), dmin.to(torch.float16)], -1).contiguous().view(torch.uint8)
    return torch.cat([dd, lo, mid, hi], -1)


def _quantize_k(w: torch.Tensor, name: str, top: int, group: int = 32, smax: int = 63):
    """quantize_q4_k's rounding over `top` steps (15: q4_k, 31: q5_k, 3: q2_k), with a scale and minimum per `group`
    values of `smax` steps (63: 6 bits, 15: 4 bits) -> (codes uint8 [..., R, K], d, dmin fp16 [..., R, K/256], sc, m
    [..., R, K/256, 256 / group])."""
    *lead, K = w.shape
    if K % QK_K:
        raise ValueError(f"{name} needs rows of whole {QK_K}-value super-blocks, got K={K}")
    b = w.float().reshape(*lead, K // QK_K, QK_K // group, group)
    neg = 0.0 - b.amin(-1).clamp(max=0.0)  # minus a sub-block's minimum, >= 0 (+0.0 for a minimum of 0)
    step = (b.amax(-1) + neg) / float(top)
    d = (step.amax(-1) / float(smax)).clamp(max=65504.0).half()
    dmin = (neg.amax(-1) / float(smax)).clamp(max=65504.0).half()
    df, dmf = d.float()[..., None], dmin.float()[..., None]
    sc = torch.where(df > 0, torch.round(step / df.clamp(min=1e-30)), 0.0).clamp(0, smax)
    m = torch.where(dmf > 0, torch.round(neg / dmf.clamp(min=1e-30)), 0.0).clamp(0, smax)
    S, M = (df * sc)[..., None], (dmf * m)[..., None]
    q = torch.where(S > 0, torch.round((b + M) / S.clamp(min=1e-30)), 0.0).clamp(0, top).to(torch.uint8)
    return q.reshape(*lead, K), d, dmin, sc, m


def quantize_q4_k(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 256 == 0) -> (nibbles uint8 [..., R, K/2], heads uint8 [..., R, K/256, 16]) (module
    doc: round to nearest throughout; each value rounded against the scale and minimum the heads hold)."""
    q, d, dmin, sc, m = _quantize_k(w, "q4_k", 15)
    return pack_nibbles(q), pack_q4_k_heads(d, dmin, sc, m)


def q4_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q4_K blocks raw uint8 [..., R, G, 144] (any strides) -> (nibbles uint8 [..., R, G * 128], heads uint8
    [..., R, G, 16]): q4_k's bytes as the file holds them (module doc)."""
    return _block_parts(raw, "Q4_K", Q4_K_BLOCK_BYTES, Q4_K_HEAD_BYTES, head_first=True)


Q5_K_HEAD_BYTES = 48  # q4_k's 16-byte head (fp16 d, dmin, 6-bit scales and minimums), then 32 bytes of fifth bits qh
Q5_K_BLOCK_BYTES = 176  # GGUF Q5_K: the head as above, then 128 bytes of nibbles


def q5_k_high(qh: torch.Tensor) -> torch.Tensor:
    """qh uint8 [..., 32] -> each of its super-block's 256 values' high bit, uint8 [..., 256] (0 or 1): value
    32 b + l takes bit b of qh[l] (Q5_K's fifth bits, Q3_K's hmask)."""
    return torch.stack([(qh >> b) & 1 for b in range(8)], -2).reshape(*qh.shape[:-1], QK_K)


def _high_bit_bytes(high: torch.Tensor) -> torch.Tensor:
    """The inverse of q5_k_high: bits uint8 [..., R, K] (0 or 1) -> qh uint8 [..., R, K/256, 32]."""
    *lead, K = high.shape
    h = high.reshape(*lead, K // QK_K, 8, 32)
    return sum((h[..., bit, :] << bit) for bit in range(8)).to(torch.uint8)


def dequantize_q5_k(packed: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(nibbles uint8 [..., R, K/2], heads uint8 [..., R, K/256, 48]) -> fp32 [..., R, K], as gguf.quants.dequantize
    computes Q5_K: (d sc) q - (dmin m) per 32 values, q = nibble + 16 x fifth bit."""
    *lead, H = packed.shape
    S, M = q4_k_scales(heads[..., :Q4_K_HEAD_BYTES])  # [..., R, K/256, 8]
    q = unpack_nibbles(packed).reshape(*lead, H * 2 // QK_K, QK_K) + 16 * q5_k_high(heads[..., Q4_K_HEAD_BYTES:])
    q = q.float().reshape(*lead, H * 2 // 32, 32)
    return (S.reshape(*lead, -1, 1) * q - M.reshape(*lead, -1, 1)).reshape(*lead, H * 2)


def quantize_q5_k(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 256 == 0) -> (nibbles uint8 [..., R, K/2], heads uint8 [..., R, K/256, 48]) (module doc:
    quantize_q4_k's rounding over 31 steps)."""
    q, d, dmin, sc, m = _quantize_k(w, "q5_k", 31)
    return pack_nibbles(q & 0x0F), torch.cat([pack_q4_k_heads(d, dmin, sc, m), _high_bit_bytes(q >> 4)], -1)


def q5_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q5_K blocks raw uint8 [..., R, G, 176] (any strides) -> (nibbles uint8 [..., R, G * 128], heads uint8
    [..., R, G, 48]): q5_k's bytes as the file holds them (module doc)."""
    if raw.dtype != torch.uint8 or raw.dim() < 2 or raw.shape[-1] != Q5_K_BLOCK_BYTES:
        raise ValueError(f"Q5_K blocks must be uint8 [..., K/256, {Q5_K_BLOCK_BYTES}], got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    *lead, G, _ = raw.shape
    return (raw[..., Q5_K_HEAD_BYTES:].reshape(*lead, G * 128).contiguous(),
            raw[..., :Q5_K_HEAD_BYTES].contiguous())


Q2_K_HEAD_BYTES = 20  # 16 bytes of 4-bit scales (low) and minimums (high), then fp16 d and dmin
Q2_K_VALUE_BYTES = 64  # the 2-bit values of a super-block
Q2_K_BLOCK_BYTES = 84  # GGUF Q2_K: scales, values, d, dmin


def q2_k_codes(values: torch.Tensor) -> torch.Tensor:
    """values uint8 [..., R, K/4] -> the 2-bit codes uint8 [..., R, K] (0..3) in value order: in each half of 128
    values (32 bytes), value 32 j + l is bits 2 j, 2 j + 1 of byte l."""
    *lead, B = values.shape
    v = values.reshape(*lead, B // 32, 1, 32)
    return ((v >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=values.device).reshape(4, 1)) & 3).reshape(*lead, B * 4)


def q2_k_scales(heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """heads uint8 [..., 20] -> (d * sc, dmin * m) fp32 [..., 16]: each 16-value group's scale and minimum."""
    d = heads[..., 16:18].contiguous().view(torch.float16)[..., 0].float()
    dmin = heads[..., 18:20].contiguous().view(torch.float16)[..., 0].float()
    sc = heads[..., :16].int()
    return d[..., None] * (sc & 15).float(), dmin[..., None] * (sc >> 4).float()


def dequantize_q2_k(values: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., R, K/4], heads uint8 [..., R, K/256, 20]) -> fp32 [..., R, K], as gguf.quants.dequantize
    computes Q2_K: (d sc) q - (dmin m) per 16 values."""
    q = q2_k_codes(values)
    *lead, K = q.shape
    S, M = q2_k_scales(heads)
    return (S.reshape(*lead, K // 16, 1) * q.float().reshape(*lead, K // 16, 16) - M.reshape(*lead, K // 16, 1)
            ).reshape(*lead, K)


def quantize_q2_k(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 256 == 0) -> (values uint8 [..., R, K/4], heads uint8 [..., R, K/256, 20]) (module doc:
    quantize_q4_k's rounding over 3 steps, a 4-bit scale and minimum per 16 values)."""
    q, d, dmin, sc, m = _quantize_k(w, "q2_k", 3, group=16, smax=15)
    dd = torch.stack([d, dmin], -1).contiguous().view(torch.uint8)
    heads = torch.cat([(sc.to(torch.uint8) | (m.to(torch.uint8) << 4)), dd], -1)
    return _q2_k_bytes(q), heads


def _q2_k_bytes(q: torch.Tensor) -> torch.Tensor:
    """The inverse of q2_k_codes: codes uint8 [..., R, K] (0..3) -> values uint8 [..., R, K/4]."""
    *lead, K = q.shape
    c = q.reshape(*lead, K // 128, 4, 32)  # half, j, l
    values = c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)
    return values.reshape(*lead, K // 4)


def q2_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q2_K blocks raw uint8 [..., R, G, 84] (any strides) -> (values uint8 [..., R, G * 64], heads uint8
    [..., R, G, 20]): q2_k's bytes as the file holds them (module doc), the scales and d, dmin side by side."""
    if raw.dtype != torch.uint8 or raw.dim() < 2 or raw.shape[-1] != Q2_K_BLOCK_BYTES:
        raise ValueError(f"Q2_K blocks must be uint8 [..., K/256, {Q2_K_BLOCK_BYTES}], got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    *lead, G, _ = raw.shape
    return (raw[..., 16:80].reshape(*lead, G * Q2_K_VALUE_BYTES).contiguous(),
            torch.cat([raw[..., :16], raw[..., 80:84]], -1))


Q3_K_HEAD_BYTES = 14  # 12 bytes of 16 six-bit scales (ggml's packing), then fp16 d
Q3_K_VALUE_BYTES = 96  # hmask (32 bytes of high bits), then 64 bytes of low bit pairs (q2_k's arrangement)
Q3_K_BLOCK_BYTES = 110  # GGUF Q3_K: hmask, low bit pairs, scales, d


def q3_k_codes(values: torch.Tensor) -> torch.Tensor:
    """values uint8 [..., R, K/256 * 96] -> the codes q int8 [..., R, K] (-4..3) in value order: the low bit pairs as
    q2_k's, minus 4 where hmask's bit of the value is clear."""
    *lead, B = values.shape
    v = values.reshape(*lead, B // Q3_K_VALUE_BYTES, Q3_K_VALUE_BYTES)
    low = q2_k_codes(v[..., 32:]).reshape(*lead, B // 96 * QK_K)
    high = q5_k_high(v[..., :32]).reshape(*lead, B // 96 * QK_K)
    return (low + 4 * high).view(torch.int8) - 4


def q3_k_scales(heads: torch.Tensor) -> torch.Tensor:
    """heads uint8 [..., 14] -> d * (sc - 32) fp32 [..., 16], each 16-value group's scale (exact in fp32)."""
    s = heads[..., :12]
    low = torch.cat([s[..., :8] & 0x0F, s[..., :8] >> 4], -1)
    top = ((s[..., 8:12].unsqueeze(-2) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=heads.device).reshape(4, 1)) & 3).flatten(-2)
    d = heads[..., 12:14].contiguous().view(torch.float16)[..., 0].float()
    return d[..., None] * ((low | (top << 4)).float() - 32.0)


def _q3_k_scale_bytes(sc: torch.Tensor) -> torch.Tensor:
    """The inverse of q3_k_scales' unpacking: sc + 32 uint8 [..., 16] (0..63) -> the 12 scale bytes [..., 12]."""
    low = (sc[..., :8] & 0x0F) | ((sc[..., 8:] & 0x0F) << 4)
    top = (sc >> 4).reshape(*sc.shape[:-1], 4, 4)  # [g, i]: scale 4 g + i's top two bits
    return torch.cat([low, sum(top[..., g, :] << (2 * g) for g in range(4)).to(torch.uint8)], -1)


def dequantize_q3_k(values: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., R, K/256 * 96], heads uint8 [..., R, K/256, 14]) -> fp32 [..., R, K], as
    gguf.quants.dequantize computes Q3_K: d (sc - 32) q per 16 values."""
    q = q3_k_codes(values)
    *lead, K = q.shape
    S = q3_k_scales(heads).reshape(*lead, K // 16, 1)
    return (S * q.float().reshape(*lead, K // 16, 16)).reshape(*lead, K)


def quantize_q3_k(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 256 == 0) -> (values uint8 [..., R, K/256 * 96], heads uint8 [..., R, K/256, 14]) (module
    doc: round to nearest; each value rounded against the scale the head holds)."""
    *lead, K = w.shape
    if K % QK_K:
        raise ValueError(f"q3_k needs rows of whole {QK_K}-value super-blocks, got K={K}")
    b = w.float().reshape(*lead, K // QK_K, 16, 16)
    step = -_signed_absmax(b) / 4.0  # [.., G, 16]: the largest magnitude to -4
    d = (-_signed_absmax(step) / 32.0).clamp(-65504.0, 65504.0).half()  # the largest scale to -32
    df = d.float()[..., None]
    sc = torch.where(df != 0, torch.round(step / torch.where(df != 0, df, 1.0)), 0.0).clamp(-32, 31)
    S = (df * sc)[..., None]
    q = (torch.where(S != 0, torch.round(b / torch.where(S != 0, S, 1.0)), 0.0).clamp(-4, 3) + 4).to(torch.uint8)
    q = q.reshape(*lead, K)
    values = torch.cat([_high_bit_bytes(q >> 2), _q2_k_bytes(q & 3).reshape(*lead, K // QK_K, 64)], -1)
    heads = torch.cat([_q3_k_scale_bytes((sc + 32).to(torch.uint8)), d[..., None].contiguous().view(torch.uint8)], -1)
    return values.reshape(*lead, K // QK_K * Q3_K_VALUE_BYTES), heads


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude along the last dim, with its sign (the first of equal magnitudes)."""
    return x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)


def q3_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q3_K blocks raw uint8 [..., R, G, 110] (any strides) -> (values uint8 [..., R, G * 96], heads uint8
    [..., R, G, 14]): q3_k's bytes as the file holds them (module doc)."""
    return _block_parts(raw, "Q3_K", Q3_K_BLOCK_BYTES, Q3_K_HEAD_BYTES, head_first=False)


def _block_parts(raw: torch.Tensor, kind: str, block: int, hbytes: int, head_first: bool) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """GGUF blocks of `block` bytes: an `hbytes` head and the values, the head first (Q4_K, IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S) or last
    (Q3_K, Q6_K, IQ1_M) -> (values uint8 [..., R, G * (block - hbytes)], heads uint8 [..., R, G, hbytes]), the
    bytes as the file holds them."""
    if raw.dtype != torch.uint8 or raw.dim() < 2 or raw.shape[-1] != block:
        raise ValueError(f"{kind} blocks must be uint8 [..., K/256, {block}], got {raw.dtype} {tuple(raw.shape)}")
    *lead, G, _ = raw.shape
    v = block - hbytes
    head, values = (raw[..., :hbytes], raw[..., hbytes:]) if head_first else (raw[..., v:], raw[..., :v])
    return values.reshape(*lead, G * v).contiguous(), head.contiguous()


Q6_K_HEAD_BYTES = 18  # 16 int8 scales, then fp16 d
Q6_K_VALUE_BYTES = 192  # ql (128) and qh (64) of a super-block
Q6_K_BLOCK_BYTES = 210  # GGUF Q6_K: ql, qh, scales, d


def q6_k_codes(values: torch.Tensor) -> torch.Tensor:
    """values uint8 [..., R, K/256 * 192] -> the 6-bit codes q uint8 [..., R, K] (0..63), in value order."""
    *lead, B = values.shape
    v = values.reshape(*lead, B // Q6_K_VALUE_BYTES, Q6_K_VALUE_BYTES)
    ql = v[..., :128].reshape(*v.shape[:-1], 2, 64)  # super-block, half: 64 bytes of ql, 32 of qh
    qh = v[..., 128:].reshape(*v.shape[:-1], 2, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], -1)  # [.., 2, 128]: values l, l + 32 (low nibbles), l + 64, l + 96 (high)
    pairs = torch.stack([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], -2)  # [.., 2, 4, 32]
    return (low | (pairs.reshape(*low.shape) << 4)).reshape(*lead, B // 3 * 4)


def _q6_k_bytes(q: torch.Tensor) -> torch.Tensor:
    """The inverse of q6_k_codes: codes uint8 [..., R, K] (0..63) -> values uint8 [..., R, K/256 * 192]."""
    *lead, K = q.shape
    h = q.reshape(*lead, K // QK_K, 2, 4, 32)  # super-block, half, quarter, l
    ql = torch.cat([(h[..., 0, :] & 0x0F) | ((h[..., 2, :] & 0x0F) << 4),
                    (h[..., 1, :] & 0x0F) | ((h[..., 3, :] & 0x0F) << 4)], -1)  # [.., 2, 64]
    qh = (h[..., 0, :] >> 4) | ((h[..., 1, :] >> 4) << 2) | ((h[..., 2, :] >> 4) << 4) | ((h[..., 3, :] >> 4) << 6)
    return torch.cat([ql.flatten(-2), qh.flatten(-2)], -1).reshape(*lead, K // QK_K * Q6_K_VALUE_BYTES)


def q6_k_scales(heads: torch.Tensor) -> torch.Tensor:
    """heads uint8 [..., 18] -> d * sc fp32 [..., 16], each 16-value group's scale (exact in fp32)."""
    d = heads[..., 16:18].contiguous().view(torch.float16)[..., 0].float()
    return d[..., None] * heads[..., :16].contiguous().view(torch.int8).float()


def dequantize_q6_k(values: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., R, K/256 * 192], heads uint8 [..., R, K/256, 18]) -> fp32 [..., R, K], as
    gguf.quants.dequantize computes Q6_K: d sc (q - 32) per 16 values."""
    q = q6_k_codes(values)
    *lead, K = q.shape
    S = q6_k_scales(heads).reshape(*lead, K // 16, 1)
    return (S * (q.float().reshape(*lead, K // 16, 16) - 32.0)).reshape(*lead, K)


def quantize_q6_k(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 256 == 0) -> (values uint8 [..., R, K/256 * 192], heads uint8 [..., R, K/256, 18]) (module
    doc: round to nearest; each value rounded against the scale the head holds)."""
    *lead, K = w.shape
    if K % QK_K:
        raise ValueError(f"q6_k needs rows of whole {QK_K}-value super-blocks, got K={K}")
    b = w.float().reshape(*lead, K // QK_K, 16, 16)
    step = b.abs().amax(-1) / 31.0  # [.., G, 16]
    d = (step.amax(-1) / 127.0).clamp(max=65504.0).half()
    df = d.float()[..., None]
    # scales rounded up: a group's largest magnitude stays within 31 steps (a scale rounded down would clip it)
    sc = torch.where(df > 0, torch.ceil(step / df.clamp(min=1e-30)), 0.0).clamp(0, 127)
    S = (df * sc)[..., None]
    q = torch.where(S > 0, torch.round(b / S.clamp(min=1e-30)), 0.0).clamp(-32, 31) + 32
    heads = torch.cat([sc.to(torch.int8).view(torch.uint8), d[..., None].contiguous().view(torch.uint8)], -1)
    return _q6_k_bytes(q.to(torch.uint8).reshape(*lead, K)), heads


def q6_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q6_K blocks raw uint8 [..., R, G, 210] (any strides) -> (values uint8 [..., R, G * 192], heads uint8
    [..., R, G, 18]): q6_k's bytes as the file holds them (module doc)."""
    return _block_parts(raw, "Q6_K", Q6_K_BLOCK_BYTES, Q6_K_HEAD_BYTES, head_first=False)


IQ4_XS_HEAD_BYTES = 8  # fp16 d, uint16 scales_h, uint8 scales_l[4]
IQ4_XS_BLOCK_BYTES = 136  # GGUF IQ4_XS: the head, then 128 bytes of codebook indices
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # llama.cpp's kvalues_iq4nl
# the midpoints between neighbouring IQ4_VALUES: a value's nearest entry is the number of them below it
_IQ4_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(IQ4_VALUES, IQ4_VALUES[1:]))


def iq4_xs_scales(heads: torch.Tensor) -> torch.Tensor:
    """heads uint8 [..., 8] -> d (ls - 32) fp32 [..., 8], each 32-value sub-block's scale (exact in fp32)."""
    d = heads[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    high = heads[..., 2].int() | (heads[..., 3].int() << 8)
    high = (high[..., None] >> torch.arange(0, 16, 2, device=heads.device)) & 3
    low = (heads[..., 4:8, None].int() >> torch.tensor([0, 4], device=heads.device)).flatten(-2) & 15
    return d[..., None] * ((low | (high << 4)) - 32).float()


def dequantize_iq4_xs(packed: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(indices uint8 [..., R, K/2], heads uint8 [..., R, K/256, 8]) -> fp32 [..., R, K], as gguf.quants.dequantize
    computes IQ4_XS: d (ls - 32) IQ4_VALUES[q] per 32 values."""
    *lead, H = packed.shape
    S = iq4_xs_scales(heads).reshape(*lead, H * 2 // 32, 1)
    values = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=packed.device)[unpack_nibbles(packed).long()]
    return (S * values.reshape(*lead, H * 2 // 32, 32)).reshape(*lead, H * 2)


def quantize_iq4_xs(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 256 == 0) -> (indices uint8 [..., R, K/2], heads uint8 [..., R, K/256, 8]) (module doc:
    round to nearest; each value rounded against the sub-block scale the head holds)."""
    *lead, K = w.shape
    if K % QK_K:
        raise ValueError(f"iq4_xs needs rows of whole {QK_K}-value super-blocks, got K={K}")
    b = w.float().reshape(*lead, K // QK_K, 8, 32)
    s = b.gather(-1, b.abs().argmax(-1, keepdim=True))[..., 0] / -127.0  # [..., G, 8]
    d = (s.abs().amax(-1) / 31.0).clamp(max=65504.0).half()
    df = d.float()[..., None]
    # ls - 32 in -32..31; -32 where d is 0, so an all-zero super-block is all zero bytes (as the padding)
    ls = torch.where(df > 0, torch.round(s / df.clamp(min=1e-30)), -32.0).clamp(-32, 31)
    dl = (df * ls)[..., None]
    x = b / torch.where(dl != 0, dl, 1.0)
    mids = torch.tensor(_IQ4_MIDPOINTS, dtype=torch.float32, device=w.device)
    q = torch.where(dl != 0, (x[..., None] > mids).sum(-1), 0).to(torch.uint8)
    u = (ls + 32).to(torch.int32)
    high = ((u >> 4) << torch.arange(0, 16, 2, device=w.device, dtype=torch.int32)).sum(-1)  # scales_h
    low = u & 15
    heads = torch.cat([d[..., None].contiguous().view(torch.uint8),
                       torch.stack([high & 0xFF, high >> 8], -1).to(torch.uint8),
                       (low[..., 0::2] | (low[..., 1::2] << 4)).to(torch.uint8)], -1)
    return pack_nibbles(q.reshape(*lead, K)), heads


def iq4_xs_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF IQ4_XS blocks raw uint8 [..., R, G, 136] (any strides) -> (indices uint8 [..., R, G * 128] in int4's chunk
    layout, heads uint8 [..., R, G, 8]): iq4_xs's bytes, the file's indices re-paired (module doc)."""
    if raw.dtype != torch.uint8 or raw.dim() < 2 or raw.shape[-1] != IQ4_XS_BLOCK_BYTES:
        raise ValueError(f"IQ4_XS blocks must be uint8 [..., K/256, {IQ4_XS_BLOCK_BYTES}], got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    *lead, G, _ = raw.shape
    qs = raw[..., IQ4_XS_HEAD_BYTES:].reshape(*lead, G, 8, 1, 16)
    codes = torch.cat([qs & 0x0F, qs >> 4], -2).reshape(*lead, G * QK_K)  # value order
    return pack_nibbles(codes), raw[..., :IQ4_XS_HEAD_BYTES].contiguous()


IQ2_XXS_HEAD_BYTES = 2  # fp16 d
IQ2_XXS_VALUE_BYTES = 64  # qs: per 32 values 4 codebook indices, then the sign indices and the scale (module doc)
IQ2_XXS_BLOCK_BYTES = 66  # GGUF IQ2_XXS: d, then qs
# llama.cpp's ksigns_iq2xs, derived: a 7-bit sign index s -> its 8 sign bits, the 8th making the count of negatives even
KSIGNS = tuple(s | (bin(s).count("1") & 1) << 7 for s in range(128))


@functools.lru_cache(maxsize=None)
def _iq_grid(kind: str) -> torch.Tensor:
    """The codebook of an IQ type as the gguf package ships it (gguf.quants.<TYPE>.grid, llama.cpp's table; kind: the
    type's name in lower case, "iq1" for IQ1_S's and IQ1_M's): float32 [entries, values per entry], in order."""
    from gguf import quants

    cls = getattr(quants, "IQ1_S" if kind == "iq1" else kind.upper())
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(-1, cls.grid_shape[1]).copy())


def iq_grid_bytes(kind: str) -> bytes:
    """The codebook the compiled kernels read (csrc/hy.h IqGrids, set at load by _native): iq2_xxs 256 entries of 8
    bytes, each the magnitude of one value (8, 25 or 43); iq3_xxs 256 entries of 4 (4 to 62); iq3_s 512 entries of 4
    (1 to 15); iq1 (IQ1_S's and
    IQ1_M's) 2048 entries of 8 int8 values (-1, 0 or 1); the entry's first value first."""
    return _iq_grid(kind).to(torch.int8).numpy().tobytes()


def dequantize_iq2_xxs(values: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., R, K/256 * 64], heads uint8 [..., R, K/256, 2]) -> fp32 [..., R, K], as
    gguf.quants.dequantize computes IQ2_XXS: d (0.5 + ls) / 4 x magnitude x sign per 8 values (module doc)."""
    *lead, B = values.shape
    G, dev = B // IQ2_XXS_VALUE_BYTES, values.device
    v = values.reshape(*lead, G, 8, 8)  # super-block, sub-block, byte
    aux = sum(v[..., 4 + i].long() << (8 * i) for i in range(4))  # [.., G, 8]: the signs and the scale
    signs = torch.tensor(KSIGNS, dtype=torch.long, device=dev)[
        (aux[..., None] >> torch.tensor([0, 7, 14, 21], device=dev)) & 127]  # [.., G, 8, 4]
    neg = (signs[..., None] >> torch.arange(8, device=dev)) & 1  # [.., G, 8, 4, 8]
    mags = _iq_grid("iq2_xxs").to(dev)[v[..., :4].long()]  # [.., G, 8, 4, 8]
    d = heads[..., 0:2].contiguous().view(torch.float16).float()  # [.., G, 1]
    db = d * (0.5 + (aux >> 28).float()) * 0.25  # [.., G, 8]
    return (db[..., None, None] * mags * (1.0 - 2.0 * neg.float())).reshape(*lead, G * QK_K)


# groups of 8 values whose codebook distances are scored at once by quantize_iq2_xxs: [n, 256] fp32 scores of 4 MiB,
# which stay in the cache (a larger call writes and re-reads its scores from DRAM)
IQ2_XXS_SEARCH_GROUPS = 1 << 12


def _iq2_xxs_pick(a: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group of 8 (a = |x| [n, 8], x [n, 8], the group's scale s [n]): the codebook entry nearest a / s and the
    signs of x with an even count of negatives (the sign whose flip costs least, |x_j| g_j, flipped where the count is
    odd). -> (entry index long [n], negatives bool [n, 8])."""
    grid = _iq_grid("iq2_xxs").to(a.device)  # [256, 8]
    t = a / s.clamp(min=1e-30)[:, None]
    idx = torch.empty(a.shape[0], dtype=torch.long, device=a.device)
    for i in range(0, a.shape[0], IQ2_XXS_SEARCH_GROUPS):  # argmin |t - g|^2 = argmin (|g|^2 - 2 t.g)
        idx[i:i + IQ2_XXS_SEARCH_GROUPS] = ((grid * grid).sum(-1) - 2 * t[i:i + IQ2_XXS_SEARCH_GROUPS] @ grid.T).argmin(-1)
    neg = x < 0
    odd = (neg.sum(-1) & 1).bool()
    flip = (a * grid[idx]).argmin(-1)
    neg[odd, flip[odd]] = ~neg[odd, flip[odd]]
    return idx, neg


def quantize_iq2_xxs(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 256 == 0) -> (values uint8 [..., R, K/256 * 64], heads uint8 [..., R, K/256, 2]) in
    iq2_xxs's bytes (module doc). Round to the nearest codebook entry, not llama.cpp's importance-weighted search: each
    sub-block's scale first from its largest magnitude (onto the codebook's 43), each group of 8 the entry nearest its
    magnitudes with the signs' parity made even (_iq2_xxs_pick), then the sub-block's least-squares scale, d =
    the largest / 3.875 in fp16 and the 4-bit ls nearest, and the entries picked again at the stored scale."""
    *lead, R, K = w.shape
    if K % QK_K:
        raise ValueError(f"iq2_xxs rows must be whole super-blocks of {QK_K} values, got {K}")
    G = K // QK_K
    x = w.detach().float().reshape(-1, 8)  # groups of 8: super-block, sub-block (8), group (4) in order
    a = x.abs()
    grid = _iq_grid("iq2_xxs").to(x.device)
    sub = a.reshape(-1, 32).amax(-1) / 43.0  # [n_sub] first scale: the largest magnitude onto 43
    idx, neg = _iq2_xxs_pick(a, x, sub.repeat_interleave(4))
    q = (grid[idx] * (1.0 - 2.0 * neg.float())).reshape(-1, 32)
    xs = x.reshape(-1, 32)
    sub = ((xs * q).sum(-1) / (q * q).sum(-1).clamp(min=1e-30)).clamp(min=0)  # least-squares sub-block scale
    sub = sub.reshape(-1, 8)  # [super-blocks, 8]
    d = (sub.amax(-1) / 3.875).to(torch.float16)  # db = d (0.5 + ls) / 4, ls <= 15
    df = d.float()[:, None]
    ls = torch.where(df > 0, torch.round(sub / (df * 0.25).clamp(min=1e-30) - 0.5), torch.zeros_like(sub)).clamp(0, 15)
    db = (df * (0.5 + ls) * 0.25).reshape(-1)  # [n_sub] the stored scales
    idx, neg = _iq2_xxs_pick(a, x, db.repeat_interleave(4))
    bits = neg[:, :7].long() << torch.arange(7, device=x.device)  # a group's sign index: the signs of values 0-6
    signs = bits.sum(-1).reshape(-1, 4)  # [n_sub, 4]
    aux = (signs << torch.tensor([0, 7, 14, 21], device=x.device)).sum(-1) | (ls.reshape(-1).long() << 28)
    sub_bytes = torch.cat([idx.reshape(-1, 4), torch.stack([(aux >> (8 * i)) & 0xFF for i in range(4)], -1)], -1)
    values = sub_bytes.to(torch.uint8).reshape(*lead, R, G * IQ2_XXS_VALUE_BYTES)
    heads = d.reshape(*lead, R, G, 1).contiguous().view(torch.uint8)
    return values, heads


FILE_ONLY_MESSAGE = ("{dtype} holds a GGUF file's {type} blocks as they are; it has no quantizer for other weights "
                     "(make such a file with llama-quantize, or choose another --cpu-dtype)")


def iq2_xxs_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF IQ2_XXS blocks raw uint8 [..., R, G, 66] (any strides) -> (values uint8 [..., R, G * 64], heads uint8
    [..., R, G, 2]): iq2_xxs's bytes as the file holds them (module doc)."""
    return _block_parts(raw, "IQ2_XXS", IQ2_XXS_BLOCK_BYTES, IQ2_XXS_HEAD_BYTES, head_first=True)


IQ3_XXS_HEAD_BYTES = 2  # fp16 d
IQ3_XXS_VALUE_BYTES = 96  # qs: 64 bytes of codebook indices (8 per 32 values), then per 32 values the signs and scale
IQ3_XXS_BLOCK_BYTES = 98  # GGUF IQ3_XXS: d, then qs


def dequantize_iq3_xxs(values: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., R, K/256 * 96], heads uint8 [..., R, K/256, 2]) -> fp32 [..., R, K], as
    gguf.quants.dequantize computes IQ3_XXS: d (0.5 + ls) / 2 x magnitude x sign per 4 values (module doc)."""
    *lead, B = values.shape
    G, dev = B // IQ3_XXS_VALUE_BYTES, values.device
    v = values.reshape(*lead, G, IQ3_XXS_VALUE_BYTES)
    w = v[..., 64:].reshape(*lead, G, 8, 4)  # per sub-block its uint32 of signs and scale
    aux = sum(w[..., i].long() << (8 * i) for i in range(4))  # [.., G, 8]
    signs = torch.tensor(KSIGNS, dtype=torch.long, device=dev)[
        (aux[..., None] >> torch.tensor([0, 7, 14, 21], device=dev)) & 127]  # [.., G, 8, 4]: per 8 values
    neg = (signs[..., None] >> torch.arange(8, device=dev)) & 1  # [.., G, 8, 4, 8]
    mags = _iq_grid("iq3_xxs").to(dev)[v[..., :64].long()].reshape(*lead, G, 8, 4, 8)  # 8 entries of 4 a sub-block
    d = heads[..., 0:2].contiguous().view(torch.float16).float()  # [.., G, 1]
    db = d * (0.5 + (aux >> 28).float()) * 0.5  # [.., G, 8]
    return (db[..., None, None] * mags * (1.0 - 2.0 * neg.float())).reshape(*lead, G * QK_K)


def quantize_iq3_xxs(w: torch.Tensor):
    """Refused: IQ3_XXS's values come from llama.cpp's importance-weighted codebook search (module doc)."""
    raise ValueError(FILE_ONLY_MESSAGE.format(dtype="iq3_xxs", type="IQ3_XXS"))


def iq3_xxs_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF IQ3_XXS blocks raw uint8 [..., R, G, 98] (any strides) -> (values uint8 [..., R, G * 96], heads uint8
    [..., R, G, 2]): iq3_xxs's bytes as the file holds them (module doc)."""
    return _block_parts(raw, "IQ3_XXS", IQ3_XXS_BLOCK_BYTES, IQ3_XXS_HEAD_BYTES, head_first=True)


IQ3_S_HEAD_BYTES = 2  # fp16 d
IQ3_S_VALUE_BYTES = 108  # qs (64), qh (8), signs (32), scales (4)
IQ3_S_BLOCK_BYTES = 110  # GGUF IQ3_S: d, then the values


def dequantize_iq3_s(values: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., R, K/256 * 108], heads uint8 [..., R, K/256, 2]) -> fp32 [..., R, K], as
    gguf.quants.dequantize computes IQ3_S: d (1 + 2 ls) x magnitude x sign per 4 values (module doc)."""
    *lead, B = values.shape
    G, dev = B // IQ3_S_VALUE_BYTES, values.device
    v = values.reshape(*lead, G, IQ3_S_VALUE_BYTES)
    bit8 = torch.arange(8, device=dev)
    qh = ((v[..., 64:72, None] >> bit8) & 1).reshape(*lead, G, 64)  # the 9th bit of each index
    idx = v[..., :64].long() | (qh.long() << 8)
    neg = ((v[..., 72:104, None] >> bit8) & 1).reshape(*lead, G, 8, 32)  # [.., G, sub-block, value]
    ls = ((v[..., 104:108, None] >> torch.tensor([0, 4], device=dev)) & 0x0F).reshape(*lead, G, 8)
    d = heads[..., 0:2].contiguous().view(torch.float16).float()  # [.., G, 1]
    db = d * (1 + 2 * ls).float()  # [.., G, 8]
    mags = _iq_grid("iq3_s").to(dev)[idx].reshape(*lead, G, 8, 32)
    return (db[..., None] * mags * (1.0 - 2.0 * neg.float())).reshape(*lead, G * QK_K)


def quantize_iq3_s(w: torch.Tensor):
    """Refused: IQ3_S's values come from llama.cpp's importance-weighted codebook search (module doc)."""
    raise ValueError(FILE_ONLY_MESSAGE.format(dtype="iq3_s", type="IQ3_S"))


def iq3_s_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF IQ3_S blocks raw uint8 [..., R, G, 110] (any strides) -> (values uint8 [..., R, G * 108], heads uint8
    [..., R, G, 2]): iq3_s's bytes as the file holds them (module doc)."""
    return _block_parts(raw, "IQ3_S", IQ3_S_BLOCK_BYTES, IQ3_S_HEAD_BYTES, head_first=True)


IQ1_S_HEAD_BYTES = 2  # fp16 d
IQ1_S_VALUE_BYTES = 48  # qs (the low 8 bits of 32 group indices), then qh (8 uint16; module doc)
IQ1_S_BLOCK_BYTES = 50  # GGUF IQ1_S: d, qs, qh
IQ1_DELTA = 0.125  # llama.cpp's IQ1S_DELTA: the shift of a group's codebook values, IQ1_S's and IQ1_M's


def dequantize_iq1_s(values: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., R, K/256 * 48], heads uint8 [..., R, K/256, 2]) -> fp32 [..., R, K], as
    gguf.quants.dequantize computes IQ1_S: d (2 ls + 1) (g + delta) per 8 values (module doc)."""
    *lead, B = values.shape
    G, dev = B // IQ1_S_VALUE_BYTES, values.device
    v = values.reshape(*lead, G, IQ1_S_VALUE_BYTES)
    qh = v[..., 32:].reshape(*lead, G, 8, 2).long()
    qh = qh[..., 0] | qh[..., 1] << 8  # [.., G, 8]
    hi = (qh[..., None] >> torch.tensor([0, 3, 6, 9], device=dev)) & 7  # [.., G, 8, 4]
    idx = v[..., :32].reshape(*lead, G, 8, 4).long() | hi << 8
    g = _iq_grid("iq1").to(dev)[idx]  # [.., G, 8, 4, 8]
    d = heads[..., 0:2].contiguous().view(torch.float16).float()  # [.., G, 1]
    dl = d * (2 * ((qh >> 12) & 7) + 1).float()  # [.., G, 8]
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA).float()  # [.., G, 8]
    return (dl[..., None, None] * (g + delta[..., None, None])).reshape(*lead, G * QK_K)


def quantize_iq1_s(w: torch.Tensor):
    """Refused: IQ1_S's values come from llama.cpp's importance-weighted codebook search (module doc)."""
    raise ValueError(FILE_ONLY_MESSAGE.format(dtype="iq1_s", type="IQ1_S"))


def iq1_s_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF IQ1_S blocks raw uint8 [..., R, G, 50] (any strides) -> (values uint8 [..., R, G * 48], heads uint8
    [..., R, G, 2]): iq1_s's bytes as the file holds them (module doc)."""
    return _block_parts(raw, "IQ1_S", IQ1_S_BLOCK_BYTES, IQ1_S_HEAD_BYTES, head_first=True)


IQ1_M_HEAD_BYTES = 8  # the 4 scales words, d's nibbles among them
IQ1_M_VALUE_BYTES = 48  # qs (the low 8 bits of 32 group indices), then qh (a nibble per group; module doc)
IQ1_M_BLOCK_BYTES = 56  # GGUF IQ1_M: qs, qh, scales (module doc)


def iq1_m_d(heads: torch.Tensor) -> torch.Tensor:
    """IQ1_M scales words uint8 [..., G, 8] -> fp32 [..., G, 1]: each super-block's fp16 d, assembled from the top
    nibbles of its 4 words (word 0's the lowest; module doc)."""
    *lead, G, _ = heads.shape
    dev = heads.device
    sc = heads.reshape(*lead, G, 4, 2).long()
    sc = sc[..., 0] | sc[..., 1] << 8  # [.., G, 4]
    bits = ((sc & 0xF000) >> torch.tensor([12, 8, 4, 0], device=dev)).sum(-1)  # disjoint nibbles: their OR
    return torch.stack([bits & 0xFF, bits >> 8], -1).to(torch.uint8).view(torch.float16).float()  # [.., G, 1]


def dequantize_iq1_m(raw: torch.Tensor) -> torch.Tensor:
    """GGUF IQ1_M blocks raw uint8 [..., G, 56] -> fp32 [..., G * 256], as gguf.quants.dequantize computes IQ1_M:
    d (2 ls + 1) (g + delta) per 8 values, d assembled from the top nibbles of the 4 scales words (module doc)."""
    *lead, G, _ = raw.shape
    dev = raw.device
    d = iq1_m_d(raw[..., 48:56])  # [.., G, 1]
    sc = raw[..., 48:56].reshape(*lead, G, 4, 2).long()
    sc = sc[..., 0] | sc[..., 1] << 8  # [.., G, 4]
    ls = ((sc[..., None] >> torch.tensor([0, 3, 6, 9], device=dev)) & 7).reshape(*lead, G, 16)
    dl = d * (2 * ls + 1).float()  # [.., G, 16]: per 16 values
    nib = (raw[..., 32:48, None].long() >> torch.tensor([0, 4], device=dev)).reshape(*lead, G, 32)  # per group
    idx = raw[..., :32].long() | (nib & 7) << 8
    delta = torch.where((nib & 8) == 0, IQ1_DELTA, -IQ1_DELTA).float()  # [.., G, 32]
    g = _iq_grid("iq1").to(dev)[idx]  # [.., G, 32, 8]
    dl = dl.reshape(*lead, G, 16, 1, 1).expand(*lead, G, 16, 2, 1).reshape(*lead, G, 32, 1)
    return (dl * (g + delta[..., None])).reshape(*lead, G * QK_K)


def dequantize_iq1_m_packed(values: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """(values uint8 [..., R, K/256 * 48], heads uint8 [..., R, K/256, 8]) -> fp32 [..., R, K]: iq1_m's packed bytes,
    the file's blocks put back together, by dequantize_iq1_m."""
    *lead, B = values.shape
    G = B // IQ1_M_VALUE_BYTES
    return dequantize_iq1_m(torch.cat([values.reshape(*lead, G, IQ1_M_VALUE_BYTES), heads], -1))


def quantize_iq1_m(w: torch.Tensor):
    """Refused: IQ1_M's values come from llama.cpp's importance-weighted codebook search (module doc)."""
    raise ValueError(FILE_ONLY_MESSAGE.format(dtype="iq1_m", type="IQ1_M"))


def iq1_m_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF IQ1_M blocks raw uint8 [..., R, G, 56] (any strides) -> (values uint8 [..., R, G * 48], heads uint8
    [..., R, G, 8]): iq1_m's bytes as the file holds them (module doc)."""
    return _block_parts(raw, "IQ1_M", IQ1_M_BLOCK_BYTES, IQ1_M_HEAD_BYTES, head_first=False)


def packed_dequantizers() -> dict:
    """dtype -> its de-quantizer of packed bytes (q, scale) -> fp32, for every CPU dtype but bf16 and int4 (whose group
    and stored order are arguments of their own)."""
    return {"int8": dequantize_int8, "mxfp4": dequantize_mxfp4_packed, "q8_0": dequantize_q8_0, "q4_0": dequantize_q4_0_packed,
            "q2_k": dequantize_q2_k, "q3_k": dequantize_q3_k, "q4_k": dequantize_q4_k, "q5_k": dequantize_q5_k,
            "q6_k": dequantize_q6_k, "iq4_xs": dequantize_iq4_xs, "iq2_xxs": dequantize_iq2_xxs,
            "iq3_xxs": dequantize_iq3_xxs, "iq3_s": dequantize_iq3_s, "iq1_s": dequantize_iq1_s, "iq1_m": dequantize_iq1_m_packed}


def mxfp4_pairs_from_gguf(qs: torch.Tensor) -> torch.Tensor:
    """The 16 code bytes of GGUF MXFP4 blocks [..., 16] (values j, j + 16 in byte j) -> the published pairing
    (values 2j, 2j + 1 in byte j), a new tensor."""
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # value order 0..31
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


# e2m1 code -> value: sign bit 3, two exponent bits, one mantissa bit (0, 0.5 subnormal; 1, 1.5; 2, 3; 4, 6).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """blocks uint8 [..., R, G, 16], scales uint8 [..., R, G] -> w [..., R, G * 32] in dtype (module doc)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} must be scales' shape {tuple(scales.shape)} + (16,)")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*scales.shape, MXFP4_BLOCK)
    w = torch.ldexp(lut[codes.long()], (scales.to(torch.int32) - 127)[..., None].float())
    return w.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 32 == 0) -> (blocks uint8 [..., R, K/32, 16], scales uint8 [..., R, K/32]).

    The shared exponent is the smallest e with max|w_block| <= 6 * 2^(e - 127) (so nothing saturates); each
    value takes the nearest of the 16 codes (ties to the even code). Values that are already mxfp4 come back
    unchanged through dequantize_mxfp4 (their codes and exponents may differ: a block whose largest value is 3
    can take the next smaller exponent). Used to write test checkpoints in the published format.
    """
    *lead, R, K = w.shape
    if K % MXFP4_BLOCK:
        raise ValueError(f"mxfp4: reduction length {K} must be a multiple of {MXFP4_BLOCK}")
    wb = w.float().reshape(*lead, R, K // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = wb.abs().amax(-1)
    e = torch.ceil(torch.log2(torch.where(amax > 0, amax / 6.0, torch.ones_like(amax))))
    e = e.clamp(-127, 127)
    e = torch.where(amax > 6.0 * torch.exp2(e), e + 1, e).clamp(-127, 128)  # log2 rounding at the edge
    v = wb / torch.exp2(e)[..., None]
    mags = torch.tensor(FP4_VALUES[:8], device=w.device)
    idx = (v.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude; argmin takes the first (even) on ties
    codes = (idx | ((v < 0).long() << 3)).to(torch.uint8)
    codes = codes.reshape(*lead, R, K // MXFP4_BLOCK, MXFP4_BLOCK // 2, 2)
    blocks = (codes[..., 0] | (codes[..., 1] << 4)).contiguous()
    return blocks, (e + 127).to(torch.uint8)


def pack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Published mxfp4 (blocks uint8 [..., R, G, 16], scales [..., R, G], G even) -> the executor's layout
    (module doc): (codes uint8 [..., R, G * 16], exponents uint8 [..., R, G]). Integer ops only (the largest
    temporary is one code byte per weight), on any device."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} must be scales' shape {tuple(scales.shape)} + (16,)")
    *lead, G = scales.shape
    if G % 2:
        raise ValueError(f"pack_mxfp4: the block count {G} must be even (rows of 64 values)")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*lead, G * MXFP4_BLOCK)  # value order
    return pack_nibbles(codes), scales.contiguous()


def unpack_mxfp4(q: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_mxfp4: the executor's (codes, exponents) -> published (blocks, scales)."""
    *lead, H = q.shape
    codes = unpack_nibbles(q).reshape(*lead, H // 16, MXFP4_BLOCK // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).contiguous(), e


def dequantize_mxfp4_packed(q: torch.Tensor, e: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The executor's packed mxfp4 (codes [..., R, K/2], exponents [..., R, K/32]) -> w [..., R, K], on q's device."""
    *lead, H = q.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=q.device)
    w = lut[unpack_nibbles(q).long()].reshape(*lead, H // 16, MXFP4_BLOCK)
    w = torch.ldexp(w, (e.to(torch.int32) - 127)[..., None].float())
    return w.reshape(*lead, H * 2).to(dtype)
