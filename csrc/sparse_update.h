// The sparse optimizer update of one device's row shard, in place: the
// algorithms, free of XLA's types (sparse_update.cc binds them to FFI
// handlers; update_bench.cc drives them alone).
//
//   SegsumUpdate: per-token gradients -> per-row sums -> global norm and
//     gate -> optimizer update, in one pass over the rows (the one-device
//     step, where no gradient travels between devices).
//   RowUpdate: per-row gradients, already summed -> optimizer update (the
//     owner side of a multi-device step).
//
// The per-row sums are bitwise those of XLA:CPU's scatter-add (each element
// summed from 0.0f in token order; a row's elements are summed in blocks
// held in registers, which changes no element's order). The norm is the
// square root of the sum, in row order, of each row's SumSquares:
// deterministic, and the same for any number of threads. The one pass
// updates each row as soon as its sum is known and keeps the old row and
// slots in an undo log; if the norm turns out not finite, the log is written
// back, so a skipped update leaves the table bit for bit unchanged.
//
// The row loops are compiled for each instruction set of simd.h and run in
// the widest the CPU has; all give the same bits.

#ifndef PALLAS_EMB_CSRC_SPARSE_UPDATE_H_
#define PALLAS_EMB_CSRC_SPARSE_UPDATE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "profile.h"
#include "row_rules.h"
#include "simd.h"
#include "thread_scratch.h"

namespace pallas_emb {

// One device's table and optimizer slots: row r's dim logical values at
// table + r * table_words (a stored row may be padded past dim), slot s's at
// slot[s] + r * slot_row_bytes[s].
struct Shard {
  float* table = nullptr;
  int64_t num_rows = 0, dim = 0, table_words = 0;
  char* slot[kMaxSlots] = {};
  int64_t slot_row_bytes[kMaxSlots] = {};
};

namespace update_internal {

// Look-ahead of the software prefetches, in gradient rows (tokens) and in
// table rows: random 512-byte rows defeat the hardware prefetcher. A
// variable only for update_bench.cc's sweeps.
struct Lookahead {
  int grads = 6, rows = 3;
};
inline Lookahead& Ahead() {
  static Lookahead a;
  return a;
}

PE_INLINE int64_t SlotFloats(const Shard& sh, int s) {
  return sh.slot_row_bytes[s] / 4;
}

inline bool HasRow(const Shard& sh, int32_t r) {
  return uint32_t(r) < uint64_t(sh.num_rows);
}

template <class Rule>
PE_INLINE void RowSlots(const Shard& sh, int32_t r, char** out) {
  for (int s = 0; s < Rule::kNumSlots; ++s)
    out[s] = sh.slot[s] + int64_t(r) * sh.slot_row_bytes[s];
}

template <class Rule>
PE_INLINE void PrefetchRow(const Shard& sh, const int32_t* rows, int64_t u,
                           int64_t end) {
  if (u >= end || !HasRow(sh, rows[u])) return;
  Prefetch<true>(sh.table + int64_t(rows[u]) * sh.table_words, sh.dim * 4);
  for (int s = 0; s < Rule::kNumSlots; ++s)
    Prefetch<true>(sh.slot[s] + int64_t(rows[u]) * sh.slot_row_bytes[s],
                   sh.slot_row_bytes[s]);
}

// Where a row's old values go in the undo log: one region for the rows and
// one per slot, each holding entry u at base + u * stride floats. Rows and
// wide slots are padded to 64 bytes (written with streaming stores); narrow
// slots (a per-row scalar) are packed, so their writes share cache lines.
struct LogLayout {
  int64_t base[kMaxSlots + 1] = {}, stride[kMaxSlots + 1] = {};
  int64_t floats = 0;  // the whole log
  // The log of `num_unique` rows (each region 64-byte aligned).
  static LogLayout Of(const Shard& sh, int num_slots, int64_t num_unique) {
    LogLayout l;
    auto pad = [](int64_t x) { return x >= 16 ? (x + 15) / 16 * 16 : x; };
    for (int r = 0; r <= num_slots; ++r) {
      l.stride[r] = pad(r == 0 ? sh.dim : SlotFloats(sh, r - 1));
      l.base[r] = l.floats;
      l.floats += (num_unique * l.stride[r] + 15) / 16 * 16;
    }
    return l;
  }
  int64_t At(int region, int64_t u) const { return base[region] + u * stride[region]; }
};

// Everything a chunk of the one pass reads and writes.
struct SegsumPass {
  const Shard* sh;
  const int32_t* rows;
  const int64_t* start;    // per unique row: first token in `order`
  const int32_t* order;    // tokens grouped by unique row, in token order
  const float* grads;
  const float* per_row;
  bool gate;
  double* sum_sq;          // per unique row
  float* undo;             // LogLayout
  LogLayout log;
  const int64_t* cut;      // chunk c: unique rows [cut[c], cut[c + 1])
  bool profile;
  uint64_t* sum_ticks;     // per chunk
  uint64_t* update_ticks;  // per chunk
};

template <class Rule, class Isa>
inline void SegsumChunk(const Rule& rule, const SegsumPass& p, int c) {
  const Shard& sh = *p.sh;
  const int64_t d = sh.dim;
  std::vector<float> g_buf(d + 16);
  float* g = g_buf.data();
  const int64_t lo = p.cut[c], hi = p.cut[c + 1];
  const int32_t* tok_end = p.order + p.start[hi];
  const Lookahead ahead = Ahead();
  uint64_t t0 = p.profile ? Ticks() : 0;
  for (int64_t u = lo; u < hi; ++u) {
    PrefetchRow<Rule>(sh, p.rows, u + ahead.rows, hi);
    const int64_t count = p.start[u + 1] - p.start[u];
    if (count == 0 && !HasRow(sh, p.rows[u])) {  // padding
      p.sum_sq[u] = 0.0;
      continue;
    }
    SumTokens<Isa>(p.grads, d, p.order + p.start[u], count, tok_end,
                   ahead.grads, g);
    const float sq = SumSquares(g, d);
    // The norm must not overflow while every element is finite (squares
    // pass float32's range at |g| ~ 1.8e19): widen a row that did.
    p.sum_sq[u] = std::isfinite(sq) ? double(sq) : SumSquaresWide(g, d);
    if (p.profile) {
      const uint64_t t1 = Ticks();
      p.sum_ticks[c] += t1 - t0;
      t0 = t1;
    }
    if (!p.gate || !HasRow(sh, p.rows[u])) continue;
    float* row = sh.table + int64_t(p.rows[u]) * sh.table_words;
    char* slot[kMaxSlots];
    RowSlots<Rule>(sh, p.rows[u], slot);
    CopyToLog<Isa>(p.undo + p.log.At(0, u), row, d);
    for (int s = 0; s < Rule::kNumSlots; ++s)
      CopyToLog<Isa>(p.undo + p.log.At(s + 1, u),
                     reinterpret_cast<float*>(slot[s]), SlotFloats(sh, s));
    rule.Apply(row, slot, g, sq, p.per_row + u * Rule::kPerRow, d);
    if (p.profile) {
      const uint64_t t1 = Ticks();
      p.update_ticks[c] += t1 - t0;
      t0 = t1;
    }
  }
  Fence();  // this thread's log writes, before another thread may read them
}

// The chunk loop compiled for each instruction set (see the file comment).
template <class Rule>
void SegsumChunkBase(const Rule& rule, const SegsumPass& p, int c) {
#ifdef PE_X86
  SegsumChunk<Rule, Sse>(rule, p, c);
#else
  SegsumChunk<Rule, Generic>(rule, p, c);
#endif
}
#ifdef PE_X86
template <class Rule>
PE_TARGET_AVX2 void SegsumChunkAvx2(const Rule& rule, const SegsumPass& p, int c) {
  SegsumChunk<Rule, Avx2>(rule, p, c);
}
template <class Rule>
PE_TARGET_AVX512 void SegsumChunkAvx512(const Rule& rule, const SegsumPass& p,
                                        int c) {
  SegsumChunk<Rule, Avx512>(rule, p, c);
}
#endif

template <class Rule>
void SegsumChunkAny(const Rule& rule, const SegsumPass& p, int c) {
#ifdef PE_X86
  switch (HostIsa()) {
    case Isa::kAvx512: return SegsumChunkAvx512(rule, p, c);
    case Isa::kAvx2: return SegsumChunkAvx2(rule, p, c);
    default: break;
  }
#endif
  SegsumChunkBase(rule, p, c);
}

struct RowPass {
  const Shard* sh;
  const int32_t* rows;
  const float* grads;
  const float* per_row;
  int64_t num_unique;
  int chunks;
};

template <class Rule>
PE_INLINE void RowChunk(const Rule& rule, const RowPass& p, int c) {
  const Shard& sh = *p.sh;
  const int64_t d = sh.dim;
  const int64_t lo = p.num_unique * c / p.chunks;
  const int64_t hi = p.num_unique * (c + 1) / p.chunks;
  const Lookahead ahead = Ahead();
  for (int64_t u = lo; u < hi; ++u) {
    PrefetchRow<Rule>(sh, p.rows, u + ahead.rows, hi);
    if (u + ahead.rows < hi) Prefetch<false>(p.grads + (u + ahead.rows) * d, d * 4);
    if (!HasRow(sh, p.rows[u])) continue;
    const float* g = p.grads + u * d;
    char* slot[kMaxSlots];
    RowSlots<Rule>(sh, p.rows[u], slot);
    rule.Apply(sh.table + int64_t(p.rows[u]) * sh.table_words, slot, g, SumSquares(g, d),
               p.per_row + u * Rule::kPerRow, d);
  }
}

template <class Rule>
void RowChunkBase(const Rule& rule, const RowPass& p, int c) { RowChunk(rule, p, c); }
#ifdef PE_X86
template <class Rule>
PE_TARGET_AVX2 void RowChunkAvx2(const Rule& rule, const RowPass& p, int c) {
  RowChunk(rule, p, c);
}
template <class Rule>
PE_TARGET_AVX512 void RowChunkAvx512(const Rule& rule, const RowPass& p, int c) {
  RowChunk(rule, p, c);
}
#endif

template <class Rule>
void RowChunkAny(const Rule& rule, const RowPass& p, int c) {
#ifdef PE_X86
  switch (HostIsa()) {
    case Isa::kAvx512: return RowChunkAvx512(rule, p, c);
    case Isa::kAvx2: return RowChunkAvx2(rule, p, c);
    default: break;
  }
#endif
  RowChunkBase(rule, p, c);
}

// The update's buffers (ThreadScratch).
struct Scratch {
  std::vector<int64_t> start, fill;
  std::vector<int32_t> order;
  std::vector<double> sum_sq;
  float* undo = nullptr;  // 64-byte aligned
  size_t undo_floats = 0;
  ~Scratch() { std::free(undo); }
  float* Undo(size_t n) {
    if (n > undo_floats) {
      std::free(undo);
      undo = static_cast<float*>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64));
      undo_floats = n;
    }
    return undo;
  }
};

template <class T>
void Grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// Groups the tokens by unique row (a stable counting sort of `inverse`);
// tokens whose slot is outside [0, num_unique) have no row and are dropped.
inline void GroupByRow(const int32_t* inverse, int64_t n, int64_t num_unique,
                       Scratch& s) {
  Grow(s.start, num_unique + 1);
  Grow(s.fill, num_unique);
  Grow(s.order, n);
  int64_t* start = s.start.data();
  std::fill(start, start + num_unique + 1, 0);
  for (int64_t t = 0; t < n; ++t)
    if (uint32_t(inverse[t]) < uint64_t(num_unique)) ++start[inverse[t] + 1];
  for (int64_t u = 0; u < num_unique; ++u) start[u + 1] += start[u];
  int64_t* fill = s.fill.data();
  std::copy(start, start + num_unique, fill);
  int32_t* order = s.order.data();
  for (int64_t t = 0; t < n; ++t)
    if (uint32_t(inverse[t]) < uint64_t(num_unique))
      order[fill[inverse[t]]++] = int32_t(t);
}

// Chunks of work per call: several per thread, claimed dynamically, so that
// a thread the OS preempts (other processes on the cores) delays the call by
// a chunk, not by half of it. Results do not depend on the count.
template <class Pool>
int Chunks(Pool* pool) {
  return pool ? 4 * std::max(1, int(pool->num_threads())) : 1;
}

}  // namespace update_internal

// The one-device update; returns the norm of the per-row sums. Rows are
// written only if `gate` and the norm is finite.
//   rows (num_unique,): local row of each unique slot, -1 for padding; distinct.
//   inverse (n,): unique slot of each token (outside [0, num_unique): none).
//   per_row (num_unique, Rule::kPerRow); grads (n, dim).
template <class Rule, class Pool>
float SegsumUpdate(Pool* pool, const Shard& sh, const Rule& rule,
                   const int32_t* rows, int64_t num_unique,
                   const int32_t* inverse, const float* per_row,
                   const float* grads, int64_t n, bool gate) {
  namespace ui = update_internal;
  PhaseTimer timer;
  ui::Scratch& s = ThreadScratch<ui::Scratch>();
  ui::GroupByRow(inverse, n, num_unique, s);
  timer.Lap(kGroupByRow);
  const int64_t d = sh.dim;
  ui::Grow(s.sum_sq, num_unique);
  ui::SegsumPass p;
  p.sh = &sh;
  p.rows = rows;
  p.start = s.start.data();
  p.order = s.order.data();
  p.grads = grads;
  p.per_row = per_row;
  p.gate = gate;
  p.sum_sq = s.sum_sq.data();
  p.log = ui::LogLayout::Of(sh, Rule::kNumSlots, num_unique);
  p.undo = gate ? s.Undo(size_t(p.log.floats)) : nullptr;
  const int chunks = ui::Chunks(pool);
  const std::vector<int64_t> cut = BalancedSplit(p.start, num_unique, chunks);
  std::vector<uint64_t> sum_ticks(chunks, 0), update_ticks(chunks, 0);
  p.cut = cut.data();
  p.profile = timer.on();
  p.sum_ticks = sum_ticks.data();
  p.update_ticks = update_ticks.data();
  ParallelFor(pool, chunks, [&](int c) { ui::SegsumChunkAny(rule, p, c); });
  if (p.profile) {  // split the pass's wall time by the threads' tick counts
    timer.Lap(kSegmentSum);
    uint64_t st = 0, ut = 0;
    for (int c = 0; c < chunks; ++c) st += sum_ticks[c], ut += update_ticks[c];
    const int64_t pass = PhaseNanos()[kSegmentSum].load();
    const double frac = st + ut ? double(st) / double(st + ut) : 1.0;
    timer.Set(kSegmentSum, int64_t(pass * frac));
    timer.Set(kRowUpdate, pass - int64_t(pass * frac));
  }
  double total = 0.0;
  for (int64_t u = 0; u < num_unique; ++u) total += p.sum_sq[u];
  const float norm = float(std::sqrt(total));
  if (gate && !std::isfinite(norm)) {
    for (int64_t u = 0; u < num_unique; ++u) {
      if (!ui::HasRow(sh, rows[u])) continue;
      std::memcpy(sh.table + int64_t(rows[u]) * sh.table_words, p.undo + p.log.At(0, u),
                  d * sizeof(float));
      for (int k = 0; k < Rule::kNumSlots; ++k)
        std::memcpy(sh.slot[k] + int64_t(rows[u]) * sh.slot_row_bytes[k],
                    p.undo + p.log.At(k + 1, u), sh.slot_row_bytes[k]);
    }
  }
  timer.Lap(kNormAndGate);
  return norm;
}

// The owner-side update of already summed rows:
//   rows (num_unique,) distinct local rows, -1 for padding;
//   per_row (num_unique, Rule::kPerRow); grads (num_unique, dim).
template <class Rule, class Pool>
void RowUpdate(Pool* pool, const Shard& sh, const Rule& rule,
               const int32_t* rows, int64_t num_unique, const float* per_row,
               const float* grads) {
  namespace ui = update_internal;
  ui::RowPass p{&sh, rows, grads, per_row, num_unique, ui::Chunks(pool)};
  ParallelFor(pool, p.chunks, [&](int c) { ui::RowChunkAny(rule, p, c); });
}

}  // namespace pallas_emb

#endif  // PALLAS_EMB_CSRC_SPARSE_UPDATE_H_
