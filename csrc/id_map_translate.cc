// PeIdMapTranslate1: a one-shard table's whole translation, PeKeyPlan and
// PeIdMapStep back to back on the keys the plan would send, with no buffers
// between them (id_map.translate with a one-shard impl).
//   the map (6, aliased), hi, lo (T,) uint32, valid (T,) pred, usable (C,)
//   pred; attrs: key_capacity K and PeIdMapStep's
//   -> the new map (6 outputs), token_slot (T,) int32 each token's local
//      slot, -1 for padding, an overflowing key or a key given no slot;
//      reset (K,) int32 and stats (4,) int32 as PeIdMapStep's

#include <cstdint>
#include <vector>

#include "id_map_core.h"
#include "thread_scratch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pallas_emb {
namespace {

// What the plan sends and the step answers, between the two (ThreadScratch).
struct Between {
  std::vector<int32_t> sent, send_count, slot, slot_uid;
  std::vector<uint32_t> send_hi, send_lo;
};

// PeIdMapTranslate1: a one-shard table's whole translation (PeKeyPlan, then
// PeIdMapStep on what it would send, then each token's answer), with no
// buffers between them.
ffi::Error IdMapTranslate1(
    ffi::Buffer<ffi::U32> key_hi_in, ffi::Buffer<ffi::U32> key_lo_in,
    ffi::Buffer<ffi::F32> count_in, ffi::Buffer<ffi::S32> last_in,
    ffi::Buffer<ffi::S32> sketch_in, ffi::BufferR0<ffi::S32> step_in,
    ffi::Buffer<ffi::U32> hi_buf, ffi::Buffer<ffi::U32> lo_buf, ffi::Buffer<ffi::PRED> valid_buf,
    ffi::Buffer<ffi::PRED> usable_buf, int64_t key_capacity, int64_t probe_limit,
    int64_t admit_after, int64_t policy, bool evict_on_insert, int64_t evict_every, float decay,
    int64_t ttl, bool train, ffi::ResultBuffer<ffi::U32> key_hi_out,
    ffi::ResultBuffer<ffi::U32> key_lo_out, ffi::ResultBuffer<ffi::F32> count_out,
    ffi::ResultBuffer<ffi::S32> last_out, ffi::ResultBuffer<ffi::S32> sketch_out,
    ffi::ResultBufferR0<ffi::S32> step_out, ffi::ResultBuffer<ffi::S32> token_slot_buf,
    ffi::ResultBuffer<ffi::S32> reset_buf, ffi::ResultBuffer<ffi::S32> stats_buf) {
  const int64_t cap = key_hi_in.element_count(), t = hi_buf.element_count(), k = key_capacity;
  if (probe_limit < 1 || probe_limit > cap || k < 1 || reset_buf->element_count() != size_t(k))
    return ffi::Error::InvalidArgument(
        "PeIdMapTranslate1: probe_limit must be in [1, capacity], reset hold key_capacity");
  Between& b = ThreadScratch<Between>();
  b.sent.resize(t);
  b.send_hi.resize(k);
  b.send_lo.resize(k);
  b.send_count.resize(k);
  b.slot.resize(k);
  b.slot_uid.resize(k);
  PlanKeys(hi_buf.typed_data(), lo_buf.typed_data(), valid_buf.typed_data(), t, 1, k,
           b.sent.data(), b.send_hi.data(), b.send_lo.data(), b.send_count.data());
  const MapArrays map = CarryMap(key_hi_in, key_lo_in, count_in, last_in, sketch_in, key_hi_out,
                                 key_lo_out, count_out, last_out, sketch_out, admit_after);
  const StepPolicy p{probe_limit, admit_after, policy, evict_on_insert,
                     evict_every, decay,       ttl,    train};
  *step_out->typed_data() =
      StepMap(map, *step_in.typed_data(), b.send_hi.data(), b.send_lo.data(), b.send_count.data(),
              k, usable_buf.typed_data(), p, b.slot.data(), b.slot_uid.data(),
              reset_buf->typed_data(), stats_buf->typed_data());
  AnswerTokens(b.sent.data(), b.slot_uid.data(), b.slot.data(), t, token_slot_buf->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pallas_emb

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    PeIdMapTranslate1, pallas_emb::IdMapTranslate1,
    pallas_emb::BindMapRets(
        pallas_emb::BindPolicyAttrs(pallas_emb::BindMapArgs(xla::ffi::Ffi::Bind())
                                        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                        .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()
                                        .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()
                                        .Attr<int64_t>("key_capacity")))
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>());
