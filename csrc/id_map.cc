// The dynamic vocabulary's per-device work on CPU, bit for bit what the XLA
// code of sharding/key_route.py and sharding/id_map.py computes:
//
// PeKeyPlan: a source's half of key_route.plan before the all_to_all.
//   hi, lo (T,) uint32 key words; valid (T,) pred
//   -> token_slot (T,) int32 send slot of each token, -1 without one
//      send_hi, send_lo (S * K,) uint32 each distinct key once, in
//        (owner, hi, lo) order within its owner's block of K; PAD-filled
//      send_count (S * K,) int32 occurrences of each sent key
//   attrs: num_shards S, capacity K
//
// PeIdMapStep: an owner's half of id_map.translate between the all_to_alls
// (id_map.owner_step): dedup of the received keys, sweep, lookup, sketch,
// insertion rounds and victims.
//   key_hi, key_lo (C,) uint32; count (C,) f32; last (C,) int32;
//   sketch (D, W) int32; step () int32 (the map, aliased to the outputs);
//   recv_hi, recv_lo (n,) uint32; recv_count (n,) int32; usable (C,) pred
//   -> the new map (6 outputs), slot (n,) int32 per distinct key (rank
//      order), slot_uid (n,) int32 rank of each received slot's key or -1,
//      reset (n,) int32 the slots given a new key, in rank order, then -1;
//      stats (4,) int32: evicted, inserted, not admitted, failed
//
// The XLA code resolves each insertion round with a scatter-min over the
// claims, the lowest rank winning a slot; here the keys of a round are
// visited in rank order and each takes its slot if it is still free, which
// picks the same winners: a slot taken earlier in the round or step is no
// longer free, and no round frees a slot.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "id_map_core.h"
#include "keyed_sort.h"
#include "probe_window.h"
#include "thread_scratch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pallas_emb {
namespace {

constexpr uint32_t kPad = 0xFFFFFFFFu;
constexpr int64_t kLfu = 0, kTtl = 2;  // id_map_policy codes (kernels/native_id_map.py)
constexpr uint32_t kMul1 = 0x85EBCA6Bu, kMul2 = 0xC2B2AE35u;
constexpr uint32_t kSalts[8] = {0x9E3779B9u, 0x7F4A7C15u, 0xF39CC060u, 0x5CEDC834u,
                                0x1B873593u, 0xCC9E2D51u, 0xE6546B64u, 0x27D4EB2Fu};

struct Scratch {
  std::vector<Keyed> keyed, tmp;
  std::vector<int32_t> offsets, fill, table_uid, token_uid, uid_slot;
  std::vector<uint64_t> u_key, matches;
  std::vector<uint32_t> u_hi, u_lo;
  std::vector<int32_t> u_cnt, estimate, victim, home, waiting;
  std::vector<uint32_t> hist;
  std::vector<uint8_t> left, admitted;
};

}  // namespace

void PlanKeys(const uint32_t* hi, const uint32_t* lo, const bool* valid, int64_t t,
              int64_t num_shards, int64_t capacity, int32_t* token_slot, uint32_t* send_hi,
              uint32_t* send_lo, int32_t* send_count) {
  const int64_t slots = num_shards * capacity;
  std::fill(token_slot, token_slot + t, -1);
  std::fill(send_hi, send_hi + slots, kPad);
  std::fill(send_lo, send_lo + slots, kPad);
  std::fill(send_count, send_count + slots, 0);

  // The distinct keys first (a step's ids repeat: the drift benchmark's
  // 4,096 hold about 1,400 keys), so that only they are sorted: an
  // open-addressing table of at least 2t entries, probed linearly from a
  // multiplicative hash of the key.
  Scratch& s = ThreadScratch<Scratch>();
  int bits = 1;
  while ((int64_t(1) << bits) < 2 * t) ++bits;
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  s.table_uid.assign(mask + 1, -1);
  s.token_uid.resize(t);
  s.u_key.clear();
  s.u_cnt.clear();
  for (int64_t i = 0; i < t; ++i) {
    if (!valid[i]) continue;
    const uint64_t key = uint64_t(hi[i]) << 32 | lo[i];
    uint64_t h = (key * 0x9E3779B97F4A7C15ull) >> (64 - bits);
    while (s.table_uid[h] >= 0 && s.u_key[s.table_uid[h]] != key) h = (h + 1) & mask;
    if (s.table_uid[h] < 0) {
      s.table_uid[h] = int32_t(s.u_key.size());
      s.u_key.push_back(key);
      s.u_cnt.push_back(0);
    }
    s.token_uid[i] = s.table_uid[h];
    ++s.u_cnt[s.table_uid[h]];
  }
  // The keys bucketed by owner (a counting sort), each bucket sorted; a
  // key's send slot is its place in its owner's bucket.
  const int64_t nu = int64_t(s.u_key.size());
  const FastMod owner_of{uint32_t(num_shards)};
  s.offsets.assign(num_shards + 1, 0);
  for (int64_t u = 0; u < nu; ++u) ++s.offsets[owner_of(uint32_t(s.u_key[u] >> 32)) + 1];
  for (int64_t o = 0; o < num_shards; ++o) s.offsets[o + 1] += s.offsets[o];
  s.keyed.resize(nu);
  s.fill.assign(s.offsets.begin(), s.offsets.end() - 1);
  for (int64_t u = 0; u < nu; ++u)
    s.keyed[s.fill[owner_of(uint32_t(s.u_key[u] >> 32))]++] = {s.u_key[u], int32_t(u)};
  s.uid_slot.assign(nu, -1);
  for (int64_t o = 0; o < num_shards; ++o) {
    Keyed* first = s.keyed.data() + s.offsets[o];
    Keyed* last = s.keyed.data() + s.offsets[o + 1];
    SortByKey(first, last, s.tmp, s.hist);
    // The keys past capacity overflow: their tokens get no slot.
    for (int64_t position = 0; position < std::min<int64_t>(last - first, capacity); ++position) {
      const Keyed& e = first[position];
      const int64_t slot = o * capacity + position;
      send_hi[slot] = uint32_t(e.key >> 32);
      send_lo[slot] = uint32_t(e.key);
      send_count[slot] = s.u_cnt[e.index];
      s.uid_slot[e.index] = int32_t(slot);
    }
  }
  for (int64_t i = 0; i < t; ++i)
    if (valid[i]) token_slot[i] = s.uid_slot[s.token_uid[i]];
}

namespace {

ffi::Error KeyPlan(ffi::Buffer<ffi::U32> hi_buf, ffi::Buffer<ffi::U32> lo_buf,
                   ffi::Buffer<ffi::PRED> valid_buf, int64_t num_shards, int64_t capacity,
                   ffi::ResultBuffer<ffi::S32> token_slot_buf,
                   ffi::ResultBuffer<ffi::U32> send_hi_buf,
                   ffi::ResultBuffer<ffi::U32> send_lo_buf,
                   ffi::ResultBuffer<ffi::S32> send_count_buf) {
  if (num_shards < 1 || capacity < 1 ||
      send_hi_buf->element_count() != size_t(num_shards * capacity))
    return ffi::Error::InvalidArgument("PeKeyPlan: send buffers must hold num_shards * capacity");
  PlanKeys(hi_buf.typed_data(), lo_buf.typed_data(), valid_buf.typed_data(),
           hi_buf.element_count(), num_shards, capacity, token_slot_buf->typed_data(),
           send_hi_buf->typed_data(), send_lo_buf->typed_data(), send_count_buf->typed_data());
  return ffi::Error::Success();
}

// A sketch row is halved once it holds width / kSketchSampleDivisor
// increments (sharding.sketch.SKETCH_SAMPLE_DIVISOR).
constexpr int64_t kSketchSampleDivisor = 4;

uint32_t SketchCell(uint32_t hi, uint32_t lo, uint32_t d, uint32_t width) {
  uint32_t x = (hi ^ kSalts[d % 8]) * kMul1;
  x = (x ^ lo ^ d) * kMul2;
  x ^= x >> 16;
  return x % width;
}

}  // namespace

int32_t StepMap(const MapArrays& map, int32_t step, const uint32_t* recv_hi,
                const uint32_t* recv_lo, const int32_t* recv_count, int64_t n,
                const bool* usable, const StepPolicy& p, int32_t* slot, int32_t* slot_uid,
                int32_t* reset, int32_t* stats) {
  uint32_t* key_hi = map.key_hi;
  uint32_t* key_lo = map.key_lo;
  float* count = map.count;
  int32_t* last = map.last;
  int32_t* sketch = map.sketch;
  const int64_t cap = map.cap, depth = map.depth, width = map.width;
  const int64_t probe_limit = p.probe_limit, admit_after = p.admit_after, policy = p.policy;
  const bool evict_on_insert = p.evict_on_insert, train = p.train;
  const int64_t evict_every = p.evict_every, ttl = p.ttl;
  const float decay = p.decay;
  std::fill(slot, slot + n, -1);
  std::fill(slot_uid, slot_uid + n, -1);
  std::fill(reset, reset + n, -1);

  // 1. The distinct keys received, ascending: a key's rank is its uid. An
  // owner with one source receives them sorted and distinct (one pass);
  // otherwise they are sorted first.
  Scratch& s = ThreadScratch<Scratch>();
  s.u_hi.clear();
  s.u_lo.clear();
  s.u_cnt.clear();
  uint64_t previous = 0;
  bool ascending = true;
  for (int64_t i = 0; i < n && ascending; ++i) {
    if (recv_count[i] <= 0) continue;
    const uint64_t key = uint64_t(recv_hi[i]) << 32 | recv_lo[i];
    ascending = s.u_hi.empty() || key > previous;
    previous = key;
    s.u_hi.push_back(recv_hi[i]);
    s.u_lo.push_back(recv_lo[i]);
    s.u_cnt.push_back(recv_count[i]);
    slot_uid[i] = int32_t(s.u_hi.size() - 1);
  }
  if (!ascending) {
    std::fill(slot_uid, slot_uid + n, -1);
    s.keyed.clear();
    for (int64_t i = 0; i < n; ++i)
      if (recv_count[i] > 0)
        s.keyed.push_back({uint64_t(recv_hi[i]) << 32 | recv_lo[i], int32_t(i)});
    SortByKey(s.keyed.data(), s.keyed.data() + s.keyed.size(), s.tmp, s.hist);
    s.u_hi.clear();
    s.u_lo.clear();
    s.u_cnt.clear();
    for (size_t j = 0; j < s.keyed.size(); ++j) {
      const Keyed& e = s.keyed[j];
      if (j == 0 || e.key != s.keyed[j - 1].key) {
        s.u_hi.push_back(uint32_t(e.key >> 32));
        s.u_lo.push_back(uint32_t(e.key));
        s.u_cnt.push_back(0);
      }
      s.u_cnt.back() += recv_count[e.index];
      slot_uid[e.index] = int32_t(s.u_hi.size() - 1);
    }
  }
  const int64_t nu = int64_t(s.u_hi.size());
  // Slot r of key u's window: its home slot, plus r, wrapped (r < cap).
  const FastMod home_of{uint32_t(cap)};
  s.home.resize(nu);
  for (int64_t u = 0; u < nu; ++u) s.home[u] = int32_t(home_of(s.u_lo[u]));
  auto pos = [&](int64_t u, int64_t r) {
    const int32_t p = s.home[u] + int32_t(r);
    return p >= cap ? p - int32_t(cap) : p;
  };

  // 2. The periodic sweep.
  int32_t evicted = 0, inserted = 0, not_admitted = 0, failed = 0;
  if (train && evict_every > 0 && step > 0 && step % evict_every == 0) {
    if (policy == kLfu && decay != 1.0f)
      for (int64_t j = 0; j < cap; ++j) count[j] = count[j] * decay;
    if (ttl >= 0)
      for (int64_t j = 0; j < cap; ++j) {  // no branch: expiry is data, mixed
        const bool expire = (last[j] >= 0) & (step - last[j] >= ttl);
        last[j] |= -int32_t(expire);  // -1 if expired
        evicted += expire;
      }
  }

  // 3. Resident keys, found in their window: the low words first, which rule
  // out nearly every other slot, then the candidates' high words.
  const MapView view{key_hi, key_lo, count, last, int32_t(cap)};
  const ProbeWindows windows(view, probe_limit);
  if (windows.masks_fit()) {
    s.matches.resize(nu);
    for (int64_t u = 0; u < nu; ++u) s.matches[u] = windows.LowMatches(s.home[u], s.u_lo[u]);
    for (int64_t u = 0; u < nu; ++u) slot[u] = windows.Resolve(s.home[u], s.matches[u], s.u_hi[u]);
  } else {
    for (int64_t u = 0; u < nu; ++u) slot[u] = windows.Find(s.home[u], s.u_hi[u], s.u_lo[u]);
  }
  if (!train) {
    std::fill(stats, stats + 4, 0);
    return step;
  }
  s.left.assign(nu, 0);
  s.estimate.assign(nu, 0);
  for (int64_t u = 0; u < nu; ++u) {
    if (slot[u] >= 0) {
      count[slot[u]] += float(s.u_cnt[u]);
      last[slot[u]] = step;
    } else {
      s.left[u] = 1;  // waiting: admitted below, or not
      s.estimate[u] = s.u_cnt[u];
    }
  }
  // 4. Admission: the sketch halved if full (sharding.sketch.age_sketch),
  // every waiting key counted in it, then estimated.
  if (depth > 0) {
    int64_t fullest = 0;
    for (int64_t d = 0; d < depth; ++d) {
      int64_t sum = 0;
      for (int64_t c = 0; c < width; ++c) sum += sketch[d * width + c];
      fullest = std::max(fullest, sum);
    }
    if (fullest >= std::max<int64_t>(width / kSketchSampleDivisor, 1))
      for (int64_t c = 0; c < depth * width; ++c) sketch[c] >>= 1;
    for (int64_t u = 0; u < nu; ++u)
      if (s.left[u])
        for (int64_t d = 0; d < depth; ++d)
          sketch[d * width + SketchCell(s.u_hi[u], s.u_lo[u], d, width)] += s.u_cnt[u];
    for (int64_t u = 0; u < nu; ++u) {
      if (!s.left[u]) continue;
      int32_t est = std::numeric_limits<int32_t>::max();
      for (int64_t d = 0; d < depth; ++d)
        est = std::min(est, sketch[d * width + SketchCell(s.u_hi[u], s.u_lo[u], d, width)]);
      s.estimate[u] = est;
      if (est < admit_after) s.left[u] = 0, ++not_admitted;
    }
  }
  s.admitted = s.left;
  auto take = [&](int64_t u, int32_t p) {
    key_hi[p] = s.u_hi[u];
    key_lo[p] = s.u_lo[u];
    count[p] = float(s.u_cnt[u]);
    last[p] = step;
    slot[u] = p;
    s.left[u] = 0;
  };
  // 5. Insertion rounds: in round r each admitted key still waiting, in rank
  // order, takes home + r if that slot is free (unused and usable). No round
  // frees a slot, so a slot free when a round reaches it was free when the
  // step began: the rounds read the slots as they reach them, where the XLA
  // code masks each window once.
  s.waiting.resize(nu);  // the keys left, in rank order; no branch per key
  size_t n_waiting = 0;
  for (int64_t u = 0; u < nu; ++u) {
    s.waiting[n_waiting] = int32_t(u);
    n_waiting += s.left[u];
  }
  int32_t* const waiting = s.waiting.data();
  for (int64_t r = 0; r < probe_limit && n_waiting > 0; ++r) {
    size_t kept = 0;
    for (size_t i = 0; i < n_waiting; ++i) {
      const int32_t u = waiting[i], q = pos(u, r);
      if ((last[q] < 0) & usable[q])
        take(u, q);
      else
        waiting[kept++] = u;
    }
    n_waiting = kept;
  }
  s.waiting.resize(n_waiting);
  // 6. The keys still waiting (in rank order) take their victims
  // (probe_window.h), all chosen before any is taken (a victim two keys
  // chose goes to the lower rank). The rounds took only free slots, which
  // are never victims, and left every other slot as it was: these are the
  // victims of the map before the rounds.
  if (evict_on_insert) {
    const VictimRule rule{
      step - int32_t(policy == kTtl ? std::max<int64_t>(ttl, 2) : 2), policy == kLfu};
    s.victim.resize(s.waiting.size());
    for (size_t i = 0; i < s.waiting.size(); ++i) {
      const int32_t u = s.waiting[i], v = windows.Victim(s.home[u], rule);
      s.victim[i] = v >= 0 && (!rule.lfu || count[v] <= float(s.estimate[u])) ? v : -1;
    }
    for (size_t i = 0; i < s.waiting.size(); ++i) {
      const int32_t p = s.victim[i];
      if (p >= 0 && last[p] != step) take(s.waiting[i], p), ++evicted;
    }
  }
  for (int64_t u = 0; u < nu; ++u) {  // no branch: each key's case is data
    reset[inserted] = slot[u];
    inserted += s.admitted[u] & !s.left[u];
    failed += s.left[u];
  }
  if (inserted < n) reset[inserted] = -1;  // written by a key not inserted
  stats[0] = evicted;
  stats[1] = inserted;
  stats[2] = not_admitted;
  stats[3] = failed;
  return step + 1;
}

namespace {

ffi::Error IdMapStep(ffi::Buffer<ffi::U32> key_hi_in, ffi::Buffer<ffi::U32> key_lo_in,
                     ffi::Buffer<ffi::F32> count_in, ffi::Buffer<ffi::S32> last_in,
                     ffi::Buffer<ffi::S32> sketch_in, ffi::BufferR0<ffi::S32> step_in,
                     ffi::Buffer<ffi::U32> recv_hi_buf, ffi::Buffer<ffi::U32> recv_lo_buf,
                     ffi::Buffer<ffi::S32> recv_count_buf, ffi::Buffer<ffi::PRED> usable_buf,
                     int64_t probe_limit, int64_t admit_after, int64_t policy,
                     bool evict_on_insert, int64_t evict_every, float decay, int64_t ttl,
                     bool train, ffi::ResultBuffer<ffi::U32> key_hi_out,
                     ffi::ResultBuffer<ffi::U32> key_lo_out, ffi::ResultBuffer<ffi::F32> count_out,
                     ffi::ResultBuffer<ffi::S32> last_out, ffi::ResultBuffer<ffi::S32> sketch_out,
                     ffi::ResultBufferR0<ffi::S32> step_out, ffi::ResultBuffer<ffi::S32> slot_buf,
                     ffi::ResultBuffer<ffi::S32> slot_uid_buf,
                     ffi::ResultBuffer<ffi::S32> reset_buf, ffi::ResultBuffer<ffi::S32> stats_buf) {
  const int64_t cap = key_hi_in.element_count();
  if (probe_limit < 1 || probe_limit > cap)
    return ffi::Error::InvalidArgument("PeIdMapStep: probe_limit must be in [1, capacity]");
  const MapArrays map = CarryMap(key_hi_in, key_lo_in, count_in, last_in, sketch_in, key_hi_out,
                                 key_lo_out, count_out, last_out, sketch_out, admit_after);
  const StepPolicy p{probe_limit, admit_after, policy, evict_on_insert,
                     evict_every, decay,       ttl,    train};
  *step_out->typed_data() =
      StepMap(map, *step_in.typed_data(), recv_hi_buf.typed_data(), recv_lo_buf.typed_data(),
              recv_count_buf.typed_data(), recv_hi_buf.element_count(), usable_buf.typed_data(),
              p, slot_buf->typed_data(), slot_uid_buf->typed_data(), reset_buf->typed_data(),
              stats_buf->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pallas_emb

XLA_FFI_DEFINE_HANDLER_SYMBOL(PeKeyPlan, pallas_emb::KeyPlan,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Attr<int64_t>("num_shards")
                                  .Attr<int64_t>("capacity")
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    PeIdMapStep, pallas_emb::IdMapStep,
    pallas_emb::BindMapRets(
        pallas_emb::BindPolicyAttrs(pallas_emb::BindMapArgs(xla::ffi::Ffi::Bind())
                                        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                        .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()))
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>());
