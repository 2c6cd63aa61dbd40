// AVX-512 kernels: the vector (GEMV-like) path for few tokens per expert, reading row-major weights.
// Blocks of 4 weight rows x up to 4 tokens: 16 zmm accumulators + 4 weight + 1 activation registers
// of the 32 (int4 at 3-4 tokens needs int32 and fp32 accumulators: see i4_rows and i4_block_nat).
// bf16: VDPBF16PS (pairs of bf16 products into fp32). int8: VPDPBUSD (u8 x s8, 4 products into int32)
// with the activations offset by +128 to make them unsigned, undone with the precomputed row sums:
// sum((a+128) w) - 128 sum(w) = sum(a w). int4: the stored nibbles (0..15) are the unsigned operand, the
// int8 activations the signed one (both in the int4 stored order, quant.py); the +8 offset is undone per
// group in int32 with the activation group sums. mxfp4: nibble unpacking, then VPSHUFB through the 16-entry
// code table (hy.h, HY_MX4_LUT) to 2 * FP4 + 12 as the unsigned operand; each int32 lane starts at -12 * the
// sum of its 4 activations, so VPDPBUSD leaves the exact dot of the block, converted and scaled once per block.
// q8_0: the int8 weights XOR 0x80 (w + 128) as the unsigned operand, the +128 undone per block with the activation
// block sums, each 32-value block scaled by its fp16 scale. q4_0: int4's nibble unpacking with the activations'
// quarters re-ordered to the file's nibble pairing, the +8 undone per block with the activation block sums, q8_0's
// fp16 block scales. q4_k: int4's nibble unpacking and VPDPBUSD without an offset, each 32-value sub-block scaled by
// its unpacked 6-bit scale, the minimums subtracted once per super-block.
// q5_k: q4_k's kernel with each value's fifth bit OR'ed on from the head. iq4_xs: q4_k's kernel with each index
// mapped through the codebook by VPSHUFB to value + 128, the +128 undone per sub-block as q8_0's. q2_k: 2-bit values
// by a shift and a mask, the minimums per 16 values with the activations' sums per 4 lanes. q3_k: q2_k's 2-bit values
// with each value's high bit added as 4 under a byte mask, VPDPBUSD from -4 x the activation sums as q6_k's. q6_k: the
// 6-bit values assembled from their nibble and bit pair, VPDPBUSD from -32 x the activation sums, each
// 16-value group scaled by its int8 scale times d.
// Software prefetch into L2: the hardware prefetchers lose a block's 4 short interleaved row streams at each block's
// start, so every kernel prefetches the rows ahead (bf16 and mxfp4 two blocks, int8 and int4 Knobs::pf_rows).
#pragma once
#include <immintrin.h>
#include "hy.h"
#include "kern_iq256.h"

namespace {

// The sums of the 16 lanes of 16 vectors at once: lane i of the result is the sum of v[i]'s lanes (FP: fp32 lanes,
// else int32). The vector kernels end every 4-row block with 4 x MT such sums; a reduce and a move to a scalar per
// sum would be a large share of a short row's instructions, where this transposing tree of four levels (two shuffles
// and an add each) makes all 16 at once (the zero vectors of a block with fewer tokens fold away).
// Level 1 adds lanes (l, l+2) of each 128-bit quarter and interleaves pairs of vectors, level 2 adds (l, l+1) and
// holds four vectors per quarter, levels 3-4 add the quarters: vector i ends in quarter i / 4, position i % 4.
// Every vector's lanes are summed in the same tree whatever its index, so a token's result does not depend on the
// tokens computed beside it.

template <bool FP>
inline __m512i add_lanes(__m512i a, __m512i b) {
  if constexpr (FP) return _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b)));
  else return _mm512_add_epi32(a, b);
}

template <bool FP>
inline __m512i hsum16(const __m512i* v) {
  __m512i s[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    s[i] = add_lanes<FP>(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = add_lanes<FP>(_mm512_unpacklo_epi64(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_epi64(s[2 * i], s[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    w[i] = add_lanes<FP>(_mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return add_lanes<FP>(_mm512_shuffle_i32x4(w[0], w[1], 0x88), _mm512_shuffle_i32x4(w[0], w[1], 0xDD));
}

// hsum16 of a block's accumulators get(j, t) (row j < 4, token t < MT) in lanes t * 4 + j, the other lanes 0.
template <bool FP, int MT, class Get>
inline __m512i block_sums(Get get) {
  __m512i v[16];
  for (int i = 0; i < 16; ++i) v[i] = i / 4 < MT ? get(i % 4, i / 4) : _mm512_setzero_si512();
  return hsum16<FP>(v);
}

// Quarter q (a compile-time value once the callers' token loops are unrolled) of v.
inline __m128 quarter(__m512 v, int q) {
  switch (q) {
    case 0: return _mm512_castps512_ps128(v);
    case 1: return _mm512_extractf32x4_ps(v, 1);
    case 2: return _mm512_extractf32x4_ps(v, 2);
    default: return _mm512_extractf32x4_ps(v, 3);
  }
}

// C[t * ldc + j] = s[t * 4 + j] * scale of token t (j < 4 rows, t < MT tokens): the epilogue of a block whose
// (row j, token t) sums are lanes t * 4 + j of s.
template <int MT>
inline void store_rows(__m512 s, const uint8_t* const* rows, int k, bool scaled, float* C, int ldc) {
#pragma GCC unroll 4
  for (int t = 0; t < MT; ++t) {
    __m128 q = quarter(s, t);
    if (scaled) q = _mm_mul_ps(q, _mm_set1_ps(act_scale(rows[t], k)));
    _mm_storeu_ps(C + t * ldc, q);
  }
}

template <int MT>
void bf16_block(const uint16_t* w, int64_t ldw, int k, const uint8_t* const* rows, float* C, int ldc, int pf_lo) {
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int kk = 0; kk < k; kk += 32) {
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512((const void*)(w + j * ldw + kk));
    for (int j = pf_lo; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + kk), _MM_HINT_T1);
    for (int t = 0; t < MT; ++t) {
      __m512i a = _mm512_loadu_si512((const void*)((const uint16_t*)rows[t] + kk));
      for (int j = 0; j < 4; ++j) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], (__m512bh)wv[j], (__m512bh)a);
    }
  }
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(acc[j][t]); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, false, C, ldc);
}

template <int MT>
void i8_block(const int8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const float* sw,
              const int32_t* rsum, float* C, int ldc, int pf_lo, int pf_rows) {
  const __m512i off = _mm512_set1_epi8((char)0x80);
  __m512i acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_si512();
  for (int kk = 0; kk < k; kk += 64) {
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512((const void*)(w + j * ldw + kk));
    // rows pf_rows.. +3 (the first block of a call: from row 4 on, see vec_gemm)
    for (int j = pf_lo == 8 ? pf_rows : 4; j < pf_rows + 4; ++j) _mm_prefetch((const char*)(w + j * ldw + kk), _MM_HINT_T1);
    for (int t = 0; t < MT; ++t) {
      __m512i a = _mm512_xor_si512(_mm512_loadu_si512((const void*)(rows[t] + kk)), off);  // a + 128
      for (int j = 0; j < 4; ++j) acc[j][t] = _mm512_dpbusd_epi32(acc[j][t], a, wv[j]);
    }
  }
  // sum((a + 128) w) - 128 sum(w) per row, then the row's and the token's scales
  const __m512i s = block_sums<false, MT>([&](int j, int t) { return acc[j][t]; });
  const __m512i rs = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)rsum));  // lane t * 4 + j: rsum[j]
  const __m512 swv = _mm512_broadcast_f32x4(_mm_loadu_ps(sw));
  const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s, _mm512_slli_epi32(rs, 7))), swv);
  store_rows<MT>(f, rows, k, true, C, ldc);
}

// int4 (quant.py / hy.h: the stored order), 4 rows x MT tokens. Per row and chunk (32 bytes, 64 stored values)
// the unpacking is one broadcast load and one AND: the low 256 bits keep the low nibbles (stored values 0..31),
// the high 256 bits the high nibbles where they are, i.e. 16 x their value (stored 32..63; <= 240 is still a
// valid unsigned VPDPBUSD operand). A shift to bring them down would cost one more instruction per row and chunk, on
// the port VPDPBUSD needs (Intel p0). So lanes 8-15 hold 16 x their sums throughout, and one multiply by 1/16
// before the final reduction restores them: a power-of-two factor does not change any fp32 rounding.
// The stored order gives each int32 lane one group for a whole fold block (`fold` groups, fold * group / 64
// chunks): the products are summed in int32 across the block, and each row and token is converted and scaled
// once per block, with a vector of the block's group scales (lane l: group l / L, L = 16 / fold lanes a group),
// where the natural order converts and scales once per group.
// The +8 of the stored nibbles is undone in int32: each group's first lane starts at -8 x (the token's group
// sum of activations; x 16 in lanes 8-15), so every group's lanes add up to its exact signed dot.
// Each row is unpacked once for all MT tokens.
// B = fold * group / 64, the chunks of a block, is a template argument (i4_block) so that the block's K loop has
// a known trip count: with a run-time count the compiler keeps the loop rolled.
// Software prefetch (int4 and mxfp4) into L2 (T1), once per 64-byte line, rather than into L1: a 4-bit row is short,
// so the lead must be several rows, and L1 prefetches are bounded by the few L1 miss buffers, L2 ones by the larger
// L2 queue. At chunk c: rows pf_rows.. ahead (hy.h Knobs); the first block of a call (pf_lo 4) from row 4 on, which
// the steady-state lead never covers.
inline void i4_prefetch(const uint8_t* w, int64_t ldw, int c, int pf_lo, int pf_rows) {
  for (int j = pf_lo == 8 ? 0 : 4 - pf_rows; j < 4; ++j)
    _mm_prefetch((const char*)(w + (j + pf_rows) * ldw + c * 32), _MM_HINT_T1);
}

// fp32 sums of 4 rows x MT tokens in i4_rows: in registers, or (MEM: 3-4 tokens, whose int32 sums take 12-16 of the
// 32 registers with the 4 weight vectors beside them) in memory, read and written once per fold block (once per row
// when a row is one block). One pass with the sums in memory reads the weights once where two passes (of 2 rows or
// of token pairs) would start twice the row streams, which leaves the loads waiting on memory.
template <int MT, bool MEM = (MT > 2)>
struct I4Sums {
  __m512 v[4][MT];
  I4Sums() { for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) v[j][t] = _mm512_setzero_ps(); }
  void fma(int j, int t, __m512 x, __m512 s) { v[j][t] = _mm512_fmadd_ps(x, s, v[j][t]); }
  __m512 get(int j, int t) const { return v[j][t]; }
};
template <int MT>
struct I4Sums<MT, true> {
  alignas(64) float m[4][MT][16];
  I4Sums() { for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) _mm512_store_ps(m[j][t], _mm512_setzero_ps()); }
  void fma(int j, int t, __m512 x, __m512 s) { _mm512_store_ps(m[j][t], _mm512_fmadd_ps(x, s, _mm512_load_ps(m[j][t]))); }
  __m512 get(int j, int t) const { return _mm512_load_ps(m[j][t]); }
};

template <int MT, int B>
void i4_rows(const uint8_t* w, int64_t ldw, int k, int group, int fold, const uint8_t* const* rows, const float* sw,
             float* C, int ldc, int pf_lo, int pf_rows) {
  const int G = k / group, L = 16 / fold;  // lanes a group
  const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8((char)0xF0), 1);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i gidx = _mm512_srl_epi32(lane, _mm_cvtsi32_si128(__builtin_ctz(L)));  // lane -> group in block
  const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi32(3), _mm256_set1_epi32(7), 1);  // x 8; lanes 8-15 x 128
  __mmask16 first = 0;  // each group's first lane
  for (int l = 0; l < 16; l += L) first |= (__mmask16)(1u << l);
  const __mmask16 gm = (__mmask16)((1u << fold) - 1);
  I4Sums<MT> acc;
  for (int b = 0; b < G / fold; ++b) {
    __m512i iacc[4][MT];
    for (int t = 0; t < MT; ++t) {
      const __m512i gs = _mm512_maskz_loadu_epi32(gm, act_gsum(rows[t], k) + b * fold);
      const __m512i off = _mm512_sub_epi32(_mm512_setzero_si512(),
                                           _mm512_sllv_epi32(_mm512_maskz_permutexvar_epi32(first, gidx, gs), shl));
      for (int j = 0; j < 4; ++j) iacc[j][t] = off;
    }
#pragma GCC unroll 4
    for (int c = b * B; c < (b + 1) * B; ++c) {
      __m512i wq[4];
      for (int j = 0; j < 4; ++j)
        wq[j] = _mm512_and_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w + j * ldw + c * 32))), nib);
      if (c % 2 == 0) i4_prefetch(w, ldw, c, pf_lo, pf_rows);
      for (int t = 0; t < MT; ++t) {
        const __m512i a = _mm512_loadu_si512((const void*)(rows[t] + c * 64));
        for (int j = 0; j < 4; ++j) iacc[j][t] = _mm512_dpbusd_epi32(iacc[j][t], wq[j], a);
      }
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 sv = _mm512_permutexvar_ps(gidx, _mm512_maskz_loadu_ps(gm, sw + j * G + b * fold));
      for (int t = 0; t < MT; ++t) acc.fma(j, t, _mm512_cvtepi32_ps(iacc[j][t]), sv);
    }
  }
  const __m512 unscale = _mm512_insertf32x8(_mm512_set1_ps(1.f), _mm256_set1_ps(0.0625f), 1);  // lanes 8-15: / 16
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(_mm512_mul_ps(acc.get(j, t), unscale)); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}

// The natural order (fold 1 with groups >= 64, or groups of 32 two to a chunk: quant.py), group size GS a
// compile-time constant: each group's sums are converted and scaled once per group (GS >= 64: per 1-2 chunks;
// GS = 32: lanes 0-7 and 8-15 are two groups, with a scale each).
template <int MT, int GS>
void i4_rows_g(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const float* sw, float* C, int ldc,
               int pf_lo, int pf_rows) {
  constexpr int CPG = GS >= 64 ? GS / 64 : 1;  // 64-value chunks per scaling step
  const int G = k / GS;
  const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8((char)0xF0), 1);
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int c0 = 0; c0 < k / 64; c0 += CPG) {
    __m512i iacc[4][MT];
    for (int t = 0; t < MT; ++t) {
      const int32_t* gs = act_gsum(rows[t], k);
      __m512i off = _mm512_maskz_set1_epi32(1, -8 * gs[GS >= 64 ? c0 / CPG : 2 * c0]);  // lane 0: 1 x
      if (GS < 64) off = _mm512_mask_set1_epi32(off, 0x100, -128 * gs[2 * c0 + 1]);   // lane 8: 16 x
      for (int j = 0; j < 4; ++j) iacc[j][t] = off;
    }
    for (int i = 0; i < CPG; ++i) {
      const int c = c0 + i;
      __m512i wq[4];
      for (int j = 0; j < 4; ++j)
        wq[j] = _mm512_and_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w + j * ldw + c * 32))), nib);
      if (CPG > 1 ? i % 2 == 0 : c % 2 == 0) i4_prefetch(w, ldw, c, pf_lo, pf_rows);
      for (int t = 0; t < MT; ++t) {
        const __m512i a = _mm512_loadu_si512((const void*)(rows[t] + c * 64));
        for (int j = 0; j < 4; ++j) iacc[j][t] = _mm512_dpbusd_epi32(iacc[j][t], wq[j], a);
      }
    }
    for (int j = 0; j < 4; ++j) {
      __m512 sv;
      if (GS >= 64) sv = _mm512_set1_ps(sw[j * G + c0 / CPG]);
      else sv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(sw[j * G + 2 * c0])),
                                   _mm256_set1_ps(sw[j * G + 2 * c0 + 1]), 1);  // lanes 0-7: K 0..31
      for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[j][t]), sv, acc[j][t]);
    }
  }
  const __m512 unscale = _mm512_insertf32x8(_mm512_set1_ps(1.f), _mm256_set1_ps(0.0625f), 1);  // lanes 8-15: / 16
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(_mm512_mul_ps(acc[j][t], unscale)); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}

// The natural order at 3-4 tokens runs token pairs: its per-group scaling (every 1-2 chunks) would touch in-memory
// sums (I4Sums) too often, and 4 rows x 4 tokens of int32 and fp32 sums do not fit in the registers. The second pair
// re-reads the block's weights from L1. A token's sums are formed in the same order either way.
template <int MT, int GS>
void i4_block_nat(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const float* sw, float* C, int ldc,
                  int pf_lo, int pf_rows) {
  if constexpr (MT <= 2) {
    i4_rows_g<MT, GS>(w, ldw, k, rows, sw, C, ldc, pf_lo, pf_rows);
  } else {
    i4_rows_g<2, GS>(w, ldw, k, rows, sw, C, ldc, pf_lo, pf_rows);
    i4_rows_g<MT - 2, GS>(w, ldw, k, rows + 2, sw, C + 2 * ldc, ldc, pf_lo, pf_rows);
  }
}

template <int MT>
void i4_block(const uint8_t* w, int64_t ldw, int k, int group, int fold, const uint8_t* const* rows, const float* sw,
              float* C, int ldc, int pf_lo, int pf_rows) {
  if (i4_natural(group, fold)) {  // the packer allows groups of 32, 64 and 128 (cpu_kernels/quant.py)
    if (group == 32) i4_block_nat<MT, 32>(w, ldw, k, rows, sw, C, ldc, pf_lo, pf_rows);
    else if (group == 64) i4_block_nat<MT, 64>(w, ldw, k, rows, sw, C, ldc, pf_lo, pf_rows);
    else i4_block_nat<MT, 128>(w, ldw, k, rows, sw, C, ldc, pf_lo, pf_rows);
    return;
  }
  switch (fold * group / 64) {  // forward() checked the layout (hy.h i4_fold_ok): 2..32 chunks, a power of two
    case 2: i4_rows<MT, 2>(w, ldw, k, group, fold, rows, sw, C, ldc, pf_lo, pf_rows); break;
    case 4: i4_rows<MT, 4>(w, ldw, k, group, fold, rows, sw, C, ldc, pf_lo, pf_rows); break;
    case 8: i4_rows<MT, 8>(w, ldw, k, group, fold, rows, sw, C, ldc, pf_lo, pf_rows); break;
    case 16: i4_rows<MT, 16>(w, ldw, k, group, fold, rows, sw, C, ldc, pf_lo, pf_rows); break;
    default: i4_rows<MT, 32>(w, ldw, k, group, fold, rows, sw, C, ldc, pf_lo, pf_rows);
  }
}

// mxfp4, 4 rows x MT tokens: per 64-value chunk (two 32-value blocks, lanes 0-7 and 8-15 of each int32
// vector) one 32-byte load per row, a shift + AND to the codes, one VPSHUFB to the unsigned operand; per
// token one VPDPBUSD of the activations with 12s (the offset) and per row and token one VPDPBUSD, a
// convert and an FMA with the blocks' scales. The scales of 8 chunks (16 exponents) are made at once per
// row (VSCALEFPS: 2^(e - 128), exact for every e, subnormal 2^-128 included) and each chunk's pair is
// picked by one VPERMPS. The lane values are exact integers times a power of two, so blocks written with
// other (code, exponent) pairs of the same values give bit-identical sums.
template <int MT>
void mx4_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* se, float* C,
               int ldc, int pf_lo) {
  const int G = k / 32, nc = k / 64;
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);  // high half: >> 4
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(HY_MX4_LUT));
  const __m512i twelve = _mm512_set1_epi8(12);
  const __m512i bias = _mm512_set1_epi32(128);
  const __m512i pair0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);  // lanes 8-15: 1
  const __m512 one = _mm512_set1_ps(1.f);
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int c0 = 0; c0 < nc; c0 += 8) {
    const int nb = std::min(16, G - 2 * c0);  // this row's blocks from 2 * c0 on (G is even)
    const __mmask16 bm = (__mmask16)((1u << nb) - 1);
    __m512 s16[4];  // scales of blocks 2 c0 .. 2 c0 + 15 of each row
    for (int j = 0; j < 4; ++j) {
      __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(bm, se + j * G + 2 * c0));
      s16[j] = _mm512_scalef_ps(one, _mm512_cvtepi32_ps(_mm512_sub_epi32(e, bias)));
    }
    __m512i idx = pair0;  // chunk c's lanes 0-7: block 2(c - c0), lanes 8-15: block 2(c - c0) + 1
    for (int c = c0; c < std::min(nc, c0 + 8); ++c, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2))) {
      __m512i wq[4];
      for (int j = 0; j < 4; ++j) {
        __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w + j * ldw + c * 32)));
        wq[j] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srlv_epi16(raw, shift), lo4));
      }
      // 1-2 tokens: 2 blocks ahead, into L2, once per 64-byte line (see i4_prefetch). 3-4 tokens, where the
      // per-block scaling makes this kernel compute-bound: the next block into L1 at every chunk (into L2 was no
      // faster there).
      if (MT <= 2 && c % 2 == 0)
        for (int j = pf_lo; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + c * 32), _MM_HINT_T1);
      if (MT > 2) for (int j = 4; j < 8; ++j) _mm_prefetch((const char*)(w + j * ldw + c * 32), _MM_HINT_T0);
      __m512i a[MT], off[MT];
      for (int t = 0; t < MT; ++t) {
        a[t] = _mm512_loadu_si512((const void*)(rows[t] + c * 64));
        off[t] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), twelve, a[t]));
      }
      for (int j = 0; j < 4; ++j) {
        const __m512 sv = _mm512_permutexvar_ps(idx, s16[j]);
        for (int t = 0; t < MT; ++t)
          acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(off[t], wq[j], a[t])), sv, acc[j][t]);
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = _mm512_reduce_add_ps(acc[j][t]) * act_scale(rows[t], k);
}

// q8_0 (hy.h q8_scales), 4 rows x MT tokens: per 64-value chunk (two 32-value blocks, lanes 0-7 and 8-15 of each
// int32 vector) one 64-byte load and one XOR per row make the unsigned operand w + 128; each token's lanes 0 and 8
// start at -128 x the activation sum of their block (the activation row's group sums, groups of 32), so VPDPBUSD
// leaves each block's exact signed dot, converted and multiplied by its row's two block scales once per row, token
// and chunk. The fp16 scales of 8 chunks (16 blocks) are converted at once per row (VCVTPH2PS) and each chunk's pair
// picked by one VPERMPS, as mx4_block does. Prefetch as i8_block: rows pf_rows.. ahead into L2, and their scales.
// q8_0 and q4_0 (one fp16 scale per 32 values, G per row): the scales of 4 rows' blocks 2 c0 .. 2 c0 + 15 (fewer at a
// row's end; G is even) converted to fp32, s16[j] for row j, and the scales of rows pf0 .. pf_rows + 3 prefetched
// into L2.
inline void block_scales16(const uint16_t* sw, int G, int c0, int pf0, int pf_rows, __m512 s16[4]) {
  const int nb = std::min(16, G - 2 * c0);
  const __mmask16 bm = (__mmask16)((1u << nb) - 1);
  for (int j = 0; j < 4; ++j) s16[j] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, sw + j * G + 2 * c0));
  for (int j = pf0; j < pf_rows + 4; ++j) _mm_prefetch((const char*)(sw + j * G + 2 * c0), _MM_HINT_T1);
}

template <int MT>
void q8_block(const int8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint16_t* sw, float* C, int ldc,
              int pf_lo, int pf_rows) {
  const int G = k / 32, nc = k / 64;
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  const __m512i pair0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);  // lanes 8-15: 1
  const int pf0 = pf_lo == 8 ? pf_rows : 4;  // the first block of a call: from row 4 on (see vec_gemm)
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int c0 = 0; c0 < nc; c0 += 8) {
    __m512 s16[4];  // scales of blocks 2 c0 .. 2 c0 + 15 of each row
    block_scales16(sw, G, c0, pf0, pf_rows, s16);
    __m512i idx = pair0;  // chunk c's lanes 0-7: block 2(c - c0), lanes 8-15: block 2(c - c0) + 1
    for (int c = c0; c < std::min(nc, c0 + 8); ++c, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2))) {
      __m512i wq[4];
      for (int j = 0; j < 4; ++j) wq[j] = _mm512_xor_si512(_mm512_loadu_si512((const void*)(w + j * ldw + c * 64)), flip);
      for (int j = pf0; j < pf_rows + 4; ++j) _mm_prefetch((const char*)(w + j * ldw + c * 64), _MM_HINT_T1);
      __m512 sv[4];
      for (int j = 0; j < 4; ++j) sv[j] = _mm512_permutexvar_ps(idx, s16[j]);
      for (int t = 0; t < MT; ++t) {
        const int32_t* gs = act_gsum(rows[t], k);
        __m512i off = _mm512_maskz_set1_epi32(1, -128 * gs[2 * c]);
        off = _mm512_mask_set1_epi32(off, 0x100, -128 * gs[2 * c + 1]);
        const __m512i a = _mm512_loadu_si512((const void*)(rows[t] + c * 64));
        for (int j = 0; j < 4; ++j)
          acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(off, wq[j], a)), sv[j], acc[j][t]);
      }
    }
  }
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(acc[j][t]); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}

// q4_0 (hy.h), 4 rows x MT tokens: per 64-value chunk (two 32-value blocks, 16 bytes each) one 32-byte load per row
// broadcast to both 256-bit halves and one AND, as int4's: the low half keeps the low nibbles (values 0-15 of the
// chunk's first block in lanes 0-3, of its second in lanes 4-7), the high half the high nibbles where they are, i.e.
// 16 x values 16-31 (first block lanes 8-11, second 12-15), undone by 1/16 before the final reduction. The token's
// 64 activations are brought into that order once per chunk (one VSHUFI64X2 of their 16-byte quarters, shared by
// the 4 rows); VPDPBUSD of the nibbles q (unsigned) with them from -8 x the activation sum of each block in lanes 0
// and 4 leaves each lane's exact dot of q - 8, converted and multiplied by its block's scale (one VPERMPS of 16
// blocks' scales converted at once per row, as q8_0's). Prefetch as int4's (rows pf_rows.. ahead into L2, once per
// line) and the scales as q8_0's.
template <int MT>
void q40_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint16_t* sw, float* C, int ldc,
               int pf_lo, int pf_rows) {
  const int G = k / 32, nc = k / 64;
  const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8((char)0xF0), 1);
  const __m512i two = _mm512_set1_epi32(2);
  // a chunk's lanes: block 2c in 0-3 and 8-11, block 2c + 1 in 4-7 and 12-15 (of the 16 scales: pair0 + 2(c - c0))
  const __m512i pair0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  const int pf0 = pf_lo == 8 ? pf_rows : 4;  // the first block of a call: from row 4 on (see vec_gemm)
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int c0 = 0; c0 < nc; c0 += 8) {
    __m512 s16[4];  // scales of blocks 2 c0 .. 2 c0 + 15 of each row
    block_scales16(sw, G, c0, pf0, pf_rows, s16);
    __m512i idx = pair0;
    for (int c = c0; c < std::min(nc, c0 + 8); ++c, idx = _mm512_add_epi32(idx, two)) {
      __m512i wq[4];
      __m512 sv[4];
      for (int j = 0; j < 4; ++j) {
        wq[j] = _mm512_and_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w + j * ldw + c * 32))), nib);
        sv[j] = _mm512_permutexvar_ps(idx, s16[j]);
      }
      if (c % 2 == 0) i4_prefetch(w, ldw, c, pf_lo, pf_rows);
      for (int t = 0; t < MT; ++t) {
        const int32_t* bsum = act_gsum(rows[t], k) + 2 * c;  // the activation sums of blocks 2c, 2c + 1
        const __m512i off = _mm512_mask_set1_epi32(_mm512_maskz_set1_epi32(1, -8 * bsum[0]), 0x10, -8 * bsum[1]);
        // quarters (values 0-15, 16-31 of block 2c, then of 2c + 1) -> 0-15 of both blocks, then 16-31 of both
        const __m512i x = _mm512_loadu_si512((const void*)(rows[t] + c * 64));
        const __m512i a = _mm512_shuffle_i64x2(x, x, _MM_SHUFFLE(3, 1, 2, 0));
        for (int j = 0; j < 4; ++j)
          acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(off, wq[j], a)), sv[j], acc[j][t]);
      }
    }
  }
  const __m512 unscale = _mm512_insertf32x8(_mm512_set1_ps(1.f), _mm256_set1_ps(0.0625f), 1);  // lanes 8-15: / 16
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(_mm512_mul_ps(acc[j][t], unscale)); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}

// A q4_k head (hy.h) -> its 8 sub-blocks' scales d sc in lanes 0-7 and minimums dmin m in lanes 8-15, in vector
// registers (scalar stores read back as vectors would stall on store forwarding): the 6-bit fields (ggml's
// get_scale_min_k4) gathered by two byte shuffles (lane l's low bits from byte P[l], its top two from byte Q[l]),
// widened, shifted and masked per lane, converted and multiplied by d (lanes 0-7) or dmin (8-15). The products are
// exact in fp32.
inline __m512 q4k_scales(const uint8_t* h) {
  const __m128i b = _mm_loadu_si128((const __m128i*)h);
  const __m512i P = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(b, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)));
  const __m512i Q = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(b, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11)));
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i low = _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m512i v = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(P, shift), low),
                                    _mm512_slli_epi32(_mm512_srli_epi32(Q, 6), 4));
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t*)h));  // d, dmin
  const __m512 mul = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                           _mm512_castps128_ps512(dd));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(v), mul);
}

// q4_k (hy.h q4k_heads), q5_k (hy.h q5k_heads) and iq4_xs (hy.h iq4_heads), 4 rows x MT tokens (MT <= 2; vec_block runs
// 3-4 tokens as two pairs, as int4's natural order does, for the registers): per 256-value super-block and row the
// head is unpacked to the 8 sub-blocks' scales (q4k_scales: and minimums; iq4_xs: iq4_scales8); per 64-value chunk
// the nibbles unpack as int4's (q4_k: one broadcast load and one AND, lanes 8-15 holding 16 x their sums, undone
// before the final reduction; q5_k and iq4_xs: the high nibbles shifted down by a 16-bit shift of their own count;
// q5_k: each value's fifth bit from the head's 32 qh bytes broadcast to both halves, shifted right by the chunk's
// bit, 2 cc for its first 32 values and 2 cc + 1 for the next, masked and moved to bit 4; iq4_xs: each index mapped
// by one VPSHUFB to its codebook value + 128, HY_IQ4_VALUES_U8, as q8_0's w + 128), VPDPBUSD with the activations
// gives each sub-block's exact dot with q (lanes 0-7: sub-block 2c, 8-15: 2c + 1; iq4_xs: lanes 0 and 8 start at
// -128 x the token's activation sum of their sub-block, as q8_0's), converted and multiplied by its scale (one
// VPERMPS of the super-block's scales per row and chunk). q4_k's and q5_k's minimums enter once per super-block, row
// and token, as - sum_j (dmin m_j) x (the token's activation sum of sub-block j), in lanes 0-7 (which the final 1/16
// leaves alone).
template <int MT, int KIND>
void kq_rows(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc,
             int pf_lo, int pf_rows) {
  const int nsb = k / 256;
  constexpr int HB = kq_head_bytes(KIND);  // head bytes a super-block
  const int64_t hst = (int64_t)nsb * HB;  // head bytes a row
  const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8((char)0xF0), 1);
  const __m512i lo4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
  const __m512i nib_sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);  // high nibbles >> 4
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(HY_IQ4_VALUES_U8));  // iq4_xs
  const __m512i pair0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);  // lanes 8-15: 1
  const int pf0 = pf_lo == 8 ? pf_rows : 4;
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    if (sb % 4 == 0)
      for (int j = pf0; j < pf_rows + 4; ++j)
        for (int b = 0; b < 4 * HB; b += 64) _mm_prefetch((const char*)(hd + j * hst + sb * HB + b), _MM_HINT_T1);
    __m512 sv16[4];  // lanes 0-7: the row's sub-block scales (q4_k, q5_k: lanes 8-15 its minimums, unused below)
    __m512i qh[4];  // q5_k: the super-block's fifth bits, in both halves
    for (int j = 0; j < 4; ++j) {
      const uint8_t* h = hd + j * hst + sb * HB;
      if constexpr (KIND == KQ_IQ4) {
        sv16[j] = _mm512_zextps256_ps512(iq4_scales8(h));
        continue;
      }
      sv16[j] = q4k_scales(h);
      if constexpr (KIND == KQ_Q5) qh[j] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(h + 16)));
      const __m512 mv = _mm512_maskz_permutexvar_ps(0xFF, _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0,
                                                                            0, 0, 0), sv16[j]);  // the minimums
      for (int t = 0; t < MT; ++t)
        acc[j][t] = _mm512_fnmadd_ps(mv, _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(0xFF, act_gsum(rows[t], k) + sb * 8)),
                                     acc[j][t]);
    }
    __m512i idx = pair0;  // chunk cc of the super-block: lanes 0-7 sub-block 2 cc, lanes 8-15 sub-block 2 cc + 1
    for (int cc = 0; cc < 4; ++cc, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2))) {
      const int c = sb * 4 + cc;
      // q5_k: the fifth bits' shift, bit 2 cc of qh for the chunk's first 32 values, bit 2 cc + 1 for its next 32
      const __m512i hb_sh = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * cc)), _mm256_set1_epi16((short)(2 * cc + 1)), 1);
      __m512i wq[4];
      __m512 sv[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w + j * ldw + c * 32)));
        if constexpr (KIND == KQ_Q5)
          wq[j] = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(raw, nib_sh), lo4),
                                  _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh[j], hb_sh), one), 4));
        else if constexpr (KIND == KQ_IQ4)
          wq[j] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srlv_epi16(raw, nib_sh), lo4));
        else
          wq[j] = _mm512_and_si512(raw, nib);
        sv[j] = _mm512_permutexvar_ps(idx, sv16[j]);
      }
      if (cc % 2 == 0) i4_prefetch(w, ldw, c, pf_lo, pf_rows);
      for (int t = 0; t < MT; ++t) {
        __m512i off = _mm512_setzero_si512();
        if constexpr (KIND == KQ_IQ4) {  // the + 128 of the codebook bytes undone per sub-block
          const int32_t* gs = act_gsum(rows[t], k) + 2 * c;  // sub-blocks 2c, 2c + 1
          off = _mm512_mask_set1_epi32(_mm512_maskz_set1_epi32(1, -128 * gs[0]), 0x100, -128 * gs[1]);
        }
        const __m512i a = _mm512_loadu_si512((const void*)(rows[t] + c * 64));
        for (int j = 0; j < 4; ++j)
          acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(off, wq[j], a)), sv[j], acc[j][t]);
      }
    }
  }
  // q4_k: lanes 8-15 / 16 (their nibbles stayed in the high half of the byte)
  const __m512 unscale = KIND != KQ_Q4 ? _mm512_set1_ps(1.f) : _mm512_insertf32x8(_mm512_set1_ps(1.f), _mm256_set1_ps(0.0625f), 1);
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(_mm512_mul_ps(acc[j][t], unscale)); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}


// q2_k (hy.h q2k_heads), 4 rows x MT tokens (MT <= 2; vec_block runs 3-4 tokens as two pairs, for the registers):
// per 256-value super-block and row its 16 groups' scales d sc and minimums dmin m as two vectors; per 64-value chunk
// one 32-byte load of its half's values broadcast to both 256-bit halves, shifted by a 16-bit shift of each half's
// count (4 (cc % 2), + 2 for the upper half) and masked: q in 0..3 as the unsigned operand. Lane l of VPDPBUSD holds 4
// values of the 16-value group 4 cc + l / 4, scaled by a VPERMPS of the scales; the minimums by the same lanes' sums
// of 4 activations (one VPDPBUSD of ones per token and chunk, shared by the 4 rows) times a VPERMPS of the minimums.
template <int MT>
void q2k_rows(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc,
              int pf_lo, int pf_rows) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 20;  // head bytes a row
  const __m512i three = _mm512_set1_epi8(3), ones = _mm512_set1_epi8(1), lo4 = _mm512_set1_epi32(15);
  const __m512i quad = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  const int pf0 = pf_lo == 8 ? pf_rows : 4;
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    __m512 S16[4], M16[4];
    for (int j = 0; j < 4; ++j) {
      const uint8_t* h = hd + j * hst + sb * 20;
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)h));
      const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t*)(h + 16)));  // d, dmin
      S16[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(sc, lo4)), _mm512_broadcastss_ps(dd));
      M16[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)),
                             _mm512_broadcastss_ps(_mm_movehdup_ps(dd)));
    }
    for (int j = pf0; j < pf_rows + 4; ++j) {
      _mm_prefetch((const char*)(w + j * ldw + sb * 64), _MM_HINT_T1);
      _mm_prefetch((const char*)(hd + j * hst + sb * 20), _MM_HINT_T1);
    }
    for (int cc = 0; cc < 4; ++cc) {
      const int half = cc / 2;
      const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * (cc % 2))),
                                            _mm256_set1_epi16((short)(4 * (cc % 2) + 2)), 1);
      const __m512i idx = _mm512_add_epi32(quad, _mm512_set1_epi32(4 * cc));
      __m512i wq[4];
      __m512 sv[4], mv[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w + j * ldw + sb * 64 + half * 32)));
        wq[j] = _mm512_and_si512(_mm512_srlv_epi16(q, sh), three);
        sv[j] = _mm512_permutexvar_ps(idx, S16[j]);
        mv[j] = _mm512_permutexvar_ps(idx, M16[j]);
      }
      for (int t = 0; t < MT; ++t) {
        const __m512i a = _mm512_loadu_si512((const void*)(rows[t] + (sb * 4 + cc) * 64));
        const __m512 as = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, a));
        for (int j = 0; j < 4; ++j) {
          acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[j], a)), sv[j],
                                      acc[j][t]);
          acc[j][t] = _mm512_fnmadd_ps(as, mv[j], acc[j][t]);
        }
      }
    }
  }
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(acc[j][t]); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}


// q3_k (hy.h q3k_heads), 4 rows x MT tokens (MT <= 2; vec_block runs 3-4 tokens as two pairs, for the registers):
// per 256-value super-block and row the 16 scales (hy.h q3k_scales) times d as one vector; per 64-value chunk q2_k's
// 32-byte load of its half's 2-bit values, shifted and masked (low2 in 0..3), plus 4 where the value's high bit is set
// (a byte mask testing bit 2 cc of the 32 hmask bytes for the chunk's first 32 values, 2 cc + 1 for its next 32): q + 4
// in 0..7 as the unsigned operand. VPDPBUSD starts each lane at -4 x the sum of its 4 activations (one VPDPBUSD of 4s
// per token and chunk, shared by the 4 rows), leaving the exact dot of q; lane l holds 4 values of the 16-value group
// 4 cc + l / 4, scaled by a VPERMPS of the scales.
template <int MT>
void q3k_rows(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc,
              int pf_lo, int pf_rows) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 14;  // head bytes a row
  const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
  const __m512i quad = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  const int pf0 = pf_lo == 8 ? pf_rows : 4;
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    __m512 sc16[4];
    for (int j = 0; j < 4; ++j) {
      const uint8_t* h = hd + j * hst + sb * 14;
      uint16_t dh;
      std::memcpy(&dh, h + 12, 2);
      sc16[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q3k_scales(h))), _mm512_set1_ps(f16_to_f32(dh)));
    }
    for (int j = pf0; j < pf_rows + 4; ++j) {
      const uint8_t* p = w + j * ldw + sb * 96;
      _mm_prefetch((const char*)p, _MM_HINT_T1);
      _mm_prefetch((const char*)(p + 64), _MM_HINT_T1);
      _mm_prefetch((const char*)(hd + j * hst + sb * 14), _MM_HINT_T1);
    }
    for (int cc = 0; cc < 4; ++cc) {
      const int half = cc / 2;
      const short s0 = (short)(4 * (cc % 2));  // the low bit pair of the chunk's first 32 values, then of its next 32
      const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16(s0), _mm256_set1_epi16((short)(s0 + 2)), 1);
      const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * cc))),
                                             _mm256_set1_epi8((char)(1 << (2 * cc + 1))), 1);
      const __m512i idx = _mm512_add_epi32(quad, _mm512_set1_epi32(4 * cc));
      __m512i wq[4];
      __m512 sv[4];
      for (int j = 0; j < 4; ++j) {
        const uint8_t* p = w + j * ldw + sb * 96;
        const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p));
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 32 + half * 32)));
        const __m512i low = _mm512_and_si512(_mm512_srlv_epi16(q, sh), three);
        wq[j] = _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hm, bit), low, four);
        sv[j] = _mm512_permutexvar_ps(idx, sc16[j]);
      }
      for (int t = 0; t < MT; ++t) {
        const __m512i a = _mm512_loadu_si512((const void*)(rows[t] + (sb * 4 + cc) * 64));
        const __m512i off = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), four, a));
        for (int j = 0; j < 4; ++j)
          acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(off, wq[j], a)), sv[j], acc[j][t]);
      }
    }
  }
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(acc[j][t]); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}


// q6_k (hy.h q6k_heads), 4 rows x MT tokens (MT <= 2; vec_block runs 3-4 tokens as two pairs, for the registers):
// per 256-value super-block and row the 16 int8 scales times d as one vector; per 64-value chunk one 64-byte load of
// ql (a half's low nibbles for its first chunk, high nibbles for its second) and one 32-byte qh load broadcast to
// both 256-bit halves, each half's bit pair moved to bits 4-5 by a 16-bit shift of its own count (no bit that
// crosses a byte lands there) and OR'ed on: q in 0..63 as the unsigned operand. VPDPBUSD starts each lane at -32 x
// the sum of its 4 activations (one VPDPBUSD of 32s per token and chunk, shared by the 4 rows), leaving the exact
// dot of (q - 32); lane l holds 4 values of the 16-value group 4 cc + l / 4, scaled by a VPERMPS of the scales.
template <int MT>
void q6k_rows(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc,
              int pf_lo, int pf_rows) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 18;  // head bytes a row
  const __m512i lo4 = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30), c32 = _mm512_set1_epi8(32);
  // 16-bit lanes 0-15 hold the chunk's first 32 values, 16-31 its next 32
  const __m512i sh_lo = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  // qh << 4, << 2
  const __m512i sh_hi = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);  // qh >> 0, >> 2
  const __m512i quad = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  const int pf0 = pf_lo == 8 ? pf_rows : 4;
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    __m512 sv16[4];
    for (int j = 0; j < 4; ++j) {
      const uint8_t* h = hd + j * hst + sb * 18;
      uint16_t dh;
      std::memcpy(&dh, h + 16, 2);
      sv16[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)h))),
                              _mm512_set1_ps(f16_to_f32(dh)));
    }
    for (int j = pf0; j < pf_rows + 4; ++j) {
      const uint8_t* p = w + j * ldw + sb * 192;
      _mm_prefetch((const char*)p, _MM_HINT_T1);
      _mm_prefetch((const char*)(p + 64), _MM_HINT_T1);
      _mm_prefetch((const char*)(p + 128), _MM_HINT_T1);
      _mm_prefetch((const char*)(hd + j * hst + sb * 18), _MM_HINT_T1);
    }
    for (int cc = 0; cc < 4; ++cc) {
      const int half = cc / 2;
      __m512i wq[4];
      __m512 sv[4];
      const __m512i idx = _mm512_add_epi32(quad, _mm512_set1_epi32(4 * cc));
      for (int j = 0; j < 4; ++j) {
        const uint8_t* p = w + j * ldw + sb * 192;
        const __m512i ql = _mm512_loadu_si512((const void*)(p + half * 64));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 128 + half * 32)));
        if (cc % 2 == 0)
          wq[j] = _mm512_or_si512(_mm512_and_si512(ql, lo4), _mm512_and_si512(_mm512_sllv_epi16(qh, sh_lo), top));
        else
          wq[j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), lo4),
                                  _mm512_and_si512(_mm512_srlv_epi16(qh, sh_hi), top));
        sv[j] = _mm512_permutexvar_ps(idx, sv16[j]);
      }
      for (int t = 0; t < MT; ++t) {
        const __m512i a = _mm512_loadu_si512((const void*)(rows[t] + (sb * 4 + cc) * 64));
        const __m512i off = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), c32, a));
        for (int j = 0; j < 4; ++j)
          acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(off, wq[j], a)), sv[j], acc[j][t]);
      }
    }
  }
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(acc[j][t]); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}


// iq2_xxs (hy.h iq2xxs_heads), 4 rows x MT <= 4 tokens (its decode is the dearer part, so the tokens share it): per
// 256-value super-block and row one 64-byte load of its qs, whose 64-bit lane ib is sub-block ib: its scale ls (bits
// 60-63) to d (2 ls + 1) / 8 in lanes 0-7 of a vector, and its 4 seven-bit sign indices (bits 32-59) to the 32 groups'
// sign bytes (hy.h iq_sign_bits; the parity bit by three shift-XOR folds) in value order, 256 bits whose 64-bit word cc
// is chunk cc's byte mask. Per 64-value chunk and row the 8 codebook entries by one gather of 8 x 8 bytes (indices: the
// chunk's bytes 0-3 and 8-11) as the unsigned operand; per token the activations negated under the row's sign mask as
// the signed one, so VPDPBUSD gives each sub-block's exact dot (lanes 0-7: sub-block 2 cc, 8-15: 2 cc + 1), converted
// and multiplied by a VPERMPS of the scales.
template <int MT>
void iq2xxs_rows(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc,
                 int pf_lo, int pf_rows) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 2;  // head bytes a row
  const long long* grid = (const long long*)g_iq_grids.iq2xxs;
  const __m128i gsel = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1, -1);  // a chunk's indices
  const __m512i words = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7);  // sub-blocks 0-3's signs
  const __m512i fields = _mm512_setr_epi32(0, 7, 14, 21, 0, 7, 14, 21, 0, 7, 14, 21, 0, 7, 14, 21);
  const __m512i m7 = _mm512_set1_epi32(127), one = _mm512_set1_epi32(1);
  const __m512i pair0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);  // lanes 8-15: 1
  const __m512i zero = _mm512_setzero_si512();
  const int pf0 = pf_lo == 8 ? pf_rows : 4;
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    for (int j = pf0; j < pf_rows + 4; ++j) {
      _mm_prefetch((const char*)(w + j * ldw + sb * 64), _MM_HINT_T1);
      if (sb % 32 == 0) _mm_prefetch((const char*)(hd + j * hst + sb * 2), _MM_HINT_T1);
    }
    __m512 sv16[4];
    alignas(64) uint64_t sgn[4][4];  // row j, chunk cc: the chunk's 64 sign bits
    for (int j = 0; j < 4; ++j) {
      const __m512i qv = _mm512_loadu_si512((const void*)(w + j * ldw + sb * 64));
      const float d = _cvtsh_ss(*(const uint16_t*)(hd + j * hst + sb * 2)) * 0.125f;
      const __m256 ls = _mm512_cvtepi64_ps(_mm512_srli_epi64(qv, 60));
      sv16[j] = _mm512_zextps256_ps512(_mm256_mul_ps(_mm256_fmadd_ps(ls, _mm256_set1_ps(2.f), _mm256_set1_ps(1.f)),
                                                     _mm256_set1_ps(d)));
      for (int h = 0; h < 2; ++h) {  // sub-blocks 4 h .. 4 h + 3: groups 16 h .. 16 h + 15
        __m512i x = _mm512_permutexvar_epi32(_mm512_add_epi32(words, _mm512_set1_epi32(8 * h)), qv);
        x = _mm512_and_si512(_mm512_srlv_epi32(x, fields), m7);
        __m512i p = _mm512_xor_si512(x, _mm512_srli_epi32(x, 4));
        p = _mm512_xor_si512(p, _mm512_srli_epi32(p, 2));
        p = _mm512_xor_si512(p, _mm512_srli_epi32(p, 1));
        x = _mm512_or_si512(x, _mm512_slli_epi32(_mm512_and_si512(p, one), 7));
        _mm_store_si128((__m128i*)&sgn[j][2 * h], _mm512_cvtepi32_epi8(x));
      }
    }
    __m512i idx = pair0;  // chunk cc: lanes 0-7 sub-block 2 cc, lanes 8-15 sub-block 2 cc + 1
    for (int cc = 0; cc < 4; ++cc, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2))) {
      __m512i wq[4];
      __m512 sv[4];
      __mmask64 mk[4];
      for (int j = 0; j < 4; ++j) {
        const __m128i q = _mm_loadu_si128((const __m128i*)(w + j * ldw + sb * 64 + cc * 16));
        wq[j] = _mm512_i64gather_epi64(_mm512_cvtepu8_epi64(_mm_shuffle_epi8(q, gsel)), grid, 8);
        sv[j] = _mm512_permutexvar_ps(idx, sv16[j]);
        mk[j] = _cvtu64_mask64(sgn[j][cc]);
      }
      for (int t = 0; t < MT; ++t) {
        const __m512i a = _mm512_loadu_si512((const void*)(rows[t] + (sb * 4 + cc) * 64));
        for (int j = 0; j < 4; ++j)
          acc[j][t] = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, wq[j], _mm512_mask_sub_epi8(a, mk[j], zero, a))), sv[j],
              acc[j][t]);
      }
    }
  }
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(acc[j][t]); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}


// iq1_s (hy.h iq1s_heads), 4 rows x MT <= 4 tokens (the decode shared by the tokens): per 256-value super-block and row
// its 8 qh words give the 32 groups' 11-bit codebook indices (the qs byte, the word's 3 bits of the group above it:
// permute, variable shift), their delta signs (bit 15 of the group's word: one test per 16 groups, a 32-bit mask of
// the groups whose s is +1) and the sub-blocks' d (2 ls + 1) / 8 in lanes 0-7 of a vector. Per 64-value chunk and row
// one gather of its 8 codebook entries (8 g + 8 a byte, hy.h IqGrids), 2 added to the bytes of the groups whose s is
// +1 (a masked add per 64-bit lane): u = 8 g + s + 9 in 0..18, the unsigned operand. Per token the chunk's
// activations' sums per 4 values times -9 (one VPDPBUSD of 9s, negated) start each row's VPDPBUSD, so the lanes hold
// the exact sum of (8 g + s) a over their 4 values (lanes 0-7: sub-block 2 cc, 8-15: 2 cc + 1), converted and
// multiplied by a VPERMPS of the scales.
template <int MT>
void iq1s_rows(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc,
               int pf_lo, int pf_rows) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 2;  // head bytes a row
  const long long* grid = (const long long*)g_iq_grids.iq1;
  const __m512i words = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // group -> its qh word
  const __m512i fields = _mm512_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9);
  const __m512i m7 = _mm512_set1_epi32(7), sbit = _mm512_set1_epi32(0x8000);
  const __m512i two = _mm512_set1_epi8(2), nine = _mm512_set1_epi8(9);
  const __m512i pair0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);  // lanes 8-15: 1
  const __m512i zero = _mm512_setzero_si512();
  const int pf0 = pf_lo == 8 ? pf_rows : 4;
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    for (int j = pf0; j < pf_rows + 4; ++j) {
      _mm_prefetch((const char*)(w + j * ldw + sb * 48), _MM_HINT_T1);
      if (sb % 32 == 0) _mm_prefetch((const char*)(hd + j * hst + sb * 2), _MM_HINT_T1);
    }
    __m512 sv16[4];
    alignas(64) int32_t ind[4][32];  // row j: group l's codebook index
    uint32_t pos[4];                 // row j: bit l set where group l's s is +1
    for (int j = 0; j < 4; ++j) {
      const uint8_t* q = w + j * ldw + sb * 48;
      const __m256i qh = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(q + 32)));
      const float d = _cvtsh_ss(*(const uint16_t*)(hd + j * hst + sb * 2)) * 0.125f;
      const __m256i ls21 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(qh, 11), _mm256_set1_epi32(14)),
                                           _mm256_set1_epi32(1));  // 2 ls + 1
      sv16[j] = _mm512_zextps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(ls21), _mm256_set1_ps(d)));
      const __m512i qh16 = _mm512_castsi256_si512(qh);
      uint32_t p = 0;
      for (int h = 0; h < 2; ++h) {  // groups 16 h .. 16 h + 15: sub-blocks 4 h .. 4 h + 3
        const __m512i x = _mm512_permutexvar_epi32(_mm512_add_epi32(words, _mm512_set1_epi32(4 * h)), qh16);
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(x, fields), m7);
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * h)));
        _mm512_store_si512((void*)&ind[j][16 * h], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 8)));
        p |= (uint32_t)_mm512_testn_epi32_mask(x, sbit) << (16 * h);
      }
      pos[j] = p;
    }
    __m512i idx = pair0;  // chunk cc: lanes 0-7 sub-block 2 cc, lanes 8-15 sub-block 2 cc + 1
    for (int cc = 0; cc < 4; ++cc, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2))) {
      __m512i wq[4];
      __m512 sv[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i g = _mm512_i32gather_epi64(_mm256_load_si256((const __m256i*)&ind[j][8 * cc]), grid, 8);
        wq[j] = _mm512_mask_add_epi64(g, (__mmask8)(pos[j] >> (8 * cc)), g, two);
        sv[j] = _mm512_permutexvar_ps(idx, sv16[j]);
      }
      for (int t = 0; t < MT; ++t) {
        const __m512i a = _mm512_loadu_si512((const void*)(rows[t] + (sb * 4 + cc) * 64));
        const __m512i n9 = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, nine, a));  // -9 x the sums per 4 values
        for (int j = 0; j < 4; ++j)
          acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(n9, wq[j], a)), sv[j], acc[j][t]);
      }
    }
  }
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(acc[j][t]); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}


// iq1_m (hy.h iq1m_heads), 4 rows x MT <= 4 tokens, iq1_s's kernel with a delta sign per 8-value group and a scale
// per 16 values: per 256-value super-block and row the 32 groups' 11-bit codebook indices (the qs byte, the group's qh
// nibble's low 3 bits: permute, variable shift), a 32-bit mask of the groups whose s is +1 (bit 3 of the nibble clear)
// and the 16 pieces' d (2 ls + 1) / 8 in the 16 lanes of a vector (d assembled from the head's top nibbles, hy.h
// iq1m_d; ls: a permute and variable shift of the 4 head words). Per 64-value chunk as iq1_s's: one gather of 8
// codebook entries, 2 added where s is +1, VPDPBUSD started at -9 x the activations' sums per 4 values; lane i of a
// chunk holds piece 4 cc + i / 4 (one VPERMPS of the scales).
template <int MT>
void iq1m_rows(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc,
               int pf_lo, int pf_rows) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 8;  // head bytes a row
  const long long* grid = (const long long*)g_iq_grids.iq1;
  const __m512i words = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // piece -> its head word
  const __m512i fields = _mm512_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9);
  const __m512i bytes = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // group -> its qh byte
  const __m512i nibs = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  const __m512i m7 = _mm512_set1_epi32(7), sbit = _mm512_set1_epi32(8), one = _mm512_set1_epi32(1);
  const __m512i nine = _mm512_set1_epi8(9), two = _mm512_set1_epi8(2);
  const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // lane -> its piece
  const __m512i zero = _mm512_setzero_si512();
  const int pf0 = pf_lo == 8 ? pf_rows : 4;
  __m512 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    for (int j = pf0; j < pf_rows + 4; ++j) {
      _mm_prefetch((const char*)(w + j * ldw + sb * 48), _MM_HINT_T1);
      if (sb % 8 == 0) _mm_prefetch((const char*)(hd + j * hst + sb * 8), _MM_HINT_T1);
    }
    __m512 sv16[4];
    alignas(64) int32_t ind[4][32];  // row j: group l's codebook index
    uint32_t up[4];                  // row j: bit l set where group l's s is +1
    for (int j = 0; j < 4; ++j) {
      const uint8_t* q = w + j * ldw + sb * 48;
      const uint8_t* h = hd + j * hst + sb * 8;
      const float d = _cvtsh_ss(iq1m_d(h)) * 0.125f;
      const __m512i sw = _mm512_cvtepu16_epi32(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i*)h)));
      const __m512i ls = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(words, sw), fields), m7);
      const __m512i ls21 = _mm512_or_si512(_mm512_slli_epi32(ls, 1), one);  // 2 ls + 1
      sv16[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(ls21), _mm512_set1_ps(d));
      const __m512i qh16 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 32)));
      uint32_t p = 0;
      for (int hf = 0; hf < 2; ++hf) {  // groups 16 hf .. 16 hf + 15: qh bytes 8 hf .. 8 hf + 7
        const __m512i x = _mm512_srlv_epi32(
            _mm512_permutexvar_epi32(_mm512_add_epi32(bytes, _mm512_set1_epi32(8 * hf)), qh16), nibs);
        const __m512i hi = _mm512_and_si512(x, m7);
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * hf)));
        _mm512_store_si512((void*)&ind[j][16 * hf], _mm512_or_si512(_mm512_slli_epi32(hi, 8), lo));
        p |= (uint32_t)_mm512_testn_epi32_mask(x, sbit) << (16 * hf);
      }
      up[j] = p;
    }
    __m512i idx = quad;  // chunk cc: lane i piece 4 cc + i / 4
    for (int cc = 0; cc < 4; ++cc, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(4))) {
      __m512i wq[4];
      __m512 sv[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i g = _mm512_i32gather_epi64(_mm256_load_si256((const __m256i*)&ind[j][8 * cc]), grid, 8);
        wq[j] = _mm512_mask_add_epi64(g, (__mmask8)(up[j] >> (8 * cc)), g, two);
        sv[j] = _mm512_permutexvar_ps(idx, sv16[j]);
      }
      for (int t = 0; t < MT; ++t) {
        const __m512i a = _mm512_loadu_si512((const void*)(rows[t] + (sb * 4 + cc) * 64));
        const __m512i n9 = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, nine, a));  // -9 x the sums per 4 values
        for (int j = 0; j < 4; ++j)
          acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(n9, wq[j], a)), sv[j], acc[j][t]);
      }
    }
  }
  const __m512i s = block_sums<true, MT>([&](int j, int t) { return _mm512_castps_si512(acc[j][t]); });
  store_rows<MT>(_mm512_castsi512_ps(s), rows, k, true, C, ldc);
}


// The 256-value super-block formats (q4_k, q5_k, iq4_xs, q2_k, q3_k, q6_k): 4 rows x MT <= 2 tokens of expert e's row r,
// each format's kernel on its values (bytes per row: the format's value bytes per 256 values) and heads.
inline bool is_super_block(int dt) {
  return dt == HY_Q4_K || dt == HY_Q5_K || dt == HY_IQ4_XS || dt == HY_Q2_K || dt == HY_Q3_K || dt == HY_Q6_K;
}

template <int MT>
void super_block_rows(const HyMat& M, int e, int r, const uint8_t* const* rows, float* C, int ldc, int pf_lo,
                      int pf_rows) {
  const int k = M.ldk;
  const int64_t ldw = M.dtype == HY_Q2_K ? k / 4 : M.dtype == HY_Q3_K ? k / 256 * 96 : M.dtype == HY_Q6_K ? k / 4 * 3 : k / 2;
  const uint8_t* w = M.w + e * M.w_estride + (int64_t)r * ldw;
  switch (M.dtype) {
    case HY_Q4_K: kq_rows<MT, KQ_Q4>(w, ldw, k, rows, q4k_heads(M, e, r), C, ldc, pf_lo, pf_rows); break;
    case HY_Q5_K: kq_rows<MT, KQ_Q5>(w, ldw, k, rows, q5k_heads(M, e, r), C, ldc, pf_lo, pf_rows); break;
    case HY_IQ4_XS: kq_rows<MT, KQ_IQ4>(w, ldw, k, rows, iq4_heads(M, e, r), C, ldc, pf_lo, pf_rows); break;
    case HY_Q2_K: q2k_rows<MT>(w, ldw, k, rows, q2k_heads(M, e, r), C, ldc, pf_lo, pf_rows); break;
    case HY_Q3_K: q3k_rows<MT>(w, ldw, k, rows, q3k_heads(M, e, r), C, ldc, pf_lo, pf_rows); break;
    default: q6k_rows<MT>(w, ldw, k, rows, q6k_heads(M, e, r), C, ldc, pf_lo, pf_rows);
  }
}

template <int MT>
void vec_block(const HyMat& M, int e, int r, const uint8_t* const* rows, float* C, int ldc, int pf_lo, int pf_rows) {
  const int G = M.dtype == HY_INT4 ? M.ldk / M.group : 1;
  const bool fp32_scales = M.dtype == HY_INT8 || M.dtype == HY_INT4;  // the others read theirs through hy.h
  const float* sw = M.scale && fp32_scales ? M.scale + e * M.s_estride + (int64_t)r * G : nullptr;
  if (M.dtype == HY_BF16) {
    bf16_block<MT>((const uint16_t*)(M.w + e * M.w_estride) + (int64_t)r * M.ldk, M.ldk, M.ldk, rows, C, ldc, pf_lo);
  } else if (M.dtype == HY_INT8) {
    i8_block<MT>((const int8_t*)(M.w + e * M.w_estride) + (int64_t)r * M.ldk, M.ldk, M.ldk, rows, sw,
                 M.rsum + e * M.r_estride + r, C, ldc, pf_lo, pf_rows);
  } else if (M.dtype == HY_MXFP4) {
    mx4_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 2), M.ldk / 2, M.ldk, rows, mx4_exps(M, e, r), C, ldc, pf_lo);
  } else if (M.dtype == HY_Q8_0) {
    q8_block<MT>((const int8_t*)(M.w + e * M.w_estride) + (int64_t)r * M.ldk, M.ldk, M.ldk, rows, q8_scales(M, e, r), C,
                 ldc, pf_lo, pf_rows);
  } else if (M.dtype == HY_Q4_0) {
    q40_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 2), M.ldk / 2, M.ldk, rows, q8_scales(M, e, r), C, ldc,
                  pf_lo, pf_rows);
  } else if (M.dtype == HY_IQ2_XXS) {
    iq2xxs_rows<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 4), M.ldk / 4, M.ldk, rows, iq2xxs_heads(M, e, r), C, ldc,
                    pf_lo, pf_rows);
  } else if (M.dtype == HY_IQ3_XXS) {  // the 256-bit kernel (kern_iq256.h), up to 2 tokens a call
    const uint8_t* w = M.w + e * M.w_estride + (int64_t)r * (M.ldk / 256 * 96);
    if constexpr (MT <= 2) {
      iq3xxs_block<MT>(w, M.ldk / 256 * 96, M.ldk, rows, iq2xxs_heads(M, e, r), C, ldc);
    } else {
      iq3xxs_block<2>(w, M.ldk / 256 * 96, M.ldk, rows, iq2xxs_heads(M, e, r), C, ldc);
      iq3xxs_block<MT - 2>(w, M.ldk / 256 * 96, M.ldk, rows + 2, iq2xxs_heads(M, e, r), C + 2 * ldc, ldc);
    }
  } else if (M.dtype == HY_IQ3_S) {  // the 256-bit kernel (kern_iq256.h), up to 2 tokens a call
    const uint8_t* w = M.w + e * M.w_estride + (int64_t)r * (M.ldk / 256 * 108);
    if constexpr (MT <= 2) {
      iq3s_block<MT>(w, M.ldk / 256 * 108, M.ldk, rows, iq2xxs_heads(M, e, r), C, ldc);
    } else {
      iq3s_block<2>(w, M.ldk / 256 * 108, M.ldk, rows, iq2xxs_heads(M, e, r), C, ldc);
      iq3s_block<MT - 2>(w, M.ldk / 256 * 108, M.ldk, rows + 2, iq2xxs_heads(M, e, r), C + 2 * ldc, ldc);
    }
  } else if (M.dtype == HY_IQ1_S) {
    iq1s_rows<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 256 * 48), M.ldk / 256 * 48, M.ldk, rows,
                  iq1s_heads(M, e, r), C, ldc, pf_lo, pf_rows);
  } else if (M.dtype == HY_IQ1_M) {
    iq1m_rows<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 256 * 48), M.ldk / 256 * 48, M.ldk, rows,
                  iq1m_heads(M, e, r), C, ldc, pf_lo, pf_rows);
  } else if (is_super_block(M.dtype)) {
    if constexpr (MT <= 2) {
      super_block_rows<MT>(M, e, r, rows, C, ldc, pf_lo, pf_rows);
    } else {  // two pairs: these kernels' accumulators fill the registers at 2 tokens
      super_block_rows<2>(M, e, r, rows, C, ldc, pf_lo, pf_rows);
      super_block_rows<MT - 2>(M, e, r, rows + 2, C + 2 * ldc, ldc, pf_lo, pf_rows);
    }
  } else {
    i4_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 2), M.ldk / 2, M.ldk, M.group, M.fold, rows, sw, C, ldc,
                 pf_lo, pf_rows);
  }
}

// C[t * ldc + r] = sum_k act_t[k] W_e[r0 + r][k] for r < nr, t < m, in 4-row x (up to) 4-token blocks.
// Every call's first block also prefetches the block right after it (pf_lo 4: rows 4..7), which the steady-state
// prefetch never covers: every decode task starts fresh weight streams.
void vec_gemm(const Knobs& kn, const HyMat& M, int e, int r0, int nr, const uint8_t* const* rows, int m, float* C, int ldc) {
  const int mt = 4;  // every dtype: int4 splits its 4-row block itself (i4_block)
  const int pf_rows = kn.pf_rows;
  for (int r = 0; r < nr; r += 4)
    for (int t = 0; t < m; t += mt) {
      float* c = C + t * ldc + r;
      const int pf_lo = r == 0 && t == 0 ? 4 : 8;
      switch (std::min(mt, m - t)) {
        case 4: vec_block<4>(M, e, r0 + r, rows + t, c, ldc, pf_lo, pf_rows); break;
        case 3: vec_block<3>(M, e, r0 + r, rows + t, c, ldc, pf_lo, pf_rows); break;
        case 2: vec_block<2>(M, e, r0 + r, rows + t, c, ldc, pf_lo, pf_rows); break;
        default: vec_block<1>(M, e, r0 + r, rows + t, c, ldc, pf_lo, pf_rows);
      }
    }
}

}  // namespace
