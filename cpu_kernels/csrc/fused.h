// The decode path of a layer call (every active expert below the AMX knee): one dynamic parallel-for per
// node with no barrier inside. Included by driver.h (it uses its Workspace, Active and run_nodes).
//
// Tasks of one node, in this order (experts heaviest first, as act[] is sorted):
//   [0, na * nbu)            (expert j, rbu-row block of F_n): gate and up GEMMs, activation -> h rows
//   [.., + na * nbd)         (expert j, rbd-row block of D):  down GEMM (+ b_down, node 0) -> Y[j's rows, block], fp32
// The caller wrote every token row before the phase. A down task of expert j waits until j's gate/up blocks are all
// done; the thread that finishes j's last gate/up block also quantizes j's h rows (int8/int4) before it
// publishes them. Tasks are taken in index order, so every task waited for is already running when its waiter
// is taken: a waiting thread waits only for work in flight, never for work nobody has taken (no deadlock, no
// idle barrier).
// The thread that finishes the last (node, expert) of a D block writes that block's final values:
// out[t, block] = sum over t's assignments i of wt[i] * Y[i, block] (summed over nodes too), so every
// expert's output is written once, contiguously, and the weighted sum is one pass per token.
// Why: with a barrier between gate/up and down, and down tasks that scatter-add every expert into one [T, D]
// accumulator, the down phase streamed its weights far below the rate gate/up reached.
//
// Task sizes (hy.h Knobs): a task covers at most task_rows rows of one expert's matrix (gate/up run it 64 rows, the
// scratch width, at a time), shrunk while the phase would give fewer than task_min tasks per thread. The last down
// tasks, one per thread, are cut into tail_split parts of 16-row multiples (so the results stay bit-identical), so
// that the threads finish nearer together: with whole tasks a call ends about half a task after the mean thread.
#pragma once
#include <atomic>

namespace {

// Largest row block (a multiple of 4 rows, the vector kernels' block, at most max_rb) that still gives the
// pool at least task_min tasks per thread for this phase, so the dynamic tail stays short.
inline int fused_block(int rows_p, int na, int threads, int max_rb, int task_min) {
  int rb = max_rb;
  while (rb > 16 && (int64_t)na * ((rows_p + rb - 1) / rb) < task_min * (int64_t)threads) rb /= 2;
  return rb;
}

struct alignas(64) PaddedFlag { std::atomic<int> v{0}; };

// Per-call synchronisation state, reused across calls (sized by the call).
struct FusedSync {
  std::vector<PaddedFlag> gu_done, ready, blk_done;  // [node * na + j] x 2, [D block]
  void reset(size_t n_exp, size_t n_blk) {
    if (gu_done.size() < n_exp) { gu_done = std::vector<PaddedFlag>(n_exp); ready = std::vector<PaddedFlag>(n_exp); }
    if (blk_done.size() < n_blk) blk_done = std::vector<PaddedFlag>(n_blk);
    for (size_t i = 0; i < n_exp; ++i) { gu_done[i].v.store(0, std::memory_order_relaxed); ready[i].v.store(0, std::memory_order_relaxed); }
    for (size_t i = 0; i < n_blk; ++i) blk_done[i].v.store(0, std::memory_order_relaxed);
  }
};
FusedSync* g_fsync = nullptr;

// slot[t * K + k]: the sorted assignment index of token t's k-th expert, or -1 if it is not run here.
// Returns HY_OK, or HY_ENOMEM when a buffer could not be allocated.
int forward_fused(const Knobs& kn, const HyLayer* L, Workspace& W, const Active* act, int na, int A,
                  const uint8_t* const* xptr, const float* wt, const int* slot, int T, int K, void* out, int out_dtype,
                  int m_max_pad) {
  const int dt = L->dtype, D = L->D, nn = L->n_nodes;
  if (!g_fsync) g_fsync = new FusedSync();
  int64_t hs[HY_MAX_NODES];
  uint8_t* hrows[HY_MAX_NODES];
  float* hf[HY_MAX_NODES];
  const uint8_t** hptr[HY_MAX_NODES];
  float* Y[HY_MAX_NODES];
  float* scratch[HY_MAX_NODES];
  int rbu[HY_MAX_NODES], nbu[HY_MAX_NODES];
  const int Dp = L->nodes[0].down.rows_p;  // D padded; the same on every node
  const int64_t scr_per = (int64_t)m_max_pad * 64 * 2;
  int max_threads = 1;
  for (int n = 0; n < nn; ++n) max_threads = std::max(max_threads, ((Pool*)L->nodes[n].pool)->n);
  const int rbd = fused_block(Dp, na, max_threads, kn.task_rows, kn.task_min), nbd = (Dp + rbd - 1) / rbd;
  const int ts = kn.tail_split;  // parts of each tail task (1: none cut)
  int dwhole[HY_MAX_NODES], dtail[HY_MAX_NODES];  // per node: down tasks kept whole, then tail tasks cut in ts parts
  for (int n = 0; n < nn; ++n) {
    const HyNode& N = L->nodes[n];
    const int thr = ((Pool*)N.pool)->n;
    hs[n] = act_stride(dt, N.down.ldk, N.down.group);
    hrows[n] = W.hrows[n].get<uint8_t>((size_t)A * hs[n]);
    hf[n] = dt == HY_BF16 ? nullptr : W.hf[n].get<float>((size_t)A * N.gate.rows_p);
    hptr[n] = W.hptr[n].get<const uint8_t*>(A);
    Y[n] = W.acc[n].get<float>((size_t)A * Dp);
    scratch[n] = W.scratch[n].get<float>((size_t)thr * scr_per);
    if (!hrows[n] || (dt != HY_BF16 && !hf[n]) || !hptr[n] || !Y[n] || !scratch[n]) return HY_ENOMEM;
    for (int i = 0; i < A; ++i) hptr[n][i] = hrows[n] + i * hs[n];
    rbu[n] = fused_block(N.gate.rows_p, na, thr, kn.task_rows, kn.task_min);
    nbu[n] = (N.gate.rows_p + rbu[n] - 1) / rbu[n];
    dtail[n] = ts > 1 ? std::min(na * nbd, thr) : 0;
    dwhole[n] = na * nbd - dtail[n];
  }
  FusedSync& S = *g_fsync;
  S.reset((size_t)nn * na, (size_t)nbd);

  auto store_block = [&](int t, int d0, int nd, const float* s) {
    if (out_dtype == HY_X_BF16) {
      uint16_t* o = (uint16_t*)out + (int64_t)t * D + d0;
      for (int d = 0; d < nd; ++d) o[d] = f32_to_bf16(s[d]);
    } else {
      std::memcpy((float*)out + (int64_t)t * D + d0, s, nd * 4);
    }
  };
  // Block b's final values for every token (the caller finished the last contribution to b).
  auto reduce_block = [&](int b) {
    const int d0 = b * rbd, nd = std::min(rbd, D - d0);
    if (nd <= 0) return;
    alignas(64) float s[HY_MAX_TASK_ROWS];  // rbd <= task_rows
    for (int t = 0; t < T; ++t) {
      std::memset(s, 0, nd * sizeof(float));
      for (int k = 0; k < K; ++k) {
        const int i = slot[(int64_t)t * K + k];
        if (i < 0) continue;
        const float w = wt[i];
        for (int n = 0; n < nn; ++n) {
          const float* y = Y[n] + (int64_t)i * Dp + d0;
          for (int d = 0; d < nd; ++d) s[d] += w * y[d];
        }
      }
      store_block(t, d0, nd, s);
    }
  };

  run_nodes(L, [&](int n) {
    return std::function<void(int, int)>([&, n](int task, int tid) {
      const HyNode& N = L->nodes[n];
      const int gu_tasks = na * nbu[n];
      if (task < gu_tasks) {
        const int j = task / nbu[n], r0 = task % nbu[n] * rbu[n], nr = std::min(rbu[n], N.gate.rows_p - r0);
        const Active& a = act[j];
        float* Cg = scratch[n] + tid * scr_per;
        float* Cu = Cg + (int64_t)m_max_pad * 64;
        for (int s0 = r0; s0 < r0 + nr; s0 += 64) {  // 64 rows at a time: the scratch width
          const int ns = std::min(64, r0 + nr - s0);
          vec_gemm(kn, N.gate, a.e, s0, ns, xptr + a.off, a.m, Cg, 64);
          vec_gemm(kn, N.up, a.e, s0, ns, xptr + a.off, a.m, Cu, 64);
          store_h(L, N, a.e, Cg, Cu, a.m, s0, ns, hptr[n] + a.off, hf[n] ? hf[n] + (int64_t)a.off * N.gate.rows_p : nullptr);
        }
        const int x = n * na + j;
        if (S.gu_done[x].v.fetch_add(1, std::memory_order_acq_rel) + 1 == nbu[n]) {  // j's h is complete
          if (dt != HY_BF16)
            for (int i = 0; i < a.m; ++i)
              quantize_row(hf[n] + (int64_t)(a.off + i) * N.gate.rows_p, N.gate.rows_p, N.down, hrows[n] + (a.off + i) * hs[n]);
          S.ready[x].v.store(1, std::memory_order_release);
        }
        return;
      }
      // down task: (expert j, block b) whole, or one of ts parts of it in the tail; a whole task counts ts parts
      int dtask = task - gu_tasks, part = -1;
      if (dtask >= dwhole[n]) {
        part = (dtask - dwhole[n]) % ts;
        dtask = dwhole[n] + (dtask - dwhole[n]) / ts;
      }
      const int j = dtask / nbd, b = dtask % nbd, counted = part < 0 ? ts : 1;
      int r0 = b * rbd, nr = std::min(rbd, Dp - r0);
      if (part >= 0) {
        const int step = (nr + ts * 16 - 1) / (ts * 16) * 16;
        r0 += part * step;
        nr = std::min(step, b * rbd + nr - r0);
      }
      if (nr > 0) {  // an empty last part adds nothing, but it still counts below
        const Active& a = act[j];
        const int x = n * na + j;
        while (!S.ready[x].v.load(std::memory_order_acquire)) _mm_pause();
        float* y = Y[n] + (int64_t)a.off * Dp + r0;
        vec_gemm(kn, N.down, a.e, r0, nr, hptr[n] + a.off, a.m, y, Dp);
        if (N.down.bias) {  // Y = W_down h + b_down (node 0 only: the node sum in reduce_block adds it once)
          const float* bd = N.down.bias + a.e * N.down.b_estride + r0;
          for (int i = 0; i < a.m; ++i)
            for (int r = 0; r < nr; ++r) y[(int64_t)i * Dp + r] += bd[r];
        }
      }
      if (S.blk_done[b].v.fetch_add(counted, std::memory_order_acq_rel) + counted == na * nn * ts) reduce_block(b);
    });
  }, [&](int n) { return na * nbu[n] + dwhole[n] + dtail[n] * ts; });
  return HY_OK;
}

}  // namespace
