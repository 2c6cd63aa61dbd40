// Persistent pool of pinned worker threads running dynamic parallel-for phases: a phase is a task
// count and a function; workers take task indices from one atomic counter, so uneven tasks balance.
// One pool per NUMA node (its cpus); pools are cached by cpu list and live until the process exits.
// The calling thread is participant 0 of a phase it runs with run(); workers are pinned to cpus[1..].
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#include <immintrin.h>

namespace {

std::atomic<int> g_spin_us{50};  // how long an idle worker (or a waiting caller) spins before it sleeps

struct Pool {
  std::vector<int> cpus;
  int n = 0;                         // participants: the calling thread (index 0) + n-1 pinned workers
  std::function<void(int, int)> fn;  // (task, participant index)
  int ntasks = 0;
  bool caller_helps = true;
  std::atomic<int> next{0};
  std::atomic<int> done{0};          // workers finished with the current phase
  std::atomic<uint64_t> gen{0};
  std::mutex mu;
  std::condition_variable cv_work, cv_done;
  pid_t pid = getpid();  // a forked child has none of the workers: it runs every phase on the caller
  bool solo = false;     // this phase runs on the caller alone

  // The caller takes the first cpu's share itself: a phase then needs no hand-back wake-up, and the
  // pool never has more runnable threads than cpus (a spinning caller would steal a worker's cpu).
  explicit Pool(const std::vector<int>& c) : cpus(c), n((int)c.size()) {
    for (int i = 1; i < n; ++i) std::thread([this, i] { loop(i); }).detach();
  }

  // Spin before sleeping: a futex wake of the pool costs tens of microseconds. The spin is a time (not a
  // pause count, whose cost differs ~10x between cores) read from g_spin_us: short by default so that idle
  // pools do not burn cores beside torch's own threads; a GPU-hosted decode sets it to cover the gap between
  // two layer calls of a step (hy_tune("spin_us", ...)), so that the workers never sleep inside a step.
  static bool spun_out(std::chrono::steady_clock::time_point t0) {
    return std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed));
  }

  void work(int idx) {
    for (int t; (t = next.fetch_add(1, std::memory_order_relaxed)) < ntasks;) fn(t, idx);
  }

  void loop(int idx) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[idx], &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: may be refused
    uint64_t seen = 0;
    for (;;) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int spins = 1; gen.load(std::memory_order_acquire) == seen; ++spins) {
        _mm_pause();
        if (spins % 64 == 0 && spun_out(t0)) break;
      }
      if (gen.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lk(mu);
        cv_work.wait(lk, [&] { return gen.load(std::memory_order_acquire) != seen; });
      }
      seen = gen.load(std::memory_order_acquire);
      work(idx);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n - 1) {
        std::lock_guard<std::mutex> lk(mu);
        cv_done.notify_all();
      }
    }
  }

  // Start a phase on the workers; returns at once. One phase per pool at a time (the job lock).
  // helps: whether the caller will take tasks too (see finish); false for first-touch copies, whose
  // pages must be touched by the pinned workers only.
  void start(std::function<void(int, int)> f, int tasks, bool helps = true) {
    fn = std::move(f);
    ntasks = tasks;
    solo = n == 1 || getpid() != pid;
    caller_helps = helps || solo;
    next.store(0, std::memory_order_relaxed);
    done.store(0, std::memory_order_relaxed);
    if (!solo) {
      {
        std::lock_guard<std::mutex> lk(mu);
        gen.fetch_add(1, std::memory_order_release);
      }
      cv_work.notify_all();
    }
  }

  // Take the caller's share (if it helps), then wait for the workers.
  void finish() {
    if (caller_helps) work(0);  // start() made it true for a solo phase
    if (solo) return;
    const auto t0 = std::chrono::steady_clock::now();
    for (int spins = 1; done.load(std::memory_order_acquire) != n - 1; ++spins) {
      _mm_pause();
      if (spins % 64 == 0 && spun_out(t0)) break;
    }
    if (done.load(std::memory_order_acquire) == n - 1) return;
    std::unique_lock<std::mutex> lk(mu);
    cv_done.wait(lk, [&] { return done.load(std::memory_order_acquire) == n - 1; });
  }

  void run(std::function<void(int, int)> f, int tasks, bool helps = true) {
    if (tasks <= 0) return;
    if (tasks == 1 && helps) { f(0, 0); return; }  // e.g. a decode step's token prep: no wake-up round trip
    start(std::move(f), tasks, helps);
    finish();
  }
};

std::mutex g_pools_mu;
std::map<std::vector<int>, Pool*>* g_pools = nullptr;  // never freed: detached workers reference it

Pool* pool_get(const int* cpus, int n) {
  std::vector<int> key(cpus, cpus + n);
  std::lock_guard<std::mutex> lk(g_pools_mu);
  if (!g_pools) g_pools = new std::map<std::vector<int>, Pool*>();
  auto it = g_pools->find(key);
  if (it != g_pools->end()) return it->second;
  Pool* p = new Pool(key);
  (*g_pools)[key] = p;
  return p;
}

}  // namespace
