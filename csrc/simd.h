// Vector building blocks of the sparse update, per instruction set.
//
// The row loops (sparse_update.h) are compiled for the architecture's
// baseline and, on x86, for AVX2 and AVX-512 (functions with a target
// attribute, which GCC flattens: everything they call is inlined and
// compiled for that target), and run in the widest the CPU has. Every
// operation rounds once, in the same order, in each (-ffp-contract=off, no
// fast-math, a fixed lane order in SumSquares), so all give the same bits;
// the wider ones take fewer instructions (a block of 128 floats is 8 AVX-512
// registers). PE_NATIVE_ISA=base|avx2|avx512 picks one (tests compare them).

#ifndef PALLAS_EMB_CSRC_SIMD_H_
#define PALLAS_EMB_CSRC_SIMD_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "profile.h"
#include "row_rules.h"

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define PE_X86 1
#define PE_TARGET_AVX2 __attribute__((target("avx2"), flatten))
#define PE_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2"), flatten))
#endif

namespace pallas_emb {

enum class Isa { kBase, kAvx2, kAvx512 };

// The widest instruction set of this CPU, or PE_NATIVE_ISA's.
inline Isa HostIsa() {
  static const Isa isa = [] {
    const char* env = std::getenv("PE_NATIVE_ISA");
    Isa best = Isa::kBase;
#ifdef PE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) best = Isa::kAvx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
      best = Isa::kAvx512;
#endif
    if (env == nullptr) return best;
    const Isa want = std::strcmp(env, "avx512") == 0 ? Isa::kAvx512
                     : std::strcmp(env, "avx2") == 0 ? Isa::kAvx2
                                                      : Isa::kBase;
    return std::min(want, best);
  }();
  return isa;
}

namespace update_internal {

template <bool kWrite>
PE_INLINE void Prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  const char* const end = c + bytes;
  for (; c + 256 <= end; c += 256) {
    __builtin_prefetch(c, kWrite ? 1 : 0);
    __builtin_prefetch(c + 64, kWrite ? 1 : 0);
    __builtin_prefetch(c + 128, kWrite ? 1 : 0);
    __builtin_prefetch(c + 192, kWrite ? 1 : 0);
  }
  for (; c < end; c += 64) __builtin_prefetch(c, kWrite ? 1 : 0);
}

inline void Fence() {
#ifdef PE_X86
  _mm_sfence();
#endif
}

// A cycle counter for the profile's split of one pass into sums and updates;
// only ratios of it are used.
inline uint64_t Ticks() {
#ifdef PE_X86
  return __rdtsc();
#else
  return uint64_t(NowNanos());
#endif
}

// The vector operations of an instruction set: V holds kWidth floats.
// Generic: one float (the compiler vectorizes what it can).
struct Generic {
  using V = float;
  static constexpr int kWidth = 1;
  static PE_INLINE V Zero() { return 0.0f; }
  static PE_INLINE V Load(const float* p) { return *p; }
  static PE_INLINE V Add(V a, V b) { return a + b; }
  static PE_INLINE void Store(float* p, V v) { *p = v; }
  static PE_INLINE bool CanStream(const void*) { return false; }
  static PE_INLINE void Stream(float* p, V v) { *p = v; }
};
#ifdef PE_X86
struct Sse {
  using V = __m128;
  static constexpr int kWidth = 4;
  static PE_INLINE V Zero() { return _mm_setzero_ps(); }
  static PE_INLINE V Load(const float* p) { return _mm_loadu_ps(p); }
  static PE_INLINE V Add(V a, V b) { return _mm_add_ps(a, b); }
  static PE_INLINE void Store(float* p, V v) { _mm_storeu_ps(p, v); }
  static PE_INLINE bool CanStream(const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
  }
  static PE_INLINE void Stream(float* p, V v) { _mm_stream_ps(p, v); }
};
struct Avx2 {
  using V = __m256;
  static constexpr int kWidth = 8;
  static inline PE_TARGET_AVX2 V Zero() { return _mm256_setzero_ps(); }
  static inline PE_TARGET_AVX2 V Load(const float* p) { return _mm256_loadu_ps(p); }
  static inline PE_TARGET_AVX2 V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline PE_TARGET_AVX2 void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static PE_INLINE bool CanStream(const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 32 == 0;
  }
  static inline PE_TARGET_AVX2 void Stream(float* p, V v) { _mm256_stream_ps(p, v); }
};
struct Avx512 {
  using V = __m512;
  static constexpr int kWidth = 16;
  static inline PE_TARGET_AVX512 V Zero() { return _mm512_setzero_ps(); }
  static inline PE_TARGET_AVX512 V Load(const float* p) { return _mm512_loadu_ps(p); }
  static inline PE_TARGET_AVX512 V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline PE_TARGET_AVX512 void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static PE_INLINE bool CanStream(const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 64 == 0;
  }
  static inline PE_TARGET_AVX512 void Stream(float* p, V v) { _mm512_stream_ps(p, v); }
};
#endif

// dst[0..n) = src[0..n) (n floats), bypassing the caches where it can: the
// undo log is read back only when an update is skipped, so caching it (and
// reading each line before writing it) would only cost bandwidth. Needs a
// fence before anything reads the log (Fence()).
template <class Isa>
inline void CopyToLog(float* __restrict dst, const float* __restrict src,
                         int64_t n) {
  constexpr int w = Isa::kWidth;
  if (w > 1 && n % w == 0 && Isa::CanStream(dst)) {
    for (int64_t j = 0; j < n; j += w) Isa::Stream(dst + j, Isa::Load(src + j));
    return;
  }
  std::memcpy(dst, src, n * sizeof(float));
}

// out = 0 + grads[tok[0]] + grads[tok[1]] + ..., element by element in
// token order, kRegs vectors of columns at a time in registers; prefetches
// the gradient row `ahead` tokens ahead in the stream [tok, tok_end).
template <class Isa, int kRegs = 8>
inline void SumTokens(const float* __restrict grads, int64_t d,
                      const int32_t* tok, int64_t count,
                      const int32_t* tok_end, int ahead,
                      float* __restrict out) {
  constexpr int w = Isa::kWidth, block = kRegs * Isa::kWidth;
  int64_t j0 = 0;
  for (; j0 + block <= d; j0 += block) {
    typename Isa::V acc[kRegs];
#pragma GCC unroll 16
    for (int k = 0; k < kRegs; ++k) acc[k] = Isa::Zero();
    for (int64_t i = 0; i < count; ++i) {
      if (j0 == 0 && tok + i + ahead < tok_end)
        Prefetch<false>(grads + int64_t(tok[i + ahead]) * d, d * 4);
      const float* __restrict r = grads + int64_t(tok[i]) * d + j0;
#pragma GCC unroll 16
      for (int k = 0; k < kRegs; ++k) acc[k] = Isa::Add(acc[k], Isa::Load(r + k * w));
    }
#pragma GCC unroll 16
    for (int k = 0; k < kRegs; ++k) Isa::Store(out + j0 + k * w, acc[k]);
  }
  for (int64_t j = j0; j < d; ++j) {
    float s = 0.0f;
    for (int64_t i = 0; i < count; ++i) {
      if (j0 == 0 && j == 0 && tok + i + ahead < tok_end)
        Prefetch<false>(grads + int64_t(tok[i + ahead]) * d, d * 4);
      s += grads[int64_t(tok[i]) * d + j];
    }
    out[j] = s;
  }
}

}  // namespace update_internal
}  // namespace pallas_emb

#endif  // PALLAS_EMB_CSRC_SIMD_H_
