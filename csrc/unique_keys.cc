// PeUniqueKeys: the distinct int32 keys with a static capacity, and each
// input's slot; bit for bit what sharding.dedup.unique_keys computes with a
// comparison sort and a binary search.
//
//   keys (n,) int32, INT32_MAX = no key
//   -> out_keys (capacity,) ascending, INT32_MAX-padded; the smallest
//      `capacity` distinct keys get a slot, the rest overflow
//      inverse (n,) slot of each input, -1 without a key or over capacity
//      num_unique () distinct keys, including those over capacity
//
// One LSD radix sort of (key - min) << 32 | position over only the key bits
// that vary (11-bit digits: two passes for a million rows, three for ten
// million); LSD radix sort is stable, so positions stay in input order.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "profile.h"
#include "thread_scratch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pallas_emb {
namespace {

constexpr int32_t kNoKey = INT32_MAX;
constexpr int kMaxDigitBits = 11;  // 2048 buckets: the histograms stay in L1

int BitWidth(uint64_t x) { return x == 0 ? 0 : 64 - __builtin_clzll(x); }

// The sort's buffers (ThreadScratch).
struct Scratch {
  std::vector<uint64_t> a, tmp;
  std::vector<uint32_t> hist;
};

// Sorts the inputs that have a key; returns how many, leaving them in s.a
// as ascending (key ^ sign) - lo << 32 | position, and lo in *lo_out.
size_t SortKeys(const int32_t* keys, int64_t n, Scratch& s, uint32_t* lo_out) {
  if (int64_t(s.a.size()) < n) {
    s.a.resize(n);
    s.tmp.resize(n);
  }
  uint32_t lo = UINT32_MAX, hi = 0;
  size_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] == kNoKey) continue;
    const uint32_t k = uint32_t(keys[i]) ^ 0x80000000u;  // signed order
    lo = std::min(lo, k);
    hi = std::max(hi, k);
    s.a[m++] = (uint64_t(k) << 32) | uint64_t(i);
  }
  *lo_out = m ? lo : 0;
  if (m == 0) return 0;
  const uint64_t base = uint64_t(lo) << 32;
  for (size_t i = 0; i < m; ++i) s.a[i] -= base;
  const int bits = BitWidth(uint64_t(hi - lo));
  if (bits == 0) return m;
  const int passes = (bits + kMaxDigitBits - 1) / kMaxDigitBits;
  const int digit = (bits + passes - 1) / passes;
  const size_t buckets = size_t(1) << digit;
  s.hist.assign(buckets * passes, 0);
  for (size_t i = 0; i < m; ++i) {
    const uint64_t k = s.a[i] >> 32;
    for (int p = 0; p < passes; ++p)
      ++s.hist[p * buckets + ((k >> (p * digit)) & (buckets - 1))];
  }
  uint64_t* src = s.a.data();
  uint64_t* dst = s.tmp.data();
  for (int p = 0; p < passes; ++p) {
    uint32_t* h = &s.hist[p * buckets];
    uint32_t sum = 0;
    for (size_t b = 0; b < buckets; ++b) {
      const uint32_t c = h[b];
      h[b] = sum;
      sum += c;
    }
    const int shift = 32 + p * digit;
    for (size_t i = 0; i < m; ++i) {
      const uint64_t e = src[i];
      dst[h[(e >> shift) & (buckets - 1)]++] = e;
    }
    std::swap(src, dst);
  }
  if (src != s.a.data()) std::memcpy(s.a.data(), src, m * sizeof(uint64_t));
  return m;
}

ffi::Error UniqueKeys(ffi::Buffer<ffi::S32> keys,
                      ffi::ResultBuffer<ffi::S32> out_keys,
                      ffi::ResultBuffer<ffi::S32> inverse,
                      ffi::ResultBufferR0<ffi::S32> num_unique) {
  const int64_t n = keys.element_count();
  const int64_t capacity = out_keys->element_count();
  if (int64_t(inverse->element_count()) != n)
    return ffi::Error::InvalidArgument("inverse must have one entry per key");
  PhaseTimer timer;
  Scratch& s = ThreadScratch<Scratch>();
  uint32_t lo = 0;
  const size_t m = SortKeys(keys.typed_data(), n, s, &lo);
  timer.Lap(kUniqueSort);
  int32_t* ok = out_keys->typed_data();
  int32_t* inv = inverse->typed_data();
  std::fill(inv, inv + n, -1);
  std::fill(ok, ok + capacity, kNoKey);
  int64_t run = -1;
  uint64_t prev = ~uint64_t(0);
  for (size_t i = 0; i < m; ++i) {
    const uint64_t key = s.a[i] >> 32;
    if (key != prev) {
      prev = key;
      ++run;
      if (run < capacity)
        ok[run] = int32_t(uint32_t(key + lo) ^ 0x80000000u);
    }
    if (run < capacity) inv[uint32_t(s.a[i])] = int32_t(run);
  }
  *num_unique->typed_data() = int32_t(run + 1);
  timer.Lap(kUniqueOutputs);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pallas_emb

XLA_FFI_DEFINE_HANDLER_SYMBOL(PeUniqueKeys, pallas_emb::UniqueKeys,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::BufferR0<xla::ffi::S32>>());
