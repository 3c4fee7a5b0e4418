"""Rows of stored arrays read and written in JAX: the table's and the
slots', each an array of rows `width` words wide stored as it is or packed
(`pallas_emb.packing`), by logical row index.

An index past the end reads zeros and writes nothing, so padding needs no
mask. On CPU a packed array is viewed as its (N * k, width) rows, a free
reshape; a TPU keeps that view in (8, 128) tiles, which would relayout the
whole array, so there a write adds each row's word differences to its
physical row instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_emb import packing


def take_rows(stored, idx, width: int, *, sorted_indices: bool = False):
  """(C, width) rows `idx` of an array of rows `width` words wide, stored
  as it is or packed; an index past the end reads zeros (JAX, traced).
  `sorted_indices`: `idx` is ascending (padding past the end, last), and
  XLA's gather is told so; on TPU an unkept promise reads wrong rows."""
  take = functools.partial(
    jnp.take, axis=0, mode="fill", fill_value=0, indices_are_sorted=sorted_indices
  )
  if stored.shape[1] == width:
    return take(stored, idx)
  k = packing.LANES // width
  phys = take(stored, idx // k)
  sub = phys.reshape(idx.shape[0], k, width)
  return jnp.take_along_axis(sub, (idx % k)[:, None, None], axis=1)[:, 0]


def put_rows(stored, idx, values, width: int):
  """`stored` with rows `idx` set to (C, w) `values`, zero-padded to
  `width` (distinct indices; an index past the end writes nothing), stored
  as it is or packed. A packed row's neighbours in its physical row are
  untouched. Sorted indices are not said to be sorted (`kernels.xla`
  says why)."""
  values = packing.padded(values.astype(stored.dtype), width)
  if stored.shape[1] == width:
    return stored.at[idx].set(values, mode="drop")
  return jax.lax.platform_dependent(
    stored, idx, values, tpu=_put_packed_rows, default=_put_row_view
  )


def _put_row_view(stored, idx, values):
  # Row-major (N, 128) words are (N * k, width) rows: a free reshape on CPU,
  # and a scatter of whole rows (one index each), not of (row, lane) words.
  rows = stored.reshape(-1, values.shape[1])
  return rows.at[idx].set(values, mode="drop").reshape(stored.shape)


def _put_packed_rows(stored, idx, values):
  # A TPU keeps (N * k, width) in (8, 128) tiles, so the reshape above would
  # relayout the whole array, twice. Instead each index adds to its physical
  # row the difference of its new words from the row's, as uint32 (exact
  # modulo 2**32), zero outside its own lanes: indices that share a
  # physical row add their own lanes, and one scatter-add of whole rows
  # writes them all.
  width = values.shape[1]
  k = packing.LANES // width
  phys = idx // k
  old = jnp.take(stored, phys, axis=0, mode="fill", fill_value=0)
  mine = jnp.arange(packing.LANES, dtype=idx.dtype)[None, :] // width == (idx % k)[:, None]
  word = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)
  delta = jnp.where(mine, word(jnp.tile(values, (1, k))) - word(old), jnp.uint32(0))
  out = word(stored).at[phys].add(delta, mode="drop")
  return jax.lax.bitcast_convert_type(out, stored.dtype)
