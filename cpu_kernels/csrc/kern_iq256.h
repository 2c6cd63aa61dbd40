// The 256-bit IQ pieces included by the AVX2 and the AVX-512 kernels alike: the sign expansion of IQ2_XXS's and
// IQ3_XXS's 7-bit sign indices, and iq3_xxs's and iq3_s's vector kernels, which every vector library runs (its AVX-512
// build with the encodings the compiler picks there), so the kernels tested against cpu_kernels.quant's de-quantizers
// on any AVX2 machine are the ones an AVX-512 host runs. 4 weight rows x up to 2 tokens: 8 ymm accumulators + the sign and
// codebook operands within the 16 registers.
#pragma once
#include <immintrin.h>
#include <cstring>
#include "hy.h"

namespace {

// 32 sign bits (bit j set: value j negative) -> +1 / -1 per value, one byte each: the word broadcast, its bytes spread to
// one byte per value by VPSHUFB and tested bit by bit.
inline __m256i sign_bits_pm1(uint32_t pat) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i sbits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)pat), spread), bits);
  return _mm256_or_si256(_mm256_cmpeq_epi8(sbits, bits), _mm256_set1_epi8(1));  // -1 where negative, else +1
}

// A sub-block's signs word (its 4 seven-bit sign indices at bits 7 l, IQ2_XXS's and IQ3_XXS's) -> +1 / -1 per value: its
// 4 sign bytes (hy.h g_iq_signs) as sign_bits_pm1's word.
inline __m256i iq_signs_pm1(uint32_t aux) {
  const uint8_t* ks = g_iq_signs.v;
  return sign_bits_pm1(ks[aux & 127] | (uint32_t)ks[(aux >> 7) & 127] << 8 | (uint32_t)ks[(aux >> 14) & 127] << 16 |
                       (uint32_t)ks[(aux >> 21) & 127] << 24);
}

// iq3_xxs (hy.h iq2xxs_heads reads its fp16 d heads): per 32-value sub-block and row its 8 codebook entries (hy.h
// g_iq_grids iq3xxs, 4 magnitudes each) as the unsigned operand; its signs (iq_signs_pm1) put onto the activations
// (VPSIGNB; maddubs pair sums <= 2 x 62 x 127, exact); the exact dot converted and multiplied by d (2 ls + 1) / 4.
template <int MT>
void iq3xxs_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C,
                  int ldc) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 2;
  const uint32_t* grid = g_iq_grids.iq3xxs;
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    float d[4];
    for (int j = 0; j < 4; ++j) {
      uint16_t dh;
      std::memcpy(&dh, hd + j * hst + sb * 2, 2);
      d[j] = _cvtsh_ss(dh) * 0.25f;
    }
    for (int j = 8; j < 12; ++j) {
      _mm_prefetch((const char*)(w + j * ldw + sb * 96), _MM_HINT_T1);
      _mm_prefetch((const char*)(w + j * ldw + sb * 96 + 95), _MM_HINT_T1);
    }
    for (int ib = 0; ib < 8; ++ib) {
      __m256i a[MT];
      for (int t = 0; t < MT; ++t) a[t] = _mm256_loadu_si256((const __m256i*)(rows[t] + sb * 256 + ib * 32));
      for (int j = 0; j < 4; ++j) {
        const uint8_t* q = w + j * ldw + sb * 96 + ib * 8;
        uint32_t aux;
        std::memcpy(&aux, w + j * ldw + sb * 96 + 64 + ib * 4, 4);
        const __m256i g = _mm256_i32gather_epi32((const int*)grid, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q)), 4);
        const __m256i sg = iq_signs_pm1(aux);
        const __m256 sc = _mm256_set1_ps(d[j] * (float)((aux >> 28) * 2 + 1));
        for (int t = 0; t < MT; ++t) {
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(g, _mm256_sign_epi8(a[t], sg)), ones16);
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[j][t]);
        }
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

// iq3_s (hy.h iq2xxs_heads reads its fp16 d heads): per 32-value sub-block and row its 8 codebook entries (hy.h
// g_iq_grids iq3s, 4 odd magnitudes each; the 9-bit indices assembled from qs and a variable shift of the qh byte) as
// the unsigned operand; its 32 sign bits (sign_bits_pm1) put onto the activations (VPSIGNB; maddubs pair sums <= 2 x 15
// x 127, exact); the exact dot converted and multiplied by d (2 ls + 1).
template <int MT>
void iq3s_block(const uint8_t* w, int64_t ldw, int k, const uint8_t* const* rows, const uint8_t* hd, float* C, int ldc) {
  const int nsb = k / 256;
  const int64_t hst = (int64_t)nsb * 2;
  const int* grid = (const int*)g_iq_grids.iq3s;
  const __m256i ones16 = _mm256_set1_epi16(1), shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i bit9 = _mm256_set1_epi32(0x100);
  __m256 acc[4][MT];
  for (int j = 0; j < 4; ++j) for (int t = 0; t < MT; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    float d[4];
    for (int j = 0; j < 4; ++j) {
      uint16_t dh;
      std::memcpy(&dh, hd + j * hst + sb * 2, 2);
      d[j] = _cvtsh_ss(dh);
    }
    for (int j = 8; j < 12; ++j) {
      _mm_prefetch((const char*)(w + j * ldw + sb * 108), _MM_HINT_T1);
      _mm_prefetch((const char*)(w + j * ldw + sb * 108 + 107), _MM_HINT_T1);
    }
    for (int ib = 0; ib < 8; ++ib) {
      __m256i a[MT];
      for (int t = 0; t < MT; ++t) a[t] = _mm256_loadu_si256((const __m256i*)(rows[t] + sb * 256 + ib * 32));
      for (int j = 0; j < 4; ++j) {
        const uint8_t* blk = w + j * ldw + sb * 108;
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 8 * ib)));
        const __m256i hi = _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32(blk[64 + ib]), _mm256_sub_epi32(
                                                _mm256_set1_epi32(8), shifts)), bit9);  // bit j of qh -> bit 8 of lane j
        const __m256i g = _mm256_i32gather_epi32(grid, _mm256_or_si256(lo, hi), 4);
        uint32_t sbits;
        std::memcpy(&sbits, blk + 72 + 4 * ib, 4);
        const __m256i sg = sign_bits_pm1(sbits);
        const int ls = (blk[104 + ib / 2] >> (4 * (ib & 1))) & 15;
        const __m256 sc = _mm256_set1_ps(d[j] * (float)(2 * ls + 1));
        for (int t = 0; t < MT; ++t) {
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(g, _mm256_sign_epi8(a[t], sg)), ones16);
          acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[j][t]);
        }
      }
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < MT; ++t) C[t * ldc + j] = hsum8(acc[j][t]) * act_scale(rows[t], k);
}

}  // namespace
