// The sparse update's XLA FFI handlers (algorithms: sparse_update.h).
//
//   Pe<Rule>SegsumUpdate(table, rows, inverse, grads, scalars, per_row, gate,
//                        *slots) -> (table, norm, *slots)
//   Pe<Rule>RowUpdate(table, rows, grads, scalars, per_row, apply, *slots)
//                     -> (table, *slots)
//
// Rules (row_rules.h): Sgd, Adagrad, RowwiseAdagrad (and its lazy decay),
// LazyAdam, Ftrl. The slots come in the rule's order, last, in any shape
// with the bytes of (rows, width) in row-major order (a per-row scalar may
// be stored lane-dense, (rows / 128, 128)). The table and slots are aliased
// to the outputs (input_output_aliases), so a donated table is updated where
// it lies.

#include <cstdint>

#include "sparse_update.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pallas_emb {
namespace {

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
using Pred = ffi::BufferR0<ffi::PRED>;

// The shard of `table` and the slots in `slots`/`slots_out` (aliased),
// checked against the rule.
template <class Rule>
ffi::Error CheckShard(const F32& table, ffi::Result<F32>& table_out,
                      const ffi::RemainingArgs& slots,
                      const ffi::RemainingRets& slots_out, const F32& scalars,
                      const F32& per_row, int64_t num_unique, const F32& grads,
                      Shard* sh) {
  // The row width comes from the gradients: a table of rows narrower than
  // 128 lanes may be stored packed, (rows * dim / 128, 128), the same bytes
  // in the same order as (rows, dim) (see pallas_emb/packing.py).
  const auto dims = table.dimensions();
  const auto grad_dims = grads.dimensions();
  if (dims.size() != 2u || grad_dims.size() != 2u || grad_dims[1] <= 0 ||
      int64_t(table.element_count()) % grad_dims[1] != 0)
    return ffi::Error::InvalidArgument(
        "table must be (rows, dim), or packed, and grads (n, dim)");
  if (table.untyped_data() != table_out->untyped_data())
    return ffi::Error::InvalidArgument(
        "table must be aliased to the output (input_output_aliases)");
  if (int64_t(scalars.element_count()) != Rule::kNumScalars)
    return ffi::Error::InvalidArgument("wrong number of scalars for the rule");
  if (int64_t(per_row.element_count()) != num_unique * Rule::kPerRow)
    return ffi::Error::InvalidArgument(
        "per_row must be (rows, number of per-row values of the rule)");
  sh->table = table_out->typed_data();
  sh->dim = grad_dims[1];
  sh->num_rows = int64_t(table.element_count()) / sh->dim;
  if (int64_t(slots.size()) != Rule::kNumSlots ||
      int64_t(slots_out.size()) != Rule::kNumSlots)
    return ffi::Error::InvalidArgument("wrong number of slots for the rule");
  for (int s = 0; s < Rule::kNumSlots; ++s) {
    auto in = slots.get<ffi::AnyBuffer>(s);
    auto out = slots_out.get<ffi::AnyBuffer>(s);
    if (!in.has_value() || !out.has_value())
      return ffi::Error::InvalidArgument("a slot is not a buffer");
    const int64_t width = Rule::kSlotWidth[s] < 0 ? sh->dim : Rule::kSlotWidth[s];
    const auto type = Rule::kSlotIsInt[s] ? ffi::DataType::S32 : ffi::DataType::F32;
    if (in->element_type() != type)
      return ffi::Error::InvalidArgument("a slot has the wrong dtype for the rule");
    if (int64_t(in->element_count()) != sh->num_rows * width)
      return ffi::Error::InvalidArgument(
          "a slot must hold rows * (width of the rule) elements");
    if (in->untyped_data() != (*out)->untyped_data())
      return ffi::Error::InvalidArgument(
          "slots must be aliased to the outputs (input_output_aliases)");
    sh->slot[s] = static_cast<char*>((*out)->untyped_data());
    sh->slot_row_bytes[s] = width * 4;
  }
  return ffi::Error::Success();
}

template <class Rule>
ffi::Error Segsum(ffi::ThreadPool pool, F32 table, S32 rows, S32 inverse,
                  F32 grads, F32 scalars, F32 per_row, Pred gate,
                  ffi::RemainingArgs slots, ffi::Result<F32> table_out,
                  ffi::ResultBufferR0<ffi::F32> norm,
                  ffi::RemainingRets slots_out) {
  Shard sh;
  const int64_t num_unique = rows.element_count();
  if (auto e = CheckShard<Rule>(table, table_out, slots, slots_out, scalars,
                                per_row, num_unique, grads, &sh); e.failure())
    return e;
  const int64_t n = inverse.element_count();
  if (int64_t(grads.element_count()) != n * sh.dim)
    return ffi::Error::InvalidArgument("grads must be (tokens, dim)");
  *norm->typed_data() = SegsumUpdate(
      &pool, sh, Rule(scalars.typed_data()), rows.typed_data(), num_unique,
      inverse.typed_data(), per_row.typed_data(), grads.typed_data(), n,
      *gate.typed_data());
  return ffi::Error::Success();
}

template <class Rule>
ffi::Error Row(ffi::ThreadPool pool, F32 table, S32 rows, F32 grads,
               F32 scalars, F32 per_row, Pred apply, ffi::RemainingArgs slots,
               ffi::Result<F32> table_out, ffi::RemainingRets slots_out) {
  Shard sh;
  const int64_t num_unique = rows.element_count();
  if (auto e = CheckShard<Rule>(table, table_out, slots, slots_out, scalars,
                                per_row, num_unique, grads, &sh); e.failure())
    return e;
  if (int64_t(grads.element_count()) != num_unique * sh.dim)
    return ffi::Error::InvalidArgument("grads must be (rows, dim)");
  if (*apply.typed_data())
    RowUpdate(&pool, sh, Rule(scalars.typed_data()), rows.typed_data(),
              num_unique, per_row.typed_data(), grads.typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pallas_emb

namespace pe = pallas_emb;
using pe::F32;
using pe::Pred;
using pe::S32;

#define PE_HANDLERS(PREFIX, RULE)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                              \
      PREFIX##SegsumUpdate, pe::Segsum<pe::RULE>,                             \
      ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<S32>()           \
          .Arg<S32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<Pred>()            \
          .RemainingArgs().Ret<F32>().Ret<ffi::BufferR0<ffi::F32>>()          \
          .RemainingRets());                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                              \
      PREFIX##RowUpdate, pe::Row<pe::RULE>,                                   \
      ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<S32>()           \
          .Arg<F32>().Arg<F32>().Arg<F32>().Arg<Pred>().RemainingArgs()       \
          .Ret<F32>().RemainingRets())

PE_HANDLERS(PeSgd, Sgd);
PE_HANDLERS(PeAdagrad, Adagrad);
PE_HANDLERS(PeRowwiseAdagrad, RowwiseAdagrad);
PE_HANDLERS(PeRowwiseAdagradLazy, RowwiseAdagradLazy);
PE_HANDLERS(PeLazyAdam, LazyAdam);
PE_HANDLERS(PeFtrl, Ftrl);
