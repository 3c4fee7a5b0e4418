// The sparse optimizer update of one device's row shard, in place.
//
//   Pe<Rule>SegsumUpdate: per-token gradients -> per-row sums -> global
//     norm and gate -> optimizer update, in one pass over the rows (the
//     one-device step, where no gradient travels between devices).
//   Pe<Rule>RowUpdate: per-row gradients, already summed, and the decision
//     to apply -> optimizer update (the owner side of a multi-device step).
//
// Rules (row_rules.h): Sgd, Adagrad, RowwiseAdagrad. The table and slots are
// aliased to the outputs (input_output_aliases), so a donated table is
// updated where it lies.
//
// The per-row sums are bitwise those of XLA:CPU's scatter-add (each row
// summed from 0.0f in token order). The norm is the square root of the sum,
// in row order, of each row's SumSquares: deterministic, and the same for
// any number of threads. The one pass updates each row as soon as its sum is
// known and keeps the old row and slots in an undo log; if the norm turns out
// not finite, the log is written back, so a skipped update leaves the table
// bit for bit unchanged.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "profile.h"
#include "row_rules.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define PE_X86 1
#endif

namespace ffi = xla::ffi;

namespace pallas_emb {
namespace {

// Look-ahead of the software prefetches, in gradient rows (tokens) and in
// table rows. Random 512-byte rows defeat the hardware prefetcher.
constexpr int kGradAhead = 8;
constexpr int kRowAhead = 4;

inline void Prefetch(const float* p, int64_t floats, bool write) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < floats * int64_t(sizeof(float)); b += 64) {
    if (write) __builtin_prefetch(c + b, 1);
    else __builtin_prefetch(c + b, 0);
  }
}

// dst[0..d) = src[0..d), bypassing the caches where it can: the undo log is
// read back only when an update is skipped, so caching it (and reading each
// line before writing it) would only cost bandwidth. Needs a fence before
// anything reads the log (Fence()).
inline void CopyToLog(float* __restrict dst, const float* __restrict src,
                      int64_t d) {
#ifdef PE_X86
  if ((d % 4) == 0 && (reinterpret_cast<uintptr_t>(dst) % 16) == 0 &&
      (reinterpret_cast<uintptr_t>(src) % 16) == 0) {
    for (int64_t j = 0; j < d; j += 4)
      _mm_stream_ps(dst + j, _mm_load_ps(src + j));
    return;
  }
#endif
  std::memcpy(dst, src, d * sizeof(float));
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

// One device's table and optimizer slot (nullptr for a rule without one).
struct Shard {
  float* table;
  float* slot;
  int64_t num_rows, dim, slot_width;
};

// Per calling thread, reused across calls (no page faults per step).
struct Scratch {
  std::vector<int64_t> start;   // per unique row: first token in `order`
  std::vector<int32_t> order;   // tokens grouped by unique row, in token order
  std::vector<double> sum_sq;   // per unique row, for the norm
  std::vector<float> undo_rows;   // per unique row: its old row
  std::vector<float> undo_slots;  // per unique row: its old slot
};
thread_local Scratch tl_scratch;

template <class T>
void Grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// Groups the tokens by unique row (a stable counting sort of `inverse`);
// tokens whose slot is outside [0, num_unique) have no row and are dropped.
void GroupByRow(const int32_t* inverse, int64_t n, int64_t num_unique,
                Scratch& s) {
  Grow(s.start, num_unique + 1);
  Grow(s.order, n);
  int64_t* start = s.start.data();
  std::fill(start, start + num_unique + 1, 0);
  for (int64_t t = 0; t < n; ++t)
    if (uint32_t(inverse[t]) < uint64_t(num_unique)) ++start[inverse[t] + 1];
  for (int64_t u = 0; u < num_unique; ++u) start[u + 1] += start[u];
  std::vector<int64_t> fill(start, start + num_unique);
  int32_t* order = s.order.data();
  for (int64_t t = 0; t < n; ++t)
    if (uint32_t(inverse[t]) < uint64_t(num_unique))
      order[fill[inverse[t]]++] = int32_t(t);
}

// out = 0 + grads[t0] + grads[t1] + ... over the tokens tok[0..count), in
// order; prefetches the rows up to `tok_end` ahead.
inline void SumTokens(const float* __restrict grads, int64_t d,
                      const int32_t* tok, int64_t count, const int32_t* tok_end,
                      float* __restrict out) {
  for (int64_t j = 0; j < d; ++j) out[j] = 0.0f;
  for (int64_t k = 0; k < count; ++k) {
    if (tok + k + kGradAhead < tok_end)
      Prefetch(grads + int64_t(tok[k + kGradAhead]) * d, d, false);
    const float* __restrict row = grads + int64_t(tok[k]) * d;
    for (int64_t j = 0; j < d; ++j) out[j] += row[j];
  }
}

// Chunks of work per call: several per thread, claimed dynamically, so that
// a thread the OS preempts (other processes on the cores) delays the call by
// a chunk, not by half of it. Results do not depend on the count.
inline int Chunks(ffi::ThreadPool* pool) {
  return pool ? 4 * std::max(1, int(pool->num_threads())) : 1;
}

inline bool HasRow(const Shard& sh, int32_t r) {
  return uint32_t(r) < uint64_t(sh.num_rows);
}

inline void PrefetchRow(const Shard& sh, const int32_t* rows, int64_t u,
                        int64_t end) {
  if (u >= end || !HasRow(sh, rows[u])) return;
  Prefetch(sh.table + int64_t(rows[u]) * sh.dim, sh.dim, true);
  if (sh.slot) Prefetch(sh.slot + int64_t(rows[u]) * sh.slot_width, sh.slot_width, true);
}

template <class Rule>
float SegsumUpdate(ffi::ThreadPool* pool, const Shard& sh, const Rule& rule,
                   const int32_t* rows, int64_t num_unique,
                   const int32_t* inverse, const float* grads, int64_t n,
                   bool gate) {
  PhaseTimer timer;
  Scratch& s = tl_scratch;
  GroupByRow(inverse, n, num_unique, s);
  timer.Lap(kGroupByRow);
  const int64_t d = sh.dim, w = sh.slot_width;
  Grow(s.sum_sq, num_unique);
  if (gate) {
    Grow(s.undo_rows, size_t(num_unique) * d);
    Grow(s.undo_slots, size_t(num_unique) * w);
  }
  const int64_t* start = s.start.data();
  const int32_t* order = s.order.data();
  double* sum_sq = s.sum_sq.data();
  float* undo_rows = s.undo_rows.data();
  float* undo_slots = s.undo_slots.data();
  const int chunks = Chunks(pool);
  const std::vector<int64_t> cut = BalancedSplit(start, num_unique, chunks);
  std::vector<uint64_t> sum_ticks(chunks, 0), update_ticks(chunks, 0);
  const bool profile = timer.on();
  ParallelFor(pool, chunks, [&](int c) {
    std::vector<float> g(d);
    const int32_t* tok_end = order + start[cut[c + 1]];
    uint64_t t0 = profile ? Ticks() : 0;
    for (int64_t u = cut[c]; u < cut[c + 1]; ++u) {
      PrefetchRow(sh, rows, u + kRowAhead, cut[c + 1]);
      SumTokens(grads, d, order + start[u], start[u + 1] - start[u], tok_end,
                g.data());
      const float sq = SumSquares(g.data(), d);
      // The norm must not overflow while every element is finite (squares
      // pass float32's range at |g| ~ 1.8e19): widen a row that did.
      sum_sq[u] = std::isfinite(sq) ? double(sq) : SumSquaresWide(g.data(), d);
      if (profile) {
        const uint64_t t1 = Ticks();
        sum_ticks[c] += t1 - t0;
        t0 = t1;
      }
      if (!gate || !HasRow(sh, rows[u])) continue;
      float* row = sh.table + int64_t(rows[u]) * d;
      float* slot = sh.slot ? sh.slot + int64_t(rows[u]) * w : nullptr;
      CopyToLog(undo_rows + u * d, row, d);
      if (slot) std::memcpy(undo_slots + u * w, slot, w * sizeof(float));
      rule.Apply(row, slot, g.data(), sq, d);
      if (profile) {
        const uint64_t t1 = Ticks();
        update_ticks[c] += t1 - t0;
        t0 = t1;
      }
    }
  Fence();  // this thread's log writes, before another thread may read them
  });
  if (profile) {  // split the pass's wall time by the threads' tick counts
    timer.Lap(kSegmentSum);
    uint64_t st = 0, ut = 0;
    for (int c = 0; c < chunks; ++c) st += sum_ticks[c], ut += update_ticks[c];
    const int64_t pass = PhaseNanos()[kSegmentSum].load();
    const double frac = st + ut ? double(st) / double(st + ut) : 1.0;
    timer.Set(kSegmentSum, int64_t(pass * frac));
    timer.Set(kRowUpdate, pass - int64_t(pass * frac));
  }
  double total = 0.0;
  for (int64_t u = 0; u < num_unique; ++u) total += sum_sq[u];
  const float norm = float(std::sqrt(total));
  if (gate && !std::isfinite(norm)) {
    for (int64_t u = 0; u < num_unique; ++u) {
      if (!HasRow(sh, rows[u])) continue;
      std::memcpy(sh.table + int64_t(rows[u]) * d, undo_rows + u * d,
                  d * sizeof(float));
      if (sh.slot)
        std::memcpy(sh.slot + int64_t(rows[u]) * w, undo_slots + u * w,
                    w * sizeof(float));
    }
  }
  timer.Lap(kNormAndGate);
  return norm;
}

template <class Rule>
void RowUpdate(ffi::ThreadPool* pool, const Shard& sh, const Rule& rule,
               const int32_t* rows, int64_t num_unique, const float* grads) {
  const int64_t d = sh.dim, w = sh.slot_width;
  const int chunks = Chunks(pool);
  ParallelFor(pool, chunks, [&](int c) {
    const int64_t lo = num_unique * c / chunks, hi = num_unique * (c + 1) / chunks;
    for (int64_t u = lo; u < hi; ++u) {
      PrefetchRow(sh, rows, u + kRowAhead, hi);
      if (!HasRow(sh, rows[u])) continue;
      const float* g = grads + u * d;
      rule.Apply(sh.table + int64_t(rows[u]) * d,
                 sh.slot ? sh.slot + int64_t(rows[u]) * w : nullptr, g,
                 SumSquares(g, d), d);
    }
  });
}

// -- argument plumbing ---------------------------------------------------------

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
using Pred = ffi::BufferR0<ffi::PRED>;

ffi::Error CheckShard(const F32& table, ffi::Result<F32>& table_out,
                      const F32* slot, ffi::Result<F32>* slot_out,
                      int slot_width_rule, int64_t num_scalars,
                      const F32& scalars, Shard* sh) {
  const auto dims = table.dimensions();
  if (dims.size() != 2u)
    return ffi::Error::InvalidArgument("table must be (rows, dim)");
  if (table.untyped_data() != table_out->untyped_data())
    return ffi::Error::InvalidArgument(
        "table must be aliased to the output (input_output_aliases)");
  if (int64_t(scalars.element_count()) != num_scalars)
    return ffi::Error::InvalidArgument("wrong number of scalars for the rule");
  sh->table = table_out->typed_data();
  sh->num_rows = dims[0];
  sh->dim = dims[1];
  sh->slot = nullptr;
  sh->slot_width = 0;
  if (slot != nullptr) {
    // Any shape with the bytes of (rows, width) in row-major order: a
    // per-row scalar may be stored lane-dense as (rows / 128, 128).
    const int64_t want = slot_width_rule < 0 ? sh->dim : slot_width_rule;
    if (int64_t(slot->element_count()) != sh->num_rows * want)
      return ffi::Error::InvalidArgument(
          "slot must hold rows * (width of the rule) elements");
    if (slot->untyped_data() != (*slot_out)->untyped_data())
      return ffi::Error::InvalidArgument(
          "slot must be aliased to the output (input_output_aliases)");
    sh->slot = (*slot_out)->typed_data();
    sh->slot_width = want;
  }
  return ffi::Error::Success();
}

template <class Rule>
ffi::Error SegsumImpl(ffi::ThreadPool pool, F32 table, const F32* slot,
                      S32 rows, S32 inverse, F32 grads, F32 scalars, Pred gate,
                      ffi::Result<F32> table_out, ffi::Result<F32>* slot_out,
                      ffi::ResultBufferR0<ffi::F32> norm) {
  Shard sh;
  if (auto e = CheckShard(table, table_out, slot, slot_out, Rule::kSlotWidth,
                          Rule::kNumScalars, scalars, &sh); e.failure())
    return e;
  const int64_t n = inverse.element_count();
  if (int64_t(grads.element_count()) != n * sh.dim)
    return ffi::Error::InvalidArgument("grads must be (tokens, dim)");
  const Rule rule(scalars.typed_data());
  *norm->typed_data() = SegsumUpdate(
      &pool, sh, rule, rows.typed_data(), rows.element_count(),
      inverse.typed_data(), grads.typed_data(), n, *gate.typed_data());
  return ffi::Error::Success();
}

template <class Rule>
ffi::Error RowImpl(ffi::ThreadPool pool, F32 table, const F32* slot, S32 rows,
                   F32 grads, F32 scalars, Pred apply, ffi::Result<F32> table_out,
                   ffi::Result<F32>* slot_out) {
  Shard sh;
  if (auto e = CheckShard(table, table_out, slot, slot_out, Rule::kSlotWidth,
                          Rule::kNumScalars, scalars, &sh); e.failure())
    return e;
  if (int64_t(grads.element_count()) != int64_t(rows.element_count()) * sh.dim)
    return ffi::Error::InvalidArgument("grads must be (rows, dim)");
  if (*apply.typed_data())
    RowUpdate(&pool, sh, Rule(scalars.typed_data()), rows.typed_data(),
              rows.element_count(), grads.typed_data());
  return ffi::Error::Success();
}

// Entry points with and without a slot buffer.
template <class Rule>
ffi::Error Segsum0(ffi::ThreadPool pool, F32 table, S32 rows, S32 inverse,
                   F32 grads, F32 scalars, Pred gate, ffi::Result<F32> table_out,
                   ffi::ResultBufferR0<ffi::F32> norm) {
  return SegsumImpl<Rule>(pool, table, nullptr, rows, inverse, grads, scalars,
                          gate, table_out, nullptr, norm);
}
template <class Rule>
ffi::Error Segsum1(ffi::ThreadPool pool, F32 table, F32 slot, S32 rows,
                   S32 inverse, F32 grads, F32 scalars, Pred gate,
                   ffi::Result<F32> table_out, ffi::Result<F32> slot_out,
                   ffi::ResultBufferR0<ffi::F32> norm) {
  return SegsumImpl<Rule>(pool, table, &slot, rows, inverse, grads, scalars,
                          gate, table_out, &slot_out, norm);
}
template <class Rule>
ffi::Error Row0(ffi::ThreadPool pool, F32 table, S32 rows, F32 grads,
                F32 scalars, Pred apply, ffi::Result<F32> table_out) {
  return RowImpl<Rule>(pool, table, nullptr, rows, grads, scalars, apply,
                       table_out, nullptr);
}
template <class Rule>
ffi::Error Row1(ffi::ThreadPool pool, F32 table, F32 slot, S32 rows, F32 grads,
                F32 scalars, Pred apply, ffi::Result<F32> table_out,
                ffi::Result<F32> slot_out) {
  return RowImpl<Rule>(pool, table, &slot, rows, grads, scalars, apply,
                       table_out, &slot_out);
}

}  // namespace
}  // namespace pallas_emb

namespace pe = pallas_emb;
using pe::F32;
using pe::Pred;
using pe::S32;

#define PE_SEGSUM0(NAME, RULE)                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                            \
      NAME, pe::Segsum0<pe::RULE>,                                          \
      ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<S32>()         \
          .Arg<S32>().Arg<F32>().Arg<F32>().Arg<Pred>().Ret<F32>()          \
          .Ret<ffi::BufferR0<ffi::F32>>())
#define PE_SEGSUM1(NAME, RULE)                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                            \
      NAME, pe::Segsum1<pe::RULE>,                                          \
      ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<F32>()         \
          .Arg<S32>().Arg<S32>().Arg<F32>().Arg<F32>().Arg<Pred>()          \
          .Ret<F32>().Ret<F32>().Ret<ffi::BufferR0<ffi::F32>>())
#define PE_ROW0(NAME, RULE)                                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                            \
      NAME, pe::Row0<pe::RULE>,                                             \
      ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<S32>()         \
          .Arg<F32>().Arg<F32>().Arg<Pred>().Ret<F32>())
#define PE_ROW1(NAME, RULE)                                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                            \
      NAME, pe::Row1<pe::RULE>,                                             \
      ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<F32>()         \
          .Arg<S32>().Arg<F32>().Arg<F32>().Arg<Pred>().Ret<F32>()          \
          .Ret<F32>())

PE_SEGSUM0(PeSgdSegsumUpdate, Sgd);
PE_SEGSUM1(PeAdagradSegsumUpdate, Adagrad);
PE_SEGSUM1(PeRowwiseAdagradSegsumUpdate, RowwiseAdagrad);
PE_ROW0(PeSgdRowUpdate, Sgd);
PE_ROW1(PeAdagradRowUpdate, Adagrad);
PE_ROW1(PeRowwiseAdagradRowUpdate, RowwiseAdagrad);
