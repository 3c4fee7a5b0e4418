"""Reordering per-key arrays: compaction, inverse permutations and the
first claimant of each slot, by sort on a TPU and by scatter elsewhere.

A TPU scatter or gather costs per index, nearly whatever it moves: 4,096
indices take 20 to 28 us on a v5e, where a sort of 4,096 keys carrying a
few operands takes 6 to 7 us. XLA:CPU is the other way round (such a sort
about 0.5 ms, the scatter about 5 us). Each function below gives the same
bits both ways; `jax.lax.platform_dependent` picks one when the program is
lowered, and only that one is compiled. The sort forms are public so that
tests on any machine check them against the scatter forms.

Pure functions of one device's arrays, inside `jax.shard_map` or not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def per_platform(tpu_form, other_form, *args):
  """`tpu_form(*args)` in a program lowered for a TPU, else
  `other_form(*args)`: two forms of one result, the same bits."""
  return jax.lax.platform_dependent(*args, tpu=tpu_form, default=other_form)


def compact_by_scatter(keep: jax.Array, values: jax.Array, size: int, fill) -> jax.Array:
  """`compact`, as a scatter of the kept values to their places."""
  at = jnp.where(keep, jnp.cumsum(keep, dtype=jnp.int32) - 1, size)
  out = jnp.full((size,) + values.shape[1:], fill, values.dtype)
  return out.at[at].set(values, mode="drop", unique_indices=True)


def compact_by_sort(keep: jax.Array, values: jax.Array, size: int, fill) -> jax.Array:
  """`compact`, as a stable sort of (n,) `values` on whether each is kept."""
  n = keep.shape[0]
  _, v = jax.lax.sort((jnp.where(keep, 0, 1), values), num_keys=1, is_stable=True)
  v = v[:size] if size <= n else jnp.concatenate([v, jnp.full((size - n,), fill, v.dtype)])
  kept = jnp.sum(keep, dtype=jnp.int32)
  return jnp.where(jnp.arange(size, dtype=jnp.int32) < kept, v, jnp.asarray(fill, v.dtype))


def compact(keep: jax.Array, values: jax.Array, size: int, fill) -> jax.Array:
  """(size, ...) `values` where `keep` (n,) bool, in their order, first;
  `fill` after them. Kept values past `size` are dropped (a static
  capacity). By sort on a TPU for (n,) values, else by scatter."""
  by_scatter = functools.partial(compact_by_scatter, size=size, fill=fill)
  if values.ndim != 1:
    return by_scatter(keep, values)
  return per_platform(
    functools.partial(compact_by_sort, size=size, fill=fill), by_scatter, keep, values
  )


def invert_by_scatter(perm: jax.Array, values: jax.Array) -> jax.Array:
  """`invert`, as a scatter to `perm`."""
  return jnp.zeros_like(values).at[perm].set(values, unique_indices=True)


def invert_by_sort(perm: jax.Array, values: jax.Array) -> jax.Array:
  """`invert`, as a sort of `values` on `perm`."""
  return jax.lax.sort((perm, values), num_keys=1)[1]


def invert(perm: jax.Array, values: jax.Array) -> jax.Array:
  """(n,) `out` with out[perm[i]] = values[i]: `values` (n,) back in the
  order that `perm` (n,) int32, a permutation of 0..n-1, took them from
  (the indices a sort carried along)."""
  return per_platform(invert_by_sort, invert_by_scatter, perm, values)


def first_claims_by_scatter(slot: jax.Array, want: jax.Array, capacity: int) -> jax.Array:
  """`first_claims`, as a scatter-min of the claimants' indices and a gather."""
  idx = jnp.arange(slot.shape[0], dtype=jnp.int32)
  claims = jnp.full((capacity,), slot.shape[0], jnp.int32)
  claims = claims.at[jnp.where(want, slot, capacity)].min(idx, mode="drop")
  return want & (claims[jnp.clip(slot, 0, capacity - 1)] == idx)


def first_claims_by_sort(slot: jax.Array, want: jax.Array, capacity: int) -> jax.Array:
  """`first_claims`, as a stable sort of the claimants on their slots, the
  first of each run winning, and the sort back (`invert_by_sort`)."""
  idx = jnp.arange(slot.shape[0], dtype=jnp.int32)
  s, by = jax.lax.sort((jnp.where(want, slot, capacity), idx), num_keys=1, is_stable=True)
  first = (s < capacity) & (s != jnp.concatenate([jnp.full((1,), -1, s.dtype), s[:-1]]))
  return invert_by_sort(by, first)


def first_claims(slot: jax.Array, want: jax.Array, capacity: int) -> jax.Array:
  """(n,) bool: the keys that `want` (n,) bool their `slot` (n,) int32 in
  [0, capacity) and come first (least index) among those that want it:
  one round of claims, the earlier key winning a slot claimed twice."""
  fn = lambda f: functools.partial(f, capacity=capacity)
  return per_platform(fn(first_claims_by_sort), fn(first_claims_by_scatter), slot, want)
