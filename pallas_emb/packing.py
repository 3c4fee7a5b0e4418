"""How table rows and their optimizer slots are stored.

Rows: float32 as is, bfloat16 as packed 32-bit words.

Lane-dense packing: the table and every slot are arrays of rows of some
width w in 32-bit words (the table's `storage_width`, a slot's `width_for`).
Rows narrower than 128 lanes whose width divides 128 are stored *packed*,
k = 128 / w logical rows per 128-lane physical row, wherever a shard's rows
are a multiple of k (`packs`): logical row r at physical row r // k, lanes
(r % k) * w ... (r % k) * w + w - 1. That is the row-major reshape of the
(rows, w) array to (rows / k, 128), so host code converts with a reshape
(`SlotSpec.as_rows` / `as_stored`, `table_rows` / `table_stored`). Why: on a
TPU XLA keeps an array whose rows are not a multiple of 128 lanes transposed
(or padded to 128 lanes) in HBM, so a Mosaic kernel, which wants (8, 128)
tiles, would relayout the whole table or slot on every step, and XLA's own
scatter into such an array materialises table-sized temporaries. A per-row
scalar (w = 1) is the extreme case, k = 128; the block kernels rotate each
row's lanes out of its physical row in VMEM (`kernels.block_update`).

Other widths are stored *padded* with zero words to the next width that
divides 128 or is a multiple of 128 (`padded_width`): 96 -> 128, 48 -> 64,
192 -> 256, 320 -> 384. The waste is (padded - w) / padded of the array's
HBM (25% at 96 and 192 words; `padding_waste`), which XLA would spend
anyway: it pads such an array to whole 128-lane tiles in HBM, transposed or
not. The pad words are never read as row values: every reader strips them
(`unpadded`, `unpack_rows(dim=)`, `SlotSpec.values`) and every writer puts
zeros there (`padded`, `stored_rows.put_rows`), so the optimizer math, checkpoints and
host copies see rows of their logical width.

A lone bfloat16 row is not a legal DMA on TPU, whose HBM tiles pack two
bfloat16 *rows* into each 32-bit sublane word. Reinterpreting a (V, D) bf16
array as words at every step would relayout the whole table, so bf16 tables are
*stored* as (V, D/2) uint32 from the start: word k of a row holds column k in
its low half and column k + D/2 in its high half. Unpacking a block of rows is
then two shifts and one concatenation, with columns in their natural order.

All conversions use only 32-bit integer ops and bitcasts, so the XLA path and
the Pallas kernels round identically (round-to-nearest-even, quiet NaN).

Stochastic rounding (`TableSpec.stochastic_rounding`): a float32 value x
between the bfloat16 neighbours lo < x < hi rounds to hi with probability
(x - lo) / (hi - lo), so an update far below half a bfloat16 ulp still moves
the row in expectation where round-to-nearest drops it every time. The
random 16 bits of each value are a hash of what the value is: its table
(`table_tag`), the table's seed, the step (`rounding_key`), its logical row
(`row_rounding_keys`) and its column (`rounding_noise`). No random state and
nothing of where the row is stored: a step rounds alike, bit for bit, on
every backend, mesh, layout and stacking. (Keyed by the value instead, rows
that once hold the same value would round alike from then on and never part
again.)
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.errors import InputError

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))
# Slots move as 32-bit words, like rows.
SLOT_DTYPES = (np.dtype(np.float32), np.dtype(np.int32))
# What the kernels also move as rows (an int32 slot, `kernels.staged_update`):
# its words travel through their float32 interfaces as float32 bit patterns.
WORD_DTYPES = (np.dtype(np.int32),)
# Lanes of a packed physical row (one TPU vreg row of 32-bit words).
LANES = 128
# Rows per lane-dense group of a per-row scalar slot.
SLOT_GROUP = LANES


def padded_width(width: int) -> int:
  """The stored width of rows `width` words wide: `width` itself when it
  divides 128 or is a multiple of 128, else the next width that does (the
  next power of two below 128, the next multiple of 128 above)."""
  if width <= 0:
    raise InputError(f"a row is at least 1 word wide, got width {width}; give the table dim >= 1.")
  if LANES % width == 0 or width % LANES == 0:
    return width
  if width < LANES:
    return 1 << (width - 1).bit_length()
  return -(-width // LANES) * LANES


def padding_waste(width: int) -> float:
  """The fraction of a stored array of rows `width` words wide that is
  padding (0.25 at 96 and 192; 0 where `padded_width` is `width`)."""
  return 1.0 - width / padded_width(width)


def padded(rows, width: int):
  """(..., w) rows (NumPy or JAX) -> (..., width) with zero pad words
  (`rows` itself when w == width)."""
  extra = width - rows.shape[-1]
  if extra == 0:
    return rows
  if extra < 0:
    raise InputError(
      f"rows {rows.shape[-1]} words wide do not fit in {width}; pass rows of at most {width} words."
    )
  xp = np if isinstance(rows, np.ndarray) else jnp
  pad = xp.zeros(rows.shape[:-1] + (extra,), rows.dtype)
  return xp.concatenate([rows, pad], axis=-1)


def unpadded(words, width: int):
  """(..., W) stored rows -> their first `width` words (the row without
  its padding; `words` itself when W == width)."""
  return words if words.shape[-1] == width else words[..., :width]


def packs(width: int, rows_per_shard: int) -> bool:
  """Whether rows `width` words wide are stored packed, 128 / width to a
  128-lane row, in shards of `rows_per_shard` rows (see the module
  docstring)."""
  return width < LANES and LANES % width == 0 and rows_per_shard % (LANES // width) == 0


def stored_shape(num_rows: int, width: int, rows_per_shard: int | None = None) -> tuple[int, int]:
  """The stored shape of `num_rows` rows `width` words wide.

  Args:
    rows_per_shard: the rows of each shard (default `num_rows`: one shard).
  """
  width = padded_width(width)
  if packs(width, num_rows if rows_per_shard is None else rows_per_shard):
    return (num_rows * width // LANES, LANES)
  return (num_rows, width)


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

  def stored_width(self, dim: int) -> int:
    """Stored words per row of this slot (`padded_width` of `width_for`)."""
    return padded_width(self.width_for(dim))

  def packed(self, rows_per_shard: int, dim: int) -> bool:
    """Whether this slot is stored packed (see `packs`)."""
    return packs(self.stored_width(dim), rows_per_shard)

  def shape_for(
    self, num_rows: int, dim: int, rows_per_shard: int | None = None
  ) -> tuple[int, int]:
    """The stored shape of this slot for `num_rows` rows of width `dim`.

    Args:
      rows_per_shard: the rows of each shard (default `num_rows`: one
        shard); rows of shards that `packs` are stored (num_rows * width /
        128, 128).
    """
    return stored_shape(num_rows, self.width_for(dim), rows_per_shard)

  def as_rows(self, stored, dim: int):
    """A stored slot (NumPy or JAX) viewed (rows, stored_width): its rows
    with their padding, if any (see `values`)."""
    return stored.reshape(-1, self.stored_width(dim))

  def values(self, stored, dim: int):
    """A stored slot (NumPy or JAX) -> (rows, width): its rows without
    padding."""
    return unpadded(self.as_rows(stored, dim), self.width_for(dim))

  def as_stored(self, rows, dim: int, rows_per_shard: int | None = None):
    """A (rows, width) or (rows, stored_width) slot (NumPy or JAX) in its
    stored shape."""
    rows = padded(rows, self.stored_width(dim))
    return rows.reshape(self.shape_for(rows.shape[0], dim, rows_per_shard))


def storage_dtype(dtype) -> np.dtype:
  """The element type of the stored table for a logical row dtype."""
  if np.dtype(dtype) in WORD_DTYPES:
    return np.dtype(dtype)
  return np.dtype(np.uint32) if np.dtype(dtype) == jnp.bfloat16 else np.dtype(np.float32)


def row_words(dim: int, dtype) -> int:
  """The 32-bit words that hold a row of `dim` elements of `dtype`."""
  return dim // 2 if np.dtype(dtype) == jnp.bfloat16 else dim


def storage_width(dim: int, dtype) -> int:
  """Stored words per row for a row of `dim` elements of `dtype` (its
  `row_words`, padded: `padded_width`)."""
  return padded_width(row_words(dim, dtype))


def table_shape(
  num_rows: int, dim: int, dtype, rows_per_shard: int | None = None
) -> tuple[int, int]:
  """The stored shape of a table of `num_rows` rows of `dim` `dtype`
  elements (packed when `packs` its storage width)."""
  return stored_shape(num_rows, storage_width(dim, dtype), rows_per_shard)


def table_rows(stored, dim: int, dtype):
  """A stored table (NumPy or JAX) viewed (rows, storage_width), padding
  included."""
  return stored.reshape(-1, storage_width(dim, dtype))


def table_stored(rows, dim: int, dtype, rows_per_shard: int | None = None):
  """(rows, row_words) or (rows, storage_width) stored rows (NumPy or JAX)
  in the table's stored shape."""
  rows = padded(rows, storage_width(dim, dtype))
  return rows.reshape(table_shape(rows.shape[0], dim, dtype, rows_per_shard))


def num_rows_of(stored, width: int) -> int | None:
  """Logical rows of an array of rows `width` words wide stored as it is
  (width columns) or packed (128 columns), else None."""
  cols = stored.shape[1]
  if cols == width:
    return stored.shape[0]
  if cols == LANES and width < LANES and LANES % width == 0:
    return stored.shape[0] * (LANES // width)
  return None


def unpack_rows(words: jax.Array, dtype, dim: int | None = None) -> jax.Array:
  """(C, W) stored rows -> (C, dim) float32 (an int32 array's words as
  float32 bit patterns). `dim`: the row width, whose `row_words` are read
  and the padding dropped (None: all W words are the row's)."""
  if dim is not None:
    words = unpadded(words, row_words(dim, dtype))
  if np.dtype(dtype) in WORD_DTYPES:
    return jax.lax.bitcast_convert_type(words, jnp.float32)
  if np.dtype(dtype) != jnp.bfloat16:
    return words.astype(jnp.float32)
  lo = jax.lax.bitcast_convert_type(words << 16, jnp.float32)
  hi = jax.lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32)
  return jnp.concatenate([lo, hi], axis=-1)


def fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finalizer, a bijection of uint32: every input bit
  flips each output bit with probability about 1/2."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def table_tag(name: str) -> int:
  """A table's stable 32-bit tag (CRC-32 of its name): what tells tables
  apart in the stochastic rounding's noise, whatever physical table (a
  stack, a shard) holds their rows."""
  return zlib.crc32(name.encode("utf-8"))


def rounding_key(seed: int, step, tag=0) -> jax.Array:
  """The uint32 key of stochastic rounding of the table tagged `tag`
  (`table_tag`), seeded `seed` (0 <= seed < 2**32), at `step` (int32,
  traced or not). `step` and `tag` may be arrays (one per row of a stack's
  members): the key has their broadcast shape."""
  as_u32 = lambda x: x.astype(jnp.uint32) if isinstance(x, jax.Array) else jnp.uint32(x)
  return fmix32(
    fmix32(fmix32(jnp.uint32(seed) ^ jnp.uint32(0x9E3779B9)) + as_u32(jnp.asarray(step)))
    + as_u32(tag)
  )


def row_rounding_keys(key: jax.Array, rows: jax.Array) -> jax.Array:
  """(C,) uint32 per-row keys of stochastic rounding: `key`
  (`rounding_key`, a scalar or one per row) and each row's *logical* row in
  its table (C,) int32, so that a row rounds alike on every mesh, stacking
  and backend."""
  return fmix32(key + rows.astype(jnp.uint32) * jnp.uint32(0x9E3779B9))


def rounding_noise(row_keys: jax.Array, dim: int) -> jax.Array:
  """(C,) or (C, 1) uint32 per-row keys (`row_rounding_keys`) -> (C, dim)
  uint32 whose low 16 bits are uniform and independent across rows,
  columns and keys."""
  row_keys = row_keys.reshape(-1, 1).astype(jnp.uint32)
  cols = jax.lax.broadcasted_iota(jnp.uint32, (1, dim), 1)
  return fmix32(row_keys + cols * jnp.uint32(0x85EBCA6B))


def _bf16_bits(x: jax.Array, noise: jax.Array | None = None) -> jax.Array:
  """float32 -> bfloat16 bit pattern in the low 16 bits of a uint32:
  round-to-nearest-even, or with `noise` rounded up when its low 16 bits
  plus the bits rounded off carry (stochastic rounding)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  if noise is None:
    rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) >> 16
  else:
    # Infinities stay: their low bits are zero and 0xFFFF never carries.
    rounded = (bits + (noise & jnp.uint32(0xFFFF))) >> 16
  is_nan = (bits & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000)
  return jnp.where(is_nan, (bits >> 16) | jnp.uint32(0x0040), rounded)


def pack_rows(rows: jax.Array, dtype, noise: jax.Array | None = None) -> jax.Array:
  """(C, dim) float32 -> (C, row_words) stored rows of `dtype`, without
  padding (`padded` adds it; `put_rows` does).

  Args:
    noise: None rounds to nearest even; (C, dim) uint32 (`rounding_noise`)
      rounds bfloat16 stochastically.
  """
  if np.dtype(dtype) in WORD_DTYPES:
    return jax.lax.bitcast_convert_type(rows, np.dtype(dtype))
  if np.dtype(dtype) != jnp.bfloat16:
    return rows.astype(jnp.float32)
  half = rows.shape[-1] // 2
  lo, hi = (None, None) if noise is None else (noise[..., :half], noise[..., half:])
  return _bf16_bits(rows[..., :half], lo) | (_bf16_bits(rows[..., half:], hi) << 16)


def to_storage(values, dtype) -> np.ndarray:
  """Host-side: (V, dim) array of `dtype` -> stored words (NumPy)."""
  values = np.asarray(values)
  if np.dtype(dtype) != jnp.bfloat16:
    return values.astype(np.float32)
  bits = values.astype(jnp.bfloat16).view(np.uint16).astype(np.uint32)
  half = values.shape[-1] // 2
  return bits[..., :half] | (bits[..., half:] << 16)


def from_storage(words, dtype, dim: int | None = None) -> np.ndarray:
  """Host-side: stored words -> (V, dim) array of `dtype` (NumPy); `dim`
  drops the padding of rows stored padded (None: every word is the row's)."""
  words = np.asarray(words)
  if dim is not None:
    words = unpadded(words, row_words(dim, dtype))
  if np.dtype(dtype) != jnp.bfloat16:
    return words.astype(np.float32)
  lo = (words & 0xFFFF).astype(np.uint16)
  hi = (words >> 16).astype(np.uint16)
  return np.concatenate([lo, hi], axis=-1).view(jnp.bfloat16)
