// The two scans of a key's probe window in the id map's step (id_map.cc):
// where the key is held, and which slot is its eviction victim.
//
// A window is the probe_limit slots from the key's home slot on, wrapping at
// the capacity. Both scans run scalar on any window, and eight slots at a
// time with AVX2 on a window that does not wrap and whose length is a
// multiple of 8 (the default probe limits); both give the same answers, the
// first slot in window order winning every tie, as the XLA code's argmax.
// Free slots need no scan: the insertion rounds (id_map.cc) read each slot
// as they reach it.

#ifndef PALLAS_EMB_CSRC_PROBE_WINDOW_H_
#define PALLAS_EMB_CSRC_PROBE_WINDOW_H_

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace pallas_emb {

// The map's per-slot arrays, as one step finds them.
struct MapView {
  const uint32_t* key_hi;
  const uint32_t* key_lo;
  const float* count;
  const int32_t* last;
  int32_t cap;
};

// Who may be evicted: a slot used, not in this step or the last (nor within
// ttl steps under "ttl"), i.e. 0 <= last <= step - min_idle; the victim is
// the least (count under "lfu", last step, place in the window).
struct VictimRule {
  int32_t newest;  // step - min_idle: the latest last step of a victim
  bool lfu;
};

inline uint32_t CountBits(float c) {  // ordered as c for c >= 0 (counts are)
  uint32_t b;
  std::memcpy(&b, &c, sizeof(b));
  return b;
}

namespace window_internal {

inline int32_t FindScalar(const MapView& m, int32_t home, int64_t probe_limit, uint32_t hi,
                          uint32_t lo) {
  for (int64_t r = 0; r < probe_limit; ++r) {
    int32_t p = home + int32_t(r);
    if (p >= m.cap) p -= m.cap;
    if (m.key_lo[p] == lo && m.key_hi[p] == hi && m.last[p] >= 0) return p;
  }
  return -1;
}

// probe_limit <= 64 (one bit per place of the window).
inline uint64_t LowMatchesScalar(const MapView& m, int32_t home, int64_t probe_limit,
                                uint32_t lo) {
  uint64_t matches = 0;
  for (int64_t r = 0; r < probe_limit; ++r) {
    int32_t p = home + int32_t(r);
    if (p >= m.cap) p -= m.cap;
    matches |= uint64_t(m.key_lo[p] == lo) << r;
  }
  return matches;
}

inline int32_t VictimScalar(const MapView& m, int32_t home, int64_t probe_limit,
                            const VictimRule& rule) {
  int32_t victim = -1;
  uint64_t best_rank = ~uint64_t(0);
  for (int64_t r = 0; r < probe_limit; ++r) {
    int32_t p = home + int32_t(r);
    if (p >= m.cap) p -= m.cap;
    const int32_t l = m.last[p];
    const uint64_t rank = (rule.lfu ? uint64_t(CountBits(m.count[p])) << 32 : 0) | uint32_t(l);
    const bool better = l >= 0 && l <= rule.newest && rank < best_rank;
    best_rank = better ? rank : best_rank;
    victim = better ? p : victim;
  }
  return victim;
}

#ifdef PE_X86
PE_TARGET_AVX2 inline uint64_t LowMatchesAvx2(const MapView& m, int32_t home,
                                              int64_t probe_limit, uint32_t lo) {
  const __m256i want = _mm256_set1_epi32(int32_t(lo));
  uint64_t matches = 0;
  for (int64_t r = 0; r < probe_limit; r += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.key_lo + home + r));
    matches |= uint64_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(v, want)))) << r;
  }
  return matches;
}

// In registers: read back from memory (one 32-byte store, eight 4-byte
// loads, which the store cannot forward) it made the map's whole step about
// 10% slower on the drift benchmark's stream.
PE_TARGET_AVX2 inline uint32_t HorizontalMin(__m256i v) {
  __m128i m = _mm_min_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_min_epu32(m, _mm_shuffle_epi32(m, 0x4E));  // lanes 2, 3, 0, 1
  m = _mm_min_epu32(m, _mm_shuffle_epi32(m, 0xB1));  // lanes 1, 0, 3, 2
  return uint32_t(_mm_cvtsi128_si32(m));
}

// Eight slots at a time, in three sweeps of the window (at most 64 slots):
// the least count among the eligible slots (lfu), the least last step among
// those, and the first slot with both.
PE_TARGET_AVX2 inline int32_t VictimAvx2(const MapView& m, int32_t home, int64_t probe_limit,
                                         const VictimRule& rule) {
  const int64_t blocks = probe_limit / 8;
  __m256i last[8], count[8], eligible[8];
  const __m256i minus_one = _mm256_set1_epi32(-1), newest = _mm256_set1_epi32(rule.newest);
  const __m256i none = _mm256_set1_epi32(-1);  // as uint32: above every count and last
  __m256i least_count = none;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = home + 8 * b;
    last[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.last + at));
    count[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.count + at));
    eligible[b] = _mm256_andnot_si256(_mm256_cmpgt_epi32(last[b], newest),
                                      _mm256_cmpgt_epi32(last[b], minus_one));
    least_count = _mm256_min_epu32(least_count, _mm256_blendv_epi8(none, count[b], eligible[b]));
  }
  const __m256i lc = _mm256_set1_epi32(int32_t(HorizontalMin(least_count)));
  __m256i least_last = none;
  for (int64_t b = 0; b < blocks; ++b) {
    if (rule.lfu) eligible[b] = _mm256_and_si256(eligible[b], _mm256_cmpeq_epi32(count[b], lc));
    least_last = _mm256_min_epu32(least_last, _mm256_blendv_epi8(none, last[b], eligible[b]));
  }
  const uint32_t ll = HorizontalMin(least_last);
  if (ll == ~uint32_t(0)) return -1;  // no slot is eligible
  const __m256i want = _mm256_set1_epi32(int32_t(ll));
  for (int64_t b = 0; b < blocks; ++b) {
    const uint32_t hit = _mm256_movemask_ps(_mm256_castsi256_ps(
      _mm256_and_si256(eligible[b], _mm256_cmpeq_epi32(last[b], want))));
    if (hit != 0) return int32_t(home + 8 * b + __builtin_ctz(hit));
  }
  return -1;
}
#endif

}  // namespace window_internal

// Scans a window with AVX2 where the CPU has it and the window allows.
class ProbeWindows {
 public:
  ProbeWindows(const MapView& m, int64_t probe_limit)
      : m_(m), probe_limit_(probe_limit),
        vector_(HostIsa() != Isa::kBase && probe_limit % 8 == 0 && probe_limit <= 64) {}

  // Whether the windows fit the 64-bit masks of LowMatches.
  bool masks_fit() const { return probe_limit_ <= 64; }

  // The slot of window `home` holding key (hi, lo), -1 if none (any window).
  int32_t Find(int32_t home, uint32_t hi, uint32_t lo) const {
    return window_internal::FindScalar(m_, home, probe_limit_, hi, lo);
  }

  // The places r in window `home` whose slot's low key word is `lo` (bit r;
  // masks_fit()): the first half of finding a key, which loads one array and
  // never branches on it, so that a step's keys' windows load side by side.
  uint64_t LowMatches(int32_t home, uint32_t lo) const {
#ifdef PE_X86
    if (vector_ && home + probe_limit_ <= m_.cap)
      return window_internal::LowMatchesAvx2(m_, home, probe_limit_, lo);
#endif
    return window_internal::LowMatchesScalar(m_, home, probe_limit_, lo);
  }

  // The second half: the slot among `matches` holding key (hi, lo), -1 if
  // none (a key is held at most once).
  int32_t Resolve(int32_t home, uint64_t matches, uint32_t hi) const {
    for (; matches != 0; matches &= matches - 1) {
      int32_t p = home + __builtin_ctzll(matches);
      if (p >= m_.cap) p -= m_.cap;
      if (m_.key_hi[p] == hi && m_.last[p] >= 0) return p;
    }
    return -1;
  }

  // The eviction victim of window `home`, -1 if no slot may be evicted.
  int32_t Victim(int32_t home, const VictimRule& rule) const {
#ifdef PE_X86
    if (vector_ && home + probe_limit_ <= m_.cap)
      return window_internal::VictimAvx2(m_, home, probe_limit_, rule);
#endif
    return window_internal::VictimScalar(m_, home, probe_limit_, rule);
  }

 private:
  MapView m_;
  int64_t probe_limit_;
  bool vector_;
};

}  // namespace pallas_emb

#endif  // PALLAS_EMB_CSRC_PROBE_WINDOW_H_
