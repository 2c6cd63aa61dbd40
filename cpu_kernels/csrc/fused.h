// The decode path of a layer call (every active expert below the AMX knee): one dynamic parallel-for per
// node with no barrier inside. Included by driver.h (it uses its Workspace, Active and run_nodes).
//
// Tasks of one node, in this order (experts heaviest first, as act[] is sorted):
//   [0, np)                  one node only, with FusedPrep tasks: the token rows (prep.fn: bf16 copy or int8 quantize)
//   [np, + na * nbu)         (expert j, rbu-row block of F_n): gate and up GEMMs, activation -> h rows
//   [.., + na * nbd)         (expert j, rbd-row block of D):  down GEMM (+ b_down, node 0) -> Y[j's rows, block], fp32
// A gate/up task of expert j waits (spins) until j's token rows are written (with FusedPrep tasks; else the
// caller wrote them all before the phase). A down task of expert j waits until j's gate/up blocks are all
// done; the thread that finishes j's last gate/up block also quantizes j's h rows (int8/int4) before it
// publishes them. Tasks are taken in index order, so every task waited for is already running when its waiter
// is taken: a waiting thread waits only for work in flight, never for work nobody has taken (no deadlock, no
// idle barrier).
// The thread that finishes the last (node, expert) of a D block writes that block's final values:
// out[t, block] = sum over t's assignments i of wt[i] * Y[i, block] (summed over nodes too), so every
// expert's output is written once, contiguously, and the weighted sum is one pass per token.
// Measured motive (issue 12): with a barrier between gate/up and down and down tasks that scatter-add every
// expert into one [T, D] accumulator, the GPU box's down phase streamed at 37-54% of DRAM at 4 tokens per
// expert while gate/up reached 78-99%.
#pragma once
#include <atomic>

namespace {

int g_fused = 1;  // 0: decode calls take the phased path (benchmark comparisons; hy_tune("fused", 0))
// 1: the token rows are the fused phase's first tasks; 0 (default): the caller's phase 0 (hy_tune("fused_prep")).
// Off by default: on the GPU box (run 20 call 1, BENCHMARKS.md session 25) it was 2-4% slower for int4 alone and
// end to end at batch 1, level at batch 8 (+0.9%), once the rows' abs max was vectorized (driver.h).
int g_fused_prep = 0;

// The token rows' preparation as tasks of the fused phase: `tasks` tasks (0: the rows are already written),
// task i writing its tokens' rows with fn(i); tok[a]: the token of sorted assignment a, whose row a gate/up task waits for.
struct FusedPrep {
  int tasks;
  const int* tok;
  std::function<void(int)> fn;
  int per;  // tokens per task: task i writes tokens [i * per, (i + 1) * per)
};
// Decode task size: at most g_task_rows rows of one expert's matrix (gate/up run it 64 rows, the scratch width,
// at a time), shrunk while the phase would give fewer than g_task_min tasks per thread (hy_tune knobs).
// Every task starts new weight streams that the prefetchers have not seen, so fewer, longer tasks read
// faster, as long as the dynamic tail stays short. Issue 12 run 11 (GPU box, 15 threads, pool past the LLC, 4 KiB pages,
// bench.decode_probe), 64 rows / >= 6 per thread -> 256 / >= 2: 8 experts x 1 token int8 83 -> 90% of DRAM,
// int4 72 -> 82%; 8 tokens x 8 experts each int8 88 -> 95%, int4 78 -> 85%; bf16 80 -> 83%, 82 -> 87%.
constexpr int HY_MAX_TASK_ROWS = 512;  // hy_tune("task_rows") clamps to it
int g_task_rows = 256;
int g_task_min = 2;
// 1: task_rows counts bf16 rows' bytes, so an int8 task holds 2x and an int4/mxfp4 one 4x the rows (at most
// HY_MAX_BLOCK_ROWS) and every dtype's task reads the same weight bytes; 0: the same rows for every dtype
// (hy_tune("byte_tasks")). Motive: a task's fixed cost (new streams, its first block, its flags) is the same for
// every dtype, and with equal rows an int4 task streams a quarter of a bf16 one's bytes.
constexpr int HY_MAX_BLOCK_ROWS = 2048;  // reduce_block's buffer holds it
int g_byte_tasks = 0;

// 2..8: the last down tasks of a call, one per pool thread, are cut into this many parts (16-row multiples, so the
// results stay bit-identical), so that the threads finish nearer together: with whole tasks the call ends about half
// a task after the mean thread does (a 256-row int8 30B down task reads 196 KB, ~20 us at a fifteenth of the GPU
// box's ~140 GB/s; bf16 twice that). 1: every task whole
// (hy_tune("tail_split"); default 4). Motive: bench.decode_probe --fit on the GPU box (issue 12 run 22) put a fixed
// ~25 us on every decode call beside a 98-99% stream rate. Issue 12 run 23 (GPU box, 30B expert, 15 threads, pool
// past the LLC, medians of interleaved rounds; BENCHMARKS.md session 28): 4 parts against whole tasks, call 2 (5
// rounds) bf16 8 x 1 +2.9%, int8 8 x 4 +3.9%, int8 8 x 1 +1.5%, bf16 8 x 4 +0.4%; the --fit's fixed cost 37.4 -> 34.2
// us (bf16) and 21.0 -> 18.7 us (int8). Call 1's slower, noisier host (3 rounds): int8 and int4 0..+3%, bf16 -3%
// at 1 token and +8% at 4.
constexpr int HY_MAX_TAIL_SPLIT = 8;
int g_tail_split = 4;

// The row cap of one decode task over matrix M (task_rows, scaled by g_byte_tasks).
inline int task_rows_for(const HyMat& M) {
  if (!g_byte_tasks) return g_task_rows;
  const int widen = M.dtype == HY_BF16 ? 1 : M.dtype == HY_INT8 ? 2 : 4;
  return std::min(HY_MAX_BLOCK_ROWS, g_task_rows * widen);
}

// Largest row block (a multiple of 4 rows, the vector kernels' block, at most max_rb) that still gives the
// pool at least g_task_min tasks per thread for this phase, so the dynamic tail stays short.
inline int fused_block(int rows_p, int na, int threads, int max_rb) {
  int rb = max_rb;
  while (rb > 16 && (int64_t)na * ((rows_p + rb - 1) / rb) < g_task_min * (int64_t)threads) rb /= 2;
  return rb;
}

struct alignas(64) PaddedFlag { std::atomic<int> v{0}; };

// Per-call synchronisation state, reused across calls (sized by the call).
struct FusedSync {
  std::vector<PaddedFlag> gu_done, ready, blk_done, tok_ready;  // [node * na + j] x 2, [D block], [prep task]
  void reset(size_t n_exp, size_t n_blk, size_t n_prep) {
    if (gu_done.size() < n_exp) { gu_done = std::vector<PaddedFlag>(n_exp); ready = std::vector<PaddedFlag>(n_exp); }
    if (blk_done.size() < n_blk) blk_done = std::vector<PaddedFlag>(n_blk);
    if (tok_ready.size() < n_prep) tok_ready = std::vector<PaddedFlag>(n_prep);
    for (size_t i = 0; i < n_exp; ++i) { gu_done[i].v.store(0, std::memory_order_relaxed); ready[i].v.store(0, std::memory_order_relaxed); }
    for (size_t i = 0; i < n_blk; ++i) blk_done[i].v.store(0, std::memory_order_relaxed);
    for (size_t i = 0; i < n_prep; ++i) tok_ready[i].v.store(0, std::memory_order_relaxed);
  }
};
FusedSync* g_fsync = nullptr;

// slot[t * K + k]: the sorted assignment index of token t's k-th expert, or -1 if it is not run here.
// Returns HY_OK, or HY_ENOMEM when a buffer could not be allocated.
int forward_fused(const HyLayer* L, Workspace& W, const Active* act, int na, int A, const uint8_t* const* xptr,
                  const float* wt, const int* slot, int T, int K, void* out, int out_dtype, int m_max_pad,
                  const FusedPrep& prep) {
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
  const int rbd = fused_block(Dp, na, max_threads, task_rows_for(L->nodes[0].down)), nbd = (Dp + rbd - 1) / rbd;
  const int ts = g_tail_split;  // parts of each tail task (1: none cut)
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
    rbu[n] = fused_block(N.gate.rows_p, na, thr, task_rows_for(N.gate));
    nbu[n] = (N.gate.rows_p + rbu[n] - 1) / rbu[n];
    dtail[n] = ts > 1 ? std::min(na * nbd, thr) : 0;
    dwhole[n] = na * nbd - dtail[n];
  }
  FusedSync& S = *g_fsync;
  S.reset((size_t)nn * na, (size_t)nbd, (size_t)prep.tasks);

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
    alignas(64) float s[HY_MAX_BLOCK_ROWS];  // rbd <= task_rows_for(down)
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
      const int np = n == 0 ? prep.tasks : 0;
      if (task < np) {
        prep.fn(task);
        S.tok_ready[task].v.store(1, std::memory_order_release);
        return;
      }
      task -= np;
      const int gu_tasks = na * nbu[n];
      if (task < gu_tasks) {
        const int j = task / nbu[n], r0 = task % nbu[n] * rbu[n], nr = std::min(rbu[n], N.gate.rows_p - r0);
        const Active& a = act[j];
        if (prep.tasks)  // j's token rows (prep tasks are taken first, so each wait is for work in flight)
          for (int i = a.off; i < a.off + a.m; ++i)
            while (!S.tok_ready[prep.tok[i] / prep.per].v.load(std::memory_order_acquire)) _mm_pause();
        float* Cg = scratch[n] + tid * scr_per;
        float* Cu = Cg + (int64_t)m_max_pad * 64;
        for (int s0 = r0; s0 < r0 + nr; s0 += 64) {  // 64 rows at a time: the scratch width
          const int ns = std::min(64, r0 + nr - s0);
          vec_gemm(N.gate, a.e, s0, ns, xptr + a.off, a.m, Cg, 64);
          vec_gemm(N.up, a.e, s0, ns, xptr + a.off, a.m, Cu, 64);
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
        vec_gemm(N.down, a.e, r0, nr, hptr[n] + a.off, a.m, y, Dp);
        if (N.down.bias) {  // Y = W_down h + b_down (node 0 only: the node sum in reduce_block adds it once)
          const float* bd = N.down.bias + a.e * N.down.b_estride + r0;
          for (int i = 0; i < a.m; ++i)
            for (int r = 0; r < nr; ++r) y[(int64_t)i * Dp + r] += bd[r];
        }
      }
      if (S.blk_done[b].v.fetch_add(counted, std::memory_order_acq_rel) + counted == na * nn * ts) reduce_block(b);
    });
  }, [&](int n) { return (n == 0 ? prep.tasks : 0) + na * nbu[n] + dwhole[n] + dtail[n] * ts; });
  return HY_OK;
}

}  // namespace
