// The dynamic vocabulary's native map steps on raw arrays (csrc/id_map.cc),
// shared by the FFI handlers of id_map.cc and id_map_translate.cc.

#ifndef PALLAS_EMB_ID_MAP_CORE_H_
#define PALLAS_EMB_ID_MAP_CORE_H_

#include <cstdint>
#include <cstring>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace pallas_emb {

// The output buffer of a map array, holding the input's values (XLA aliases
// them when it can; otherwise this copies).
template <xla::ffi::DataType D>
auto* Carry(xla::ffi::Buffer<D>& in, xla::ffi::ResultBuffer<D>& out) {
  auto* dst = out->typed_data();
  if (dst != in.typed_data())
    std::memcpy(dst, in.typed_data(), in.element_count() * sizeof(*dst));
  return dst;
}

// A shard's map arrays (cap slots; sketch depth x width, depth 0 when
// admission does not use it) and the policy of its steps.
struct MapArrays {
  uint32_t* key_hi;
  uint32_t* key_lo;
  float* count;
  int32_t* last;
  int32_t* sketch;
  int64_t cap, depth, width;
};
struct StepPolicy {
  int64_t probe_limit, admit_after, policy;
  bool evict_on_insert;
  int64_t evict_every;
  float decay;
  int64_t ttl;
  bool train;
};

namespace ffi_types = xla::ffi;

// The map a step updates, from a handler's six map arguments and results:
// the results hold the arguments' values (Carry); admit_after > 1 uses the
// sketch.
inline MapArrays CarryMap(ffi_types::Buffer<ffi_types::U32>& key_hi_in,
                          ffi_types::Buffer<ffi_types::U32>& key_lo_in,
                          ffi_types::Buffer<ffi_types::F32>& count_in,
                          ffi_types::Buffer<ffi_types::S32>& last_in,
                          ffi_types::Buffer<ffi_types::S32>& sketch_in,
                          ffi_types::ResultBuffer<ffi_types::U32>& key_hi_out,
                          ffi_types::ResultBuffer<ffi_types::U32>& key_lo_out,
                          ffi_types::ResultBuffer<ffi_types::F32>& count_out,
                          ffi_types::ResultBuffer<ffi_types::S32>& last_out,
                          ffi_types::ResultBuffer<ffi_types::S32>& sketch_out,
                          int64_t admit_after) {
  const auto dims = sketch_in.dimensions();
  return {Carry(key_hi_in, key_hi_out),
          Carry(key_lo_in, key_lo_out),
          Carry(count_in, count_out),
          Carry(last_in, last_out),
          Carry(sketch_in, sketch_out),
          int64_t(key_hi_in.element_count()),
          admit_after > 1 ? dims[0] : 0,
          dims[1]};
}

// The bindings both map handlers share: the map's six arrays as arguments
// or results, and the step's policy attributes (StepPolicy's, in order).
template <typename Binding>
auto BindMapArgs(Binding b) {
  return std::move(b).template Arg<ffi_types::Buffer<ffi_types::U32>>()
      .template Arg<ffi_types::Buffer<ffi_types::U32>>()
      .template Arg<ffi_types::Buffer<ffi_types::F32>>()
      .template Arg<ffi_types::Buffer<ffi_types::S32>>()
      .template Arg<ffi_types::Buffer<ffi_types::S32>>()
      .template Arg<ffi_types::BufferR0<ffi_types::S32>>();
}
template <typename Binding>
auto BindMapRets(Binding b) {
  return std::move(b).template Ret<ffi_types::Buffer<ffi_types::U32>>()
      .template Ret<ffi_types::Buffer<ffi_types::U32>>()
      .template Ret<ffi_types::Buffer<ffi_types::F32>>()
      .template Ret<ffi_types::Buffer<ffi_types::S32>>()
      .template Ret<ffi_types::Buffer<ffi_types::S32>>()
      .template Ret<ffi_types::BufferR0<ffi_types::S32>>();
}
template <typename Binding>
auto BindPolicyAttrs(Binding b) {
  return std::move(b).template Attr<int64_t>("probe_limit")
      .template Attr<int64_t>("admit_after")
      .template Attr<int64_t>("policy")
      .template Attr<bool>("evict_on_insert")
      .template Attr<int64_t>("evict_every")
      .template Attr<float>("decay")
      .template Attr<int64_t>("ttl")
      .template Attr<bool>("train");
}

// PeKeyPlan's work: t tokens' keys (hi, lo; valid false for padding) into
// num_shards * capacity send slots; token_slot (t,) each token's slot or -1.
void PlanKeys(const uint32_t* hi, const uint32_t* lo, const bool* valid, int64_t t,
              int64_t num_shards, int64_t capacity, int32_t* token_slot, uint32_t* send_hi,
              uint32_t* send_lo, int32_t* send_count);

// A one-shard translation's answers: token_slot (t,) each token's slot, its
// key's through the key's send slot (sent, PlanKeys's token_slot) and rank
// (StepMap's slot_uid, slot); -1 for padding, a key over capacity or a key
// given no slot.
inline void AnswerTokens(const int32_t* sent, const int32_t* slot_uid, const int32_t* slot,
                         int64_t t, int32_t* token_slot) {
  for (int64_t i = 0; i < t; ++i) {
    const int32_t uid = sent[i] >= 0 ? slot_uid[sent[i]] : -1;
    token_slot[i] = uid >= 0 ? slot[uid] : -1;
  }
}

// PeIdMapStep's work on n received slots: the map updated in place; slot,
// slot_uid and reset (n,) and stats (4,) as PeIdMapStep's outputs. Returns
// the map's next step.
int32_t StepMap(const MapArrays& map, int32_t step, const uint32_t* recv_hi,
                const uint32_t* recv_lo, const int32_t* recv_count, int64_t n,
                const bool* usable, const StepPolicy& p, int32_t* slot, int32_t* slot_uid,
                int32_t* reset, int32_t* stats);

}  // namespace pallas_emb

#endif  // PALLAS_EMB_ID_MAP_CORE_H_
