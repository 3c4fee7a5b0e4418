// The sparse update's XLA FFI handlers (algorithms: sparse_update.h).
//
//   Pe<Rule>SegsumUpdate(table, rows, inverse, grads, scalars, per_row, gate,
//                        *slots) -> (table, norm, *slots)
//   Pe<Rule>RowUpdate(table, rows, grads, scalars, per_row, apply, *slots)
//                     -> (table, *slots)
//
// attrs (both): dim, table_words, slot_words (see CheckShard).
//
// Rules (row_rules.h): Sgd, Adagrad, RowwiseAdagrad (and its lazy decay),
// LazyAdam, Ftrl. The slots come in the rule's order, last, in any shape
// with the bytes of (rows, slot_words) in row-major order (a per-row scalar
// may be stored lane-dense, (rows / 128, 128)). The table and slots are aliased
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
// checked against the rule and against the stored widths the caller states:
// `dim` is the rows' logical width (the gradients' and the math's),
// `table_words` the words per stored table row (dim itself, or padded to a
// width that divides 128 or is a multiple of it; a packed table,
// (rows * table_words / 128, 128), has the same bytes in the same order),
// `slot_words[s]` the words per stored row of slot s. The width is never
// inferred from the gradients: a padded table read at the gradients' width
// would update the wrong rows (see pallas_emb/packing.py).
template <class Rule>
ffi::Error CheckShard(const F32& table, ffi::Result<F32>& table_out,
                      const ffi::RemainingArgs& slots,
                      const ffi::RemainingRets& slots_out, const F32& scalars,
                      const F32& per_row, int64_t num_unique, const F32& grads,
                      int64_t dim, int64_t table_words,
                      ffi::Span<const int64_t> slot_words, Shard* sh) {
  const auto grad_dims = grads.dimensions();
  if (dim < 1 || table_words < dim)
    return ffi::Error::InvalidArgument(
        "dim must be >= 1 and table_words >= dim (the stored row holds the "
        "logical row)");
  if (grad_dims.size() != 2u || grad_dims[1] != dim)
    return ffi::Error::InvalidArgument(
        "grads must be (n, dim): as wide as the table's logical rows");
  if (table.dimensions().size() != 2u ||
      int64_t(table.element_count()) % table_words != 0)
    return ffi::Error::InvalidArgument(
        "table must hold whole stored rows of table_words words");
  if (table.untyped_data() != table_out->untyped_data())
    return ffi::Error::InvalidArgument(
        "table must be aliased to the output (input_output_aliases)");
  if (int64_t(scalars.element_count()) != Rule::kNumScalars)
    return ffi::Error::InvalidArgument("wrong number of scalars for the rule");
  if (int64_t(per_row.element_count()) != num_unique * Rule::kPerRow)
    return ffi::Error::InvalidArgument(
        "per_row must be (rows, number of per-row values of the rule)");
  sh->table = table_out->typed_data();
  sh->dim = dim;
  sh->table_words = table_words;
  sh->num_rows = int64_t(table.element_count()) / table_words;
  if (int64_t(slots.size()) != Rule::kNumSlots ||
      int64_t(slots_out.size()) != Rule::kNumSlots ||
      int64_t(slot_words.size()) != Rule::kNumSlots)
    return ffi::Error::InvalidArgument("wrong number of slots for the rule");
  for (int s = 0; s < Rule::kNumSlots; ++s) {
    auto in = slots.get<ffi::AnyBuffer>(s);
    auto out = slots_out.get<ffi::AnyBuffer>(s);
    if (!in.has_value() || !out.has_value())
      return ffi::Error::InvalidArgument("a slot is not a buffer");
    const int64_t width = Rule::kSlotWidth[s] < 0 ? dim : Rule::kSlotWidth[s];
    const auto type = Rule::kSlotIsInt[s] ? ffi::DataType::S32 : ffi::DataType::F32;
    if (in->element_type() != type)
      return ffi::Error::InvalidArgument("a slot has the wrong dtype for the rule");
    if (slot_words[s] < width)
      return ffi::Error::InvalidArgument(
          "slot_words must hold the rule's slot width");
    if (int64_t(in->element_count()) != sh->num_rows * slot_words[s])
      return ffi::Error::InvalidArgument(
          "a slot must hold rows * slot_words elements");
    if (in->untyped_data() != (*out)->untyped_data())
      return ffi::Error::InvalidArgument(
          "slots must be aliased to the outputs (input_output_aliases)");
    sh->slot[s] = static_cast<char*>((*out)->untyped_data());
    sh->slot_row_bytes[s] = slot_words[s] * 4;
  }
  return ffi::Error::Success();
}

template <class Rule>
ffi::Error Segsum(ffi::ThreadPool pool, F32 table, S32 rows, S32 inverse,
                  F32 grads, F32 scalars, F32 per_row, Pred gate,
                  ffi::RemainingArgs slots, ffi::Result<F32> table_out,
                  ffi::ResultBufferR0<ffi::F32> norm,
                  ffi::RemainingRets slots_out, int64_t dim,
                  int64_t table_words, ffi::Span<const int64_t> slot_words) {
  Shard sh;
  const int64_t num_unique = rows.element_count();
  if (auto e = CheckShard<Rule>(table, table_out, slots, slots_out, scalars,
                                per_row, num_unique, grads, dim, table_words,
                                slot_words, &sh); e.failure())
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
               ffi::Result<F32> table_out, ffi::RemainingRets slots_out,
               int64_t dim, int64_t table_words,
               ffi::Span<const int64_t> slot_words) {
  Shard sh;
  const int64_t num_unique = rows.element_count();
  if (auto e = CheckShard<Rule>(table, table_out, slots, slots_out, scalars,
                                per_row, num_unique, grads, dim, table_words,
                                slot_words, &sh); e.failure())
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
          .RemainingRets().Attr<int64_t>("dim")                               \
          .Attr<int64_t>("table_words")                                       \
          .Attr<ffi::Span<const int64_t>>("slot_words"));                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                              \
      PREFIX##RowUpdate, pe::Row<pe::RULE>,                                   \
      ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<S32>()           \
          .Arg<F32>().Arg<F32>().Arg<F32>().Arg<Pred>().RemainingArgs()       \
          .Ret<F32>().RemainingRets().Attr<int64_t>("dim")                    \
          .Attr<int64_t>("table_words")                                       \
          .Attr<ffi::Span<const int64_t>>("slot_words"))

PE_HANDLERS(PeSgd, Sgd);
PE_HANDLERS(PeAdagrad, Adagrad);
PE_HANDLERS(PeRowwiseAdagrad, RowwiseAdagrad);
PE_HANDLERS(PeRowwiseAdagradLazy, RowwiseAdagradLazy);
PE_HANDLERS(PeLazyAdam, LazyAdam);
PE_HANDLERS(PeFtrl, Ftrl);
