// Work splitting over XLA's intra-op thread pool, safe when the pool is busy.
//
// XLA:CPU hands an FFI handler its intra-op pool (ffi::ThreadPool). With
// several simulated devices, every device's handler may run at once and all
// of them share that pool, so a handler must never wait for a task that has
// not started: the calling thread claims chunks itself, and a helper task that
// starts late finds nothing left to do. Results never depend on which thread
// ran a chunk.

#ifndef PALLAS_EMB_CSRC_PARALLEL_H_
#define PALLAS_EMB_CSRC_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace pallas_emb {

// Runs fn(i) for i in [0, n), on the calling thread and up to n - 1 tasks of
// `pool`; returns when every call returned. Pool: xla::ffi::ThreadPool, or
// any class with its num_threads() and Schedule(task).
template <class Pool>
void ParallelFor(Pool* pool, int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  if (pool == nullptr || n == 1 || pool->num_threads() <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int> next{0};
    int done = 0;  // guarded by mu
    std::mutex mu;
    std::condition_variable cv;
    const std::function<void(int)>* fn;
    int n;
  };
  auto state = std::make_shared<State>();
  state->fn = &fn;
  state->n = n;
  auto work = [](State& s) {
    int i;
    while ((i = s.next.fetch_add(1)) < s.n) {
      (*s.fn)(i);
      std::lock_guard<std::mutex> lock(s.mu);
      if (++s.done == s.n) s.cv.notify_all();
    }
  };
  const int helpers = std::min(n - 1, int(pool->num_threads()));
  // A helper owns a reference to the state, so one that starts after the
  // call returned only reads `next` (already >= n) and exits; it calls fn
  // only for a claimed chunk, and the caller waits for every claimed chunk.
  for (int h = 0; h < helpers; ++h) pool->Schedule([state, work] { work(*state); });
  work(*state);
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done == state->n; });
}

// Splits [0, nu) into `chunks` consecutive ranges of about equal weight,
// where item u weighs offsets[u + 1] - offsets[u]. Returns chunks + 1 cuts.
inline std::vector<int64_t> BalancedSplit(const int64_t* offsets, int64_t nu,
                                          int chunks) {
  std::vector<int64_t> cut(chunks + 1, nu);
  cut[0] = 0;
  const int64_t total = offsets[nu] - offsets[0];
  int64_t u = 0;
  for (int c = 1; c < chunks; ++c) {
    const int64_t want = offsets[0] + total * c / chunks;
    while (u < nu && offsets[u] < want) ++u;
    cut[c] = std::max(u, cut[c - 1]);
  }
  return cut;
}

}  // namespace pallas_emb

#endif  // PALLAS_EMB_CSRC_PARALLEL_H_
