// AVX2 + FMA kernels (fallback ISA; also what runs on AMD hosts without AVX-512). Blocks of 4 weight
// rows x up to 2 tokens keep the 8 accumulators plus operands within the 16 ymm registers.
// int8 uses the sign trick: maddubs(|a|, w*sign(a)) stays exact because |a|, |w| <= 127, so the s16
// pair sums (<= 2*127*127) cannot saturate.
#pragma once
#include <immintrin.h>
#include "hy.h"
#include "kern_iq256.h"

namespace {

inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256i dot_u8s8_i32(__m256i u, __m256i s) {  // 32 u8*s8 products -> 8 int32 lanes of 4-products
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
inline __m256 dot_u8s8(__m256i u, __m256i s) {  // 32 u8*s8 products -> 8 fp32 lanes of 4-products
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

template <int MT>
void bf16_block(const uint16_t* w, int64_t ldw, int k, const uint8_t* const* rows, float* C, int ldc) {
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int kk = 0; kk < k; kk += 8) {
    __m256 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = bf16x8(w + j * ldw + kk);
    for (int t = 0; t < MT; ++t) {
      __m256 a = bf16x8((const uint16_t*)rows[t] + kk);
      for (int j = 0; j < 4; ++j) acc[j][t] = _mm256_fmadd_ps(wv[j], a, acc[j][t]);
    }
  }
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]);
}

template <int MT>
void i8_block(const int8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const float* sw, float* C, int ldc) {
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int kk = 0; kk < k; kk += 32) {
    __m256i wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm256_loadu_si256((const __m256i*)(w + j * ldw + kk));
    for (int t = 0; t < MT; ++t) {
      __m256i a = _mm256_loadu_si256((const __m256i*)(rows[t] + kk));
      __m256i ax = _mm256_sign_epi8(a, a);
      // Exact in fp32 per step (|sum| < 2^24); accumulating in fp32 keeps one code path with int4.
      for (int j = 0; j < 4; ++j) acc[j][t] = _mm256_add_ps(acc[j][t], dot_u8s8(ax, _mm256_sign_epi8(wv[j], a)));
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * sw[j] * act_scale(rows[t], k);
}

// int4 in the natural order (quant.py): per 64 K values 32 bytes, low nibbles K[0..31], high nibbles K[32..63];
// value = nibble - 8. Group size GS a compile-time constant. For GS >= 64 the maddubs pair sums of a whole group (at most 4
// of them per lane, each |.| <= 2 * 15 * 127) are added in int16 without saturating, widened once by
// madd, and the +8 of the stored nibbles is undone there in int32 with the activations' group sum
// (-8 * gsum in lane 0): every lane total is the exact signed dot of the group, converted and scaled once
// per group and row and token. The previous form converted and multiply-added both halves of every chunk
// in fp32 and subtracted 8 * sum_g s_g * gsum_g in a scalar loop after the K loop. GS = 32: the low and
// high nibbles of a chunk are two groups, each widened, offset, converted and scaled on its own.
// Prefetch as in the AVX-512 kernels (8 rows down, into L2, once per line): the hardware prefetchers lose a block's
// short interleaved row streams at each block's start.
template <int MT, int GS>
void i4_block_g(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const float* sw, float* C, int ldc) {
  constexpr int CPG = GS >= 64 ? GS / 64 : 1;  // 64-value chunks per group (GS = 32: half a chunk)
  const int G = k / GS;
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int c0 = 0; c0 < k / 64; c0 += CPG) {
    const int g0 = GS >= 64 ? c0 / CPG : 2 * c0;  // the (first) group of this step
    __m256i off[MT], off2[MT];  // -8 * group sum in lane 0 (off2: GS = 32's second group)
    for (int t = 0; t < MT; ++t) {
      const int32_t* gs = act_gsum(rows[t], k);
      off[t] = _mm256_zextsi128_si256(_mm_cvtsi32_si128(-8 * gs[g0]));
      off2[t] = GS < 64 ? _mm256_zextsi128_si256(_mm_cvtsi32_si128(-8 * gs[g0 + 1])) : off[t];
    }
    for (int j = 8; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + c0 * 32), _MM_HINT_T1);
    for (int j = 0; j < 4; ++j) {
      if (GS >= 64) {
        __m256i s16[MT];
        for (int t = 0; t < MT; ++t) s16[t] = _mm256_setzero_si256();
        for (int i = 0; i < CPG; ++i) {
          const int c = c0 + i;
          const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + j * ldw + c * 32));
          const __m256i lo = _mm256_and_si256(raw, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
          for (int t = 0; t < MT; ++t) {
            const __m256i alo = _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64));
            const __m256i ahi = _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64 + 32));
            s16[t] = _mm256_add_epi16(s16[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi)));
          }
        }
        const __m256 sv = _mm256_set1_ps(sw[j * G + g0]);
        for (int t = 0; t < MT; ++t)
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(s16[t], ones), off[t])), sv, acc[j][t]);
      } else {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + j * ldw + c0 * 32));
        const __m256i lo = _mm256_and_si256(raw, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
        const __m256 slo = _mm256_set1_ps(sw[j * G + g0]), shi = _mm256_set1_ps(sw[j * G + g0 + 1]);
        for (int t = 0; t < MT; ++t) {
          const __m256i alo = _mm256_loadu_si256((const __m256i*)(rows[t] + c0 * 64));
          const __m256i ahi = _mm256_loadu_si256((const __m256i*)(rows[t] + c0 * 64 + 32));
          const __m256i ilo = _mm256_add_epi32(dot_u8s8_i32(lo, alo), off[t]);
          const __m256i ihi = _mm256_add_epi32(dot_u8s8_i32(hi, ahi), off2[t]);
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ilo), slo, acc[j][t]);
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ihi), shi, acc[j][t]);
        }
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

// int4 in the group-interleaved stored order (quant.py, hy.h i4_for_each_word; fold > 1, not the natural order):
// the low nibbles of a chunk are words 0-7 of the 16, the high nibbles words 8-15, each word (int32 lane) one
// group for a whole fold block. Each row walks its block line by line (64 bytes, 2 chunks), prefetching the
// same line 8 rows down: per line the maddubs pair sums of the low and the high half are added in int16,
// widened by madd into int32 block sums (one per token and half; each group's first lane starts at -8 x the
// token's group sum), converted and scaled once per block with a vector of the block's group scales per half.
// Rows in turn rather than interleaved per line: 4 rows' block sums do not fit in the 16 ymm registers.
// B = fold * group / 64 (chunks a block) is a template argument: with a run-time line length the compiler kept
// the row and chunk loops rolled and the block sums in memory (about 1.5x slower).
template <int MT, int B>
void i4_block_fold(const uint8_t* w, int64_t ldw, int k, int group, int fold, const uint8_t* const* rows,
                   const float* sw, float* C, int ldc) {
  const int G = k / group, L = 16 / fold;  // lanes a group
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_epi32(8);
  const __m256i sh = _mm256_set1_epi32(__builtin_ctz(L));
  const __m256i ilo = _mm256_srlv_epi32(lane, sh);  // group of lanes 0-7 (words 0-7) in the block
  // words 8-15: groups 8 / L .. of the first 8 loaded values, or (fold 16) the next 8 values' 0..7
  const __m256i ihi = fold == 16 ? lane : _mm256_srlv_epi32(_mm256_add_epi32(lane, eight), sh);
  const __m256i lmask = _mm256_set1_epi32(L - 1), zero = _mm256_setzero_si256();
  const __m256i flo = _mm256_cmpeq_epi32(_mm256_and_si256(lane, lmask), zero);  // a group's first lane
  const __m256i fhi = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_add_epi32(lane, eight), lmask), zero);
  const __m256i vm = _mm256_cmpgt_epi32(_mm256_set1_epi32(std::min(fold, 8)), lane);  // the block's first values
  const int hi_off = fold == 16 ? 8 : 0;
  constexpr int step = B >= 2 ? 2 : 1;
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int b = 0; b < G / fold; ++b) {
    __m256i olo[MT], ohi[MT];
    for (int t = 0; t < MT; ++t) {
      const int32_t* gs = act_gsum(rows[t], k) + b * fold;
      const __m256i g0 = _mm256_maskload_epi32(gs, vm), g1 = _mm256_maskload_epi32(gs + hi_off, vm);
      olo[t] = _mm256_sub_epi32(zero, _mm256_slli_epi32(_mm256_and_si256(_mm256_permutevar8x32_epi32(g0, ilo), flo), 3));
      ohi[t] = _mm256_sub_epi32(zero, _mm256_slli_epi32(_mm256_and_si256(_mm256_permutevar8x32_epi32(g1, ihi), fhi), 3));
    }
    for (int j = 0; j < 4; ++j) {
      const uint8_t* wj = w + j * ldw;
      __m256i s32lo[MT], s32hi[MT];
      for (int t = 0; t < MT; ++t) { s32lo[t] = olo[t]; s32hi[t] = ohi[t]; }
#pragma GCC unroll 4
      for (int c0 = b * B; c0 < (b + 1) * B; c0 += step) {
        if (c0 % 2 == 0) _mm_prefetch((const char*)(wj + 8 * ldw + c0 * 32), _MM_HINT_T1);  // 8 rows down
        __m256i s16lo[MT], s16hi[MT];
        for (int t = 0; t < MT; ++t) s16lo[t] = s16hi[t] = zero;
        for (int c = c0; c < c0 + step; ++c) {  // 2 x 15 x 127 x 2 chunks: no int16 saturation
          const __m256i raw = _mm256_loadu_si256((const __m256i*)(wj + c * 32));
          const __m256i lo = _mm256_and_si256(raw, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
          for (int t = 0; t < MT; ++t) {
            s16lo[t] = _mm256_add_epi16(s16lo[t], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64))));
            s16hi[t] = _mm256_add_epi16(s16hi[t], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64 + 32))));
          }
        }
        for (int t = 0; t < MT; ++t) {
          s32lo[t] = _mm256_add_epi32(s32lo[t], _mm256_madd_epi16(s16lo[t], ones));
          s32hi[t] = _mm256_add_epi32(s32hi[t], _mm256_madd_epi16(s16hi[t], ones));
        }
      }
      const float* sj = sw + j * G + b * fold;
      const __m256 slo = _mm256_permutevar8x32_ps(_mm256_maskload_ps(sj, vm), ilo);
      const __m256 shi = _mm256_permutevar8x32_ps(_mm256_maskload_ps(sj + hi_off, vm), ihi);
      for (int t = 0; t < MT; ++t) {
        acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32lo[t]), slo, acc[j][t]);
        acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32hi[t]), shi, acc[j][t]);
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

template <int MT>
void i4_block(const uint8_t* w, int64_t ldw, int k, int group, int fold, const uint8_t* const* rows, const float* sw,
              float* C, int ldc) {
  if (!i4_natural(group, fold)) {
    switch (fold * group / 64) {  // forward() checked the layout (hy.h i4_fold_ok): 2..32 chunks, a power of two
      case 2: return i4_block_fold<MT, 2>(w, ldw, k, group, fold, rows, sw, C, ldc);
      case 4: return i4_block_fold<MT, 4>(w, ldw, k, group, fold, rows, sw, C, ldc);
      case 8: return i4_block_fold<MT, 8>(w, ldw, k, group, fold, rows, sw, C, ldc);
      case 16: return i4_block_fold<MT, 16>(w, ldw, k, group, fold, rows, sw, C, ldc);
      default: return i4_block_fold<MT, 32>(w, ldw, k, group, fold, rows, sw, C, ldc);
    }
  }
  switch (group) {  // the packer allows 32, 64 and 128 (cpu_kernels/quant.py)
    case 32: i4_block_g<MT, 32>(w, ldw, k, rows, sw, C, ldc); break;
    case 64: i4_block_g<MT, 64>(w, ldw, k, rows, sw, C, ldc); break;
    default: i4_block_g<MT, 128>(w, ldw, k, rows, sw, C, ldc);
  }
}

// mxfp4 (hy.h, HY_MX4_LUT): per 64 K values 32 bytes, low nibbles one 32-value block, high nibbles the next.
// Codes -> 2 * FP4 + 12 (u8, <= 24) by VPSHUFB, maddubs with the int8 activations (pair sums <= 2*24*127, no
// saturation), minus 12 * each lane's activation sum: the exact integer dot per lane, then one scale per block.
// Tokens' activations and offsets are loaded once per chunk and each row unpacked once for all of them.
template <int MT>
void mx4_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* se, float* C,
               int ldc) {
  const int G = k / 32;
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(HY_MX4_LUT));
  const __m256i twelve = _mm256_set1_epi8(12);
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int c = 0; c < k / 64; ++c) {
    __m256i alo[MT], ahi[MT], olo[MT], ohi[MT];
    for (int t = 0; t < MT; ++t) {
      alo[t] = _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64));
      ahi[t] = _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64 + 32));
      olo[t] = dot_u8s8_i32(twelve, alo[t]);
      ohi[t] = dot_u8s8_i32(twelve, ahi[t]);
    }
    if (c % 2 == 0)  // the rows 2 blocks down, once per 64-byte line (as the AVX-512 kernels)
      for (int j = 8; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + c * 32), _MM_HINT_T1);
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + j * ldw + c * 32));
      const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, lo4));
      const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4));
      const __m256 slo = _mm256_set1_ps(mx4_scale(se[j * G + 2 * c])), shi = _mm256_set1_ps(mx4_scale(se[j * G + 2 * c + 1]));
      for (int t = 0; t < MT; ++t) {
        acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot_u8s8_i32(lo, alo[t]), olo[t])), slo, acc[j][t]);
        acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot_u8s8_i32(hi, ahi[t]), ohi[t])), shi, acc[j][t]);
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

// q8_0 (hy.h q8_scales): per 32-value block and row one load, |w| as the unsigned operand and the activations with
// w's sign as the signed one (maddubs pair sums <= 2 x 128 x 127: exact, w = -128 included, whose |w| is 128 as a
// byte), the exact block dot converted and multiplied by the block's fp16 scale (F16C). Prefetch as the
// other kernels: 8 rows down, into L2, once per 64-byte line.
template <int MT>
void q8_block(const int8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint16_t* sw, float* C, int ldc) {
  const int G = k / 32;
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    if (g % 2 == 0)
      for (int j = 8; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + g * 32), _MM_HINT_T1);
    __m256i a[MT];
    for (int t = 0; t < MT; ++t) a[t] = _mm256_loadu_si256((const __m256i*)(rows[t] + g * 32));
    for (int j = 0; j < 4; ++j) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + j * ldw + g * 32));
      const __m256i wa = _mm256_abs_epi8(wv);
      const __m256 sv = _mm256_set1_ps(_cvtsh_ss(sw[j * G + g]));
      for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_fmadd_ps(dot_u8s8(wa, _mm256_sign_epi8(a[t], wv)), sv, acc[j][t]);
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

// q4_0 (hy.h), per 64-value chunk (two 32-value blocks, 16 bytes each) and row one 32-byte load: its low nibbles are
// values 0-15 of both blocks (lanes 0-3 the first block, 4-7 the second), its high nibbles values 16-31 of both. The
// token's activations are brought into the same two orders once per chunk (two VPERM2I128 of its halves, shared by the
// 4 rows); maddubs of each nibble half with them (pair sums <= 2 x 15 x 127), added in int16 (<= 4 x 15 x 127), less
// the same pairs' activation sums times 8 (maddubs of 8s, once per token and chunk), widened by madd: the exact dot of
// q - 8 per lane, converted and multiplied by its block's fp16 scale (8 blocks' scales converted at once per row by F16C, and each
// chunk's pair picked by one VPERMPS). Prefetch as the other kernels: 8 rows down, into L2, once per 64-byte line.
template <int MT>
void q40_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint16_t* sw, float* C, int ldc) {
  const int G = k / 32, nc = k / 64;
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), eight = _mm256_set1_epi8(8);
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int c0 = 0; c0 < nc; c0 += 4) {
    const int nb = std::min(8, G - 2 * c0);  // this row's blocks from 2 * c0 on (G is even)
    __m256 s8[4];  // scales of blocks 2 c0 .. 2 c0 + 7 of each row
    for (int j = 0; j < 4; ++j) {
      if (nb == 8) {
        s8[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sw + j * G + 2 * c0)));
        continue;
      }
      alignas(16) uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // a row's last blocks: no read past them
      std::memcpy(h, sw + j * G + 2 * c0, 2 * (size_t)nb);
      s8[j] = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)h));
    }
    for (int c = c0; c < std::min(nc, c0 + 4); ++c) {
      const int i = 2 * (c - c0);
      const __m256i idx = _mm256_setr_epi32(i, i, i, i, i + 1, i + 1, i + 1, i + 1);  // blocks 2c, 2c + 1
      __m256i alo[MT], ahi[MT], off[MT];
      for (int t = 0; t < MT; ++t) {
        const __m256i a0 = _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64));  // block 2c's 32 activations
        const __m256i a1 = _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64 + 32));  // block 2c + 1's
        alo[t] = _mm256_permute2x128_si256(a0, a1, 0x20);  // values 0-15 of both blocks
        ahi[t] = _mm256_permute2x128_si256(a0, a1, 0x31);  // values 16-31 of both
        // 8 x the sums of each pair of activations the maddubs below pair (<= 4 x 8 x 127 in int16)
        off[t] = _mm256_add_epi16(_mm256_maddubs_epi16(eight, alo[t]), _mm256_maddubs_epi16(eight, ahi[t]));
      }
      if (c % 2 == 0) for (int j = 8; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + c * 32), _MM_HINT_T1);
      for (int j = 0; j < 4; ++j) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + j * ldw + c * 32));
        const __m256i lo = _mm256_and_si256(raw, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
        const __m256 sv = _mm256_permutevar8x32_ps(s8[j], idx);
        for (int t = 0; t < MT; ++t) {
          const __m256i s16 = _mm256_sub_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo[t]), _mm256_maddubs_epi16(hi, ahi[t])), off[t]);
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)), sv, acc[j][t]);
        }
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

// A q4_k / q5_k head (hy.h) -> its 8 sub-blocks' 6-bit scales sc and minimums m as 16 bytes [sc 0-7, m 0-7] in both
// 128-bit halves (ggml's get_scale_min_k4: each byte's low bits from byte P[l], masked or its high nibble, its top two
// from byte Q[l]), the super-block's d, and its minimums dmin m as fp32 lanes; d and dmin by F16C.
inline __m256i q4k_scales(const uint8_t* h, float& d, __m256& Mn) {
  int32_t d2;
  std::memcpy(&d2, h, 4);
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(d2));  // d, dmin
  d = _mm_cvtss_f32(dd);
  const __m128i b = _mm_loadu_si128((const __m128i*)h);
  const __m128i P = _mm_shuffle_epi8(b, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m128i Q = _mm_shuffle_epi8(b, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m128i low = _mm_or_si128(_mm_and_si128(P, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
                                   _mm_and_si128(_mm_srli_epi16(P, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
  const __m128i v = _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(Q, 2), _mm_set1_epi8(0x30)));
  Mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))), _mm256_broadcastss_ps(_mm_movehdup_ps(dd)));
  return _mm256_broadcastsi128_si256(v);
}

// q4_k (hy.h q4k_heads) and q5_k (hy.h q5k_heads): per 256-value super-block and row the head unpacked to the 8
// sub-blocks' scales as bytes and the minimums (q4k_scales); per 64-value chunk the low and high nibbles (sub-blocks
// 2c and 2c + 1; q5_k: each value's fifth bit OR'ed on from the head's 32 qh bytes, bit 2 cc for the low nibbles and
// 2 cc + 1 for the high ones, by a 16-bit shift whose crossing bits the mask drops, moved to bit 4) maddubs'd with
// their activations (pair sums <= 2 x 31 x 127) and multiplied by their sub-block's scale as madd widens them (the
// scale's byte zero-extended into every int16 lane by one VPSHUFB): the super-block's dot stays in int32 (lane totals
// <= 8 x 2 x 7874 x 63 < 2^31), converted and scaled by d once per super-block, row and token. The minimums are
// subtracted once per super-block, row and token as - sum_j (dmin m_j) x (activation sum of sub-block j). Rows in
// turn, each through all of k: its accumulators in registers for every token count, prefetching 8 rows down.
template <int MT, int KIND>
void kq_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc) {
  static_assert(KIND == KQ_Q4 || KIND == KQ_Q5, "iq4_xs: iq4_block");
  const int nsb = k / 256;
  constexpr int HB = kq_head_bytes(KIND);  // head bytes a super-block
  const int64_t hst = (int64_t)nsb * HB;
  const __m256i lo4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int j = 0; j < 4; ++j) {
    __m256 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; ++sb) {
      const uint8_t* h = hd + j * hst + sb * HB;
      const uint8_t* wr = w + j * ldw + sb * 128;
      _mm_prefetch((const char*)(wr + 8 * ldw), _MM_HINT_T1);
      _mm_prefetch((const char*)(wr + 8 * ldw + 64), _MM_HINT_T1);
      float d;
      __m256 Mn;
      const __m256i sc = q4k_scales(h, d, Mn);
      for (int t = 0; t < MT; ++t)
        acc[t] = _mm256_fnmadd_ps(Mn, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(act_gsum(rows[t], k) + sb * 8))),
                                  acc[t]);
      __m256i qh;
      if constexpr (KIND == KQ_Q5) qh = _mm256_loadu_si256((const __m256i*)(h + 16));
      __m256i ia[MT];
      for (int t = 0; t < MT; ++t) ia[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int cc = 0; cc < 4; ++cc) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(wr + cc * 32));
        __m256i lo = _mm256_and_si256(raw, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
        if constexpr (KIND == KQ_Q5) {
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * cc)), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * cc + 1)), one), 4));
        }
        const __m256i slo = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(0x8000 | (2 * cc))));
        const __m256i shi = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(0x8000 | (2 * cc + 1))));
        const int c = sb * 4 + cc;
        for (int t = 0; t < MT; ++t) {
          const __m256i alo = _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64));
          const __m256i ahi = _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64 + 32));
          ia[t] = _mm256_add_epi32(ia[t], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, alo), slo),
                                                           _mm256_madd_epi16(_mm256_maddubs_epi16(hi, ahi), shi)));
        }
      }
      const __m256 dv = _mm256_set1_ps(d);
      for (int t = 0; t < MT; ++t) acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t]), dv, acc[t]);
    }
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[t]) * act_scale(rows[t], k);
  }
}

// iq4_xs (hy.h iq4_heads): per 256-value super-block and row the 8 sub-blocks' scales d (ls - 32) (hy.h iq4_scales8);
// per 64-value chunk the low and high nibbles (sub-blocks 2c and 2c + 1) mapped by VPSHUFB to the signed codebook
// values, whose magnitudes are maddubs' unsigned operand and whose signs go onto the activations (q8_0's sign trick:
// pair sums <= 2 x 127 x 127, exact), widened, converted and multiplied by their scale. Unlike q4_k's kernel the 4 rows
// go in turn within each chunk, interleaving their longer per-token work (codebook, signs): q4_k's order, with each
// sub-block's dot kept in int32, is the slower one for this format (BENCHMARKS.md, Choices behind the defaults).
template <int MT>
void iq4_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * kq_head_bytes(KQ_IQ4);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(HY_IQ4_VALUES));
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    __m256 S[4];
    for (int j = 0; j < 4; ++j) S[j] = iq4_scales8(hd + j * hst + sb * kq_head_bytes(KQ_IQ4));
    for (int c = sb * 4; c < sb * 4 + 4; ++c) {
      if (c % 2 == 0) for (int j = 8; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + c * 32), _MM_HINT_T1);
      const int g = 2 * (c - sb * 4);
      for (int j = 0; j < 4; ++j) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + j * ldw + c * 32));
        const __m256i vlo = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, lo4));
        const __m256i vhi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4));
        const __m256 slo = _mm256_permutevar8x32_ps(S[j], _mm256_set1_epi32(g));
        const __m256 shi = _mm256_permutevar8x32_ps(S[j], _mm256_set1_epi32(g + 1));
        for (int t = 0; t < MT; ++t) {
          const __m256i alo = _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64));
          const __m256i ahi = _mm256_loadu_si256((const __m256i*)(rows[t] + c * 64 + 32));
          acc[j][t] = _mm256_fmadd_ps(dot_u8s8(_mm256_abs_epi8(vlo), _mm256_sign_epi8(alo, vlo)), slo, acc[j][t]);
          acc[j][t] = _mm256_fmadd_ps(dot_u8s8(_mm256_abs_epi8(vhi), _mm256_sign_epi8(ahi, vhi)), shi, acc[j][t]);
        }
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

// q2_k (hy.h q2k_heads): per 256-value super-block and row its 16 groups' scales d sc and minimums dmin m as two
// vectors of 8 each; each 32-value piece is one 32-byte load of its half's values shifted by 2 j (a 16-bit shift; the
// mask drops the crossing bits): q in 0..3, maddubs'd with its activations; lanes 0-3 belong to the piece's first
// 16-value group, 4-7 to its second, scaled by their scales, and the same lanes' activation sums (maddubs with ones,
// once per token and piece, shared by the 4 rows) times their minimums subtracted.
template <int MT>
void q2k_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 20;
  const __m256i three = _mm256_set1_epi8(3), ones = _mm256_set1_epi8(1), lo4 = _mm256_set1_epi32(15);
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    __m256 S[4][2], Mn[4][2];
    for (int j = 0; j < 4; ++j) {
      const uint8_t* h = hd + j * hst + sb * 20;
      uint16_t dh, mh;
      std::memcpy(&dh, h + 16, 2);
      std::memcpy(&mh, h + 18, 2);
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh)), dm = _mm256_set1_ps(_cvtsh_ss(mh));
      for (int g = 0; g < 2; ++g) {
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(h + 8 * g)));
        S[j][g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(sc, lo4)), d);
        Mn[j][g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(sc, 4)), dm);
      }
    }
    for (int j = 8; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + sb * 64), _MM_HINT_T1);
    for (int p = 0; p < 8; ++p) {  // 32-value pieces: half p / 4, bits 2 (p % 4) of its 32 bytes
      const int half = p / 4;
      const __m128i sh = _mm_cvtsi32_si128(2 * (p % 4));
      __m256i a[MT];
      __m256 as[MT];
      for (int t = 0; t < MT; ++t) {
        a[t] = _mm256_loadu_si256((const __m256i*)(rows[t] + sb * 256 + p * 32));
        as[t] = _mm256_cvtepi32_ps(dot_u8s8_i32(ones, a[t]));
      }
      const __m256i idx = _mm256_setr_epi32(2 * (p % 4), 2 * (p % 4), 2 * (p % 4), 2 * (p % 4), 2 * (p % 4) + 1,
                                            2 * (p % 4) + 1, 2 * (p % 4) + 1, 2 * (p % 4) + 1);
      for (int j = 0; j < 4; ++j) {
        const __m256i qv = _mm256_loadu_si256((const __m256i*)(w + j * ldw + sb * 64 + half * 32));
        const __m256i q = _mm256_and_si256(_mm256_srl_epi16(qv, sh), three);
        const __m256 sv = _mm256_permutevar8x32_ps(S[j][half], idx), mv = _mm256_permutevar8x32_ps(Mn[j][half], idx);
        for (int t = 0; t < MT; ++t) {
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8_i32(q, a[t])), sv, acc[j][t]);
          acc[j][t] = _mm256_fnmadd_ps(as[t], mv, acc[j][t]);
        }
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

// q3_k (hy.h q3k_heads): per 256-value super-block and row the 16 scales (hy.h q3k_scales) times d as two vectors of
// 8; each 32-value piece p is q2_k's load of its half's 2-bit values shifted and masked, OR'ed with bit p of the 32
// hmask bytes moved to bit 2 (16-bit shifts; the mask drops the crossing bits): q + 4 in 0..7; maddubs with the
// activations minus the same with 4s (once per token and piece, shared by the 4 rows) is the exact dot of q per lane
// of 4 values; lanes 0-3 belong to the piece's first 16-value group, 4-7 to its second.
template <int MT>
void q3k_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 14;
  const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), four = _mm256_set1_epi8(4);
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    __m256 Sc[4][2];
    for (int j = 0; j < 4; ++j) {
      const uint8_t* h = hd + j * hst + sb * 14;
      uint16_t dh;
      std::memcpy(&dh, h + 12, 2);
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
      const __m128i sc = q3k_scales(h);
      Sc[j][0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
      Sc[j][1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
    }
    for (int j = 8; j < 12; ++j) {
      const uint8_t* p = w + j * ldw + sb * 96;
      _mm_prefetch((const char*)p, _MM_HINT_T1);
      _mm_prefetch((const char*)(p + 64), _MM_HINT_T1);
    }
    for (int p = 0; p < 8; ++p) {  // 32-value pieces: half p / 4, bits 2 (p % 4) of its 32 value bytes, hmask bit p
      const int half = p / 4, part = p % 4;
      const __m128i lsh = _mm_cvtsi32_si128(2 * part), hsh = _mm_cvtsi32_si128(p);
      __m256i a[MT], off[MT];
      for (int t = 0; t < MT; ++t) {
        a[t] = _mm256_loadu_si256((const __m256i*)(rows[t] + sb * 256 + p * 32));
        off[t] = dot_u8s8_i32(four, a[t]);
      }
      const __m256i idx = _mm256_setr_epi32(2 * part, 2 * part, 2 * part, 2 * part, 2 * part + 1, 2 * part + 1,
                                            2 * part + 1, 2 * part + 1);
      for (int j = 0; j < 4; ++j) {
        const uint8_t* base = w + j * ldw + sb * 96;
        const __m256i hm = _mm256_loadu_si256((const __m256i*)base);
        const __m256i qv = _mm256_loadu_si256((const __m256i*)(base + 32 + half * 32));
        const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi16(qv, lsh), three),
                                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hm, hsh), one), 2));
        const __m256 sv = _mm256_permutevar8x32_ps(Sc[j][half], idx);  // groups 2p, 2p + 1 of the super-block
        for (int t = 0; t < MT; ++t)
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot_u8s8_i32(q, a[t]), off[t])), sv, acc[j][t]);
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

// q6_k (hy.h q6k_heads): per 256-value super-block and row the 16 int8 scales, each in both 16-bit halves of its
// 32-bit lane (madd's operand), as two vectors of 8; each 32-value piece is one 32-byte ql load's low or high nibbles
// OR'ed with its bit pair of a 32-byte qh load moved to bits 4-5 (16-bit shifts: no bit crossing a byte lands there),
// q in 0..63; maddubs with the activations (pair sums <= 2 x 63 x 127) less the same with 32s (per token, piece and
// row: rows go in turn) is the exact pair sum of (q - 32) in int16 (|.| <= 2 x 32 x 127), which
// madd multiplies by its 16-value group's scale as it widens (lanes 0-3 the piece's first group, 4-7 its second):
// the super-block's dot stays in int32 (lane totals <= 8 x 2 x 8128 x 128 < 2^31) and is converted and scaled by d
// once per super-block, row and token (a float conversion and multiply-add per piece before). A row's super-block is
// walked whole before the next row's.
template <int MT>
void q6k_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 18;
  const __m256i lo4 = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
  for (int j = 0; j < 4; ++j) {
    __m256 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; ++sb) {
      const uint8_t* h = hd + j * hst + sb * 18;
      const uint8_t* base = w + j * ldw + sb * 192;
      _mm_prefetch((const char*)(base + 8 * ldw), _MM_HINT_T1);
      _mm_prefetch((const char*)(base + 8 * ldw + 64), _MM_HINT_T1);
      _mm_prefetch((const char*)(base + 8 * ldw + 128), _MM_HINT_T1);
      uint16_t dh;
      std::memcpy(&dh, h + 16, 2);
      const __m128i sc = _mm_loadu_si128((const __m128i*)h);
      __m256i S[2];
      for (int half = 0; half < 2; ++half) {
        const __m256i s32 = _mm256_cvtepi8_epi32(half ? _mm_srli_si128(sc, 8) : sc);
        S[half] = _mm256_or_si256(_mm256_and_si256(s32, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(s32, 16));
      }
      __m256i ia[MT];
      for (int t = 0; t < MT; ++t) ia[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {  // 32-value pieces: half p / 4, its values 32 (p % 4) .. 32 (p % 4) + 31
        const int half = p / 4, part = p % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i*)(base + half * 64 + (part % 2) * 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(base + 128 + half * 32));
        __m256i q;
        switch (part) {  // the nibble and the qh bit pair (bits 0-1, 2-3, 4-5, 6-7) moved to bits 4-5
          case 0: q = _mm256_or_si256(_mm256_and_si256(ql, lo4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)); break;
          case 1: q = _mm256_or_si256(_mm256_and_si256(ql, lo4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)); break;
          case 2: q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), lo4), _mm256_and_si256(qh, top)); break;
          default:
            q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), lo4),
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), top));
        }
        const __m256i idx = _mm256_setr_epi32(2 * part, 2 * part, 2 * part, 2 * part, 2 * part + 1, 2 * part + 1,
                                              2 * part + 1, 2 * part + 1);
        const __m256i sv = _mm256_permutevar8x32_epi32(S[half], idx);  // groups 2p, 2p + 1 of the super-block
        for (int t = 0; t < MT; ++t) {
          const __m256i a = _mm256_loadu_si256((const __m256i*)(rows[t] + sb * 256 + p * 32));
          const __m256i pq = _mm256_sub_epi16(_mm256_maddubs_epi16(q, a), _mm256_maddubs_epi16(c32, a));
          ia[t] = _mm256_add_epi32(ia[t], _mm256_madd_epi16(pq, sv));
        }
      }
      const __m256 dv = _mm256_set1_ps(_cvtsh_ss(dh));
      for (int t = 0; t < MT; ++t) acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t]), dv, acc[t]);
    }
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[t]) * act_scale(rows[t], k);
  }
}

// iq2_xxs (hy.h iq2xxs_heads): per 32-value sub-block and row its 4 codebook entries (hy.h g_iq_grids) as the
// unsigned operand, and its 4 sign bytes (hy.h g_iq_signs) spread to one byte per value (kern_iq256.h iq_signs_pm1)
// as +-1, put onto the activations (VPSIGNB; maddubs pair sums <= 2 x 43 x 127,
// exact); the exact dot converted and multiplied by d (2 ls + 1) / 8.
template <int MT>
void iq2xxs_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 2;
  const uint64_t* grid = g_iq_grids.iq2xxs;
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    float d[4];
    for (int j = 0; j < 4; ++j) {
      uint16_t dh;
      std::memcpy(&dh, hd + j * hst + sb * 2, 2);
      d[j] = _cvtsh_ss(dh) * 0.125f;
    }
    for (int j = 8; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + sb * 64), _MM_HINT_T1);
    for (int ib = 0; ib < 8; ++ib) {
      __m256i a[MT];
      for (int t = 0; t < MT; ++t) a[t] = _mm256_loadu_si256((const __m256i*)(rows[t] + sb * 256 + ib * 32));
      for (int j = 0; j < 4; ++j) {
        const uint8_t* q = w + j * ldw + sb * 64 + ib * 8;
        uint32_t aux;
        std::memcpy(&aux, q + 4, 4);
        const __m256i g = _mm256_setr_epi64x((long long)grid[q[0]], (long long)grid[q[1]], (long long)grid[q[2]],
                                             (long long)grid[q[3]]);
        const __m256i sg = iq_signs_pm1(aux);  // kern_iq256.h
        const __m256 sc = _mm256_set1_ps(d[j] * (float)(2 * (aux >> 28) + 1));
        for (int t = 0; t < MT; ++t)
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8_i32(g, _mm256_sign_epi8(a[t], sg))), sc, acc[j][t]);
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

// iq1_s (hy.h iq1s_heads): per 32-value sub-block and row its 4 codebook entries (hy.h g_iq_grids, 8 g + 8 a byte)
// with 2 added where the sub-block's s is +1 (its qh word's bit 15 clear) and 9 taken away: 8 g + s in -9..9 a byte,
// its magnitude the unsigned operand and its sign put onto the activations (VPSIGNB; maddubs pair sums <= 2 x 9 x 127,
// exact); the exact dot converted and multiplied by d (2 ls + 1) / 8.
template <int MT>
void iq1s_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 2;
  const uint64_t* grid = g_iq_grids.iq1;
  const __m256i nine = _mm256_set1_epi8(9);
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    float d[4];
    for (int j = 0; j < 4; ++j) {
      uint16_t dh;
      std::memcpy(&dh, hd + j * hst + sb * 2, 2);
      d[j] = _cvtsh_ss(dh) * 0.125f;
    }
    for (int j = 8; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + sb * 48), _MM_HINT_T1);
    for (int ib = 0; ib < 8; ++ib) {
      __m256i a[MT];
      for (int t = 0; t < MT; ++t) a[t] = _mm256_loadu_si256((const __m256i*)(rows[t] + sb * 256 + ib * 32));
      for (int j = 0; j < 4; ++j) {
        const uint8_t* q = w + j * ldw + sb * 48;
        uint16_t qh;
        std::memcpy(&qh, q + 32 + 2 * ib, 2);
        const uint64_t up = qh & 0x8000 ? 0 : 0x0202020202020202ULL;  // s = +1: 8 g + 10
        const uint8_t* qs = q + 4 * ib;
        const __m256i u = _mm256_setr_epi64x((long long)(grid[qs[0] | (qh << 8 & 0x700)] + up),
                                             (long long)(grid[qs[1] | (qh << 5 & 0x700)] + up),
                                             (long long)(grid[qs[2] | (qh << 2 & 0x700)] + up),
                                             (long long)(grid[qs[3] | (qh >> 1 & 0x700)] + up));
        const __m256i v = _mm256_sub_epi8(u, nine);  // 8 g + s
        const __m256i m = _mm256_abs_epi8(v);
        const __m256 sc = _mm256_set1_ps(d[j] * (float)(2 * (qh >> 12 & 7) + 1));
        for (int t = 0; t < MT; ++t)
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8_i32(m, _mm256_sign_epi8(a[t], v))), sc, acc[j][t]);
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

// iq1_m (hy.h iq1m_heads): iq1_s's kernel with a delta sign per 8-value group and a scale per 16 values. Per
// super-block and row the 16 pieces' d (2 ls + 1) / 8 (d assembled from the head, hy.h iq1m_d; ls: a permute and
// variable shift of the head words); per 32-value sub-block ib and row its 4 codebook entries with 2 added to those
// whose group's qh nibble has bit 3 clear (s = +1: a compare of the sub-block's 2 qh bytes against each group's sign
// bit), then as iq1_s's; lanes 0-3 of the exact dot hold piece 2 ib, lanes 4-7 piece 2 ib + 1 (one VPERMPS of the
// pair of scales).
template <int MT>
void iq1m_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 8;
  const uint64_t* grid = g_iq_grids.iq1;
  const __m256i nine = _mm256_set1_epi8(9), two = _mm256_set1_epi8(2);
  const __m256i sbits = _mm256_setr_epi64x(8, 0x80, 0x800, 0x8000);  // group i's delta sign in the sub-block's qh
  const __m256i fields = _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9), m7 = _mm256_set1_epi32(7);
  const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    alignas(32) float scl[4][16];  // row j: piece p's d (2 ls + 1) / 8
    for (int j = 0; j < 4; ++j) {
      const uint8_t* h = hd + j * hst + sb * 8;
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(iq1m_d(h)) * 0.125f);
      const __m256i w4 = _mm256_cvtepu16_epi32(_mm_loadl_epi64((const __m128i*)h));  // lanes 0-3: the words
      for (int hf = 0; hf < 2; ++hf) {  // pieces 8 hf .. 8 hf + 7: words 2 hf, 2 hf + 1
        const __m256i x = _mm256_permutevar8x32_epi32(w4, _mm256_add_epi32(pair, _mm256_set1_epi32(2 * hf)));
        const __m256i ls = _mm256_and_si256(_mm256_srlv_epi32(x, fields), m7);
        const __m256i ls21 = _mm256_or_si256(_mm256_slli_epi32(ls, 1), _mm256_set1_epi32(1));  // 2 ls + 1
        _mm256_store_ps(scl[j] + 8 * hf, _mm256_mul_ps(_mm256_cvtepi32_ps(ls21), d));
      }
    }
    for (int j = 8; j < 12; ++j) _mm_prefetch((const char*)(w + j * ldw + sb * 48), _MM_HINT_T1);
    for (int ib = 0; ib < 8; ++ib) {
      __m256i a[MT];
      for (int t = 0; t < MT; ++t) a[t] = _mm256_loadu_si256((const __m256i*)(rows[t] + sb * 256 + ib * 32));
      for (int j = 0; j < 4; ++j) {
        const uint8_t* q = w + j * ldw + sb * 48;
        const uint8_t* qs = q + 4 * ib;
        uint16_t qh;  // groups 4 ib .. 4 ib + 3: a nibble each
        std::memcpy(&qh, q + 32 + 2 * ib, 2);
        const __m256i g = _mm256_setr_epi64x((long long)grid[qs[0] | (qh << 8 & 0x700)],
                                             (long long)grid[qs[1] | (qh << 4 & 0x700)],
                                             (long long)grid[qs[2] | (qh & 0x700)],
                                             (long long)grid[qs[3] | (qh >> 4 & 0x700)]);
        const __m256i up = _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(qh), sbits), _mm256_setzero_si256());
        const __m256i v = _mm256_sub_epi8(_mm256_add_epi8(g, _mm256_and_si256(up, two)), nine);  // 8 g + s
        const __m256i m = _mm256_abs_epi8(v);
        const __m256 scv = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double*)&scl[j][2 * ib]))), pair);
        for (int t = 0; t < MT; ++t)
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8_i32(m, _mm256_sign_epi8(a[t], v))), scv, acc[j][t]);
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

template <int MT>
void vec_block(const HyMat& M, int e, int r, const uint8_t* const* rows, float* C, int ldc) {
  const int G = M.dtype == HY_INT4 ? M.ldk / M.group : 1;
  const bool fp32_scales = M.dtype == HY_INT8 || M.dtype == HY_INT4;  // the others read theirs through hy.h
  const float* sw = M.scale && fp32_scales ? M.scale + e * M.s_estride + (int64_t)r * G : nullptr;
  if (M.dtype == HY_BF16) {
    const uint16_t* w = (const uint16_t*)(M.w + e * M.w_estride) + (int64_t)r * M.ldk;
    bf16_block<MT>(w, M.ldk, M.ldk, rows, C, ldc);
  } else if (M.dtype == HY_INT8) {
    const int8_t* w = (const int8_t*)(M.w + e * M.w_estride) + (int64_t)r * M.ldk;
    i8_block<MT>(w, M.ldk, M.ldk, rows, sw, C, ldc);
  } else if (M.dtype == HY_MXFP4) {
    mx4_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 2), M.ldk / 2, M.ldk, rows, mx4_exps(M, e, r), C, ldc);
  } else if (M.dtype == HY_Q8_0) {
    q8_block<MT>((const int8_t*)(M.w + e * M.w_estride) + (int64_t)r * M.ldk, M.ldk, M.ldk, rows, q8_scales(M, e, r), C, ldc);
  } else if (M.dtype == HY_Q4_0) {
    q40_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 2), M.ldk / 2, M.ldk, rows, q8_scales(M, e, r), C, ldc);
  } else if (M.dtype == HY_Q4_K) {
    kq_block<MT, KQ_Q4>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 2), M.ldk / 2, M.ldk, rows, q4k_heads(M, e, r), C,
                        ldc);
  } else if (M.dtype == HY_Q5_K) {
    kq_block<MT, KQ_Q5>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 2), M.ldk / 2, M.ldk, rows, q5k_heads(M, e, r), C,
                        ldc);
  } else if (M.dtype == HY_IQ4_XS) {
    iq4_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 2), M.ldk / 2, M.ldk, rows, iq4_heads(M, e, r), C,
                         ldc);
  } else if (M.dtype == HY_Q2_K) {
    q2k_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 4), M.ldk / 4, M.ldk, rows, q2k_heads(M, e, r), C, ldc);
  } else if (M.dtype == HY_Q3_K) {
    q3k_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 256 * 96), M.ldk / 256 * 96, M.ldk, rows,
                  q3k_heads(M, e, r), C, ldc);
  } else if (M.dtype == HY_IQ2_XXS) {
    iq2xxs_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 4), M.ldk / 4, M.ldk, rows, iq2xxs_heads(M, e, r), C,
                     ldc);
  } else if (M.dtype == HY_IQ3_XXS) {
    iq3xxs_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 256 * 96), M.ldk / 256 * 96, M.ldk, rows,
                     iq2xxs_heads(M, e, r), C, ldc);
  } else if (M.dtype == HY_IQ3_S) {
    iq3s_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 256 * 108), M.ldk / 256 * 108, M.ldk, rows,
                   iq2xxs_heads(M, e, r), C, ldc);
  } else if (M.dtype == HY_IQ1_S) {
    iq1s_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 256 * 48), M.ldk / 256 * 48, M.ldk, rows,
                   iq1s_heads(M, e, r), C, ldc);
  } else if (M.dtype == HY_IQ1_M) {
    iq1m_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 256 * 48), M.ldk / 256 * 48, M.ldk, rows,
                   iq1m_heads(M, e, r), C, ldc);
  } else if (M.dtype == HY_Q6_K) {
    q6k_block<MT>(M.w + e * M.w_estride + (int64_t)r * (M.ldk / 4 * 3), M.ldk / 4 * 3, M.ldk, rows, q6k_heads(M, e, r), C,
                  ldc);
  } else {
    const uint8_t* w = M.w + e * M.w_estride + (int64_t)r * (M.ldk / 2);
    i4_block<MT>(w, M.ldk / 2, M.ldk, M.group, M.fold, rows, sw, C, ldc);
  }
}

// C[t * ldc + r] = sum_k act_t[k] W_e[r0 + r][k] for r < nr, t < m (the AVX2 kernels read no knob).
void vec_gemm(const Knobs&, const HyMat& M, int e, int r0, int nr, const uint8_t* const* rows, int m, float* C, int ldc) {
  for (int r = 0; r < nr; r += 4)
    for (int t = 0; t < m; t += 2) {
      if (m - t >= 2) vec_block<2>(M, e, r0 + r, rows + t, C + t * ldc + r, ldc);
      else vec_block<1>(M, e, r0 + r, rows + t, C + t * ldc + r, ldc);
    }
}

}  // namespace
