// The packer: a checkpoint's expert matrices (fp32, bf16, fp16, or block-FP8 with its scales, any strides: memory-
// mapped views) -> the executor's packed bf16 / int8 / int4 rows with their scales and row sums (hy.h HyMat), in
// parallel over (expert, row block) on a node's pool, one row at a time through an fp32 buffer, so nothing larger
// than a row is ever staged. Byte for byte what cpu_kernels/quant.py (the PyTorch reference) writes:
//   int8: s = max|w| / 127, q = clamp(rne(w * ((1 / max|w|) * 127)), -127, 127), rsum = sum q
//   int4: per group s = max|w| / 7, nibble = clamp(rne(w * ((1 / max|w|) * 7)), -8, 7) + 8, stored order + chunk
//         nibble layout of quant.py (hy.h i4_for_each_word)
//   q8_0: per 32-value block d = fp16(min(max|w| / 127, 65504)) (round to nearest even), q = clamp(rne(w / d),
//         -127, 127) with d read back as fp32 (0 where d is 0)
//   q4_0: per 32-value block m = its value of largest magnitude (the first one), d = fp16(clamp(m / -8, -65504,
//         65504)) (+0 where that is zero), q = clamp(rne(w / d), -8, 7) + 8 with d read back as fp32 (8 where d is
//         0), byte j of the block holding value j's q in its low nibble and value 16 + j's in its high one
//   bf16: round to nearest even
// (torch's `127.0 / amax` is amax.reciprocal() * 127: two roundings, kept so.) Padding rows and columns are zeros
// going through the same steps (int4: nibble 8, scale 0; q4_0: the byte 0x88, scale 0). A GGUF Q4_0 source (18-byte
// blocks of 32 values: fp16 d, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31; x = (q - 8) *
// d) is q4_0 exactly: its 16 bytes and d copied as they are; and int4 in groups of 32 exactly: its nibbles and d
// stored as they are, never through fp32 values (quant.py q4_0_nibbles + pack_int4);
// a GGUF Q8_0 source (34-byte blocks: fp16 d, then 32 int8 values) is q8_0 exactly, and a GGUF Q4_K source
// (144-byte super-blocks: a 16-byte head, then 128 bytes of nibbles in int4's chunk layout) q4_k exactly: copied
// as they are, as are a GGUF Q5_K source (176-byte super-blocks: q5_k's 48-byte head, then its 128 bytes of nibbles)
// into q5_k and a GGUF Q6_K source (210-byte super-blocks: 192 bytes of values, then an 18-byte head) into q6_k.
// A GGUF Q2_K source (84-byte super-blocks: 16 scale bytes, 64 bytes of values, fp16 d, dmin) is q2_k exactly: its
// values, and its scale bytes with d and dmin as the head. A GGUF Q3_K source (110-byte super-blocks: 96 bytes of
// values, hmask then 2-bit values, then a 14-byte head of 12 scale bytes and fp16 d) is q3_k exactly, copied as
// Q6_K's is. (The K-quants from float sources are cpu_kernels/quant.py's.)
// A GGUF IQ4_XS source (136-byte super-blocks: fp16 d, scales_h, scales_l[4], then 16 bytes of codebook indices per
// 32 values, values j and 16 + j in byte j) is iq4_xs exactly: its 8-byte head as it is, its indices re-paired into
// int4's chunk layout. iq4_xs from floats, as quant.py quantize_iq4_xs: per 32-value sub-block the value of largest
// magnitude m (the first one) gives s = m / -127, per super-block d = fp16(min(max|s| / 31, 65504)), each sub-block's
// ls - 32 = clamp(rne(s / d), -32, 31) (-32 where d is 0: zeros are all zero bytes), and each value the index of the
// nearest codebook entry to w / (d (ls - 32)), the number of midpoints between entries below it (index 0 where
// d (ls - 32) is 0).
// A GGUF IQ2_XXS source (66-byte super-blocks: fp16 d, then 64 bytes of qs) is iq2_xxs exactly: its d as the head, its
// qs as the values, as they are. iq2_xxs from floats is quantized in torch (cpu_kernels/quant.py quantize_iq2_xxs):
// refused here.
// A GGUF IQ3_XXS source (98-byte super-blocks: fp16 d, then 96 bytes of qs) is iq3_xxs exactly likewise, and an IQ3_S
// one (110 bytes: d, then 108 of qs, qh, signs and scales) iq3_s; from floats refused (no quantizer anywhere: the
// file's blocks only).
// A GGUF IQ1_S source (50-byte super-blocks: fp16 d, then 32 bytes of qs and 16 of qh) is iq1_s exactly: its d as the
// head, its qs and qh as the values, as they are; from floats refused likewise.
// A GGUF IQ1_M source (56-byte super-blocks: 32 bytes of qs, 16 of qh, 8 of scales holding d's nibbles) is iq1_m
// exactly: its scales as the head, its qs and qh as the values, as they are; from floats refused likewise.
// Included by api.h.
#pragma once
#include <atomic>
#include <vector>
#include "hy.h"
#include "pool.h"

enum { HY_SRC_F32 = 0, HY_SRC_BF16 = 1, HY_SRC_F16 = 2, HY_SRC_FP8 = 3, HY_SRC_Q4_0 = 4, HY_SRC_Q8_0 = 5,
       HY_SRC_Q4_K = 6, HY_SRC_Q6_K = 7, HY_SRC_Q5_K = 8, HY_SRC_Q2_K = 9,
       HY_SRC_Q3_K = 10, HY_SRC_IQ4_XS = 11, HY_SRC_IQ2_XXS = 12, HY_SRC_IQ1_S = 13, HY_SRC_IQ1_M = 14,
       HY_SRC_IQ3_XXS = 15, HY_SRC_IQ3_S = 16 };
constexpr int HY_ENONFINITE = -5;  // a NaN or Inf among the values read (or made by an FP8 block scale)

// n experts of one matrix kind as the checkpoint holds them (cpu_kernels/moe.py ExpertRows): expert i's element
// (r, c) of its rows x k window is at w[i] + (r * rs + c * cs) elements; FP8: times its block scale
// s[i][((r0 + r) / b0) * srs + ((c0 + c) / b1) * scs] (r0, c0: the window's place in the whole matrix). Q4_0: row r's
// block b starts at w[i] + r * rs + b * cs bytes (each block's 18 bytes contiguous), k = blocks x 32.
typedef struct {
  const void* const* w;
  const void* const* s;
  int64_t rs, cs, srs, scs;
  int32_t wdtype, sdtype;  // HY_SRC_*; sdtype: HY_SRC_F32 or HY_SRC_BF16
  int32_t r0, c0, b0, b1;
  int32_t rows, k;
} HyPackSrc;

namespace {

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0xF, m = b & 7;
      float f = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp((float)m, -9);
      if (e == 0xF && m == 7) f = __builtin_nanf("");
      v[b] = (b & 0x80) ? -f : f;
    }
  }
};
const Fp8Table g_fp8;

template <class T, class Cvt>
inline void load_strided(const T* p, int64_t cs, int k, float* out, Cvt cvt) {
  if (cs == 1) for (int c = 0; c < k; ++c) out[c] = cvt(p[c]);
  else for (int c = 0; c < k; ++c) out[c] = cvt(p[c * cs]);
}

// Row r of source expert i into out[0, ldk) as fp32 (zeros past k, and for r >= rows); false if a value is not finite.
inline bool load_row(const HyPackSrc& S, int i, int r, float* out, int ldk) {
  if (r >= S.rows) {
    std::memset(out, 0, sizeof(float) * ldk);
    return true;
  }
  const int k = S.k;
  const int64_t off = (int64_t)r * S.rs;
  switch (S.wdtype) {
    case HY_SRC_F32: load_strided((const float*)S.w[i] + off, S.cs, k, out, [](float x) { return x; }); break;
    case HY_SRC_BF16: load_strided((const uint16_t*)S.w[i] + off, S.cs, k, out, bf16_to_f32); break;
    case HY_SRC_F16: load_strided((const uint16_t*)S.w[i] + off, S.cs, k, out, f16_to_f32); break;
    default: {  // FP8: one block scale per run of b1 columns
      const uint8_t* p = (const uint8_t*)S.w[i] + off;
      const int64_t srow = (int64_t)((S.r0 + r) / S.b0) * S.srs;
      for (int c = 0; c < k;) {
        const int bc = (S.c0 + c) / S.b1, end = std::min(k, (bc + 1) * S.b1 - S.c0);
        const int64_t at = srow + (int64_t)bc * S.scs;
        const float s = S.sdtype == HY_SRC_BF16 ? bf16_to_f32(((const uint16_t*)S.s[i])[at]) : ((const float*)S.s[i])[at];
        for (; c < end; ++c) out[c] = g_fp8.v[p[c * S.cs]] * s;
      }
    }
  }
  std::memset(out + k, 0, sizeof(float) * (ldk - k));
  uint32_t bad = 0;  // exponent all ones: Inf or NaN
  for (int c = 0; c < k; ++c) {
    uint32_t u;
    std::memcpy(&u, out + c, 4);
    bad |= (u & 0x7F800000u) == 0x7F800000u;
  }
  return !bad;
}

// q[i] = clamp(rne(v[i] * inv), lo, hi) + off, as torch.round(...).clamp(lo, hi) (+ off) computes it in fp32.
template <class T>
inline void quantize_values(const float* v, int n, float inv, float lo, float hi, float off, T* q) {
  for (int i = 0; i < n; ++i) {
    float t = std::nearbyint(v[i] * inv);
    t = t < lo ? lo : (t > hi ? hi : t);
    q[i] = (T)(t + off);
  }
}

// torch.where(amax > 0, amax.reciprocal() * top, 0)
inline float inverse_scale(float amax, float top) { return amax > 0.f ? (1.0f / amax) * top : 0.f; }

void pack_row_int8(const float* v, const HyMat& M, int e, int r) {
  int8_t* q = (int8_t*)M.w + e * M.w_estride + (int64_t)r * M.ldk;
  const float amax = abs_max(v, M.ldk);
  quantize_values(v, M.ldk, inverse_scale(amax, 127.f), -127.f, 127.f, 0.f, q);
  int32_t sum = 0;
  for (int i = 0; i < M.ldk; ++i) sum += q[i];
  ((float*)M.scale)[e * M.s_estride + r] = amax / 127.f;
  ((int32_t*)M.rsum)[e * M.r_estride + r] = sum;
}

// A row's nibbles nat[0, ldk) (natural order) -> its stored bytes: quant.py pack_int4's order and chunk layout.
void store_row_int4(const uint8_t* nat, const HyMat& M, int e, int r, uint8_t* st) {
  const int ldk = M.ldk, group = M.group;
  const uint8_t* s = nat;
  if (!i4_natural(group, M.fold)) {
    i4_for_each_word(ldk, group, M.fold, [&](int P, int N) { std::memcpy(st + 4 * P, nat + 4 * N, 4); });
    s = st;
  }
  uint8_t* out = (uint8_t*)M.w + e * M.w_estride + (int64_t)r * (ldk / 2);
  for (int c = 0; c < ldk / 64; ++c)
    for (int j = 0; j < 32; ++j) out[c * 32 + j] = (uint8_t)(s[c * 64 + j] | (s[c * 64 + 32 + j] << 4));
}

void pack_row_int4(const float* v, const HyMat& M, int e, int r, uint8_t* nat, uint8_t* st) {
  const int ldk = M.ldk, group = M.group, G = ldk / group;
  float* scale = (float*)M.scale + e * M.s_estride + (int64_t)r * G;
  for (int g = 0; g < G; ++g) {
    const float amax = abs_max(v + g * group, group);
    quantize_values(v + g * group, group, inverse_scale(amax, 7.f), -8.f, 7.f, 8.f, nat + g * group);
    scale[g] = amax / 7.f;
  }
  store_row_int4(nat, M, e, r, st);
}

// Row r of Q4_0 source expert i -> int4 row r of expert e (group 32): the blocks' nibbles and d as they are; padding
// (columns past k, rows past rows) nibble 8 with scale 0. False if a block's d is not finite.
bool pack_row_q4_0_int4(const HyPackSrc& S, int i, const HyMat& M, int e, int r, uint8_t* nat, uint8_t* st) {
  const int ldk = M.ldk, nb = r < S.rows ? S.k / 32 : 0;
  float* scale = (float*)M.scale + e * M.s_estride + (int64_t)r * (ldk / 32);
  uint32_t bad = 0;
  const uint8_t* row = (const uint8_t*)S.w[i] + (int64_t)r * S.rs;
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = row + (int64_t)b * S.cs;
    uint16_t h;
    std::memcpy(&h, blk, 2);
    bad |= (h & 0x7C00u) == 0x7C00u;  // exponent all ones: Inf or NaN
    scale[b] = f16_to_f32(h);
    for (int j = 0; j < 16; ++j) {
      nat[32 * b + j] = blk[2 + j] & 0x0F;
      nat[32 * b + 16 + j] = blk[2 + j] >> 4;
    }
  }
  std::memset(nat + 32 * nb, 8, (size_t)(ldk - 32 * nb));
  for (int b = nb; b < ldk / 32; ++b) scale[b] = 0.f;
  store_row_int4(nat, M, e, r, st);
  return !bad;
}

// fp32 -> IEEE fp16, round to nearest even, as torch's .to(torch.float16) (finite inputs; callers clamp to 65504):
// below 2^-14 the subnormal's units of 2^-24 are rne(|f| 2^24) (1024 units is the smallest normal's encoding);
// above, the exponent is re-biased and the mantissa rounded from 23 bits to 10 (a carry steps the exponent).
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  u &= 0x7FFFFFFFu;
  if (u < 0x38800000u) {
    float a;
    std::memcpy(&a, &u, 4);
    return (uint16_t)(sign | (uint16_t)std::nearbyint(a * 16777216.0f));
  }
  u -= 0x38000000u;
  u += 0xFFFu + ((u >> 13) & 1u);
  return (uint16_t)(sign | (uint16_t)(u >> 13));
}

void pack_row_q8_0(const float* v, const HyMat& M, int e, int r) {
  int8_t* q = (int8_t*)M.w + e * M.w_estride + (int64_t)r * M.ldk;
  uint16_t* d = (uint16_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 32);
  for (int b = 0; b < M.ldk / 32; ++b) {
    const float amax = abs_max(v + 32 * b, 32), m = amax / 127.f;
    d[b] = f32_to_f16(m < 65504.f ? m : 65504.f);
    const float df = f16_to_f32(d[b]);
    for (int j = 0; j < 32; ++j) {
      float t = df > 0.f ? std::nearbyint(v[32 * b + j] / df) : 0.f;
      q[32 * b + j] = (int8_t)(t < -127.f ? -127.f : (t > 127.f ? 127.f : t));
    }
  }
}

// Row r of Q8_0 source expert i -> q8_0 row r of expert e: the blocks' values and d as they are; padding (columns
// past k, rows past rows) value 0 with scale 0. False if a block's d is not finite.
bool pack_row_q8_0_src(const HyPackSrc& S, int i, const HyMat& M, int e, int r) {
  const int ldk = M.ldk, nb = r < S.rows ? S.k / 32 : 0;
  int8_t* q = (int8_t*)M.w + e * M.w_estride + (int64_t)r * ldk;
  uint16_t* d = (uint16_t*)M.scale + e * M.s_estride + (int64_t)r * (ldk / 32);
  uint32_t bad = 0;
  const uint8_t* row = (const uint8_t*)S.w[i] + (int64_t)r * S.rs;
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = row + (int64_t)b * S.cs;
    std::memcpy(d + b, blk, 2);
    bad |= (d[b] & 0x7C00u) == 0x7C00u;  // exponent all ones: Inf or NaN
    std::memcpy(q + 32 * b, blk + 2, 32);
  }
  std::memset(q + 32 * nb, 0, (size_t)(ldk - 32 * nb));
  std::memset(d + nb, 0, 2 * (size_t)(ldk / 32 - nb));
  return !bad;
}

// Row r of Q4_0 source expert i -> q4_0 row r of expert e: each block's 16 bytes of nibbles and its d as they are;
// padding (columns past k, rows past rows) the byte 0x88 (q = 8) with scale 0. False if a block's d is not finite.
bool pack_row_q4_0_src(const HyPackSrc& S, int i, const HyMat& M, int e, int r) {
  const int ldk = M.ldk, nb = r < S.rows ? S.k / 32 : 0;
  uint8_t* q = (uint8_t*)M.w + e * M.w_estride + (int64_t)r * (ldk / 2);
  uint16_t* d = (uint16_t*)M.scale + e * M.s_estride + (int64_t)r * (ldk / 32);
  uint32_t bad = 0;
  const uint8_t* row = (const uint8_t*)S.w[i] + (int64_t)r * S.rs;
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = row + (int64_t)b * S.cs;
    uint16_t db;
    std::memcpy(&db, blk, 2);
    bad |= (db & 0x7C00u) == 0x7C00u;  // exponent all ones: Inf or NaN
    d[b] = db;
    std::memcpy(q + 16 * b, blk + 2, 16);
  }
  std::memset(q + 16 * nb, 0x88, (size_t)(ldk / 2 - 16 * nb));
  std::memset(d + nb, 0, 2 * (size_t)(ldk / 32 - nb));
  return !bad;
}

// A row's values v[0, ldk) (zero padded) -> q4_0 row r of expert e, as quant.py quantize_q4_0 (this file's head
// comment): llama.cpp's Q4_0 scale, the block's value of largest magnitude over -8.
void pack_row_q4_0(const float* v, const HyMat& M, int e, int r) {
  uint8_t* q = (uint8_t*)M.w + e * M.w_estride + (int64_t)r * (M.ldk / 2);
  uint16_t* d = (uint16_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 32);
  for (int b = 0; b < M.ldk / 32; ++b) {
    const float* x = v + 32 * b;
    float amax = -1.f, m = 0.f;
    for (int j = 0; j < 32; ++j)
      if (std::fabs(x[j]) > amax) { amax = std::fabs(x[j]); m = x[j]; }
    const float dm = m / -8.f;
    d[b] = f32_to_f16(dm < -65504.f ? -65504.f : (dm > 65504.f ? 65504.f : dm));
    if ((d[b] & 0x7FFFu) == 0) d[b] = 0;  // a zero d is +0 (a positive largest value gives -0), as the padding's
    const float df = f16_to_f32(d[b]);
    uint8_t u[32];
    for (int j = 0; j < 32; ++j) {
      float t = df != 0.f ? std::nearbyint(x[j] / df) : 0.f;
      u[j] = (uint8_t)((t < -8.f ? -8.f : (t > 7.f ? 7.f : t)) + 8.f);
    }
    for (int j = 0; j < 16; ++j) q[16 * b + j] = (uint8_t)(u[j] | (u[16 + j] << 4));
  }
}

// The GGUF super-block copies' frame: row r of source expert i's super-blocks -> row r of expert e's values (qb bytes a
// super-block) and heads (hb bytes); copy(blk, q, h) moves one super-block and returns 1 if its scales are not finite.
// Padding (columns past k, rows past rows) is zero bytes (code 0 under an all-zero head: the value 0). False if any
// super-block's scales are not finite.
template <class Copy>
bool pack_row_super_blocks(const HyPackSrc& S, int i, const HyMat& M, int e, int r, int qb, int hb, Copy copy) {
  const int nsb = M.ldk / 256, nb = r < S.rows ? S.k / 256 : 0;
  uint8_t* q = (uint8_t*)M.w + e * M.w_estride + (int64_t)r * nsb * qb;
  uint8_t* h = (uint8_t*)M.scale + e * M.s_estride + (int64_t)r * nsb * hb;
  uint32_t bad = 0;
  const uint8_t* row = (const uint8_t*)S.w[i] + (int64_t)r * S.rs;
  for (int b = 0; b < nb; ++b) bad |= copy(row + (int64_t)b * S.cs, q + (int64_t)qb * b, h + (int64_t)hb * b);
  std::memset(q + (int64_t)qb * nb, 0, (size_t)qb * (nsb - nb));
  std::memset(h + (int64_t)hb * nb, 0, (size_t)hb * (nsb - nb));
  return !bad;
}

// Row r of Q4_K (HB = 16) or Q5_K (HB = 48) source expert i -> q4_k / q5_k row r of expert e: each super-block's
// first HB bytes (fp16 d and dmin, the 6-bit scales and minimums; Q5_K: then its 32 bytes of fifth bits) as the head
// and its 128 bytes of nibbles, as they are. False if a head's d or dmin is not finite.
bool pack_row_kq_src(const HyPackSrc& S, int i, const HyMat& M, int e, int r, int HB) {
  return pack_row_super_blocks(S, i, M, e, r, 128, HB, [HB](const uint8_t* blk, uint8_t* q, uint8_t* h) {
    std::memcpy(h, blk, HB);
    std::memcpy(q, blk + HB, 128);
    uint16_t d, dmin;
    std::memcpy(&d, blk, 2);
    std::memcpy(&dmin, blk + 2, 2);
    uint32_t bad = 0;
    bad |= ((d & 0x7C00u) == 0x7C00u) | ((dmin & 0x7C00u) == 0x7C00u);  // exponent all ones: Inf or NaN
    return bad;
  });
}

// Row r of Q2_K source expert i -> q2_k row r of expert e: each super-block's 64 value bytes, and its 16 scale bytes
// with d and dmin as the head, as they are. False if a head's d or dmin is not finite.
bool pack_row_q2_k_src(const HyPackSrc& S, int i, const HyMat& M, int e, int r) {
  return pack_row_super_blocks(S, i, M, e, r, 64, 20, [](const uint8_t* blk, uint8_t* q, uint8_t* h) {
    std::memcpy(q, blk + 16, 64);
    std::memcpy(h, blk, 16);
    std::memcpy(h + 16, blk + 80, 4);
    uint16_t dd[2];  // d, dmin
    std::memcpy(dd, blk + 80, 4);
    uint32_t bad = 0;
    bad |= (dd[0] & 0x7C00u) == 0x7C00u;  // exponent all ones: Inf or NaN
    bad |= (dd[1] & 0x7C00u) == 0x7C00u;
    return bad;
  });
}

// Row r of Q6_K (VB = 192, HB = 18) or Q3_K (VB = 96, HB = 14) source expert i -> q6_k / q3_k row r of expert e: each
// super-block's first VB bytes of values and the HB-byte head after them (its last two bytes fp16 d) as they are.
// False if a head's d is not finite.
bool pack_row_values_head_src(const HyPackSrc& S, int i, const HyMat& M, int e, int r, int VB, int HB) {
  return pack_row_super_blocks(S, i, M, e, r, VB, HB, [VB, HB](const uint8_t* blk, uint8_t* q, uint8_t* h) {
    std::memcpy(q, blk, VB);
    std::memcpy(h, blk + VB, HB);
    uint16_t d;
    std::memcpy(&d, blk + VB + HB - 2, 2);
    uint32_t bad = 0;
    bad |= (d & 0x7C00u) == 0x7C00u;  // exponent all ones: Inf or NaN
    return bad;
  });
}

// Row r of IQ4_XS source expert i -> iq4_xs row r of expert e: each super-block's 8-byte head as it is, and its
// indices re-paired from the file's (values j and 16 + j of a sub-block in byte j) into int4's chunk layout (values
// j and 32 + j of a 64-value chunk, its two sub-blocks). False if a head's d is not finite.
bool pack_row_iq4_xs_src(const HyPackSrc& S, int i, const HyMat& M, int e, int r) {
  return pack_row_super_blocks(S, i, M, e, r, 128, 8, [](const uint8_t* blk, uint8_t* q, uint8_t* h) {
    std::memcpy(h, blk, 8);
    for (int cc = 0; cc < 4; ++cc) {  // chunk cc: sub-blocks 2 cc (low nibbles) and 2 cc + 1 (high nibbles)
      const uint8_t* lo = blk + 8 + 32 * cc;
      const uint8_t* hi = lo + 16;
      uint8_t* out = q + 32 * cc;
      for (int j = 0; j < 16; ++j) {
        out[j] = (uint8_t)((lo[j] & 0x0F) | (hi[j] << 4));
        out[16 + j] = (uint8_t)((lo[j] >> 4) | (hi[j] & 0xF0));
      }
    }
    uint16_t dh;
    std::memcpy(&dh, blk, 2);
    uint32_t bad = 0;
    bad |= (dh & 0x7C00u) == 0x7C00u;  // exponent all ones: Inf or NaN
    return bad;
  });
}

// Row r of a d-first IQ source expert i (IQ2_XXS: 64 bytes of qs after d; IQ3_XXS: 96; IQ3_S: 108; IQ1_S: 48) -> the
// same dtype's row r of expert e: each super-block's fp16 d as the head and its `vbytes` after it as the values, as they
// are. False if a d is not finite.
bool pack_row_d_first_src(const HyPackSrc& S, int i, const HyMat& M, int e, int r, int vbytes) {
  return pack_row_super_blocks(S, i, M, e, r, vbytes, 2, [vbytes](const uint8_t* blk, uint8_t* q, uint8_t* h) {
    std::memcpy(h, blk, 2);
    std::memcpy(q, blk + 2, vbytes);
    uint32_t bad = 0;
    bad |= (h[1] & 0x7C) == 0x7C;  // d's exponent (bits 10-14, its high byte's 2-6) all ones: Inf or NaN
    return bad;
  });
}

// Row r of IQ1_M source expert i -> iq1_m row r of expert e: each super-block's 8 bytes of scales as the head and its
// 48 bytes of qs and qh as the values, as they are. False if a d (rebuilt from the scales' top nibbles) is not finite.
bool pack_row_iq1_m_src(const HyPackSrc& S, int i, const HyMat& M, int e, int r) {
  return pack_row_super_blocks(S, i, M, e, r, 48, 8, [](const uint8_t* blk, uint8_t* q, uint8_t* h) {
    std::memcpy(h, blk + 48, 8);
    std::memcpy(q, blk, 48);
    return (uint32_t)((iq1m_d(h) & 0x7C00u) == 0x7C00u);  // d's exponent all ones: Inf or NaN
  });
}

// One 32-value sub-block's scale s = m / -127, m its value of largest magnitude (the first one): the codebook's
// entry of largest magnitude, -127, times s is m.
inline float iq4_sub_scale(const float* v) {
  float amax = -1.f, m = 0.f;
  for (int j = 0; j < 32; ++j)
    if (std::fabs(v[j]) > amax) { amax = std::fabs(v[j]); m = v[j]; }
  return m / -127.f;
}

// The index of w's nearest codebook entry on the grid of step dl (0 where dl is 0): how many of the 15 midpoints
// between neighbouring entries lie below w / dl.
inline uint8_t iq4_index(float w, float dl) {
  static const float mid[15] = {-115.5f, -93.5f, -74.f, -57.f, -42.f, -28.5f, -16.f, -4.5f,
                                7.f, 19.f, 31.5f, 45.5f, 61.f, 79.f, 101.f};
  if (dl == 0.f) return 0;
  const float x = w / dl;
  uint8_t n = 0;
  for (float b : mid) n += x > b;
  return n;
}

// A row's values v[0, ldk) (zero padded) -> iq4_xs row r of expert e, as quant.py quantize_iq4_xs (pack.h's head
// comment); nat: ldk bytes of scratch for the indices in natural order.
void pack_row_iq4_xs(const float* v, const HyMat& M, int e, int r, uint8_t* nat) {
  uint8_t* h = (uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 256) * 8;
  for (int b = 0; b < M.ldk / 256; ++b) {
    const float* w = v + 256 * b;
    float s[8], smax = 0.f;
    for (int ib = 0; ib < 8; ++ib) {
      s[ib] = iq4_sub_scale(w + 32 * ib);
      smax = std::max(smax, std::fabs(s[ib]));
    }
    const float dm = smax / 31.f;
    const uint16_t d = f32_to_f16(dm < 65504.f ? dm : 65504.f);
    const float df = f16_to_f32(d);
    uint16_t sh = 0;
    uint32_t sl = 0;
    for (int ib = 0; ib < 8; ++ib) {
      float t = df > 0.f ? std::nearbyint(s[ib] / df) : -32.f;  // d = 0: an all-zero head
      t = t < -32.f ? -32.f : (t > 31.f ? 31.f : t);
      const int ls = (int)t + 32;
      sh |= (uint16_t)((ls >> 4) << (2 * ib));
      sl |= (uint32_t)(ls & 15) << (4 * ib);
      const float dl = df * t;
      for (int j = 0; j < 32; ++j) nat[256 * b + 32 * ib + j] = iq4_index(w[32 * ib + j], dl);
    }
    std::memcpy(h + 8 * b, &d, 2);
    std::memcpy(h + 8 * b + 2, &sh, 2);
    std::memcpy(h + 8 * b + 4, &sl, 4);
  }
  store_row_int4(nat, M, e, r, nullptr);  // int4's natural chunk layout (group 32, fold 1: no reordering)
}

void pack_row_bf16(const float* v, const HyMat& M, int e, int r) {
  uint16_t* out = (uint16_t*)(M.w + e * M.w_estride) + (int64_t)r * M.ldk;
  for (int i = 0; i < M.ldk; ++i) out[i] = f32_to_bf16(v[i]);
}

// bf16 rows of a contiguous bf16 source are copied as they are (round to nearest even of a bf16 value is itself).
bool copy_row_bf16(const HyPackSrc& S, int i, const HyMat& M, int e, int r) {
  uint16_t* out = (uint16_t*)(M.w + e * M.w_estride) + (int64_t)r * M.ldk;
  int n = 0;
  if (r < S.rows) {
    const uint16_t* p = (const uint16_t*)S.w[i] + (int64_t)r * S.rs;
    std::memcpy(out, p, 2 * (size_t)S.k);
    n = S.k;
  }
  std::memset(out + n, 0, 2 * (size_t)(M.ldk - n));
  uint32_t bad = 0;
  for (int c = 0; c < n; ++c) bad |= (out[c] & 0x7F80u) == 0x7F80u;
  return !bad;
}

// The GGUF super-block sources: (source code, the dtype that holds them exactly, bytes per 256-value super-block).
struct SuperBlockSrc {
  int src, dtype, bytes;
};
constexpr SuperBlockSrc kSuperBlockSrcs[] = {{HY_SRC_Q2_K, HY_Q2_K, 84},   {HY_SRC_Q3_K, HY_Q3_K, 110},
                                             {HY_SRC_Q4_K, HY_Q4_K, 144},  {HY_SRC_Q5_K, HY_Q5_K, 176},
                                             {HY_SRC_Q6_K, HY_Q6_K, 210},  {HY_SRC_IQ4_XS, HY_IQ4_XS, 136},
                                             {HY_SRC_IQ2_XXS, HY_IQ2_XXS, 66}, {HY_SRC_IQ1_S, HY_IQ1_S, 50},
                                             {HY_SRC_IQ1_M, HY_IQ1_M, 56}, {HY_SRC_IQ3_XXS, HY_IQ3_XXS, 98},
                                             {HY_SRC_IQ3_S, HY_IQ3_S, 110}};

bool pack_args_ok(const HyPackSrc* S, const HyMat* M, int n) {
  if (!S || !M || !S->w || n < 0 || S->rows < 0 || S->k < 0 || S->rows > M->rows_p || S->k > M->ldk || !M->w) return false;
  if (S->wdtype < HY_SRC_F32 || S->wdtype > HY_SRC_IQ3_S) return false;
  for (const SuperBlockSrc& b : kSuperBlockSrcs)  // each into its own dtype only, whole super-blocks, each one's
    if (S->wdtype == b.src)                        // bytes in one run
      return M->dtype == b.dtype && M->scale && S->k % 256 == 0 && S->cs >= b.bytes && M->ldk % 256 == 0;
  if (M->dtype == HY_Q4_K || M->dtype == HY_Q5_K || M->dtype == HY_Q6_K || M->dtype == HY_Q2_K || M->dtype == HY_Q3_K ||
      M->dtype == HY_IQ2_XXS || M->dtype == HY_IQ1_S || M->dtype == HY_IQ1_M || M->dtype == HY_IQ3_XXS ||
      M->dtype == HY_IQ3_S)
    return false;  // from floats: cpu_kernels/quant.py (iq2_xxs; iq3_xxs, iq3_s, iq1_s, iq1_m: none)
  if (S->wdtype == HY_SRC_Q8_0)  // q8_0 only, whole blocks, each block's bytes in one run
    return M->dtype == HY_Q8_0 && M->scale && S->k % 32 == 0 && S->cs >= 34 && M->ldk % 32 == 0;
  if (S->wdtype == HY_SRC_Q4_0)  // q4_0, or int4 in groups of 32; whole blocks, each block's bytes in one run
    return M->scale && S->k % 32 == 0 && S->cs >= 18 &&
           ((M->dtype == HY_Q4_0 && M->ldk % 64 == 0) ||
            (M->dtype == HY_INT4 && M->group == 32 && i4_fold_ok(M->ldk, M->group, M->fold)));
  if (S->wdtype == HY_SRC_FP8 && (!S->s || S->b0 < 1 || S->b1 < 1 || S->r0 < 0 || S->c0 < 0 ||
                                  (S->sdtype != HY_SRC_F32 && S->sdtype != HY_SRC_BF16)))
    return false;
  if (M->dtype == HY_INT8) return M->scale && M->rsum;
  if (M->dtype == HY_INT4) return M->scale && i4_fold_ok(M->ldk, M->group, M->fold);
  if (M->dtype == HY_Q8_0) return M->scale && M->ldk % 32 == 0;
  if (M->dtype == HY_Q4_0) return M->scale && M->ldk % 64 == 0;
  if (M->dtype == HY_IQ4_XS) return M->scale && M->ldk % 256 == 0;
  return M->dtype == HY_BF16;
}

}  // namespace

// Packs source experts 0..n-1 (S) into experts e0..e0+n-1 of M (its q bytes, scales and row sums; every row up to
// rows_p and value up to ldk written) on the pool's threads; helps: whether the calling thread takes tasks too (not
// where the pages must be first touched on the pool's NUMA node). Returns HY_OK, HY_EARG, or HY_ENONFINITE with
// *bad = the first source expert holding a NaN or Inf (its rows may be partly written).
HY_API int hy_pack_mat(void* pool, const HyPackSrc* S, const HyMat* M, int e0, int n, int helps, int32_t* bad) {
  if (!pool || !pack_args_ok(S, M, n) || e0 < 0) return HY_EARG;
  std::lock_guard<std::mutex> lk(g_job_mu);
  constexpr int RB = 16;  // rows per task
  const int blocks = (M->rows_p + RB - 1) / RB;
  const bool copy = M->dtype == HY_BF16 && S->wdtype == HY_SRC_BF16 && S->cs == 1;
  std::atomic<int> first_bad{n};
  ((Pool*)pool)->run([&](int task, int) {
    static thread_local std::vector<float> v;
    static thread_local std::vector<uint8_t> tmp;
    const int i = task / blocks, e = e0 + i, ldk = M->ldk;
    if ((int)v.size() < ldk) v.resize(ldk);
    if ((int)tmp.size() < 2 * ldk) tmp.resize(2 * ldk);
    bool ok = true;
    for (int r = (task % blocks) * RB; r < std::min(M->rows_p, (task % blocks + 1) * RB); ++r) {
      if (copy) { ok &= copy_row_bf16(*S, i, *M, e, r); continue; }
      if (S->wdtype == HY_SRC_Q4_0 && M->dtype == HY_Q4_0) { ok &= pack_row_q4_0_src(*S, i, *M, e, r); continue; }
      if (S->wdtype == HY_SRC_Q4_0) { ok &= pack_row_q4_0_int4(*S, i, *M, e, r, tmp.data(), tmp.data() + ldk); continue; }
      if (S->wdtype == HY_SRC_Q8_0) { ok &= pack_row_q8_0_src(*S, i, *M, e, r); continue; }
      if (S->wdtype == HY_SRC_Q4_K) { ok &= pack_row_kq_src(*S, i, *M, e, r, 16); continue; }
      if (S->wdtype == HY_SRC_Q5_K) { ok &= pack_row_kq_src(*S, i, *M, e, r, 48); continue; }
      if (S->wdtype == HY_SRC_Q6_K) { ok &= pack_row_values_head_src(*S, i, *M, e, r, 192, 18); continue; }
      if (S->wdtype == HY_SRC_Q3_K) { ok &= pack_row_values_head_src(*S, i, *M, e, r, 96, 14); continue; }
      if (S->wdtype == HY_SRC_Q2_K) { ok &= pack_row_q2_k_src(*S, i, *M, e, r); continue; }
      if (S->wdtype == HY_SRC_IQ4_XS) { ok &= pack_row_iq4_xs_src(*S, i, *M, e, r); continue; }
      if (S->wdtype == HY_SRC_IQ2_XXS) { ok &= pack_row_d_first_src(*S, i, *M, e, r, 64); continue; }
      if (S->wdtype == HY_SRC_IQ3_XXS) { ok &= pack_row_d_first_src(*S, i, *M, e, r, 96); continue; }
      if (S->wdtype == HY_SRC_IQ3_S) { ok &= pack_row_d_first_src(*S, i, *M, e, r, 108); continue; }
      if (S->wdtype == HY_SRC_IQ1_S) { ok &= pack_row_d_first_src(*S, i, *M, e, r, 48); continue; }
      if (S->wdtype == HY_SRC_IQ1_M) { ok &= pack_row_iq1_m_src(*S, i, *M, e, r); continue; }
      ok &= load_row(*S, i, r, v.data(), ldk);
      if (M->dtype == HY_INT8) pack_row_int8(v.data(), *M, e, r);
      else if (M->dtype == HY_INT4) pack_row_int4(v.data(), *M, e, r, tmp.data(), tmp.data() + ldk);
      else if (M->dtype == HY_Q8_0) pack_row_q8_0(v.data(), *M, e, r);
      else if (M->dtype == HY_Q4_0) pack_row_q4_0(v.data(), *M, e, r);
      else if (M->dtype == HY_IQ4_XS) pack_row_iq4_xs(v.data(), *M, e, r, tmp.data());
      else pack_row_bf16(v.data(), *M, e, r);
    }
    if (!ok) {
      int seen = first_bad.load();
      while (i < seen && !first_bad.compare_exchange_weak(seen, i)) {}
    }
  }, n * blocks, helps != 0);
  const int found = first_bad.load();
  if (bad) *bad = found < n ? found : -1;
  return found < n ? HY_ENONFINITE : (int)HY_OK;
}
