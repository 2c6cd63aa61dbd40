// The C ABI each ISA library exports (mirrored by cpu_kernels/_native.py): pools, the layer call,
// the streaming-read probe, the run-time knobs and the packer (pack.h). Included after driver.h.
#pragma once
#include "driver.h"
#include "lane.h"
#include "pack.h"  // hy_pack_mat: checkpoint experts -> packed rows

HY_API const char* hy_isa() { return HY_ISA_NAME; }

HY_API void hy_profile_enable(int on) { g_prof_on = on != 0; }

// The expert kernels' gated activation (hy.h gated_act_row: fast_exp / fast_erf) over n values, so the tests can
// hold its accuracy to torch's in fp32, which the quantized layer outputs would mask.
HY_API void hy_gated_act(int act, const float* g, const float* u, float* out, int n, float alpha, float limit) {
  gated_act_row(act, g, u, out, n, alpha, limit);
}

// One token's activation row as the int8/int4/mxfp4 kernels read it (driver.h quantize_row: n values zero padded to
// ldk, int8, then the fp32 scale and the int32 group sums; int4 in the stored order of `fold`), so the tests can
// hold it byte for byte to cpu_kernels.reference.activation_row. row: act_stride(dtype, ldk, group) bytes.
HY_API int hy_quantize_act(const float* v, int n, int dtype, int ldk, int group, int fold, uint8_t* row) {
  if (dtype == HY_BF16 || n < 0 || n > ldk || group <= 0 || ldk % group || (dtype == HY_INT4 && !i4_fold_ok(ldk, group, fold)))
    return HY_EARG;
  HyMat M{};
  M.dtype = dtype; M.ldk = ldk; M.group = group; M.fold = fold;
  quantize_row(v, n, M, row);
  return HY_OK;
}

// Sets one run-time knob (hy.h Knobs, and the pool's spin_us), clamped to its range; returns the previous value, or
// -1 for an unknown name. The names are cpu_kernels/_native.py TUNABLES. Taken under the call lock, so a call in
// flight keeps the knobs it started with.
HY_API int hy_tune(const char* name, int value) {
  std::lock_guard<std::mutex> lk(g_job_mu);
  Knobs& k = g_knobs;
  int old;
  if (!std::strcmp(name, "fused")) { old = k.fused; k.fused = value != 0; }
  else if (!std::strcmp(name, "task_rows")) { old = k.task_rows; k.task_rows = std::min(HY_MAX_TASK_ROWS, std::max(64, value / 64 * 64)); }
  else if (!std::strcmp(name, "task_min")) { old = k.task_min; k.task_min = std::max(1, value); }
  else if (!std::strcmp(name, "tail_split")) { old = k.tail_split; k.tail_split = std::min(HY_MAX_TAIL_SPLIT, std::max(1, value)); }
  else if (!std::strcmp(name, "pf_rows")) { old = k.pf_rows; k.pf_rows = std::min(64, std::max(8, value / 4 * 4)); }
  else if (!std::strcmp(name, "amx_kblock")) { old = k.amx_kblock; k.amx_kblock = std::min(64, std::max(1, value)); }
  else if (!std::strcmp(name, "stream_pf")) { old = k.stream_pf; k.stream_pf = std::max(0, value) / 64 * 64; }
  else if (!std::strcmp(name, "spin_us")) { old = g_spin_us.load(); g_spin_us.store(std::max(0, value)); }
  else return -1;
  return old;
}

// Copies the accumulated phase times (seconds) and call count into out[8]; reset != 0 zeroes them.
HY_API void hy_profile_read(double* out, int reset) {
  std::lock_guard<std::mutex> lk(g_job_mu);
  for (int i = 0; i < 8; ++i) { out[i] = g_prof[i]; if (reset) g_prof[i] = 0; }
}

// Sets the codebooks the IQ kernels read (hy.h IqGrids) from the caller's copy: iq2xxs 256 entries of 8 bytes. Called
// once per library when it loads (cpu_kernels/_native.py), before any layer call. Returns HY_OK or HY_EARG.
HY_API int hy_set_grids(const uint64_t* iq2xxs, int n2) {
  if (!iq2xxs || n2 != 256) return HY_EARG;
  std::lock_guard<std::mutex> lk(g_job_mu);
  std::memcpy(g_iq_grids.iq2xxs, iq2xxs, sizeof(g_iq_grids.iq2xxs));
  return HY_OK;
}

// Sets the IQ3_XXS codebook (hy.h IqGrids iq3xxs) from the caller's copy: 256 entries of 4 magnitude bytes. Called
// once per library when it loads (cpu_kernels/_native.py), before any layer call. Returns HY_OK or HY_EARG.
HY_API int hy_set_iq3_grid(const uint32_t* grid, int n) {
  if (!grid || n != 256) return HY_EARG;
  std::lock_guard<std::mutex> lk(g_job_mu);
  std::memcpy(g_iq_grids.iq3xxs, grid, sizeof(g_iq_grids.iq3xxs));
  return HY_OK;
}

// Sets the IQ3_S codebook (hy.h IqGrids iq3s) from the caller's copy: 512 entries of 4 magnitude bytes. Called once
// per library when it loads (cpu_kernels/_native.py), before any layer call. Returns HY_OK or HY_EARG.
HY_API int hy_set_iq3s_grid(const uint32_t* grid, int n) {
  if (!grid || n != 512) return HY_EARG;
  std::lock_guard<std::mutex> lk(g_job_mu);
  std::memcpy(g_iq_grids.iq3s, grid, sizeof(g_iq_grids.iq3s));
  return HY_OK;
}

// Sets the IQ1 codebook (hy.h IqGrids iq1, IQ1_S's and IQ1_M's) from the caller's copy: 2048 entries of 8 int8 values
// in {-1, 0, 1}, kept as the bytes 8 g + 8. Called once per library when it loads (cpu_kernels/_native.py), before any
// layer call. Returns HY_OK or HY_EARG (a value outside -1..1).
HY_API int hy_set_iq1_grid(const int8_t* grid, int n) {
  if (!grid || n != 2048) return HY_EARG;
  uint64_t t[2048];
  for (int i = 0; i < 2048; ++i) {
    uint64_t e = 0;
    for (int j = 0; j < 8; ++j) {
      const int g = grid[8 * i + j];
      if (g < -1 || g > 1) return HY_EARG;
      e |= (uint64_t)(8 * g + 8) << (8 * j);
    }
    t[i] = e;
  }
  std::lock_guard<std::mutex> lk(g_job_mu);
  std::memcpy(g_iq_grids.iq1, t, sizeof(g_iq_grids.iq1));
  return HY_OK;
}

HY_API void* hy_pool_get(const int* cpus, int n) { return n > 0 ? pool_get(cpus, n) : nullptr; }

HY_API int hy_pool_threads(void* pool) { return pool ? ((Pool*)pool)->n : 0; }

// Copy with the pool's threads so that, by first touch, dst's pages land on the pool's NUMA node.
HY_API void hy_pool_copy(void* pool, void* dst, const void* src, int64_t nbytes) {
  std::lock_guard<std::mutex> lk(g_job_mu);
  const int64_t chunk = 1 << 21;
  ((Pool*)pool)->run([&](int task, int) {
    int64_t o = task * chunk;
    std::memcpy((uint8_t*)dst + o, (const uint8_t*)src + o, std::min(chunk, nbytes - o));
  }, (int)((nbytes + chunk - 1) / chunk), /*helps=*/false);
}

HY_API int hy_forward(const HyLayer* L, const void* x, int x_dtype, int T, int K, const int32_t* ids,
                      const float* wts, const int32_t* lmap, int n_global, void* out, int out_dtype) {
  return forward(L, x, x_dtype, T, K, ids, wts, lmap, n_global, out, out_dtype);
}

// One layer call packaged for a CUDA stream-ordered host function (cuLaunchHostFunc(stream, hy_host_job,
// job)): everything the call needs sits in pinned buffers the job points at, so the host function runs
// without Python and without the GIL (DESIGN section 3b). A host function cannot report an error to the
// stream: a failed call poisons `out` with NaN and counts itself in `failures`; rc keeps the last code.
struct HyJob {
  const HyLayer* L;
  const void* x;
  const void* ids;  // int32 [T, K], or int64 when ids64 (as the router writes them: no conversion kernel)
  const float* wts;
  const int32_t* lmap;
  void* out;
  int32_t x_dtype, T, K, n_global, out_dtype;
  int32_t pin_cpu;  // >= 0: pin the calling thread (the driver's callback thread) to this cpu, once
  int32_t rc;
  int32_t ids64;
  int64_t runs, failures;
  int64_t busy_ns;  // time spent in forward over all runs (steady clock): what the lane costs in a step
};

namespace {
void run_host_job(void* p) {
  HyJob* j = (HyJob*)p;
  // The callback thread becomes participant 0 of node 0's pool, whose workers leave pin_cpu to it.
  static thread_local int pinned = -1;
  if (j->pin_cpu >= 0 && pinned != j->pin_cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(j->pin_cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
    pinned = j->pin_cpu;
  }
  int rc;
  try {
    const int32_t* ids = (const int32_t*)j->ids;
    if (j->ids64) {  // narrow once; an id outside int32 becomes -1, which forward refuses (HY_EID)
      static thread_local std::vector<int32_t> narrow;
      const int64_t n = (int64_t)j->T * j->K;
      narrow.resize(n);
      const int64_t* wide = (const int64_t*)j->ids;
      for (int64_t i = 0; i < n; ++i) narrow[i] = wide[i] >= 0 && wide[i] <= INT32_MAX ? (int32_t)wide[i] : -1;
      ids = narrow.data();
    }
    const auto t0 = std::chrono::steady_clock::now();
    rc = forward(j->L, j->x, j->x_dtype, j->T, j->K, ids, j->wts, j->lmap, j->n_global, j->out, j->out_dtype);
    j->busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  } catch (...) {  // nothing may unwind into the CUDA driver
    rc = HY_EEXC;  // e.g. bad_alloc
  }
  j->rc = rc;
  j->runs += 1;
  if (rc != HY_OK && j->out && j->L) {
    j->failures += 1;
    int64_t n = (int64_t)j->T * j->L->D;
    if (j->out_dtype == HY_X_BF16) {
      uint16_t* o = (uint16_t*)j->out;
      for (int64_t i = 0; i < n; ++i) o[i] = 0x7FC0;  // bf16 quiet NaN
    } else {
      float* o = (float*)j->out;
      for (int64_t i = 0; i < n; ++i) o[i] = __builtin_nanf("");
    }
  }
}

}  // namespace

HY_API void hy_host_job(void* p) { run_host_job(p); }

// The doorbell lane (lane.h). bell: two page-locked words; done: cap page-locked words, zeroed; pin_cpu: the
// cpu of node 0's pool the lane thread takes as participant 0 (as hy_host_job's pin_cpu), or -1.
HY_API void* hy_lane_create(uint32_t* bell, uint32_t* done, int cap, int pin_cpu) {
  if (!bell || !done || cap < 1) return nullptr;
  try { return new Lane(bell, done, cap, pin_cpu); } catch (...) { return nullptr; }
}

// Registers a HyJob (it must outlive the lane's use of it); returns its id (>= 1), or -1 when the lane is full.
HY_API int hy_lane_add(void* lane, void* job) { return lane && job ? ((Lane*)lane)->add(job) : -1; }

// Re-points a registered id at another job (the stream must be done with the old one); 0 on success, -1 if not.
HY_API int hy_lane_set(void* lane, int id, void* job) { return lane && job && ((Lane*)lane)->set(id, job) ? 0 : -1; }

HY_API int64_t hy_lane_served(void* lane) { return lane ? ((Lane*)lane)->served.load() : 0; }

// Stops and joins the lane thread (after the last stream that rings it has finished).
HY_API void hy_lane_destroy(void* lane) { delete (Lane*)lane; }

// Multithreaded streaming read of buf with the pool's threads (the benchmark's DRAM-read ceiling, the
// same way the kernels read weights: each thread takes 1 MiB chunks). Returns a checksum so the loads
// cannot be optimised away.
HY_API int64_t hy_stream_read(void* pool, const void* buf, int64_t nbytes) {
  std::lock_guard<std::mutex> lk(g_job_mu);
  const int64_t stream_pf = g_knobs.stream_pf;
  Pool* p = (Pool*)pool;
  const int64_t chunk = 1 << 20;
  std::vector<int64_t> part(p->n * 8, 0);
  p->run([&](int task, int tid) {
    const uint8_t* b = (const uint8_t*)buf + task * chunk;
    int64_t n = std::min(chunk, nbytes - task * chunk) / 128 * 128;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t pf = stream_pf;
    for (int64_t o = 0; o < n; o += 128) {
      if (pf) { _mm_prefetch((const char*)(b + o + pf), _MM_HINT_T0); _mm_prefetch((const char*)(b + o + pf + 64), _MM_HINT_T0); }
      a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i*)(b + o)));
      a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i*)(b + o + 32)));
      a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i*)(b + o + 64)));
      a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i*)(b + o + 96)));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    int64_t s[4];
    _mm256_storeu_si256((__m256i*)s, a0);
    part[tid * 8] += s[0] + s[1] + s[2] + s[3];
  }, (int)((nbytes + chunk - 1) / chunk));
  int64_t s = 0;
  for (int i = 0; i < p->n; ++i) s += part[i * 8];
  return s;
}
