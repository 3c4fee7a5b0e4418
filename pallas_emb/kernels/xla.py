"""The gather and the fused update in plain XLA.

The oracle for the Pallas kernels and the fast path off TPU. Both functions
work on one device's row shard, validate their arguments with the kernels'
own checks, and call the optimizer's `update_rows`, like the kernels do.
Tables and slots may be stored packed (`pallas_emb.packing`): rows are read
and written as sub-rows of their physical rows, never through a reshape of
the whole array (on a TPU that is a relayout of the whole shard).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_emb import packing, stored_rows
from pallas_emb.kernels import checks
from pallas_emb.kernels.protocol import RowUpdate


def _out_of_bounds(rows: jax.Array, size: int, keep: jax.Array) -> jax.Array:
  # An index past the end makes gathers fill and scatters drop.
  return jnp.where(keep & (rows >= 0), rows, size)


def gather(
  table: jax.Array, rows: jax.Array, *, dtype, dim: int | None = None, ascending: bool = False
) -> jax.Array:
  """Reads rows of a stored table.

  Args:
    table: (R, W) stored rows (float32, or uint32 words for bfloat16), or,
      given `dim`, packed (R * W / 128, 128).
    rows: (C,) int32 local row ids, -1 for padding.
    dtype: the table's logical dtype.
    dim: the row width (None: the table's rows are stored as they are).
    ascending: the rows are ascending, padding last; XLA's gather is
      told (`stored_rows.take_rows`).

  Returns:
    (C, dim) float32, zero rows for padding.
  """
  dim = checks.check_gather(table, rows, dtype, dim)
  width = checks.row_width(table, dim, dtype)
  idx = _out_of_bounds(rows, packing.num_rows_of(table, width), True)
  words = stored_rows.take_rows(table, idx, width, sorted_indices=ascending)
  return packing.unpack_rows(words, dtype, dim)


def update_stored_rows(words, slots, grads, scalars, *, optimizer: RowUpdate, dtype, noise=None):
  """Stored rows -> updated stored rows: `optimizer.update_rows` between the
  storage's unpacking and packing, what every form runs on the rows it
  moved (this path on all of them, the block kernels per 8-row group).

  Args:
    words: (C, W) stored table rows (padding words included).
    slots: name -> (C, stored width) stored slot rows.
    grads: (C, dim) float32.
    scalars: `optimizer.scalars(step)`.
    noise: None, or (C, dim) uint32 stochastic rounding bits of bfloat16
      rows (`packing.rounding_noise`).

  Returns:
    (words, slots) of the same shapes; the math saw rows of their logical
    width, and pad words are written zero.
  """
  dim = grads.shape[1]
  specs = optimizer.slot_specs()
  new_rows, new_slots = optimizer.update_rows(
    packing.unpack_rows(words, dtype, dim),
    {k: packing.unpadded(v, specs[k].width_for(dim)) for k, v in slots.items()},
    grads,
    scalars,
  )
  packed = packing.padded(
    packing.pack_rows(new_rows, dtype, noise).astype(words.dtype), words.shape[1]
  )
  return packed, {
    k: packing.padded(new_slots[k].astype(v.dtype), v.shape[1]) for k, v in slots.items()
  }


def fused_update(
  table,
  slots,
  rows,
  grads,
  scalars,
  apply,
  *,
  optimizer: RowUpdate,
  dtype,
  rounding_keys=None,
  dim: int | None = None,
):
  """Applies `optimizer` to the listed rows, in place when donated.

  Args:
    table: (R, W) stored rows, or packed (R * W / 128, 128).
    slots: name -> optimizer state in its stored shape (`SlotSpec.shape_for`)
      or, for a row-shaped slot, (R, width).
    rows: (C,) int32 distinct local row ids, ascending, -1 padding last
      (as every form of the fused update takes them); XLA's gathers are
      told so, its scatters not (see below why).
    grads: (C, dim) float32 summed gradient per row.
    scalars: `optimizer.scalars(step)`.
    apply: bool scalar; when False nothing is written.
    optimizer: supplies `update_rows`.
    dtype: the table's logical dtype.
    rounding_keys: None rounds bfloat16 rows to nearest even; (C,) uint32
      per-row keys (`packing.row_rounding_keys`) round them stochastically.
    dim: the table's row width (None: the gradients'; see
      `checks.check_update`).

  Returns:
    (table, slots) with only the listed rows changed.
  """
  kw = dict(optimizer=optimizer, dtype=dtype, rounding_keys=rounding_keys, dim=dim)
  dim = checks.check_update(table, slots, rows, grads, scalars, **kw)
  width = packing.storage_width(dim, dtype)
  idx = _out_of_bounds(rows, checks.table_rows(table, dim, dtype), apply)
  specs = optimizer.slot_specs()
  widths = {k: specs[k].stored_width(dim) for k in slots}
  noise = None if rounding_keys is None else packing.rounding_noise(rounding_keys, dim)
  take = functools.partial(stored_rows.take_rows, idx=idx, sorted_indices=True)
  words, new_slots = update_stored_rows(
    take(table, width=width),
    {k: take(v, width=widths[k]) for k, v in slots.items()},
    grads,
    scalars,
    optimizer=optimizer,
    dtype=dtype,
    noise=noise,
  )
  # The scatters are not told the rows are sorted: a TPU would then scatter
  # faster (36,900 rows into a 1M x 128 float32 table: 2.45 ms against 6.6
  # on a v5e, issue #48) but hold 8 bytes per table row in temp (pod_check,
  # W-TPU at 2.5M rows per chip: 27.7 MiB against 6.1), so per-chip memory
  # would follow the table, not the ids.
  table = stored_rows.put_rows(table, idx, words, width)
  return table, {k: stored_rows.put_rows(v, idx, new_slots[k], widths[k]) for k, v in slots.items()}
