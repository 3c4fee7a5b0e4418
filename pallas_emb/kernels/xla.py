"""The gather and the fused update in plain XLA.

The oracle for the Pallas kernels and the fast path off TPU. Both functions
work on one device's row shard, validate their arguments with the kernels'
own checks, and call the optimizer's `update_rows`, like the kernels do.
Tables and slots may be stored packed (`pallas_emb.packing`): rows are read
and written as sub-rows of their physical rows, never through a reshape of
the whole array (on a TPU that is a relayout of the whole shard).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_emb import packing
from pallas_emb.kernels import checks
from pallas_emb.kernels.protocol import RowUpdate


def _out_of_bounds(rows: jax.Array, size: int, keep: jax.Array) -> jax.Array:
  # An index past the end makes gathers fill and scatters drop.
  return jnp.where(keep & (rows >= 0), rows, size)


def gather(table: jax.Array, rows: jax.Array, *, dtype, dim: int | None = None) -> jax.Array:
  """Reads rows of a stored table.

  Args:
    table: (R, W) stored rows (float32, or uint32 words for bfloat16), or,
      given `dim`, packed (R * W / 128, 128).
    rows: (C,) int32 local row ids, -1 for padding.
    dtype: the table's logical dtype.
    dim: the row width (None: the table's rows are stored as they are).

  Returns:
    (C, dim) float32, zero rows for padding.
  """
  dim = checks.check_gather(table, rows, dtype, dim)
  width = checks.row_width(table, dim, dtype)
  idx = _out_of_bounds(rows, packing.num_rows_of(table, width), True)
  return packing.unpack_rows(packing.take_rows(table, idx, width), dtype, dim)


def fused_update(
  table, slots, rows, grads, scalars, apply, *, optimizer: RowUpdate, dtype, rounding_key=None
):
  """Applies `optimizer` to the listed rows, in place when donated.

  Args:
    table: (R, W) stored rows, or packed (R * W / 128, 128).
    slots: name -> optimizer state in its stored shape (`SlotSpec.shape_for`)
      or, for a row-shaped slot, (R, width).
    rows: (C,) int32 distinct local row ids, -1 for padding.
    grads: (C, dim) float32 summed gradient per row.
    scalars: `optimizer.scalars(step)`.
    apply: bool scalar; when False nothing is written.
    optimizer: supplies `update_rows`.
    dtype: the table's logical dtype.
    rounding_key: None rounds bfloat16 rows to nearest even; a uint32
      scalar (`packing.rounding_key(seed, step)`) rounds them stochastically.

  Returns:
    (table, slots) with only the listed rows changed.
  """
  kw = dict(optimizer=optimizer, dtype=dtype, rounding_key=rounding_key)
  dim = checks.check_update(table, slots, rows, grads, scalars, **kw)
  width = packing.storage_width(dim, dtype)
  idx = _out_of_bounds(rows, checks.table_rows(table, dim, dtype), apply)
  specs = optimizer.slot_specs()
  widths = {k: specs[k].stored_width(dim) for k in slots}
  noise = None if rounding_key is None else packing.rounding_noise(rounding_key, rows, dim)
  new_rows, new_slots = optimizer.update_rows(
    packing.unpack_rows(packing.take_rows(table, idx, width), dtype, dim),
    {
      k: packing.unpadded(packing.take_rows(v, idx, widths[k]), specs[k].width_for(dim))
      for k, v in slots.items()
    },
    grads,
    scalars,
  )
  table = packing.put_rows(table, idx, packing.pack_rows(new_rows, dtype, noise), width)
  return table, {k: packing.put_rows(v, idx, new_slots[k], widths[k]) for k, v in slots.items()}
