// AMX kernels (TDPBF16PS for bf16, TDPBSSD for int8 and for int4 unpacked to int8) for many tokens per expert. The row-major weight
// matrix is the A operand as it is (a tile = 16 rows x 64 bytes, loaded with the row stride), the
// activations the B operand, packed per expert into VNNI tiles by the driver (pack_b_block); the tile
// product is C^T = W . X^T, transposed back when written out. Tile shapes: Intel SDM vol. 1 ch. 18
// (palette 1: 8 tiles of at most 16 rows x 64 bytes; TMUL M, N <= 16, K <= 64 bytes).
// Blocking: tiles 0-3 accumulate a 32-row x 32-token block (2 A tiles x 2 B tiles, 4 TDPs per 4 tile
// loads); K is walked in blocks of Knobs::amx_kblock chunks (hy.h; default 16: 512 bf16 / 1024 int8) so the A
// panel (32 KiB) stays near L1 across the token blocks and the B panels of one K block (m_pad x 1 KiB) stay in
// L2; partial C blocks wait in a per-thread buffer between K blocks; the last K block writes C through L1 tiles.
// Layout choice (DESIGN 3b): W as the A operand keeps the one row-major copy the GPU lane ships. Down runs
// slower than gate+up because it re-reads every expert's packed activations per row block and makes memory
// passes around the tiles, not because of the A-operand layout.
#pragma once
#include <immintrin.h>
#include <vector>
#include "hy.h"

namespace {

#if HY_AMX_EMULATE
// Scalar stand-ins for the tile instructions (same operands and semantics as the SDM's pseudo-code),
// so that the AMX driver path and this file's loops run and are tested on machines without AMX.
struct EmuTiles { alignas(64) uint8_t t[8][16][64]; };
thread_local EmuTiles g_tiles;
inline void emu_load(int t, const void* b, int64_t s) { for (int r = 0; r < 16; ++r) std::memcpy(g_tiles.t[t][r], (const uint8_t*)b + r * s, 64); }
inline void emu_store(int t, void* b, int64_t s) { for (int r = 0; r < 16; ++r) std::memcpy((uint8_t*)b + r * s, g_tiles.t[t][r], 64); }
inline void emu_zero(int t) { std::memset(g_tiles.t[t], 0, 1024); }
inline void emu_dpbf16ps(int c, int a, int b) {
  float* C = (float*)g_tiles.t[c];
  const uint16_t* A = (const uint16_t*)g_tiles.t[a];
  const uint16_t* B = (const uint16_t*)g_tiles.t[b];
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n)
      for (int k = 0; k < 16; ++k)
        C[m * 16 + n] += bf16_to_f32(A[m * 32 + 2 * k]) * bf16_to_f32(B[k * 32 + 2 * n]) +
                         bf16_to_f32(A[m * 32 + 2 * k + 1]) * bf16_to_f32(B[k * 32 + 2 * n + 1]);
}
inline void emu_dpbssd(int c, int a, int b) {
  int32_t* C = (int32_t*)g_tiles.t[c];
  const int8_t* A = (const int8_t*)g_tiles.t[a];
  const int8_t* B = (const int8_t*)g_tiles.t[b];
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n)
      for (int k = 0; k < 16; ++k)
        for (int i = 0; i < 4; ++i) C[m * 16 + n] += A[m * 64 + 4 * k + i] * B[k * 64 + 4 * n + i];
}
#define HY_TILE_CONFIG(cfg) (void)(cfg)
#define HY_TILE_LOAD(t, b, s) emu_load(t, b, s)
#define HY_TILE_STORE(t, b, s) emu_store(t, b, s)
#define HY_TILE_ZERO(t) emu_zero(t)
#define HY_TDPBF16PS(c, a, b) emu_dpbf16ps(c, a, b)
#define HY_TDPBSSD(c, a, b) emu_dpbssd(c, a, b)
#else
#define HY_TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define HY_TILE_LOAD(t, b, s) _tile_loadd(t, b, s)
#define HY_TILE_STORE(t, b, s) _tile_stored(t, b, s)
#define HY_TILE_ZERO(t) _tile_zero(t)
#define HY_TDPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define HY_TDPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#endif

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void amx_config() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
  HY_TILE_CONFIG(&cfg);
}

// One finished 16x16 C^T tile (weight rows x tokens, in L1) -> C [token, row], scaled for int8.
template <bool BF16>
inline void write_tile(const float* tile, float* C, int ldc, int t0, int r0, const float* sw, const float* bscale) {
  for (int n = 0; n < 16; ++n) {
    float* c = C + (int64_t)(t0 + n) * ldc + r0;
    if (BF16) {
      for (int r = 0; r < 16; ++r) c[r] = tile[r * 16 + n];
    } else {
      const float s = bscale[t0 + n];
      for (int r = 0; r < 16; ++r) c[r] = (float)((const int32_t*)tile)[r * 16 + n] * sw[r0 + r] * s;
    }
  }
}

// nmat weight matrices of the same shape (gate and up, or down alone) against the same packed
// activations: K blocks outermost, so each block's B panels are fetched into L2 once for all of them.
template <bool BF16>
void amx_gemm_t(const HyMat* const* Ms, float* const* Cs, int nmat, int e, int r0, int nr, const uint8_t* bpack,
                const float* bscale, int m_pad, int ldc, int kblock) {
  // Tokens in chunks of TC: the B panels of one K block for one chunk (TC x KB x 64 B) and the
  // parked partial sums (nmat x nr x TC fp32) then stay in L2 together.
  constexpr int TC = 256;
  static thread_local std::vector<float> cbuf_v;
  if (cbuf_v.size() < (size_t)nmat * nr * TC) cbuf_v.resize((size_t)nmat * nr * TC);
  alignas(64) float tile[4][256];
  amx_config();
  const HyMat& M0 = *Ms[0];
  const int64_t ldb = BF16 ? (int64_t)M0.ldk * 2 : M0.ldk;  // bytes per weight row
  const int nkc = (int)(ldb / 64);
  const int64_t cst = (int64_t)TC * 4;  // cbuf row stride in bytes
  const int KB = kblock;
  for (int t0 = 0; t0 < m_pad; t0 += TC) {
    const int tb0 = t0 / 16, tb1 = std::min(m_pad, t0 + TC) / 16;
    for (int kb = 0; kb < nkc; kb += KB) {
      const int ke = std::min(nkc, kb + KB);
      for (int mi = 0; mi < nmat; ++mi) {
        const HyMat& M = *Ms[mi];
        float* C = Cs[mi];
        float* cbuf = cbuf_v.data() + (size_t)mi * nr * TC;  // [nr, TC]: partial C^T between K blocks
        const uint8_t* W = M.w + e * M.w_estride + (int64_t)r0 * ldb;
        const float* sw = BF16 ? nullptr : M.scale + e * M.s_estride + r0;
        for (int rb = 0; rb < nr; rb += 32) {
          const uint8_t* A0 = W + rb * ldb;
          const uint8_t* A1 = A0 + 16 * ldb;
          for (int tb = tb0; tb < tb1; tb += 2) {
            float* c0 = cbuf + (int64_t)rb * TC + (tb - tb0) * 16;
            float* c2 = c0 + 16 * TC;
            if (kb == 0) {
              HY_TILE_ZERO(0); HY_TILE_ZERO(1); HY_TILE_ZERO(2); HY_TILE_ZERO(3);
            } else {
              HY_TILE_LOAD(0, c0, cst); HY_TILE_LOAD(1, c0 + 16, cst);
              HY_TILE_LOAD(2, c2, cst); HY_TILE_LOAD(3, c2 + 16, cst);
            }
            const uint8_t* B0 = bpack + (int64_t)tb * nkc * 1024;
            const uint8_t* B1 = B0 + (int64_t)nkc * 1024;
            for (int kc = kb; kc < ke; ++kc) {
              HY_TILE_LOAD(4, A0 + kc * 64, ldb);
              HY_TILE_LOAD(5, A1 + kc * 64, ldb);
              HY_TILE_LOAD(6, B0 + kc * 1024, 64);
              HY_TILE_LOAD(7, B1 + kc * 1024, 64);
              if (BF16) {
                HY_TDPBF16PS(0, 4, 6); HY_TDPBF16PS(1, 4, 7); HY_TDPBF16PS(2, 5, 6); HY_TDPBF16PS(3, 5, 7);
              } else {
                HY_TDPBSSD(0, 4, 6); HY_TDPBSSD(1, 4, 7); HY_TDPBSSD(2, 5, 6); HY_TDPBSSD(3, 5, 7);
              }
            }
            if (ke < nkc) {  // more K blocks to come: park the partial sums
              HY_TILE_STORE(0, c0, cst); HY_TILE_STORE(1, c0 + 16, cst);
              HY_TILE_STORE(2, c2, cst); HY_TILE_STORE(3, c2 + 16, cst);
            } else {  // done: transpose each tile through L1 straight into C (no strided pass over C)
              HY_TILE_STORE(0, tile[0], 64); HY_TILE_STORE(1, tile[1], 64);
              HY_TILE_STORE(2, tile[2], 64); HY_TILE_STORE(3, tile[3], 64);
              write_tile<BF16>(tile[0], C, ldc, tb * 16, rb, sw, bscale);
              write_tile<BF16>(tile[1], C, ldc, tb * 16 + 16, rb, sw, bscale);
              write_tile<BF16>(tile[2], C, ldc, tb * 16, rb + 16, sw, bscale);
              write_tile<BF16>(tile[3], C, ldc, tb * 16 + 16, rb + 16, sw, bscale);
            }
          }
        }
      }
    }
  }
}

// 64 int4 values of one row (32 bytes: low nibbles stored values 0..31, high nibbles 32..63, each value + 8) ->
// 64 signed int8 in stored order, the A-tile row of TDPBSSD. Plain loops: the compiler vectorizes them per ISA, and
// the emulated build (tested on any machine) runs the very same code as the AMX one.
inline void unpack_i4_chunk(const uint8_t* src, int8_t* dst) {
  for (int i = 0; i < 32; ++i) dst[i] = (int8_t)((src[i] & 15) - 8);
  for (int i = 0; i < 32; ++i) dst[32 + i] = (int8_t)((src[i] >> 4) - 8);
}

// Stored chunks [kb, ke) of one row (whole fold blocks) -> the panel row in natural K order: the tiles need one
// group per 64-value step, and the driver packs the activations' B tiles in natural order. nat: stored word ->
// natural word of the whole row (hy.h i4_for_each_word), nullptr for the natural order.
inline void unpack_i4_row(const uint8_t* src, int kb, int ke, const int* nat, int8_t* dst) {
  if (!nat) {
    for (int kc = kb; kc < ke; ++kc) unpack_i4_chunk(src + kc * 32, dst + (kc - kb) * 64);
    return;
  }
  alignas(64) int8_t tmp[64];
  for (int kc = kb; kc < ke; ++kc) {
    unpack_i4_chunk(src + kc * 32, tmp);
    for (int l = 0; l < 16; ++l) std::memcpy(dst + 4 * (nat[kc * 16 + l] - kb * 16), tmp + 4 * l, 4);
  }
}

// int4 with groups of 64 or 128 values (whole 64-value K chunks; 32 goes to the vector path) on AMX. Per
// 32-row panel and K block, the nibbles are unpacked once into signed int8 A tiles (L1/L2 scratch) and reused
// for every token block. Each group's products are summed in int32 tiles over its 1-2 chunks, then folded
// into fp32 accumulators [row, token] with the row's group scale (the scale differs per group, so int32 cannot
// run on across groups); the token scales are applied once at the end. The weights are read once per call as
// in amx_gemm_t; the fold and the unpacking are vector work the bf16/int8 tiles do not have.
void amx_gemm_i4(const HyMat* const* Ms, float* const* Cs, int nmat, int e, int r0, int nr, const uint8_t* bpack,
                 const float* bscale, int m_pad, int ldc, int kblock) {
  constexpr int TC = 256;  // tokens per chunk: the fp32 accumulators (nmat x nr x TC) stay in L2
  const HyMat& M0 = *Ms[0];
  const int nkc = M0.ldk / 64, cpg = M0.group / 64, G = M0.ldk / M0.group;
  const int64_t ldw = M0.ldk / 2;  // bytes of one packed row
  // K block in whole groups, and in whole fold blocks of the stored order (whose chunks hold several groups)
  const int unit = i4_natural(M0.group, M0.fold) ? cpg : M0.fold * M0.group / 64;
  const int KB = std::max(unit, kblock / unit * unit);
  static thread_local std::vector<int> nat_v;  // stored word -> natural word (the interleaved order only)
  const int* nat = nullptr;
  if (!i4_natural(M0.group, M0.fold)) {
    nat_v.resize(nkc * 16);
    i4_for_each_word(M0.ldk, M0.group, M0.fold, [&](int P, int N) { nat_v[P] = N; });
    nat = nat_v.data();
  }
  const int64_t lda = (int64_t)KB * 64;                     // A panel row stride (bytes)
  static thread_local std::vector<float> acc_v;
  static thread_local std::vector<int8_t> panel_v;
  if (acc_v.size() < (size_t)nmat * nr * TC) acc_v.resize((size_t)nmat * nr * TC);
  if (panel_v.size() < (size_t)32 * lda) panel_v.resize((size_t)32 * lda);
  int8_t* panel = panel_v.data();
  alignas(64) int32_t tile[4][256];
  amx_config();
  for (int t0 = 0; t0 < m_pad; t0 += TC) {
    const int tb0 = t0 / 16, tb1 = std::min(m_pad, t0 + TC) / 16, nt = (tb1 - tb0) * 16;
    for (int mi = 0; mi < nmat; ++mi)
      for (int r = 0; r < nr; ++r) std::memset(acc_v.data() + ((size_t)mi * nr + r) * TC, 0, nt * 4);
    for (int kb = 0; kb < nkc; kb += KB) {
      const int ke = std::min(nkc, kb + KB);
      for (int mi = 0; mi < nmat; ++mi) {
        const HyMat& M = *Ms[mi];
        const uint8_t* W = M.w + e * M.w_estride + (int64_t)r0 * ldw;
        const float* S = M.scale + e * M.s_estride + (int64_t)r0 * G;
        float* acc = acc_v.data() + (size_t)mi * nr * TC;
        for (int rb = 0; rb < nr; rb += 32) {
          for (int r = 0; r < 32; ++r) unpack_i4_row(W + (rb + r) * ldw, kb, ke, nat, panel + r * lda);
          for (int tb = tb0; tb < tb1; tb += 2) {
            const uint8_t* B0 = bpack + (int64_t)tb * nkc * 1024;
            const uint8_t* B1 = B0 + (int64_t)nkc * 1024;
            for (int g0 = kb; g0 < ke; g0 += cpg) {
              HY_TILE_ZERO(0); HY_TILE_ZERO(1); HY_TILE_ZERO(2); HY_TILE_ZERO(3);
              for (int kc = g0; kc < g0 + cpg; ++kc) {
                HY_TILE_LOAD(4, panel + (kc - kb) * 64, lda);
                HY_TILE_LOAD(5, panel + 16 * lda + (kc - kb) * 64, lda);
                HY_TILE_LOAD(6, B0 + kc * 1024, 64);
                HY_TILE_LOAD(7, B1 + kc * 1024, 64);
                HY_TDPBSSD(0, 4, 6); HY_TDPBSSD(1, 4, 7); HY_TDPBSSD(2, 5, 6); HY_TDPBSSD(3, 5, 7);
              }
              HY_TILE_STORE(0, tile[0], 64); HY_TILE_STORE(1, tile[1], 64);
              HY_TILE_STORE(2, tile[2], 64); HY_TILE_STORE(3, tile[3], 64);
              const int g = g0 / cpg;
              for (int q = 0; q < 4; ++q) {  // tile q: rows rb + 16 (q / 2) .., tokens (tb - tb0) * 16 + 16 (q % 2) ..
                const int rq = rb + 16 * (q / 2), tq = (tb - tb0) * 16 + 16 * (q % 2);
                for (int r = 0; r < 16; ++r) {
                  const float sc = S[(int64_t)(rq + r) * G + g];
                  float* a = acc + (int64_t)(rq + r) * TC + tq;
                  const int32_t* c = tile[q] + r * 16;
                  for (int n = 0; n < 16; ++n) a[n] += (float)c[n] * sc;
                }
              }
            }
          }
        }
      }
    }
    for (int mi = 0; mi < nmat; ++mi) {  // C[t][r] = acc[r][t] * token scale
      const float* acc = acc_v.data() + (size_t)mi * nr * TC;
      for (int n = 0; n < nt; ++n) {
        float* c = Cs[mi] + (int64_t)(t0 + n) * ldc;
        const float bs = bscale[t0 + n];
        for (int r = 0; r < nr; ++r) c[r] = acc[(int64_t)r * TC + n] * bs;
      }
    }
  }
}

// C_i[t * ldc + r] = sum_k X[t][k] W_i[r0 + r][k] for the nmat matrices (see vec_gemm for the layout).
void amx_gemm(const Knobs& kn, const HyMat* const* Ms, float* const* Cs, int nmat, int e, int r0, int nr,
              const uint8_t* bpack, const float* bscale, int m_pad, int ldc) {
  if (Ms[0]->dtype == HY_BF16) amx_gemm_t<true>(Ms, Cs, nmat, e, r0, nr, bpack, bscale, m_pad, ldc, kn.amx_kblock);
  else if (Ms[0]->dtype == HY_INT4) amx_gemm_i4(Ms, Cs, nmat, e, r0, nr, bpack, bscale, m_pad, ldc, kn.amx_kblock);
  else amx_gemm_t<false>(Ms, Cs, nmat, e, r0, nr, bpack, bscale, m_pad, ldc, kn.amx_kblock);
}

}  // namespace
