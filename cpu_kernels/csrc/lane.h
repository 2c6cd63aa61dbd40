// The doorbell lane: a persistent CPU thread that runs layer calls (HyJob, api.h) when a GPU stream asks,
// through two words of page-locked host memory, instead of through CUDA host functions.
//
//   GPU stream:  ... input copies -> write doorbell := id -> wait until done[id] == 1 [-> write done[id] := 0] -> output copy
//   this thread: spin until doorbell != 0 -> doorbell := 0, done[previous id] := 0 -> run job id -> done[id] := 1
//
// The stream's own re-arm write is needed only where it may ring the same id twice in a row (a model with
// one CPU-lane layer replaying one graph): otherwise this thread's re-arm of the previous id comes first.
//
// Two doorbells: [0] for jobs the stream waits for at once, [1] for deferred jobs (expert deferral: rung
// by one layer, waited for by the next), each with at most one ring outstanding; [0] is served first.
//
// The stream side is CUDA's stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32, which
// graphs capture as memory-operation nodes), issued from Python; this library needs no CUDA headers. Why:
// a host function is run by the driver's callback thread after the stream reaches it, and the stream
// waits for the callback to return before it moves on; this thread already spins when the doorbell rings,
// and the GPU polls done[id] itself, so the hand-off costs a PCIe round trip each way. Job ids are fixed
// when a step is captured (graphs replay the same values), so each job has its own done word; the stream
// is serial, so one doorbell serves every job of a lane.
#pragma once
#include <thread>
#include <time.h>

namespace {

void run_host_job(void* p);  // api.h

struct Lane {
  volatile uint32_t* doorbell;  // page-locked [2]: written by the GPU, cleared here
  volatile uint32_t* done;      // page-locked [cap]: done[id - 1] set here, waited on and cleared by the GPU
  int cap;
  int pin_cpu;
  std::mutex mu;
  std::vector<void*> jobs;  // by id - 1
  std::atomic<bool> stop{false};
  std::atomic<int64_t> served{0};  // doorbells answered
  std::thread th;

  Lane(uint32_t* bell, uint32_t* dn, int cap_, int pin) : doorbell(bell), done(dn), cap(cap_), pin_cpu(pin) {
    th = std::thread([this] { loop(); });
  }

  bool set(int id, void* job) {  // re-point a registered id (eager jobs cycle through a few ids)
    std::lock_guard<std::mutex> lk(mu);
    if (id < 1 || id > (int)jobs.size()) return false;
    jobs[id - 1] = job;
    return true;
  }

  int add(void* job) {
    std::lock_guard<std::mutex> lk(mu);
    if ((int)jobs.size() >= cap) return -1;
    jobs.push_back(job);
    return (int)jobs.size();
  }

  void loop() {
    if (pin_cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(pin_cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
    }
    auto last = std::chrono::steady_clock::now();
    long nap_ns = 0;
    uint32_t prev[2] = {0, 0};  // per doorbell: the id answered last
    for (int spins = 0; !stop.load(std::memory_order_relaxed);) {
      int bell = 0;
      uint32_t id = __atomic_load_n(doorbell, __ATOMIC_ACQUIRE);
      if (id == 0) id = __atomic_load_n(doorbell + (bell = 1), __ATOMIC_ACQUIRE);
      if (id == 0) {
        _mm_pause();
        if (++spins % 64 == 0 && std::chrono::steady_clock::now() - last >
                                     std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed))) {
          // Idle past the spin window: poll with naps growing from 20 us to 1 ms (a GPU write cannot wake a
          // futex), so an idle lane costs almost nothing and the first doorbell after a pause waits at most
          // one nap; within a decode step the lane never gets here (the spin window covers the gaps).
          nap_ns = nap_ns ? std::min(2 * nap_ns, 1000000L) : 20000L;
          timespec ts{0, nap_ns};
          nanosleep(&ts, nullptr);
        }
        continue;
      }
      nap_ns = 0;
      __atomic_store_n(doorbell + bell, 0u, __ATOMIC_RELAXED);
      // Re-arm the previous job's done word: the stream rang this doorbell only after its wait on that word
      // passed, so nothing waits on it any more. This is what lets a stream skip its own re-arm write when
      // it never rings the same id twice in a row (hybrid.offload.doorbell, ring(rearm=False)).
      if (prev[bell] && prev[bell] <= (uint32_t)cap) __atomic_store_n(done + prev[bell] - 1, 0u, __ATOMIC_RELAXED);
      prev[bell] = id;
      void* job = nullptr;
      {
        std::lock_guard<std::mutex> lk(mu);
        if (id <= jobs.size()) job = jobs[id - 1];
      }
      if (job) run_host_job(job);  // an id never issued by the Python side runs nothing
      served.fetch_add(1, std::memory_order_relaxed);
      if (id <= (uint32_t)cap) __atomic_store_n(done + id - 1, 1u, __ATOMIC_RELEASE);  // x86 TSO: out's stores land first
      last = std::chrono::steady_clock::now();
      spins = 0;
    }
  }

  ~Lane() {
    stop.store(true);
    th.join();
  }
};

}  // namespace
