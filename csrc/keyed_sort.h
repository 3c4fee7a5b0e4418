// Helpers of the id map's handlers (id_map.cc): remainders by a divisor
// fixed per call, and the sort of (key, index) pairs by key.

#ifndef PALLAS_EMB_CSRC_KEYED_SORT_H_
#define PALLAS_EMB_CSRC_KEYED_SORT_H_

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pallas_emb {

// x % d for a divisor fixed per call, without a division (Lemire, Kaser and
// Kurz, "Faster remainder by direct computation", 2019; exact for 32-bit x
// and d): a key's owner and its home slot are remainders, one per key.
class FastMod {
 public:
  explicit FastMod(uint32_t d) : d_(d), m_(~uint64_t(0) / d + 1) {}
  uint32_t operator()(uint32_t x) const {
    return uint32_t((static_cast<unsigned __int128>(m_ * x) * d_) >> 64);
  }

 private:
  uint64_t d_, m_;
};

// (key, index) pairs sorted by key: the sort of both handlers.
struct Keyed {
  uint64_t key;
  int32_t index;
};

// Sorts [first, last) by key, with `tmp` as scratch; a no-op on sorted input
// (an owner with one source receives its keys sorted). The keys are hashes,
// spread evenly over their range: one counting pass puts them in about n
// buckets by their leading bits (about one key each), and each bucket is
// sorted alone (insertion sort; std::sort for a large one, so an uneven input
// costs n log n, not n^2). Ties keep no order: the callers read only keys.
inline void SortByKey(Keyed* first, Keyed* last, std::vector<Keyed>& tmp, std::vector<uint32_t>& hist) {
  const size_t n = last - first;
  const auto less = [](const Keyed& a, const Keyed& b) { return a.key < b.key; };
  if (std::is_sorted(first, last, less)) return;
  uint64_t lo = ~uint64_t(0), hi = 0;
  for (const Keyed* e = first; e != last; ++e) lo = std::min(lo, e->key), hi = std::max(hi, e->key);
  const int bits = 64 - __builtin_clzll(hi - lo);  // hi > lo: the input is not sorted
  const int bucket_bits = std::min(bits, 64 - __builtin_clzll(uint64_t(n)));  // ~n buckets
  const int shift = bits - bucket_bits;
  const size_t buckets = size_t(1) << bucket_bits;
  auto bucket = [&](const Keyed& e) { return (e.key - lo) >> shift; };
  hist.assign(buckets + 1, 0);
  for (const Keyed* e = first; e != last; ++e) ++hist[bucket(*e) + 1];
  for (size_t b = 0; b < buckets; ++b) hist[b + 1] += hist[b];
  tmp.resize(n);
  for (const Keyed* e = first; e != last; ++e) tmp[hist[bucket(*e)]++] = *e;
  // hist[b] is now the end of bucket b, the start of bucket b + 1.
  constexpr uint32_t kSmall = 16;
  for (size_t b = 0, begin = 0; b < buckets; begin = hist[b++]) {
    Keyed* const lo_e = tmp.data() + begin;
    Keyed* const hi_e = tmp.data() + hist[b];
    if (hi_e - lo_e > kSmall) {
      std::sort(lo_e, hi_e, less);
      continue;
    }
    for (Keyed* e = lo_e + 1; e < hi_e; ++e)
      for (Keyed* f = e; f > lo_e && f->key < f[-1].key; --f) std::swap(*f, f[-1]);
  }
  std::copy(tmp.begin(), tmp.begin() + n, first);
}

}  // namespace pallas_emb

#endif  // PALLAS_EMB_CSRC_KEYED_SORT_H_
