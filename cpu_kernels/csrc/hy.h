// Shared definitions of the CPU expert executor: the C ABI structs (mirrored by cpu_kernels/_native.py
// with ctypes), bf16 helpers and the activation functions. Included by every per-ISA library.
// Shape vocabulary: T tokens, E experts, K experts per token, D hidden, F expert intermediate.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
#include <immintrin.h>

#define HY_API extern "C" __attribute__((visibility("default")))
#define HY_MAX_NODES 8

enum { HY_BF16 = 0, HY_INT8 = 1, HY_INT4 = 2, HY_MXFP4 = 3, HY_Q8_0 = 4, HY_Q4_K = 5, HY_Q6_K = 6, HY_Q5_K = 7, HY_Q2_K = 8,
       HY_Q3_K = 9, HY_IQ4_XS = 10, HY_Q4_0 = 11, HY_IQ2_XXS = 12, HY_IQ1_S = 13,
       HY_IQ1_M = 14, HY_IQ3_XXS = 15, HY_IQ3_S = 16 };
enum { HY_X_F32 = 0, HY_X_BF16 = 1 };
enum { HY_ACT_SILU = 0, HY_ACT_GELU = 1, HY_ACT_SWIGLU_OAI = 2 };
enum { HY_OK = 0, HY_EID = -1, HY_EARG = -2, HY_ENOMEM = -3, HY_EEXC = -4 };  // EEXC: a C++ exception

// One projection of every expert held by one NUMA node: expert e's row-major [rows_p, ldk] (int4: ldk/2 bytes a
// row) at w + e * w_estride (the node's experts are expert-major blocks: gate, up, down back to back). Rows are the output channels, ldk the (padded) reduction length. Padding is zero, so padded
// rows and columns contribute nothing; the GPU lane can use w[:, :rows, :k] as a strided view.
typedef struct {
  const uint8_t* w;
  const float* scale;    // int8: [E, rows_p] per output channel; int4: [E, rows_p, ldk/group]; mxfp4: uint8
                         // shared exponents [E, rows_p, ldk/32] (read through mx4_exps; s_estride in bytes);
                         // q8_0: fp16 [E, rows_p, ldk/32] (read through q8_scales; s_estride in fp16 values);
                         // q4_k: uint8 heads [E, rows_p, ldk/256, 16] (read through q4k_heads; s_estride in bytes);
                         // q6_k: uint8 heads [E, rows_p, ldk/256, 18] (read through q6k_heads; s_estride in bytes);
                         // q5_k: uint8 heads [E, rows_p, ldk/256, 48] (read through q5k_heads; s_estride in bytes);
                         // q2_k: uint8 heads [E, rows_p, ldk/256, 20] (read through q2k_heads; s_estride in bytes);
                         // q3_k: uint8 heads [E, rows_p, ldk/256, 14] (read through q3k_heads; s_estride in bytes);
                         // iq4_xs: uint8 heads [E, rows_p, ldk/256, 8] (read through iq4_heads; s_estride in bytes);
                         // q4_0: fp16 [E, rows_p, ldk/32] as q8_0's (read through q8_scales; s_estride in fp16 values);
                         // iq2_xxs: uint8 heads [E, rows_p, ldk/256, 2] (read through iq2xxs_heads; s_estride in bytes);
                         // iq1_s: uint8 heads [E, rows_p, ldk/256, 2] (read through iq1s_heads; s_estride in bytes);
                         // iq1_m: uint8 heads [E, rows_p, ldk/256, 8] (read through iq1m_heads; s_estride in bytes);
                         // iq3_xxs: uint8 heads [E, rows_p, ldk/256, 2] (read through iq2xxs_heads; s_estride in bytes);
                         // iq3_s: uint8 heads [E, rows_p, ldk/256, 2] (read through iq2xxs_heads; s_estride in bytes)
  const int32_t* rsum;   // int8: [E, rows_p] sum of each row's int8 values (AVX-512 VNNI offset correction)
  const float* bias;     // fp32 [E, rows_p] added to the GEMM result (zero padded), nullptr: none. gate/up: this
                         // node's F slice; down: set on node 0 only, so the node sum adds it once
  int64_t w_estride;     // bytes between experts
  int64_t s_estride;     // floats (mxfp4: bytes) between experts in scale
  int64_t r_estride;     // int32s between experts in rsum
  int64_t b_estride;     // floats between experts in bias
  int32_t rows, rows_p, k, ldk, group, dtype;
  int32_t fold;          // int4: groups per fold block of the stored order (i4_for_each_word; quant.int4_fold_groups)
} HyMat;

typedef struct {
  void* pool;            // Pool* of this node's pinned threads
  HyMat gate, up, down;  // gate/up: rows = F_n (this node's slice of F), k = D; down: rows = D, k = F_n
} HyNode;

typedef struct {
  int32_t dtype, act, n_local, D, n_nodes, knee;  // knee: tokens/expert from which the AMX path is used
  float alpha, limit;                             // activation parameters (GPT-OSS SwiGLU)
  HyNode nodes[HY_MAX_NODES];
} HyLayer;

namespace {

// The run-time knobs (api.h hy_tune, listed in cpu_kernels/_native.py TUNABLES). A layer call copies them once at
// its start (driver.h forward) and passes the copy down, so a change never lands inside a call and the kernels'
// loops read a local. Every knob changes speed only: the outputs are bit-identical at any setting.
constexpr int HY_MAX_TASK_ROWS = 512;  // task_rows' ceiling: fused.h's per-block sum buffer holds it
constexpr int HY_MAX_TAIL_SPLIT = 8;
struct Knobs {
  // 1: decode-sized calls run fused.h's single phase; 0: the phased path that prefill takes (tests and benchmarks
  // compare the two paths at decode shapes with it).
  int fused = 1;
  // Most weight rows of one decode task, and the fewest decode tasks per thread the row blocks shrink to give
  // (fused.h): every task starts weight streams the hardware prefetchers have not seen, so fewer, longer tasks read
  // faster as long as the dynamic tail stays short.
  int task_rows = 256;
  int task_min = 2;
  // Parts (1..HY_MAX_TAIL_SPLIT) each of a decode call's last down tasks, one per thread, is cut into, so that the
  // threads finish nearer together (fused.h).
  int tail_split = 4;
  // Rows ahead that the AVX-512 int8 and int4 kernels prefetch into L2 (a multiple of 4, 8..64): their rows are a half
  // and a quarter of a bf16 one, so they need more rows of lead than bf16's fixed 8 for the same bytes (kern_avx512.h).
  int pf_rows = 16;
  // K block of the AMX kernels in 64-byte chunks (1..64): 16 keeps a 32-row A panel (32 KiB) near L1 across the
  // token blocks and one K block's B panels in L2 (kern_amx.h).
  int amx_kblock = 16;
  // Bytes ahead hy_stream_read prefetches in software (0: none); the DRAM ceiling takes the best of several.
  int stream_pf = 0;
};
Knobs g_knobs;  // written by hy_tune under the call lock (driver.h g_job_mu)
// spin_us, the pool workers' spin before they sleep, is pool.h's g_spin_us: idle workers read it between calls.

// Sum of the 8 fp32 lanes of a 256-bit vector (every ISA library is built with AVX2 or more).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch's float->bfloat16 conversion does (NaN inputs are not expected).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// exp(x) without a libm call, so that activation loops vectorize: 2^(x log2 e) split into an integer
// part (the float exponent) and a fraction f in [-0.5, 0.5], 2^f by its degree-6 Taylor polynomial in
// f ln 2 (truncation error < 1.3e-7 relative). Inputs clamped to [-87, 88] (normal float results).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // ternaries (not fmin) vectorize to vmin/vmax
  float t = x * 1.44269504088896341f;
  float fi = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  float f = (t - fi) * 0.69314718055994531f;
  float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
  uint32_t bits = (uint32_t)((int32_t)fi + 127) << 23;
  float s;
  std::memcpy(&s, &bits, 4);
  return p * s;
}

// erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), for the exact-GELU activation.
inline float fast_erf(float x) {
  float ax = std::fabs(x);
  float t = 1.0f / (1.0f + 0.3275911f * ax);
  float y = 1.0f - t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f)))) *
                       fast_exp(-ax * ax);
  return std::copysign(y, x);
}

// Gated activation out[i] = act(g[i]) * u[i] over a row; one loop per activation so each vectorizes.
inline void gated_act_row(int act, const float* __restrict g, const float* __restrict u, float* __restrict out, int n,
                          float alpha, float limit) {
  switch (act) {
    case HY_ACT_GELU:  // exact (erf) GELU, torch.nn.functional.gelu's default
      for (int i = 0; i < n; ++i) out[i] = 0.5f * g[i] * (1.0f + fast_erf(g[i] * 0.70710678118654752f)) * u[i];
      break;
    case HY_ACT_SWIGLU_OAI:  // GPT-OSS: gate clamped above, up clamped both sides, g*sigmoid(alpha g)*(up+1)
      for (int i = 0; i < n; ++i) {
        float gi = g[i] > limit ? limit : g[i];
        float ui = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
        out[i] = gi / (1.0f + fast_exp(-alpha * gi)) * (ui + 1.0f);
      }
      break;
    default:  // SiLU (Qwen3, DeepSeek, Mixtral)
      for (int i = 0; i < n; ++i) out[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
  }
}

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// mxfp4 (cpu_kernels/quant.py, module doc): nibble-packed e2m1 codes in int4's chunk layout (per 64 K values
// 32 bytes: low nibbles K 0..31 = one 32-value block, high nibbles K 32..63 the next) and one uint8 exponent
// e per block. The kernels map a code through MX4_LUT to 2 * FP4 value + 12, an unsigned byte in [0, 24]
// (the VNNI / maddubs unsigned operand; the int8 activations are the signed one), take 12 * (sum of the 4
// activations of each int32 lane) off every lane, which leaves the exact integer dot of 2 * FP4 values
// with the activations, and scale each block by mx4_scale(e) = 2^(e - 128) (2^(e-127) of the format,
// halved for the doubled codes). Every e in 0..255 is a finite fp32 (2^-128 is subnormal, 2^127 normal).
#define HY_MX4_LUT 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
struct Mx4Scales {
  float v[256];
  Mx4Scales() { for (int e = 0; e < 256; ++e) v[e] = std::ldexp(1.0f, e - 128); }
};
const Mx4Scales g_mx4_scales;
inline float mx4_scale(uint8_t e) { return g_mx4_scales.v[e]; }
inline const uint8_t* mx4_exps(const HyMat& M, int e, int r) {
  return (const uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 32);
}

// Activation row layout. bf16: uint16 [ldk]. int8/int4/mxfp4: int8 [ldk] | fp32 scale | int32 group sums
// [ldk/group] (the int4 kernels need sum(a) per group to undo the +8 offset of the stored nibbles).
inline int64_t act_stride(int dtype, int ldk, int group) {
  if (dtype == HY_BF16) return align_up((int64_t)ldk * 2, 64);
  return align_up((int64_t)ldk + 4 + 4 * (int64_t)(ldk / group), 64);
}
// int4's stored (group-interleaved) order, cpu_kernels/quant.py int4_order: a row is cut into fold blocks of
// `fold` groups = B = fold * group / 64 chunks of 64 values; in each unpacked chunk (16 words of 4 values) word l
// belongs to group l / L (L = 16 / fold) of its block and is word c * L + l % L of that group (c: the chunk in
// the block). The kernels' int32 lanes then each sum one group over a whole block. Words, not values: a word's
// 4 values keep their order (a VPDPBUSD lane's 4 products).
inline bool i4_natural(int group, int fold) { return fold <= 1 || fold * group == 64; }
// f(stored word, natural word) for every word of a row of ldk values, in stored order (shifts, no divisions).
template <class Fn>
inline void i4_for_each_word(int ldk, int group, int fold, Fn f) {
  const int L = 16 / fold, B = fold * group / 64, gw = group / 4, sh = __builtin_ctz(L);
  int P = 0;
  for (int base = 0; base < ldk / 4; base += fold * gw)
    for (int c = 0; c < B; ++c)
      for (int l = 0; l < 16; ++l, ++P) f(P, base + (l >> sh) * gw + c * L + (l & (L - 1)));
}
// A layout the kernels can read: fold one of 1, 2, 4, 8, 16 dividing the row's group count, blocks of whole chunks.
inline bool i4_fold_ok(int ldk, int group, int fold) {
  return group > 0 && ldk % 64 == 0 && ldk % group == 0 && (fold == 1 || fold == 2 || fold == 4 || fold == 8 ||
         fold == 16) && (ldk / group) % fold == 0 && fold * group % 64 == 0;
}

// q8_0 (cpu_kernels/quant.py, module doc): int8 values row-major [rows_p, ldk] as int8's, and one fp16 scale per
// 32-value block along K, [rows_p, ldk/32]: llama.cpp's Q8_0 values (w = q * d), their 8.5 bits a weight, apart.
inline const uint16_t* q8_scales(const HyMat& M, int e, int r) {
  return (const uint16_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 32);
}
// q4_0 (cpu_kernels/quant.py, module doc): llama.cpp's Q4_0 values, w = (q - 8) d, q in 0..15: per 32-value block 16
// bytes as the file holds them (value j of the block in byte j's low nibble, value 16 + j in its high nibble), a row's
// blocks back to back, [rows_p, ldk/2], and q8_0's fp16 scales [rows_p, ldk/32] (q8_scales); 4.5 bits a weight as
// the file's. Padding is the byte 0x88 (q = 8) under a zero scale, what an all-zero block quantizes to.

// IEEE fp16 -> fp32 in scalar code (the AVX2 build targets AVX2 + FMA, without F16C).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  uint32_t u;
  if (e == 0x1F) u = sign | 0x7F800000u | (m << 13);
  else if (e) u = sign | ((e + 112) << 23) | (m << 13);
  else {  // zero or subnormal: m * 2^-24, exact in fp32
    const float f = (float)m * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// q4_k (cpu_kernels/quant.py, module doc): nibbles [rows_p, ldk/2] in int4's natural chunk layout (llama.cpp's Q4_K
// layout too) and per 256-value super-block a 16-byte head [rows_p, ldk/256, 16]: fp16 d, fp16 dmin and 12 bytes of
// 6-bit scales sc and minimums m of its 8 sub-blocks of 32; w = (d sc) q - (dmin m). ldk is a multiple of 256.
inline const uint8_t* q4k_heads(const HyMat& M, int e, int r) {
  return (const uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 256) * 16;
}
// q6_k (cpu_kernels/quant.py, module doc): per 256-value super-block of a row 192 bytes of 6-bit values as llama.cpp's
// Q6_K holds them (128 bytes of low nibbles ql, then 64 bytes of high bit pairs qh; w [rows_p, ldk * 3 / 4]) and an
// 18-byte head [rows_p, ldk/256, 18]: 16 int8 scales sc, one per 16 values, then fp16 d; w = d sc (q - 32), q in
// 0..63. In each half of 128 values (ql 64 bytes, qh 32), value l < 32 is ql[l]'s low nibble with qh[l]'s bits 0-1 on
// top, l + 32 ql[l + 32]'s low nibble with bits 2-3, l + 64 ql[l]'s high nibble with bits 4-5, l + 96 ql[l + 32]'s
// high nibble with bits 6-7. ldk is a multiple of 256.
inline const uint8_t* q6k_heads(const HyMat& M, int e, int r) {
  return (const uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 256) * 18;
}

// q5_k (cpu_kernels/quant.py, module doc): q4_k's nibbles [rows_p, ldk/2] and per 256-value super-block a 48-byte
// head [rows_p, ldk/256, 48]: q4_k's 16-byte head, then 32 bytes qh of fifth bits (value 64 j + l, l < 32, takes bit
// 2 j of qh[l]; value 64 j + 32 + l bit 2 j + 1); w = (d sc) (nibble + 16 x bit) - (dmin m), llama.cpp's Q5_K.
inline const uint8_t* q5k_heads(const HyMat& M, int e, int r) {
  return (const uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 256) * 48;
}

// q2_k (cpu_kernels/quant.py, module doc): 2-bit values [rows_p, ldk/4] as llama.cpp's Q2_K holds them (in each half
// of 128 values, 32 bytes: value 32 j + l is bits 2 j, 2 j + 1 of byte l) and per 256-value super-block a 20-byte head
// [rows_p, ldk/256, 20]: 16 bytes of a 4-bit scale sc (low nibble) and minimum m (high) per 16 values, then fp16 d
// and dmin; w = (d sc) q - (dmin m), q in 0..3. ldk is a multiple of 256.
inline const uint8_t* q2k_heads(const HyMat& M, int e, int r) {
  return (const uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 256) * 20;
}

// q3_k (cpu_kernels/quant.py, module doc): per 256-value super-block of a row 96 bytes of values as llama.cpp's Q3_K
// holds them (32 bytes hmask of high bits, then q2_k's 64 bytes of 2-bit values; w [rows_p, ldk / 256 * 96]) and a
// 14-byte head [rows_p, ldk/256, 14]: the file's 12 bytes of 16 six-bit scales (q3k_scales), then fp16 d; value
// 32 b + l takes bit b of hmask[l]; w = d (sc - 32) (low2 - 4 (1 - high)), a value in -4..3. ldk is a multiple of 256.
inline const uint8_t* q3k_heads(const HyMat& M, int e, int r) {
  return (const uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 256) * 14;
}
// A q3_k head's 16 scales sc - 32 as signed bytes (ggml's packing): scale i < 8 has the low nibble of byte i, scale
// i >= 8 the high nibble of byte i - 8, and scale 4 g + i its top two bits from bits 2 g, 2 g + 1 of byte 8 + i. Byte
// shuffles, then 32-bit shifts of each lane's own count (the masks drop the bits a shift pulls over a byte edge).
// Reads the head's first 12 bytes only.
inline __m128i q3k_scales(const uint8_t* h) {
  uint32_t top;
  std::memcpy(&top, h + 8, 4);
  const __m128i b = _mm_insert_epi32(_mm_loadl_epi64((const __m128i*)h), (int)top, 2);
  const __m128i lo = _mm_and_si128(
      _mm_srlv_epi32(_mm_shuffle_epi8(b, _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7)),
                     _mm_setr_epi32(0, 0, 4, 4)),
      _mm_set1_epi8(15));
  const __m128i hi = _mm_and_si128(
      _mm_srlv_epi32(_mm_shuffle_epi8(b, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11)),
                     _mm_setr_epi32(0, 2, 4, 6)),
      _mm_set1_epi8(3));
  return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi32(hi, 4)), _mm_set1_epi8(32));
}
// iq4_xs (cpu_kernels/quant.py, module doc): 4-bit codebook indices [rows_p, ldk/2] in int4's natural chunk layout
// (per 64 values 32 bytes: values 0..31 in the low nibbles, 32..63 in the high ones; llama.cpp's IQ4_XS pairs values
// j and 16 + j of each 32 in byte j instead, re-paired when packed) and per 256-value super-block the file's 8-byte
// head [rows_p, ldk/256, 8]: fp16 d, uint16 scales_h, uint8 scales_l[4]. Sub-block i's 6-bit scale is
// ls = ((scales_l >> 4 i) & 15) | (((scales_h >> 2 i) & 3) << 4) (scales_l read as one little-endian uint32);
// w = d (ls - 32) HY_IQ4_VALUES[code]. ldk is a multiple of 256.
inline const uint8_t* iq4_heads(const HyMat& M, int e, int r) {
  return (const uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 256) * 8;
}
// The 4-bit super-block formats the kq kernels read alike: q4_k, q5_k (q4_k's values with a fifth bit) and
// iq4_xs (codebook indices, no minimums); and the head bytes of each per 256 values.
enum KqKind { KQ_Q4 = 0, KQ_Q5 = 1, KQ_IQ4 = 2 };
constexpr int kq_head_bytes(int kind) { return kind == KQ_Q5 ? 48 : kind == KQ_IQ4 ? 8 : 16; }

// An iq4_xs head -> its 8 sub-blocks' scales d (ls - 32) as fp32 lanes 0-7 (exact in fp32): each lane's 4 low bits
// from scales_l shifted by 4 i, its 2 high bits from scales_h shifted by 2 i (one variable shift each); d by the scalar
// fp16 conversion (once per super-block and row).
inline __m256 iq4_scales8(const uint8_t* h) {
  uint16_t dh, sh;
  uint32_t sl;
  std::memcpy(&dh, h, 2);
  std::memcpy(&sh, h + 2, 2);
  std::memcpy(&sl, h + 4, 4);
  const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sl), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                      _mm256_set1_epi32(15));
  const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                      _mm256_set1_epi32(3));
  const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(ls), _mm256_set1_ps(f16_to_f32(dh)));
}
// llama.cpp's kvalues_iq4nl, the IQ4_XS codebook; and + 128 (unsigned bytes, the AVX-512 VNNI operand)
#define HY_IQ4_VALUES -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
#define HY_IQ4_VALUES_U8 1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181, \
                         (char)197, (char)217, (char)241

// iq2_xxs (cpu_kernels/quant.py, module doc): per 256-value super-block of a row the file's 64 bytes of qs as they are
// [rows_p, ldk/256 * 64] and its fp16 d as the head [rows_p, ldk/256, 2]. Sub-block ib (32 values) is qs bytes 8 ib ..
// 8 ib + 7: bytes 0-3 the codebook indices of its 4 groups of 8 values, bytes 4-7 a little-endian uint32 whose bits
// 7 l .. 7 l + 6 are group l's sign index (hy.h iq_sign_bits) and bits 28-31 the scale ls; w = d (2 ls + 1) / 8 x the
// codebook entry's magnitude x its sign. ldk is a multiple of 256.
inline const uint8_t* iq2xxs_heads(const HyMat& M, int e, int r) {
  return (const uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 256) * 2;
}
// iq3_xxs (cpu_kernels/quant.py, module doc): per 256-value super-block of a row the file's 96 bytes of qs as they are
// [rows_p, ldk/256 * 96] and its fp16 d as the head [rows_p, ldk/256, 2] (iq2xxs_heads reads it). Bytes 0-63 are the
// codebook indices of the 64 groups of 4 values in order (sub-block ib's: bytes 8 ib .. 8 ib + 7); bytes 64 + 4 ib ..
// 67 + 4 ib a little-endian uint32 as iq2_xxs's fourth-to-seventh bytes (the sign indices of its 4 groups of 8 values
// at bits 7 l, the scale ls at bits 28-31); w = d (2 ls + 1) / 4 x the codebook entry's magnitude x its sign. ldk is a
// multiple of 256.
// iq3_s (cpu_kernels/quant.py, module doc): per super-block the file's 108 bytes after d as they are [rows_p, ldk/256 *
// 108] and d as the head (iq2xxs_heads reads it): bytes 0-63 the low 8 bits of the 64 groups' 9-bit codebook indices,
// 64-71 their 9th bits (bit j of byte ib: group 8 ib + j), 72-103 a sign bit per value (bit j of byte i: value 8 i + j),
// 104-107 the 4-bit scales (sub-block 2 i in byte i's low nibble, 2 i + 1 in its high one); w = d (2 ls + 1) x the
// entry's magnitude x its sign. ldk is a multiple of 256.
// The IQ2_XXS codebook, set once per library at load by hy_set_grids (api.h) from the table the gguf package ships
// (gguf.quants.IQ2_XXS.grid; cpu_kernels/_native.py load): entry i's 8 bytes are its 8 magnitudes (8, 25 or 43), the
// first value in the lowest byte. All zero until set, so a kernel never reads an unset table.
// The IQ1 codebook (IQ1_S's and IQ1_M's: gguf.quants.IQ1_S.grid), set likewise by hy_set_iq1_grid: entry i's 8 values
// g in {-1, 0, 1} kept as the bytes 8 g + 8 (0, 8 or 16), the unsigned operand the kernels add a group's delta to
// (hy.h iq1s_heads).
// The IQ3_XXS codebook, set likewise by hy_set_iq3_grid (gguf.quants.IQ3_XXS.grid): entry i's 4 bytes are its 4
// magnitudes (4 to 62), the first value in the lowest byte.
// The IQ3_S codebook, set likewise by hy_set_iq3s_grid (gguf.quants.IQ3_S.grid): entry i's 4 bytes are its 4
// magnitudes (1 to 15, odd), the first value in the lowest byte.
struct IqGrids {
  alignas(64) uint64_t iq2xxs[256];
  alignas(64) uint32_t iq3xxs[256];
  alignas(64) uint32_t iq3s[512];
  alignas(64) uint64_t iq1[2048];
};
IqGrids g_iq_grids{};
// A 7-bit sign index s -> its group's 8 signs as bits (bit j set: value j negative): s's 7 bits, and an 8th that makes
// the count of negatives even (llama.cpp's ksigns_iq2xs, derived here).
inline uint8_t iq_sign_bits(int s) { return (uint8_t)(s | (__builtin_parity((unsigned)s) << 7)); }
struct IqSigns {
  uint8_t v[128];
  IqSigns() { for (int s = 0; s < 128; ++s) v[s] = iq_sign_bits(s); }
};
const IqSigns g_iq_signs;

// iq1_s (cpu_kernels/quant.py, module doc): per 256-value super-block of a row the file's 48 bytes after d as they are
// [rows_p, ldk/256 * 48] and its fp16 d as the head [rows_p, ldk/256, 2]. qs (bytes 0-31): the low 8 bits of group l's
// codebook index; qh (bytes 32-47): a little-endian uint16 per 32-value sub-block ib, bits 3 i .. 3 i + 2 the top 3
// bits of group 4 ib + i's index, bits 12-14 the scale ls, bit 15 the delta sign. w = d (2 ls + 1) (g + delta) =
// d (2 ls + 1) / 8 x (8 g + s), s = +1 (bit 15 clear) or -1: the kernels take u = 8 g + 8 + (s + 1) in 0..18 (hy.h
// IqGrids: 8 g + 8, plus 2 where s = +1) as the unsigned operand and subtract 9 x the activations' sum. ldk is a
// multiple of 256.
inline const uint8_t* iq1s_heads(const HyMat& M, int e, int r) {
  return (const uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 256) * 2;
}

// iq1_m (cpu_kernels/quant.py, module doc): per 256-value super-block of a row the file's first 48 bytes as they are
// [rows_p, ldk/256 * 48] and its 8 bytes of scales as the head [rows_p, ldk/256, 8]. qs (bytes 0-31): the low 8 bits of
// group l's codebook index; qh (bytes 32-47): byte j's low nibble for group 2 j, its high nibble for 2 j + 1, bits 0-2
// the index's top 3 bits, bit 3 the delta sign. The head: 4 little-endian uint16 words, word w's bits 3 i .. 3 i + 2 the
// scale ls of 16-value piece 4 w + i, its bits 12-15 bits 4 w .. 4 w + 3 of the fp16 d (iq1m_d). w = d (2 ls + 1)
// (g + delta) per 8 values, as iq1_s's (the kernels' u = 8 g + 8 + (s + 1) likewise). ldk is a multiple of 256.
inline const uint8_t* iq1m_heads(const HyMat& M, int e, int r) {
  return (const uint8_t*)M.scale + e * M.s_estride + (int64_t)r * (M.ldk / 256) * 8;
}
// An iq1_m head's fp16 d, assembled from its 4 words' top nibbles (word 0's the lowest).
inline uint16_t iq1m_d(const uint8_t* h) {
  uint16_t s[4];
  std::memcpy(s, h, 8);
  return (uint16_t)(s[0] >> 12 | (s[1] >> 8 & 0x00F0) | (s[2] >> 4 & 0x0F00) | (s[3] & 0xF000));
}

inline float act_scale(const uint8_t* row, int ldk) { float s; std::memcpy(&s, row + ldk, 4); return s; }
inline const int32_t* act_gsum(const uint8_t* row, int ldk) { return (const int32_t*)(row + ldk + 4); }

}  // namespace
