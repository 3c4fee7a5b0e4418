"""How table rows and their optimizer slots are stored.

Rows: float32 as is, bfloat16 as packed 32-bit words.

Slots: (rows, width) arrays beside the table, except that a per-row scalar
(width 1) is stored lane-dense, (rows / 128, 128), wherever the rows of a
shard are whole 128-row groups (`RowLayout` gives every shard of 128 rows or
more a multiple of 128): row r at [r // 128, r % 128]. On a TPU an (R, 1)
array is relaid out and padded 128x whenever a kernel or a reshape needs it
(8, 128)-tiled; the grouped array is dense in every layout, and the kernels
move whole groups (`kernels.scalar_slots`).

A lone bfloat16 row is not a legal DMA on TPU, whose HBM tiles pack two
bfloat16 *rows* into each 32-bit sublane word. Reinterpreting a (V, D) bf16
array as words at every step would relayout the whole table, so bf16 tables are
*stored* as (V, D/2) uint32 from the start: word k of a row holds column k in
its low half and column k + D/2 in its high half. Unpacking a block of rows is
then two shifts and one concatenation, with columns in their natural order.

All conversions use only 32-bit integer ops and bitcasts, so the XLA path and
the Pallas kernels round identically (round-to-nearest-even, quiet NaN).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))
# Slots move as 32-bit words, like rows.
SLOT_DTYPES = (np.dtype(np.float32), np.dtype(np.int32))
# Rows per lane-dense group of a per-row scalar slot.
SLOT_GROUP = 128


class SlotSpec(NamedTuple):
  """One per-row optimizer state array, stored beside the table.

  Attributes:
    width: columns per row; None means the table's `dim`.
    dtype: float32 or int32.
    init: initial value of every element.
  """

  width: int | None = None
  dtype: Any = np.float32
  init: float = 0.0

  def width_for(self, dim: int) -> int:
    """Columns per row of this slot for a table of width `dim`."""
    return dim if self.width is None else self.width

  def grouped(self, rows_per_shard: int) -> bool:
    """Whether this slot is stored lane-dense in groups of 128 rows."""
    return self.width == 1 and rows_per_shard % SLOT_GROUP == 0

  def shape_for(
    self, num_rows: int, dim: int, rows_per_shard: int | None = None
  ) -> tuple[int, int]:
    """The stored shape of this slot for `num_rows` rows of width `dim`.

    Args:
      rows_per_shard: the rows of each shard (default `num_rows`: one
        shard); a per-row scalar of shards of whole 128-row groups is stored
        (num_rows / 128, 128).
    """
    if self.grouped(num_rows if rows_per_shard is None else rows_per_shard):
      return (num_rows // SLOT_GROUP, SLOT_GROUP)
    return (num_rows, self.width_for(dim))

  def as_rows(self, stored, dim: int):
    """A stored slot (NumPy or JAX) viewed (rows, width)."""
    return stored.reshape(-1, self.width_for(dim))

  def as_stored(self, rows, dim: int, rows_per_shard: int | None = None):
    """A (rows, width) slot (NumPy or JAX) in its stored shape."""
    return rows.reshape(self.shape_for(rows.shape[0], dim, rows_per_shard))


def storage_dtype(dtype) -> np.dtype:
  """The element type of the stored table for a logical row dtype."""
  return np.dtype(np.uint32) if np.dtype(dtype) == jnp.bfloat16 else np.dtype(np.float32)


def storage_width(dim: int, dtype) -> int:
  """Stored words per row for a row of `dim` elements of `dtype`."""
  return dim // 2 if np.dtype(dtype) == jnp.bfloat16 else dim


def unpack_rows(words: jax.Array, dtype) -> jax.Array:
  """(C, storage_width) stored rows -> (C, dim) float32."""
  if np.dtype(dtype) != jnp.bfloat16:
    return words.astype(jnp.float32)
  lo = jax.lax.bitcast_convert_type(words << 16, jnp.float32)
  hi = jax.lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32)
  return jnp.concatenate([lo, hi], axis=-1)


def _bf16_bits(x: jax.Array) -> jax.Array:
  """float32 -> bfloat16 bit pattern in the low 16 bits of a uint32 (RNE)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) >> 16
  is_nan = (bits & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000)
  return jnp.where(is_nan, (bits >> 16) | jnp.uint32(0x0040), rounded)


def pack_rows(rows: jax.Array, dtype) -> jax.Array:
  """(C, dim) float32 -> (C, storage_width) stored rows of `dtype`."""
  if np.dtype(dtype) != jnp.bfloat16:
    return rows.astype(jnp.float32)
  half = rows.shape[-1] // 2
  return _bf16_bits(rows[..., :half]) | (_bf16_bits(rows[..., half:]) << 16)


def to_storage(values, dtype) -> np.ndarray:
  """Host-side: (V, dim) array of `dtype` -> stored words (NumPy)."""
  values = np.asarray(values)
  if np.dtype(dtype) != jnp.bfloat16:
    return values.astype(np.float32)
  bits = values.astype(jnp.bfloat16).view(np.uint16).astype(np.uint32)
  half = values.shape[-1] // 2
  return bits[..., :half] | (bits[..., half:] << 16)


def from_storage(words, dtype) -> np.ndarray:
  """Host-side: stored words -> (V, dim) array of `dtype` (NumPy)."""
  words = np.asarray(words)
  if np.dtype(dtype) != jnp.bfloat16:
    return words.astype(np.float32)
  lo = (words & 0xFFFF).astype(np.uint16)
  hi = (words >> 16).astype(np.uint16)
  return np.concatenate([lo, hi], axis=-1).view(jnp.bfloat16)
