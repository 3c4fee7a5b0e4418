// A stand-alone driver of the native update, for instruction counts and
// timings without Python or XLA (not part of the library).
//
//   cmake --build build --target pe_update_bench
//   build/pe_update_bench IDS_FILE VOCAB RULE [REPS] [THREADS] [AHEAD...]
//   valgrind --tool=callgrind --toggle-collect='*SegsumUpdate*'
//     build/pe_update_bench IDS_FILE VOCAB RULE 1 1
//   (one command; valgrind has no AVX-512: it counts the AVX2 loops)
//
// IDS_FILE holds int32 ids (the benchmark's W1: `python -c "from
// pallas_emb.bench.workloads import zipf_ids; zipf_ids(65536, 10**6).tofile('w1.ids')"`).
// RULE: sgd, adagrad, rowwise_adagrad, rowwise_adagrad_lazy, lazy_adam, ftrl.
// It dedups the ids (std::sort, untimed), then times REPS one-device updates
// (SegsumUpdate: segment sum, norm, gate, update) of a VOCAB x 128 float32
// table on THREADS threads, and prints the minimum and median milliseconds,
// of wall time and of the process's CPU time (all threads: on a machine
// other processes share, it does not count the time they took the cores),
// and the phases of the fastest repetition. Each AHEAD, "G,R", is a
// prefetch look-ahead (gradient rows, table rows) to compare: the
// repetitions cycle through them, so that the machine's noise hits each alike.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <time.h>

#include "sparse_update.h"

namespace pe = pallas_emb;

// The pool the kernels split their work over, as XLA's would.
class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Run(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int64_t num_threads() const { return int64_t(threads_.size()); }
  template <class F>
  void Schedule(F&& f) {
    {
      std::lock_guard<std::mutex> l(mu_);
      tasks_.emplace_back(std::forward<F>(f));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::vector<std::thread> threads_;
  std::deque<std::function<void()>> tasks_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

template <class T>
T* HugeArray(size_t n, T init) {
  const size_t bytes = n * sizeof(T);
  void* p = nullptr;
  if (posix_memalign(&p, size_t(2) << 20, bytes)) std::abort();
  madvise(p, bytes, MADV_HUGEPAGE);
  T* a = static_cast<T*>(p);
  std::fill(a, a + n, init);
  return a;
}

double CpuMs() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

struct Config {
  pe::update_internal::Lookahead ahead;
  std::vector<double> ms, cpu_ms;
  std::vector<int64_t> best = std::vector<int64_t>(pe::kNumPhases);
};

template <class Rule>
int Run(const std::vector<int32_t>& ids, int64_t vocab, int reps, int threads,
        std::vector<Config> configs, const std::vector<float>& scalars) {
  constexpr int64_t d = 128;
  const int64_t n = int64_t(ids.size());
  std::vector<int32_t> keys(ids);
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  int64_t capacity = 1;
  while (capacity < int64_t(keys.size())) capacity *= 2;
  std::vector<int32_t> rows(capacity, -1), inverse(n);
  std::copy(keys.begin(), keys.end(), rows.begin());
  for (int64_t t = 0; t < n; ++t)
    inverse[t] = int32_t(std::lower_bound(keys.begin(), keys.end(), ids[t]) - keys.begin());
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::vector<float> grads(n * d);
  for (float& g : grads) g = normal(gen);
  std::vector<float> per_row(capacity * std::max(1, Rule::kPerRow), 1.0f);

  pe::Shard sh;
  sh.table = HugeArray<float>(vocab * d, 0.0f);
  sh.num_rows = vocab;
  sh.dim = d;
  sh.table_words = d;
  for (int s = 0; s < Rule::kNumSlots; ++s) {
    const int64_t w = Rule::kSlotWidth[s] < 0 ? d : Rule::kSlotWidth[s];
    sh.slot[s] = reinterpret_cast<char*>(HugeArray<float>(vocab * w, 0.1f));
    sh.slot_row_bytes[s] = w * 4;
  }
  if (Rule::kNumSlots && Rule::kSlotIsInt[Rule::kNumSlots - 1])
    std::fill_n(reinterpret_cast<int32_t*>(sh.slot[Rule::kNumSlots - 1]), vocab, 0);
  const Rule rule(scalars.data());
  Pool pool(threads > 1 ? threads - 1 : 0);  // the caller is a thread too
  pe::ProfilingEnabled().store(true);
  for (int r = 0; r < reps; ++r) {
    for (Config& c : configs) {
      pe::update_internal::Ahead() = c.ahead;
      const double c0 = CpuMs();
      const auto t0 = std::chrono::steady_clock::now();
      pe::SegsumUpdate(threads > 1 ? &pool : static_cast<Pool*>(nullptr), sh,
                       rule, rows.data(), capacity, inverse.data(),
                       per_row.data(), grads.data(), n, true);
      const double t = std::chrono::duration<double, std::milli>(
          std::chrono::steady_clock::now() - t0).count();
      c.cpu_ms.push_back(CpuMs() - c0);
      if (c.ms.empty() || t < *std::min_element(c.ms.begin(), c.ms.end()))
        for (int p = 0; p < pe::kNumPhases; ++p) c.best[p] = pe::PhaseNanos()[p].load();
      c.ms.push_back(t);
    }
  }
  std::printf("unique %zu of %lld ids, %d threads\n", keys.size(), (long long)n,
              threads);
  for (Config& c : configs) {
    std::sort(c.ms.begin(), c.ms.end());
    std::sort(c.cpu_ms.begin(), c.cpu_ms.end());
    std::printf("ahead %d,%d: wall min %.3f median %.3f ms; cpu min %.3f median %.3f ms "
                "(fastest: group %.3f, sums %.3f, update %.3f, norm %.3f)\n",
                c.ahead.grads, c.ahead.rows, c.ms[0], c.ms[c.ms.size() / 2],
                c.cpu_ms[0], c.cpu_ms[c.cpu_ms.size() / 2], c.best[pe::kGroupByRow] / 1e6,
                c.best[pe::kSegmentSum] / 1e6, c.best[pe::kRowUpdate] / 1e6,
                c.best[pe::kNormAndGate] / 1e6);
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s IDS_FILE VOCAB RULE [REPS] [THREADS]\n", argv[0]);
    return 2;
  }
  std::ifstream f(argv[1], std::ios::binary);
  std::vector<int32_t> ids;
  int32_t x;
  while (f.read(reinterpret_cast<char*>(&x), sizeof(x))) ids.push_back(x);
  const int64_t vocab = std::atoll(argv[2]);
  const std::string rule = argv[3];
  const int reps = argc > 4 ? std::atoi(argv[4]) : 20;
  const int threads = argc > 5 ? std::atoi(argv[5]) : 2;
  std::vector<Config> configs;
  for (int a = 6; a < argc; ++a) {
    Config c;
    if (std::sscanf(argv[a], "%d,%d", &c.ahead.grads, &c.ahead.rows) != 2) return 2;
    configs.push_back(c);
  }
  if (configs.empty()) configs.emplace_back();
  // Scalars as native.py passes them: the optimizer's scalars, then the
  // rule's static hyperparameters.
  if (rule == "sgd") return Run<pe::Sgd>(ids, vocab, reps, threads, configs, {0.01f});
  if (rule == "adagrad") return Run<pe::Adagrad>(ids, vocab, reps, threads, configs, {0.01f, 1e-7f});
  if (rule == "rowwise_adagrad")
    return Run<pe::RowwiseAdagrad>(ids, vocab, reps, threads, configs, {0.01f, 7.f, 1e-8f, 1.f, 0.f});
  if (rule == "rowwise_adagrad_lazy")
    return Run<pe::RowwiseAdagradLazy>(ids, vocab, reps, threads, configs,
                                        {0.01f, 7.f, 1e-8f, 0.999f, 0.f});
  if (rule == "lazy_adam")
    return Run<pe::LazyAdam>(ids, vocab, reps, threads, configs, {1e-3f, 0.9f, 0.999f, 1e-8f});
  if (rule == "ftrl")
    return Run<pe::Ftrl>(ids, vocab, reps, threads, configs, {0.01f, -0.5f, 0.f, 0.f, 0.f, 0.f});
  std::fprintf(stderr, "unknown rule %s\n", rule.c_str());
  return 2;
}
