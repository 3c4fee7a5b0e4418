"""The update of an optimizer whose math does not run in Mosaic, its rows
moved by the kernels.

`OptaxRows` runs arbitrary optax code, and Mosaic does not lower all of it
(optax's Adam raises the step count, an int32, to a power). On the XLA path
a TPU step then stages whole slots into VMEM and scatters packed rows word
by word (`pod_check --pipelines=sync --optimizer=optax_rows`, W-TPU at
D = 16 on v5e:2x2: 275 MiB of temp and 368 GB accessed for a 15 MiB
table). Here only the math runs in XLA, on the listed rows:

1. the block gather (`block_gather`) reads the listed rows of the table and
   of each slot (an int32 slot's words travel as float32 bit patterns,
   `packing.WORD_DTYPES`);
2. `optimizer.update_rows` runs in XLA on those (C, width) blocks, as on
   the XLA path;
3. the block update (`block_update`) writes each array's new rows back, one
   call per array, with `_ASSIGN`: an update whose new rows are its
   "gradients".

Each array is swept twice (by the gather, and by the update); nothing
table-sized is copied. The
values are the XLA path's bit for bit: the same `update_rows` on the same
rows, written as the XLA path writes them (`packing.pack_rows`, bfloat16
rounded stochastically with the same noise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_emb import packing
from pallas_emb.kernels import block_gather, block_update, checks
from pallas_emb.kernels.protocol import RowUpdate


class _NoScalars(NamedTuple):
  """`_Assign`'s per-step scalars: none (its new rows come as gradients)."""


@dataclasses.dataclass(frozen=True)
class _Assign:
  """A row update that sets each row to its "gradient": the new rows."""

  def slot_specs(self) -> dict:
    return {}

  def update_rows(self, rows, slots, grads, scalars):
    del rows, slots, scalars
    return grads, {}


_ASSIGN = _Assign()


def fused_update(
  table: jax.Array,
  slots: Mapping[str, jax.Array],
  rows: jax.Array,
  grads: jax.Array,
  scalars: NamedTuple,
  apply: jax.Array,
  *,
  optimizer: RowUpdate,
  dtype,
  rounding_keys: jax.Array | None = None,
  dim: int | None = None,
  interpret=False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`optimizer` applied to the listed rows, in place; arguments and result
  as for `block_update.fused_update` (rows ascending, padding last)."""
  kw = dict(optimizer=optimizer, dtype=dtype, rounding_keys=rounding_keys, dim=dim)
  dim = checks.check_update(table, slots, rows, grads, scalars, **kw)
  if rows.shape[0] == 0:
    return table, dict(slots)
  specs = optimizer.slot_specs()
  widths = {k: specs[k].width_for(dim) for k in slots}

  def read(array, array_dtype, width):
    """(C, width) float32: the listed rows (an int32 array's words as bit
    patterns: `packing.unpack_rows`)."""
    return block_gather.gather(array, rows, dtype=array_dtype, dim=width, interpret=interpret)

  def write(array, array_dtype, new, keys=None):
    """The array with the listed rows set to (C, width) float32 `new`."""
    out, _ = block_update.fused_update(
      array,
      {},
      rows,
      new,
      _NoScalars(),
      apply,
      optimizer=_ASSIGN,
      dtype=array_dtype,
      rounding_keys=keys,
      interpret=interpret,
    )
    return out

  old_slots = {k: packing.pack_rows(read(v, v.dtype, widths[k]), v.dtype) for k, v in slots.items()}
  new_rows, new_slots = optimizer.update_rows(read(table, dtype, dim), old_slots, grads, scalars)
  return write(table, dtype, new_rows.astype(jnp.float32), rounding_keys), {
    k: write(v, v.dtype, packing.unpack_rows(new_slots[k].astype(v.dtype), v.dtype))
    for k, v in slots.items()
  }
