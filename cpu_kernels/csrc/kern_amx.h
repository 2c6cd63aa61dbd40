// AMX kernels (TDPBF16PS for bf16, TDPBSSD for int8) for many tokens per expert. The row-major weight
// matrix is the A operand as it is (a tile = 16 rows x 64 bytes, loaded with the row stride), the
// activations the B operand, packed per expert into VNNI tiles by the driver (pack_b_block); the tile
// product is C^T = W . X^T, transposed back when written out. Tile shapes: Intel SDM vol. 1 ch. 18
// (palette 1: 8 tiles of at most 16 rows x 64 bytes; TMUL M, N <= 16, K <= 64 bytes).
// Blocking: tiles 0-3 accumulate a 32-row x 32-token block (2 A tiles x 2 B tiles, 4 TDPs per 4 tile
// loads); K is walked in blocks of 8 chunks (256 bf16 / 512 int8) so the A panel (16 KiB) stays in
// L1 across the token blocks and the B panels of one K block (m_pad x 512 B) stay in L2; partial
// C blocks wait in a per-thread buffer between K blocks.
#pragma once
#include <immintrin.h>
#include <vector>
#include "hy.h"

namespace {

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
  _tile_loadconfig(&cfg);
}

template <bool BF16>
void amx_gemm_t(const HyMat& M, int e, int r0, int nr, const uint8_t* bpack, const float* bscale, int m_pad,
                float* C, int ldc) {
  static thread_local std::vector<float> cbuf_v;
  if (cbuf_v.size() < (size_t)nr * m_pad) cbuf_v.resize((size_t)nr * m_pad);
  float* cbuf = cbuf_v.data();  // [nr, m_pad]: C^T, fp32 (bf16) or int32 (int8) bits
  amx_config();
  const int64_t ldb = BF16 ? (int64_t)M.ldk * 2 : M.ldk;  // bytes per weight row
  const int nkc = (int)(ldb / 64), ntb = m_pad / 16;
  const int64_t cst = (int64_t)m_pad * 4;  // cbuf row stride in bytes
  const uint8_t* W = M.w + e * M.w_estride + (int64_t)r0 * ldb;
  constexpr int KB = 8;
  for (int kb = 0; kb < nkc; kb += KB) {
    const int ke = std::min(nkc, kb + KB);
    for (int rb = 0; rb < nr; rb += 32) {
      const uint8_t* A0 = W + rb * ldb;
      const uint8_t* A1 = A0 + 16 * ldb;
      for (int tb = 0; tb < ntb; tb += 2) {
        float* c0 = cbuf + (int64_t)rb * m_pad + tb * 16;
        float* c2 = c0 + 16 * m_pad;
        if (kb == 0) {
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        } else {
          _tile_loadd(0, c0, cst); _tile_loadd(1, c0 + 16, cst);
          _tile_loadd(2, c2, cst); _tile_loadd(3, c2 + 16, cst);
        }
        const uint8_t* B0 = bpack + (int64_t)tb * nkc * 1024;
        const uint8_t* B1 = B0 + (int64_t)nkc * 1024;
        for (int kc = kb; kc < ke; ++kc) {
          _tile_loadd(4, A0 + kc * 64, ldb);
          _tile_loadd(5, A1 + kc * 64, ldb);
          _tile_loadd(6, B0 + kc * 1024, 64);
          _tile_loadd(7, B1 + kc * 1024, 64);
          if (BF16) {
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
          } else {
            _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
          }
        }
        _tile_stored(0, c0, cst); _tile_stored(1, c0 + 16, cst);
        _tile_stored(2, c2, cst); _tile_stored(3, c2 + 16, cst);
      }
    }
  }
  // C^T -> C [m_pad, ldc]; int8: int32 sums times weight-row and token scales.
  const float* sw = BF16 ? nullptr : M.scale + e * M.s_estride + r0;
  for (int r = 0; r < nr; ++r) {
    const float* src = cbuf + (int64_t)r * m_pad;
    if (BF16) {
      for (int t = 0; t < m_pad; ++t) C[(int64_t)t * ldc + r] = src[t];
    } else {
      const int32_t* si = (const int32_t*)src;
      for (int t = 0; t < m_pad; ++t) C[(int64_t)t * ldc + r] = (float)si[t] * sw[r] * bscale[t];
    }
  }
}

void amx_gemm(const HyMat& M, int e, int r0, int nr, const uint8_t* bpack, const float* bscale, int m_pad,
              float* C, int ldc) {
  if (M.dtype == HY_BF16) amx_gemm_t<true>(M, e, r0, nr, bpack, bscale, m_pad, C, ldc);
  else amx_gemm_t<false>(M, e, r0, nr, bpack, bscale, m_pad, C, ldc);
}

}  // namespace
