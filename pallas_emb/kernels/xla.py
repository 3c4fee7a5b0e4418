"""The gather and the fused update in plain XLA.

The oracle for the Pallas kernels and the fast path off TPU. Both functions
work on one device's row shard, validate their arguments with the kernels'
own checks, and call the optimizer's `update_rows`, like the kernels do.
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


def gather(table: jax.Array, rows: jax.Array, *, dtype) -> jax.Array:
  """Reads rows of a stored table.

  Args:
    table: (R, W) stored rows (float32, or uint32 words for bfloat16).
    rows: (C,) int32 local row ids, -1 for padding.
    dtype: the table's logical dtype.

  Returns:
    (C, dim) float32, zero rows for padding.
  """
  checks.check_gather(table, rows, dtype)
  idx = _out_of_bounds(rows, table.shape[0], True)
  words = jnp.take(table, idx, axis=0, mode="fill", fill_value=0)
  return packing.unpack_rows(words, dtype)


def fused_update(table, slots, rows, grads, scalars, apply, *, optimizer: RowUpdate, dtype):
  """Applies `optimizer` to the listed rows, in place when donated.

  Args:
    table: (R, W) stored rows.
    slots: name -> (R, width) optimizer state.
    rows: (C,) int32 distinct local row ids, -1 for padding.
    grads: (C, dim) float32 summed gradient per row.
    scalars: `optimizer.scalars(step)`.
    apply: bool scalar; when False nothing is written.
    optimizer: supplies `update_rows`.
    dtype: the table's logical dtype.

  Returns:
    (table, slots) with only the listed rows changed.
  """
  checks.check_update(table, slots, rows, grads, scalars, optimizer=optimizer, dtype=dtype)
  idx = _out_of_bounds(rows, table.shape[0], apply)
  take = lambda x: jnp.take(x, idx, axis=0, mode="fill", fill_value=0)
  put = lambda x, v: x.at[idx].set(v.astype(x.dtype), mode="drop")
  # Slots as (R, width), whatever their stored shape (see packing.SlotSpec).
  specs, dim = optimizer.slot_specs(), grads.shape[1]
  rows_of = {k: specs[k].as_rows(jnp.asarray(v), dim) for k, v in slots.items()}
  new_rows, new_slots = optimizer.update_rows(
    packing.unpack_rows(take(table), dtype),
    {k: take(v) for k, v in rows_of.items()},
    grads,
    scalars,
  )
  table = put(table, packing.pack_rows(new_rows, dtype))
  return table, {k: put(v, new_slots[k]).reshape(slots[k].shape) for k, v in rows_of.items()}
