"""Static-capacity deduplication of ids: one sort, no atomics.

`unique_keys` is the primitive: it sorts the int32 keys once, marks the first
of every run and numbers the runs. The first `capacity` distinct keys get a
slot; the rest are *overflow*: their tokens get inverse -1, exactly like
invalid ids, so they read a zero row and write nothing. Nothing is ever
clamped onto another row.

Two ways to find each input's slot, with identical results:

* "search": binary search of each input in the kept keys. On CPU 3x faster
  than carrying positions through the sort.
* "sort": the sort carries each input's position and the ranks are scattered
  back. On TPU the binary search compiles to one gather per search step over
  all inputs, which XLA:TPU's cost model charges a tile per element (6 GB for
  86k ids); the sort carries positions for free.

`dedup` applies it to logical ids under a `RowLayout`, keyed by physical row so
that the unique keys come out grouped by owner shard.

The "search" core can be replaced by any `UniqueImpl` that gives the same
arrays bit for bit (the caller's native CPU kernel, say): this package
imports nothing from its callers, so they pass it in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

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
    order: (n,) int32 input position of each key in ascending order, or
      None ("sort" only: what lets routing scatter per-input results back
      instead of gathering them).
    sorted_keys: (n,) int32 the inputs' keys ascending (both methods sort
      them; per-segment counts of distinct keys read them).
    sorted_slot: (n,) int32 slot of each input in that order, -1 if none,
      or None ("sort" only).
  """

  keys: jax.Array
  inverse: jax.Array
  num_unique: jax.Array
  num_overflow: jax.Array
  num_invalid: jax.Array
  order: jax.Array | None = None
  sorted_keys: jax.Array | None = None
  sorted_slot: jax.Array | None = None


METHODS = ("search", "sort")

# (keys (n,) int32, capacity) -> (kept keys (capacity,), inverse (n,),
# num_unique ()), all int32, exactly as `unique_keys` "search" defines them.
UniqueImpl = Callable[[jax.Array, int], tuple[jax.Array, jax.Array, jax.Array]]


def set_at(targets, at, values) -> tuple[jax.Array, ...]:
  """`targets` (each (m,), 32-bit) with element at[i] of each set to
  values[k][i] (a value broadcast to at's shape, cast to its target's
  dtype; an index past m writes nothing), as one scatter of their stacked
  words: a TPU scatter costs per index, nearly whatever it writes there.
  The stack is a copy: for per-key arrays, not for a table-sized one."""
  word = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)
  stacked = jnp.stack([word(x) for x in targets])
  new = jnp.stack(
    [word(jnp.broadcast_to(v, at.shape).astype(x.dtype)) for x, v in zip(targets, values)]
  )
  out = stacked.at[:, at].set(new, mode="drop")
  return tuple(jax.lax.bitcast_convert_type(o, x.dtype) for o, x in zip(out, targets))


def _unique(keys, inverse, num_unique, capacity: int, **sorted_fields) -> Unique:
  """A `Unique` of `capacity` kept keys out of `num_unique` distinct ones."""
  return Unique(
    keys=keys,
    inverse=inverse,
    num_unique=num_unique,
    num_overflow=jnp.maximum(num_unique - capacity, 0),
    num_invalid=jnp.zeros((), jnp.int32),
    **sorted_fields,
  )


def unique_keys(
  keys: jax.Array, capacity: int, method: str = "search", *, impl: UniqueImpl | None = None
) -> Unique:
  """Distinct values of `keys` with a static capacity.

  Args:
    keys: (n,) int32. SENTINEL marks an input that has no key.
    capacity: static number of slots in the result, >= 1.
    method: "search" or "sort" (see the module docstring); same result.
    impl: with "search", computes the keys, inverse and count instead of the
      sort and search below; it must give the same bits.

  Returns:
    A `Unique`. The largest keys overflow first: the result is deterministic
    and independent of input order.
  """
  if keys.ndim != 1 or keys.dtype != jnp.int32:
    raise TypeError(f"keys must be a 1-D int32 array, got {keys.dtype}{list(keys.shape)}.")
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}.")
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  if impl is not None and method == "search":
    out_keys, inverse, num_unique = impl(keys, capacity)
    return _unique(out_keys, inverse, num_unique, capacity)
  if method == "sort":
    sorted_keys, position = jax.lax.sort(
      (keys, jnp.arange(keys.shape[0], dtype=jnp.int32)), num_keys=1
    )
  else:
    sorted_keys = jnp.sort(keys)
  valid = sorted_keys != SENTINEL
  prev = jnp.concatenate([jnp.full((1,), SENTINEL, jnp.int32), sorted_keys[:-1]])
  first = valid & (sorted_keys != prev)
  rank = jnp.cumsum(first, dtype=jnp.int32) - 1
  out_keys = (
    jnp.full((capacity,), SENTINEL, jnp.int32)
    .at[jnp.where(first & (rank < capacity), rank, capacity)]
    .set(sorted_keys, mode="drop", unique_indices=True)
  )
  order = sorted_slot = None
  if method == "sort":
    # Every input has a run (its rank); scatter the kept ones back in place.
    order, sorted_slot = position, jnp.where(valid & (rank < capacity), rank, -1)
    inverse = jnp.zeros_like(keys).at[order].set(sorted_slot, unique_indices=True)
  else:
    slot = jnp.minimum(
      jnp.searchsorted(out_keys, keys, method="scan_unrolled"), capacity - 1
    ).astype(jnp.int32)
    inverse = jnp.where((keys != SENTINEL) & (out_keys[slot] == keys), slot, -1)
  return _unique(
    out_keys,
    inverse,
    jnp.sum(first, dtype=jnp.int32),
    capacity,
    order=order,
    sorted_keys=sorted_keys,
    sorted_slot=sorted_slot,
  )


def dedup(
  ids: jax.Array,
  layout: RowLayout,
  capacity: int,
  method: str = "search",
  *,
  impl: UniqueImpl | None = None,
) -> Unique:
  """Deduplicates logical ids, keyed by physical row.

  Args:
    ids: (n,) int32 logical row ids; PAD_ID is padding, any other id outside
      [0, layout.num_rows) is invalid.
    layout: where the rows live; keys are `layout.physical_of(id)`.
    capacity: static number of unique slots.
    method, impl: see `unique_keys`.

  Returns:
    A `Unique` whose keys are physical rows, ascending, hence grouped by owner.
  """
  if ids.ndim != 1 or ids.dtype != jnp.int32:
    raise TypeError(f"ids must be a 1-D int32 array, got {ids.dtype}{list(ids.shape)}.")
  in_range = (ids >= 0) & (ids < layout.num_rows)
  keys = jnp.where(in_range, layout.physical_of(jnp.where(in_range, ids, 0)), SENTINEL).astype(
    jnp.int32
  )
  result = unique_keys(keys, capacity, method, impl=impl)
  num_invalid = jnp.sum(~in_range & (ids != PAD_ID), dtype=jnp.int32)
  return result._replace(num_invalid=num_invalid)
