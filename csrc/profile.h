// Phase timings of the most recent native call, for the benchmark's profile.
//
// Off by default (then a phase costs one relaxed load). When on, each handler
// records how long its phases took; the last call's figures are read from
// Python through PeLastProfile (ctypes). With several devices calling at
// once the figures mix calls: profile a one-device step.

#ifndef PALLAS_EMB_CSRC_PROFILE_H_
#define PALLAS_EMB_CSRC_PROFILE_H_

#include <atomic>
#include <chrono>
#include <cstdint>

namespace pallas_emb {

enum Phase : int {
  kUniqueSort = 0,     // unique_keys: radix sort of (key, position)
  kUniqueOutputs,      // unique_keys: runs, kept keys, inverse
  kGroupByRow,         // update: tokens grouped by unique row (counting sort)
  kSegmentSum,         // update: per-row gradient sums, token order
  kRowUpdate,          // update: read row and slots, optimizer math, write back
  kNormAndGate,        // update: global norm, restore if not finite
  kNumPhases,
};

std::atomic<bool>& ProfilingEnabled();
std::atomic<int64_t>* PhaseNanos();  // kNumPhases entries

inline int64_t NowNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Times consecutive phases of one call: Lap(p) charges the time since the
// previous lap to phase p.
class PhaseTimer {
 public:
  PhaseTimer() : on_(ProfilingEnabled().load(std::memory_order_relaxed)) {
    if (on_) last_ = NowNanos();
  }
  bool on() const { return on_; }
  void Lap(Phase p) {
    if (!on_) return;
    const int64_t now = NowNanos();
    PhaseNanos()[p].store(now - last_, std::memory_order_relaxed);
    last_ = now;
  }
  // Charges `nanos` to phase p without moving the lap clock.
  void Set(Phase p, int64_t nanos) {
    if (on_) PhaseNanos()[p].store(nanos, std::memory_order_relaxed);
  }

 private:
  bool on_;
  int64_t last_ = 0;
};

}  // namespace pallas_emb

#endif  // PALLAS_EMB_CSRC_PROFILE_H_
