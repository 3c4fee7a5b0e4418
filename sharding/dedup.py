"""Static-capacity deduplication of ids: one sort, no atomics.

`unique_keys` is the primitive: it sorts the int32 keys once, marks the first
of every run, numbers the runs, and finds each input's run by binary search
(deterministic, and on CPU 3x faster than sorting (key, position) pairs). The first
`capacity` distinct keys get a slot; the rest are *overflow*: their tokens get
inverse -1, exactly like invalid ids, so they read a zero row and write
nothing. Nothing is ever clamped onto another row.

`dedup` applies it to logical ids under a `RowLayout`, keyed by physical row so
that the unique keys come out grouped by owner shard.

The sort-based core can be replaced by any `UniqueImpl` that gives the same
arrays bit for bit (the caller's native kernel, say): this package imports
nothing from its callers, so they pass it in.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from sharding.layout import SENTINEL, RowLayout

# Ids equal to PAD_ID are padding (ragged bags): no row, no gradient, not
# counted. Every other id outside [0, num_rows) is invalid and counted.
PAD_ID = -1


class Unique(NamedTuple):
  """Result of `unique_keys` / `dedup`.

  Attributes:
    keys: (capacity,) int32, the distinct keys ascending, SENTINEL-padded.
    inverse: (n,) int32, slot in `keys` of each input, or -1 (no slot).
    num_unique: () int32, distinct valid keys, including those over capacity.
    num_overflow: () int32, distinct valid keys that did not fit `capacity`.
    num_invalid: () int32, inputs outside [0, num_rows) other than PAD_ID
      (always 0 from `unique_keys`, which has no notion of range).
  """

  keys: jax.Array
  inverse: jax.Array
  num_unique: jax.Array
  num_overflow: jax.Array
  num_invalid: jax.Array


# (keys (n,) int32, capacity) -> (kept keys (capacity,), inverse (n,),
# num_unique ()), all int32, exactly as `unique_keys` defines them.
UniqueImpl = Callable[[jax.Array, int], tuple[jax.Array, jax.Array, jax.Array]]


def unique_keys(keys: jax.Array, capacity: int, *,
                impl: UniqueImpl | None = None) -> Unique:
  """Distinct values of `keys` with a static capacity.

  Args:
    keys: (n,) int32. SENTINEL marks an input that has no key.
    capacity: static number of slots in the result, >= 1.
    impl: computes the keys, inverse and count instead of the sort below;
      it must give the same bits.

  Returns:
    A `Unique`. The largest keys overflow first: the result is deterministic
    and independent of input order.
  """
  if keys.ndim != 1 or keys.dtype != jnp.int32:
    raise TypeError(
        f"keys must be a 1-D int32 array, got {keys.dtype}{list(keys.shape)}.")
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}.")
  out_keys, inverse, num_unique = (impl or _sorted_unique)(keys, capacity)
  return Unique(
      keys=out_keys,
      inverse=inverse,
      num_unique=num_unique,
      num_overflow=jnp.maximum(num_unique - capacity, 0),
      num_invalid=jnp.zeros((), jnp.int32),
  )


def _sorted_unique(keys: jax.Array, capacity: int):
  sorted_keys = jnp.sort(keys)
  valid = sorted_keys != SENTINEL
  prev = jnp.concatenate([jnp.full((1,), SENTINEL, jnp.int32), sorted_keys[:-1]])
  first = valid & (sorted_keys != prev)
  rank = jnp.cumsum(first, dtype=jnp.int32) - 1
  out_keys = jnp.full((capacity,), SENTINEL, jnp.int32).at[
      jnp.where(first & (rank < capacity), rank, capacity)].set(
          sorted_keys, mode="drop", unique_indices=True)
  # Each key's slot by binary search in the kept keys: cheaper on CPU than
  # carrying positions through the sort and scattering the ranks back.
  slot = jnp.minimum(jnp.searchsorted(out_keys, keys, method="scan_unrolled"),
                     capacity - 1).astype(jnp.int32)
  inverse = jnp.where((keys != SENTINEL) & (out_keys[slot] == keys), slot, -1)
  return out_keys, inverse, jnp.sum(first, dtype=jnp.int32)


def dedup(ids: jax.Array, layout: RowLayout, capacity: int, *,
          impl: UniqueImpl | None = None) -> Unique:
  """Deduplicates logical ids, keyed by physical row.

  Args:
    ids: (n,) int32 logical row ids; PAD_ID is padding, any other id outside
      [0, layout.num_rows) is invalid.
    layout: where the rows live; keys are `layout.physical_of(id)`.
    capacity: static number of unique slots.
    impl: passed to `unique_keys`.

  Returns:
    A `Unique` whose keys are physical rows, ascending, hence grouped by owner.
  """
  if ids.ndim != 1 or ids.dtype != jnp.int32:
    raise TypeError(
        f"ids must be a 1-D int32 array, got {ids.dtype}{list(ids.shape)}.")
  in_range = (ids >= 0) & (ids < layout.num_rows)
  keys = jnp.where(in_range, layout.physical_of(jnp.where(in_range, ids, 0)),
                   SENTINEL).astype(jnp.int32)
  result = unique_keys(keys, capacity, impl=impl)
  num_invalid = jnp.sum(~in_range & (ids != PAD_ID), dtype=jnp.int32)
  return result._replace(num_invalid=num_invalid)
