// The fused-MoE driver shared by every ISA library: routing, activation preparation, the phases of one
// layer call and NUMA slices (the exported C API is api.h). The including file first defines the ISA kernels:
//   vec_gemm(kn, M, e, r0, nr, rows, m, C, ldc)   C[i*ldc + r] = sum_k act_i[k] * W_e[r0 + r][k]
//   amx_gemm(kn, Ms, Cs, nmat, e, r0, nr, bpack, bscale, m_pad, ldc)   same for nmat matrices at once,
//                                             activations packed as AMX B tiles
// (kn: the call's copy of the run-time knobs, hy.h Knobs)
// and the macros HY_ISA_NAME and HY_HAS_AMX.
//
// Phases of one call (each a dynamic parallel-for; NUMA nodes run theirs concurrently on their pools):
//   0  prepare each token's row once: bf16, or int8 + scale + group sums            (node 0's pool)
//   P  AMX experts: pack their token rows into VNNI B tiles                          (node 0's pool)
//   1  (expert, 64-row block of F_n): gate and up GEMMs (+ biases), activation, h [m, F_n] (every node)
//   Q  int8/int4: quantize h rows; AMX experts: pack h into B tiles                 (every node)
//   2  32/64-row block of D: down GEMM of every expert (+ b_down, node 0), weighted scatter into acc_n [T, D]
//   3  out = sum over nodes of acc_n, converted to out's dtype (one node: done at the end of 2)
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include "hy.h"
#include "pool.h"

namespace {

// Symmetric per-token int8 quantization of n values (zero padded up to M.ldk) into an activation row for
// matrix M (hy.h act_stride): for int4 in M's stored order (hy.h i4_for_each_word), the group sums by natural group.
// max |v[i]| over n values (0 for n = 0; NaNs ignored, as std::max(a, NaN) = a). Written in vectors by hand:
// a running float max is a serial chain the compiler may not reorder without -ffast-math. Max is exact, so the
// lanes' order changes nothing.
inline float abs_max(const float* v, int n) {
  int i = 0;
  float amax = 0.f;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v + i)), m);  // NaN lane: keeps m
  amax = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), mag), m);  // NaN lane: keeps m
  alignas(32) float l[8];
  _mm256_store_ps(l, m);
  for (float x : l) amax = std::max(amax, x);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));
  return amax;
}

void quantize_row(const float* v, int n, const HyMat& M, uint8_t* row) {
  const int ldk = M.ldk, group = M.group;
  const bool reorder = M.dtype == HY_INT4 && !i4_natural(group, M.fold);
  const float amax = abs_max(v, n);
  float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
  int8_t nat[reorder ? ldk : 1];
  int8_t* q = reorder ? nat : (int8_t*)row;
  for (int i = 0; i < n; ++i) q[i] = (int8_t)std::nearbyint(std::min(127.f, std::max(-127.f, v[i] * inv)));
  std::memset(q + n, 0, ldk - n);
  std::memcpy(row + ldk, &scale, 4);
  int32_t* gs = (int32_t*)(row + ldk + 4);
  for (int g = 0; g < ldk / group; ++g) {
    int32_t s = 0;
    for (int i = g * group; i < (g + 1) * group; ++i) s += q[i];
    gs[g] = s;
  }
  if (reorder)
    i4_for_each_word(ldk, group, M.fold, [&](int P, int N) { std::memcpy(row + 4 * P, q + 4 * N, 4); });
}

// 16 tokens x 64 bytes of K -> one AMX B tile (16 rows of 64 bytes): B row kk holds, for each token n,
// the 4 bytes K[4kk..4kk+3] (two bf16 or four int8: the VNNI pairing of TDPBF16PS / TDPBSSD, Intel SDM
// vol. 2, "TDPBF16PS"). That is a 16x16 transpose of 32-bit words. Missing tokens are zero.
// The tiles are in natural K order: int4 rows (stored in M's order, quantize_row) are read back through the
// word map, as kern_amx.h unpacks the int4 weights to natural order.
void pack_b_block(const uint8_t* const* rows, int m, int tb, int kbytes, const HyMat& M, uint8_t* dst) {
  int nkc = kbytes / 64;
  const bool reorder = M.dtype == HY_INT4 && !i4_natural(M.group, M.fold);
  int stored[reorder ? nkc * 16 : 1];  // natural word -> stored word
  if (reorder) i4_for_each_word(M.ldk, M.group, M.fold, [&](int P, int N) { stored[N] = P; });
  for (int kc = 0; kc < nkc; ++kc) {
    uint32_t* tile = (uint32_t*)(dst + ((int64_t)tb * nkc + kc) * 1024);
    for (int n = 0; n < 16; ++n) {
      int t = tb * 16 + n;
      if (t < m && reorder) {
        for (int kk = 0; kk < 16; ++kk) std::memcpy(tile + kk * 16 + n, rows[t] + 4 * stored[kc * 16 + kk], 4);
      } else if (t < m) {
        const uint32_t* src = (const uint32_t*)(rows[t] + kc * 64);
        for (int kk = 0; kk < 16; ++kk) tile[kk * 16 + n] = src[kk];
      } else {
        for (int kk = 0; kk < 16; ++kk) tile[kk * 16 + n] = 0;
      }
    }
  }
}

// Where the fp32 per-token activation scales of an expert's packed B tiles start: after its tiles.
inline int64_t packed_scales_offset(int m, int kbytes) { return align_up(m, 32) * (int64_t)kbytes; }

// One 16-token block of an AMX expert's rows: B tiles (pack_b_block), then each padded token's activation
// scale (int8/int4 rows carry one after their ldk values; bf16 and padding get 0).
void pack_token_block(const uint8_t* const* rows, int m, int tb, int kbytes, const HyMat& M, bool quantized,
                      uint8_t* dst) {
  const int ldk = M.ldk;
  pack_b_block(rows, m, tb, kbytes, M, dst);
  float* sc = (float*)(dst + packed_scales_offset(m, kbytes));
  for (int n = tb * 16; n < tb * 16 + 16; ++n) sc[n] = (quantized && n < m) ? act_scale(rows[n], ldk) : 0.f;
}

struct Buf {
  uint8_t* p = nullptr;
  size_t cap = 0;
  template <class T> T* get(size_t count) {
    size_t need = std::max<size_t>(64, count * sizeof(T));
    if (need > cap) {
      std::free(p);
      cap = need + need / 4;
      if (posix_memalign((void**)&p, 64, cap)) { p = nullptr; cap = 0; }
    }
    return (T*)p;
  }
};

struct Workspace {
  Buf cnt, off, tok, wt, slot, xrows, xptr, act, xpack;
  Buf hrows[HY_MAX_NODES], hf[HY_MAX_NODES], hptr[HY_MAX_NODES], hpack[HY_MAX_NODES];
  Buf acc[HY_MAX_NODES], scratch[HY_MAX_NODES];
};

std::mutex g_job_mu;  // one layer call at a time per library; concurrent callers queue here

// Optional per-phase wall times (caller's view), for the benchmark: route, tokens, pack x, gate/up,
// quantize/pack h, down, reduce; slot 7 counts calls. Off unless hy_profile_enable(1).
bool g_prof_on = false;
double g_prof[8] = {0};
struct PhaseClock {
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void lap(int slot) {
    if (!g_prof_on) return;
    auto now = std::chrono::steady_clock::now();
    g_prof[slot] += std::chrono::duration<double>(now - t).count();
    t = now;
  }
};
Workspace* g_ws = nullptr;

// pack_rows: padded token rows of the AMX experts before this one; its packed activations start at
// pack_rows * (row bytes + 4) (tiles, then one fp32 scale per padded token).
struct Active { int e, m, off, amx; int64_t pack_rows; };

// Run one phase on every node's pool at once; a pool shared by two nodes (fake topologies) runs them
// one after the other.
template <class F>
void run_nodes(const HyLayer* L, F make, std::function<int(int)> ntasks) {
  Pool* started[HY_MAX_NODES];
  int ns = 0;
  for (int n = 0; n < L->n_nodes; ++n) {
    Pool* p = (Pool*)L->nodes[n].pool;
    int tasks = ntasks(n);
    if (tasks <= 0) continue;
    for (int i = 0; i < ns; ++i) if (started[i] == p) { p->finish(); started[i] = started[--ns]; break; }
    p->start(make(n), tasks, /*helps=*/false);
    started[ns++] = p;
  }
  // The caller works as participant 0 of node 0's pool (finished first, while the other nodes run);
  // on other nodes participant 0's cpu stays idle rather than have the caller read remote memory.
  Pool* p0 = (Pool*)L->nodes[0].pool;
  for (int i = 0; i < ns; ++i)
    if (started[i] == p0) { p0->caller_helps = true; p0->finish(); started[i] = started[--ns]; break; }
  for (int i = 0; i < ns; ++i) started[i]->finish();
}

// Rows r0..r0+nr of h = act(gate + b_gate) * (up + b_up) for expert e's m tokens (Cg, Cu: [m, 64] fp32 GEMM
// results; the biases only where the node has them): bf16 into the token rows hrow[i] (zeroing the padding
// after the last block), or fp32 into hf [m, F_n] for int8/int4, quantized once the whole row is known.
void store_h(const HyLayer* L, const HyNode& N, int e, const float* Cg, const float* Cu, int m, int r0, int nr,
             const uint8_t* const* hrow, float* hf) {
  const float* bg = N.gate.bias ? N.gate.bias + e * N.gate.b_estride + r0 : nullptr;
  const float* bu = N.up.bias ? N.up.bias + e * N.up.b_estride + r0 : nullptr;
  alignas(64) float gb[64], ub[64];
  for (int i = 0; i < m; ++i) {
    const float* g = Cg + i * 64;
    const float* u = Cu + i * 64;
    if (bg) { for (int r = 0; r < nr; ++r) gb[r] = g[r] + bg[r]; g = gb; }
    if (bu) { for (int r = 0; r < nr; ++r) ub[r] = u[r] + bu[r]; u = ub; }
    if (L->dtype == HY_BF16) {
      float v[64];
      gated_act_row(L->act, g, u, v, nr, L->alpha, L->limit);
      uint16_t* h = (uint16_t*)hrow[i] + r0;
      for (int r = 0; r < nr; ++r) h[r] = f32_to_bf16(v[r]);
      if (r0 + nr == N.gate.rows_p) std::memset(h + nr, 0, (N.down.ldk - N.gate.rows_p) * 2);
    } else {
      gated_act_row(L->act, g, u, hf + (int64_t)i * N.gate.rows_p + r0, nr, L->alpha, L->limit);
    }
  }
}

}  // namespace
#include "fused.h"
namespace {

int forward(const HyLayer* L, const void* x, int x_dtype, int T, int K, const int32_t* ids,
            const float* wts, const int32_t* lmap, int n_global, void* out, int out_dtype) {
  if (!L || L->n_nodes < 1 || L->n_nodes > HY_MAX_NODES || T < 0 || K < 1 || L->n_local < 0) return HY_EARG;
  if (T == 0) return HY_OK;
  const int dt = L->dtype, D = L->D, E = L->n_local;
  const HyMat& G0 = L->nodes[0].gate;
  for (int n = 0; n < L->n_nodes; ++n) {
    // a down of its own dtype only beside a quantized one (their activation rows are alike)
    if (L->nodes[n].down.dtype != dt && (dt == HY_BF16 || L->nodes[n].down.dtype == HY_BF16)) return HY_EARG;
    for (const HyMat* M : {&L->nodes[n].gate, &L->nodes[n].up, &L->nodes[n].down}) {
      // int4: the stored order the packer chose must be one the kernels read (hy.h)
      if (M->dtype == HY_INT4 && !i4_fold_ok(M->ldk, M->group, M->fold)) return HY_EARG;
      // q4_k, q5_k, iq4_xs: whole super-blocks, activation sums per sub-block
      if ((M->dtype == HY_Q4_K || M->dtype == HY_Q5_K || M->dtype == HY_IQ4_XS) && (M->ldk % 256 || M->group != 32))
        return HY_EARG;
      // q6_k, q2_k, q3_k, iq2_xxs, iq3_xxs, iq3_s, iq1_s, iq1_m: whole super-blocks
      if ((M->dtype == HY_Q6_K || M->dtype == HY_Q2_K || M->dtype == HY_Q3_K || M->dtype == HY_IQ2_XXS ||
           M->dtype == HY_IQ3_XXS || M->dtype == HY_IQ3_S || M->dtype == HY_IQ1_S || M->dtype == HY_IQ1_M) &&
          M->ldk % 256)
        return HY_EARG;
      // q4_0: whole 64-value chunks (two blocks a load), activation sums per block
      if (M->dtype == HY_Q4_0 && (M->ldk % 64 || M->group != 32)) return HY_EARG;
    }
  }
  const int Dk = G0.ldk;  // padded D, the reduction length of gate/up
  std::lock_guard<std::mutex> lk(g_job_mu);
  const Knobs kn = g_knobs;  // this call's knobs: hy_tune waits for the lock, so none changes mid-call
  if (!g_ws) g_ws = new Workspace();
  Workspace& W = *g_ws;
  PhaseClock clk;

  // Routing: counting sort of the (token, k) assignments by local expert, tokens in increasing order.
  int* cnt = W.cnt.get<int>(E + 1);
  std::fill(cnt, cnt + E + 1, 0);
  for (int64_t a = 0; a < (int64_t)T * K; ++a) {
    int id = ids[a];
    if (id < 0 || id >= n_global) return HY_EID;
    int l = lmap[id];
    if (l >= E) return HY_EARG;
    if (l >= 0) cnt[l]++;
  }
  int* off = W.off.get<int>(E + 1);
  off[0] = 0;
  for (int e = 0; e < E; ++e) off[e + 1] = off[e] + cnt[e];
  const int A = off[E];
  int* tok = W.tok.get<int>(A);
  float* wt = W.wt.get<float>(A);
  int* slot = W.slot.get<int>((size_t)T * K);  // [T, K] sorted index of each assignment, -1: not run here
  std::fill(cnt, cnt + E, 0);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      int l = lmap[ids[(int64_t)t * K + k]];
      slot[(int64_t)t * K + k] = -1;
      if (l < 0) continue;
      int i = off[l] + cnt[l]++;
      slot[(int64_t)t * K + k] = i;
      tok[i] = t;
      wt[i] = wts[(int64_t)t * K + k];
    }
  // Active experts, heaviest first so the dynamic task order balances (experts with no tokens: no work).
  Active* act = W.act.get<Active>(E);
  int na = 0, m_max = 0;
  int64_t pad_rows = 0;
  const int kb_x = dt == HY_BF16 ? Dk * 2 : Dk;  // bytes of one token row's K
  for (int e = 0; e < E; ++e) {
    int m = off[e + 1] - off[e];
    if (!m) continue;
    // No AMX kernel for mxfp4, q8_0, q4_0, the K-quants and the IQ formats, nor for int4 in groups of 32 (half a 64-value K tile), nor
    // for a layer whose down has a dtype of its own: the vector path.
    int amx = HY_HAS_AMX && dt != HY_MXFP4 && dt != HY_Q8_0 && dt != HY_Q4_K && dt != HY_Q5_K && dt != HY_Q6_K && dt != HY_Q2_K &&
              dt != HY_Q3_K && dt != HY_IQ4_XS && dt != HY_Q4_0 && dt != HY_IQ2_XXS && dt != HY_IQ1_S && dt != HY_IQ1_M &&
              dt != HY_IQ3_XXS && dt != HY_IQ3_S &&
              (dt != HY_INT4 || G0.group >= 64) &&
              L->nodes[0].down.dtype == dt && m >= L->knee;
    act[na++] = {e, m, off[e], amx, 0};
    m_max = std::max(m_max, m);
  }
  std::sort(act, act + na, [](const Active& a, const Active& b) { return a.m > b.m; });
  for (int j = 0; j < na; ++j)
    if (act[j].amx) { act[j].pack_rows = pad_rows; pad_rows += align_up(act[j].m, 32); }
  const int m_max_pad = (int)align_up(std::max(m_max, 1), 32);

  clk.lap(0);
  // Phase 0: token rows. bf16 tokens whose width needs no padding are used in place (no copy).
  const bool x_in_place = dt == HY_BF16 && x_dtype == HY_X_BF16 && D == Dk;
  const int64_t xs = x_in_place ? (int64_t)D * 2 : act_stride(dt, Dk, G0.group);
  uint8_t* xrows = x_in_place ? (uint8_t*)x : W.xrows.get<uint8_t>((size_t)T * xs);
  if (!xrows) return HY_ENOMEM;
  auto prep_token = [&](int t) {  // token t's row: bf16 (converted, zero padded), or int8 + scale + group sums
    uint8_t* row = xrows + t * xs;
    if (dt == HY_BF16) {
      uint16_t* r = (uint16_t*)row;
      if (x_dtype == HY_X_BF16) std::memcpy(r, (const uint16_t*)x + (int64_t)t * D, D * 2);
      else for (int d = 0; d < D; ++d) r[d] = f32_to_bf16(((const float*)x)[(int64_t)t * D + d]);
      std::memset(r + D, 0, (Dk - D) * 2);
    } else {
      float tmp[D];
      if (x_dtype == HY_X_BF16) for (int d = 0; d < D; ++d) tmp[d] = bf16_to_f32(((const uint16_t*)x)[(int64_t)t * D + d]);
      else std::memcpy(tmp, (const float*)x + (int64_t)t * D, D * 4);
      quantize_row(tmp, D, G0, row);
    }
  };
  const uint8_t** xptr = W.xptr.get<const uint8_t*>(A);
  for (int i = 0; i < A; ++i) xptr[i] = xrows + tok[i] * xs;
  Pool* p0 = (Pool*)L->nodes[0].pool;
  const int per = 8;  // tokens per preparation task
  if (!x_in_place)
    p0->run([&](int task, int) { for (int t = task * per; t < std::min(T, task * per + per); ++t) prep_token(t); },
            (T + per - 1) / per);
  clk.lap(1);
  // Decode-sized calls without AMX experts: one barrier-free phase (fused.h). Its [A, D] fp32 expert
  // outputs are bounded (64 MiB) so that big vector-path prefills keep the phased path's [T, D] accumulator.
  const bool fused = kn.fused && pad_rows == 0 && na > 0 && (int64_t)A * L->nodes[0].down.rows_p <= (16 << 20);
  if (fused) {
    int rc = forward_fused(kn, L, W, act, na, A, xptr, wt, slot, T, K, out, out_dtype, m_max_pad);
    clk.lap(3);  // the profile counts the whole fused phase (down included) as gate_up
    if (g_prof_on) g_prof[7] += 1;
    return rc;
  }

  // Phase P: pack AMX experts' token rows.
  uint8_t* xpack = W.xpack.get<uint8_t>(pad_rows * (kb_x + 4));
  int np = 0;
  int* ptask = W.cnt.get<int>(E + 1);  // reuse: prefix of pack tasks per active expert
  for (int j = 0; j < na; ++j) { ptask[j] = np; if (act[j].amx) np += align_up(act[j].m, 32) / 16; }
  ptask[na] = np;
  auto find_j = [&](int task) { return int(std::upper_bound(ptask, ptask + na + 1, task) - ptask) - 1; };
  p0->run([&](int task, int) {
    int j = find_j(task), tb = task - ptask[j];
    const Active& a = act[j];
    pack_token_block(xptr + a.off, a.m, tb, kb_x, G0, dt != HY_BF16, xpack + a.pack_rows * (kb_x + 4));
  }, np);

  clk.lap(2);
  // Per node buffers.
  const int nn = L->n_nodes;
  int64_t hs[HY_MAX_NODES];
  uint8_t* hrows[HY_MAX_NODES];
  float* hf[HY_MAX_NODES];
  const uint8_t** hptr[HY_MAX_NODES];
  uint8_t* hpack[HY_MAX_NODES];
  float* acc[HY_MAX_NODES];
  float* scratch[HY_MAX_NODES];
  int kb_h[HY_MAX_NODES];  // bytes of one packed h row (down's K) per node
  int64_t scr_per = (int64_t)m_max_pad * 64 * 2;
  for (int n = 0; n < nn; ++n) {
    const HyNode& N = L->nodes[n];
    hs[n] = act_stride(dt, N.down.ldk, N.down.group);
    hrows[n] = W.hrows[n].get<uint8_t>((size_t)A * hs[n]);
    hf[n] = dt == HY_BF16 ? nullptr : W.hf[n].get<float>((size_t)A * N.gate.rows_p);
    hptr[n] = W.hptr[n].get<const uint8_t*>(A);
    for (int i = 0; i < A; ++i) hptr[n][i] = hrows[n] + i * hs[n];
    kb_h[n] = dt == HY_BF16 ? N.down.ldk * 2 : N.down.ldk;
    hpack[n] = W.hpack[n].get<uint8_t>(pad_rows * (kb_h[n] + 4));
    acc[n] = W.acc[n].get<float>((size_t)T * N.down.rows_p);
    scratch[n] = W.scratch[n].get<float>((size_t)((Pool*)N.pool)->n * scr_per);
  }
  auto hpack_off = [&](int n, const Active& a) { return a.pack_rows * (kb_h[n] + 4); };

  // Phase 1: gate, up, activation.
  run_nodes(L, [&](int n) {
    return std::function<void(int, int)>([&, n](int task, int tid) {
      const HyNode& N = L->nodes[n];
      int nblk = (N.gate.rows_p + 63) / 64;
      const Active& a = act[task / nblk];
      int r0 = task % nblk * 64, nr = std::min(64, N.gate.rows_p - r0);
      float* Cg = scratch[n] + tid * scr_per;
      float* Cu = Cg + (int64_t)m_max_pad * 64;
      if (a.amx) {
#if HY_HAS_AMX
        const uint8_t* bp = xpack + a.pack_rows * (kb_x + 4);
        const float* bs = (const float*)(bp + packed_scales_offset(a.m, kb_x));
        const HyMat* ms[2] = {&N.gate, &N.up};
        float* cs[2] = {Cg, Cu};
        amx_gemm(kn, ms, cs, 2, a.e, r0, nr, bp, bs, (int)align_up(a.m, 32), 64);
#endif
      } else {
        vec_gemm(kn, N.gate, a.e, r0, nr, xptr + a.off, a.m, Cg, 64);
        vec_gemm(kn, N.up, a.e, r0, nr, xptr + a.off, a.m, Cu, 64);
      }
      store_h(L, N, a.e, Cg, Cu, a.m, r0, nr, hptr[n] + a.off, hf[n] ? hf[n] + (int64_t)a.off * N.gate.rows_p : nullptr);
    });
  }, [&](int n) { return na * ((L->nodes[n].gate.rows_p + 63) / 64); });

  clk.lap(3);
  // Phase Q: quantize h (int8/int4), pack h for AMX experts. Tasks: (active expert, 16-token block).
  int qt = 0;
  int* qtask = W.cnt.get<int>(E + 1);
  for (int j = 0; j < na; ++j) {
    qtask[j] = qt;
    if (dt != HY_BF16 || act[j].amx) qt += (int)(act[j].amx ? align_up(act[j].m, 32) / 16 : (act[j].m + 15) / 16);
  }
  qtask[na] = qt;
  run_nodes(L, [&](int n) {
    return std::function<void(int, int)>([&, n](int task, int) {
      const HyNode& N = L->nodes[n];
      int j = int(std::upper_bound(qtask, qtask + na + 1, task) - qtask) - 1, tb = task - qtask[j];
      const Active& a = act[j];
      if (dt != HY_BF16)
        for (int i = tb * 16; i < std::min(a.m, tb * 16 + 16); ++i)
          quantize_row(hf[n] + (int64_t)(a.off + i) * N.gate.rows_p, N.gate.rows_p, N.down, hrows[n] + (a.off + i) * hs[n]);
      if (a.amx)
        pack_token_block(hptr[n] + a.off, a.m, tb, kb_h[n], N.down, dt != HY_BF16, hpack[n] + hpack_off(n, a));
    });
  }, [&](int) { return qt; });

  clk.lap(4);
  // Phase 2: down projection; a task owns a block of D rows for every token, so no two tasks write
  // the same acc element. Smaller blocks when D gives too few tasks for the pool.
  // AMX tasks re-read every expert's packed h (from L3) per task: 128-row tasks halve that traffic against
  // 64-row ones. The vector path (decode) streams weights only and balances better with 32-row tasks (shorter tail).
  bool any_amx = false;
  for (int j = 0; j < na; ++j) any_amx |= act[j].amx != 0;
  int rbd[HY_MAX_NODES];
  for (int n = 0; n < nn; ++n) {
    const int rows = L->nodes[n].down.rows_p, thr = ((Pool*)L->nodes[n].pool)->n;
    rbd[n] = !any_amx ? 32 : rows / 128 >= thr ? 128 : rows / 64 >= thr ? 64 : 32;
  }
  // Token t's final values of columns [d0, d0 + nd) (s: fp32) -> out, in out's dtype.
  auto store_row = [&](const float* s, int t, int d0, int nd) {
    if (out_dtype == HY_X_BF16) {
      uint16_t* o = (uint16_t*)out + (int64_t)t * D + d0;
      for (int d = 0; d < nd; ++d) o[d] = f32_to_bf16(s[d]);
    } else {
      std::memcpy((float*)out + (int64_t)t * D + d0, s, nd * 4);
    }
  };
  // Final values of columns [d0, d0 + nd) for every token (src: [T, ld] fp32) -> out, in out's dtype.
  auto write_out = [&](const float* src, int64_t ld, int d0, int nd) {
    if (nd <= 0) return;
    for (int t = 0; t < T; ++t) store_row(src + (int64_t)t * ld, t, d0, nd);
  };
  run_nodes(L, [&](int n) {
    return std::function<void(int, int)>([&, n](int task, int tid) {
      const HyNode& N = L->nodes[n];
      int r0 = task * rbd[n], nr = std::min(rbd[n], N.down.rows_p - r0);
      const int ldacc = N.down.rows_p;
      for (int t = 0; t < T; ++t) std::memset(acc[n] + (int64_t)t * ldacc + r0, 0, nr * 4);
      float* C = scratch[n] + tid * scr_per;  // [m_pad, ldc]; scr_per = m_max_pad * 128 floats
      const int ldc = rbd[n];
      for (int j = 0; j < na; ++j) {
        const Active& a = act[j];
        if (a.amx) {
#if HY_HAS_AMX
          const uint8_t* bp = hpack[n] + hpack_off(n, a);
          const HyMat* ms[1] = {&N.down};
          float* cs[1] = {C};
          amx_gemm(kn, ms, cs, 1, a.e, r0, nr, bp, (const float*)(bp + packed_scales_offset(a.m, kb_h[n])),
                   (int)align_up(a.m, 32), ldc);
#endif
        } else {
          vec_gemm(kn, N.down, a.e, r0, nr, hptr[n] + a.off, a.m, C, ldc);
        }
        const float* bd = N.down.bias ? N.down.bias + a.e * N.down.b_estride + r0 : nullptr;  // node 0 only
        for (int i = 0; i < a.m; ++i) {
          float w = wt[a.off + i];
          float* dst = acc[n] + (int64_t)tok[a.off + i] * ldacc + r0;
          const float* c = C + (int64_t)i * ldc;
          if (bd) for (int r = 0; r < nr; ++r) dst[r] += w * (c[r] + bd[r]);  // out += w * (W_down h + b_down)
          else for (int r = 0; r < nr; ++r) dst[r] += w * c[r];
        }
      }
      if (nn == 1) write_out(acc[0] + r0, ldacc, r0, std::min(nr, D - r0));  // block still in cache
    });
  }, [&](int n) { return (L->nodes[n].down.rows_p + rbd[n] - 1) / rbd[n]; });

  clk.lap(5);
  // Phase 3 (several nodes only; one node wrote out in phase 2): sum node partials, convert.
  if (nn > 1) p0->run([&](int task, int) {
    for (int t = task * 8; t < std::min(T, task * 8 + 8); ++t) {
      float sum[D];
      const float* s0 = acc[0] + (int64_t)t * L->nodes[0].down.rows_p;
      for (int d = 0; d < D; ++d) sum[d] = s0[d];
      for (int n = 1; n < nn; ++n) {
        const float* sn = acc[n] + (int64_t)t * L->nodes[n].down.rows_p;
        for (int d = 0; d < D; ++d) sum[d] += sn[d];
      }
      store_row(sum, t, 0, D);
    }
  }, (T + 7) / 8);
  clk.lap(6);
  if (g_prof_on) g_prof[7] += 1;
  return HY_OK;
}

}  // namespace
