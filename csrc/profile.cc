// The profile's switch and figures, and their C entry points for ctypes.

#include "profile.h"

namespace pallas_emb {

std::atomic<bool>& ProfilingEnabled() {
  static std::atomic<bool> enabled{false};
  return enabled;
}

std::atomic<int64_t>* PhaseNanos() {
  static std::atomic<int64_t> nanos[kNumPhases] = {};
  return nanos;
}

}  // namespace pallas_emb

extern "C" {

// Turns the phase timers on (1) or off (0).
void PeSetProfiling(int on) { pallas_emb::ProfilingEnabled().store(on != 0); }

// Copies min(n, number of phases) figures, nanoseconds, in Phase order;
// returns the number of phases.
int PeLastProfile(int64_t* out, int n) {
  for (int p = 0; p < n && p < pallas_emb::kNumPhases; ++p)
    out[p] = pallas_emb::PhaseNanos()[p].load();
  return pallas_emb::kNumPhases;
}

}  // extern "C"
