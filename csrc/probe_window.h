// The two scans of a key's probe window in the id map's step (id_map.cc):
// where the key is held, and which slots are free and which is the victim.
//
// A window is the probe_limit slots from the key's home slot on, wrapping at
// the capacity. Both scans run scalar on any window, and eight slots at a
// time with AVX2 on a window that does not wrap and whose length is a
// multiple of 8 (the default probe limits); both give the same answers, the
// first slot in window order winning every tie, as the XLA code's argmax.

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
  const bool* usable;
  int32_t cap;
};

// What the second scan finds in a window.
struct WindowScan {
  bool any_free;  // a slot of the window is free (and usable)
  int32_t victim;  // the eviction victim's slot, -1 for none
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

inline WindowScan ScanScalar(const MapView& m, int32_t home, int64_t probe_limit,
                             const VictimRule& rule, uint64_t* free) {
  WindowScan out{false, -1};
  uint64_t best_rank = ~uint64_t(0);
  for (int64_t r = 0; r < probe_limit; ++r) {
    int32_t p = home + int32_t(r);
    if (p >= m.cap) p -= m.cap;
    const int32_t l = m.last[p];
    const bool is_free = l < 0 && m.usable[p];
    free[r / 64] |= uint64_t(is_free) << (r % 64);
    out.any_free |= is_free;
    const uint64_t rank = (rule.lfu ? uint64_t(CountBits(m.count[p])) << 32 : 0) | uint32_t(l);
    const bool better = l >= 0 && l <= rule.newest && rank < best_rank;
    best_rank = better ? rank : best_rank;
    out.victim = better ? p : out.victim;
  }
  return out;
}

#ifdef PE_X86
PE_TARGET_AVX2 inline int32_t FindAvx2(const MapView& m, int32_t home, int64_t probe_limit,
                                       uint32_t hi, uint32_t lo) {
  const __m256i want = _mm256_set1_epi32(int32_t(lo));
  for (int64_t r = 0; r < probe_limit; r += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.key_lo + home + r));
    for (uint32_t hits = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(v, want)));
         hits != 0; hits &= hits - 1) {
      const int32_t p = home + int32_t(r) + __builtin_ctz(hits);
      if (m.key_hi[p] == hi && m.last[p] >= 0) return p;
    }
  }
  return -1;
}

PE_TARGET_AVX2 inline uint32_t HorizontalMin(__m256i v) {
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  uint32_t m = lanes[0];
  for (int i = 1; i < 8; ++i) m = lanes[i] < m ? lanes[i] : m;
  return m;
}

// Eight slots at a time, in three sweeps of the window (at most 64 slots):
// the least count among the eligible slots (lfu), the least last step among
// those, and the first slot with both.
PE_TARGET_AVX2 inline WindowScan ScanAvx2(const MapView& m, int32_t home, int64_t probe_limit,
                                          const VictimRule& rule, uint64_t* free) {
  const int64_t blocks = probe_limit / 8;
  __m256i last[8], count[8], eligible[8];
  const __m256i minus_one = _mm256_set1_epi32(-1), newest = _mm256_set1_epi32(rule.newest);
  const __m256i none = _mm256_set1_epi32(-1);  // as uint32: above every count and last
  __m256i least_count = none;
  WindowScan out{false, -1};
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = home + 8 * b;
    last[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.last + at));
    count[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.count + at));
    const __m256i usable = _mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m.usable + at)));
    const __m256i empty = _mm256_cmpgt_epi32(_mm256_setzero_si256(), last[b]);
    const uint32_t free_bits = _mm256_movemask_ps(_mm256_castsi256_ps(
      _mm256_andnot_si256(_mm256_cmpeq_epi32(usable, _mm256_setzero_si256()), empty)));
    free[b / 8] |= uint64_t(free_bits) << (8 * (b % 8));
    out.any_free |= free_bits != 0;
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
  if (ll == ~uint32_t(0)) return out;  // no slot is eligible
  const __m256i want = _mm256_set1_epi32(int32_t(ll));
  for (int64_t b = 0; b < blocks; ++b) {
    const uint32_t hit = _mm256_movemask_ps(_mm256_castsi256_ps(
      _mm256_and_si256(eligible[b], _mm256_cmpeq_epi32(last[b], want))));
    if (hit != 0) {
      out.victim = int32_t(home + 8 * b + __builtin_ctz(hit));
      break;
    }
  }
  return out;
}
#endif

}  // namespace window_internal

// Scans a window with AVX2 where the CPU has it and the window allows.
class ProbeWindows {
 public:
  ProbeWindows(const MapView& m, int64_t probe_limit)
      : m_(m), probe_limit_(probe_limit),
        vector_(HostIsa() != Isa::kBase && probe_limit % 8 == 0 && probe_limit <= 64) {}

  // The slot of window `home` holding key (hi, lo), -1 if none.
  int32_t Find(int32_t home, uint32_t hi, uint32_t lo) const {
#ifdef PE_X86
    if (vector_ && home + probe_limit_ <= m_.cap)
      return window_internal::FindAvx2(m_, home, probe_limit_, hi, lo);
#endif
    return window_internal::FindScalar(m_, home, probe_limit_, hi, lo);
  }

  // Free slots (bit r of `free`, (probe_limit + 63) / 64 zeroed words, for
  // slot home + r) and the victim of window `home`.
  WindowScan Scan(int32_t home, const VictimRule& rule, uint64_t* free) const {
#ifdef PE_X86
    if (vector_ && home + probe_limit_ <= m_.cap)
      return window_internal::ScanAvx2(m_, home, probe_limit_, rule, free);
#endif
    return window_internal::ScanScalar(m_, home, probe_limit_, rule, free);
  }

 private:
  MapView m_;
  int64_t probe_limit_;
  bool vector_;
};

}  // namespace pallas_emb

#endif  // PALLAS_EMB_CSRC_PROBE_WINDOW_H_
