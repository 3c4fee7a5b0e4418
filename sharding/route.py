"""Moving unique ids to the shards that own their rows, and values back.

Every function here runs inside `jax.shard_map` over the table axis: each
device is at once a *source* (it holds a data shard's unique ids) and an
*owner* (it holds a row shard). One routing plan serves both directions:

* lookup: owners gather their rows, `from_owners` returns them to the sources;
* update: `to_owners` sends each source's per-id gradients to the owners and
  sums the same row arriving from several sources (fixed source order, so the
  sum is deterministic).

Buffers are static: each source sends at most `route_capacity` ids to each
owner, and each owner merges at most `owner_capacity` distinct rows. Ids over
either capacity are counted as overflow and dropped (zero row, no update).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sharding.dedup import Unique, UniqueImpl, unique_keys
from sharding.layout import SENTINEL


class RoutePlan(NamedTuple):
  """Per-device routing of one table's unique ids (all int32).

  Attributes:
    send_slot: (unique_capacity,) slot `owner * route_capacity + position` of
      each source-side unique id in the send buffer, -1 if it has none.
    owner_rows: (owner_capacity,) local rows this owner must read/update,
      ascending, -1 padding. Distinct: the update kernel relies on it.
    owner_inverse: (num_shards * route_capacity,) slot in `owner_rows` of each
      received id, -1 for an empty or dropped slot.
    num_owner_unique: () distinct rows received by this owner.
    num_overflow: () ids dropped by this device for route or owner capacity.
  """

  send_slot: jax.Array
  owner_rows: jax.Array
  owner_inverse: jax.Array
  num_owner_unique: jax.Array
  num_overflow: jax.Array


def empty_plan(*, unique_capacity: int, num_shards: int, route_capacity: int,
               owner_capacity: int) -> RoutePlan:
  """The plan of a device that routes nothing (no id, no owner row).

  Shaped like `plan_route`'s result for the same capacities, so an update
  that applies nothing has the same structure as one that does.
  """
  full = lambda n, v: jnp.full((n,), v, jnp.int32)
  return RoutePlan(send_slot=full(unique_capacity, -1),
                   owner_rows=full(owner_capacity, -1),
                   owner_inverse=full(num_shards * route_capacity, -1),
                   num_owner_unique=jnp.zeros((), jnp.int32),
                   num_overflow=jnp.zeros((), jnp.int32))


def _drop_negative(idx: jax.Array, size: int) -> jax.Array:
  # JAX wraps negative indices like NumPy; send -1 out of bounds instead.
  return jnp.where(idx < 0, size, idx)


def plan_route(
    unique_physical: jax.Array,
    *,
    rows_per_shard: int,
    num_shards: int,
    route_capacity: int,
    owner_capacity: int,
    axis_name,
    unique_impl: UniqueImpl | None = None,
) -> RoutePlan:
  """Buckets sorted physical row ids by owner and exchanges them.

  Args:
    unique_physical: (unique_capacity,) int32 distinct physical rows,
      ascending, SENTINEL-padded (the keys of `sharding.dedup.dedup`).
    rows_per_shard: rows held by each owner (`RowLayout.rows_per_shard`).
    num_shards: size of `axis_name`.
    route_capacity: ids one source may send to one owner.
    owner_capacity: distinct rows one owner may receive.
    axis_name: the mesh axis the table is sharded over.
    unique_impl: the owner-side merge's `unique_keys` implementation.
  """
  keys = unique_physical
  capacity = keys.shape[0]
  valid = keys != SENTINEL
  owner = jnp.where(valid, keys // rows_per_shard, 0)
  # Keys ascend, so each owner's ids form one run starting at its first key.
  starts = jnp.searchsorted(
      keys, jnp.arange(num_shards, dtype=jnp.int32) * rows_per_shard
  ).astype(jnp.int32)
  position = jnp.arange(capacity, dtype=jnp.int32) - starts[owner]
  fits = valid & (position < route_capacity)
  send_slot = jnp.where(fits, owner * route_capacity + position, -1)
  num_slots = num_shards * route_capacity
  send_rows = jnp.full((num_slots,), -1, jnp.int32).at[
      _drop_negative(send_slot, num_slots)].set(
          keys - owner * rows_per_shard, mode="drop", unique_indices=True)
  recv_rows = _exchange(send_rows, axis_name)
  if num_shards == 1 and owner_capacity >= num_slots:
    # One source: what arrives is already distinct and ascending, so the
    # owner-side merge is the identity and its sort can be skipped.
    merged = _identity_merge(recv_rows, owner_capacity)
  else:
    merged = unique_keys(jnp.where(recv_rows >= 0, recv_rows, SENTINEL),
                         owner_capacity, impl=unique_impl)
  return RoutePlan(
      send_slot=send_slot,
      owner_rows=jnp.where(merged.keys != SENTINEL, merged.keys, -1),
      owner_inverse=merged.inverse,
      num_owner_unique=jnp.minimum(merged.num_unique, owner_capacity),
      num_overflow=jnp.sum(valid & ~fits, dtype=jnp.int32)
      + merged.num_overflow,
  )


def _identity_merge(rows: jax.Array, capacity: int) -> Unique:
  valid = rows >= 0
  pad = capacity - rows.shape[0]
  keys = jnp.pad(jnp.where(valid, rows, SENTINEL), (0, pad),
                 constant_values=SENTINEL)
  count = jnp.sum(valid, dtype=jnp.int32)
  return Unique(keys=keys,
                inverse=jnp.where(valid, jnp.arange(rows.shape[0],
                                                    dtype=jnp.int32), -1),
                num_unique=count, num_overflow=jnp.zeros((), jnp.int32),
                num_invalid=jnp.zeros((), jnp.int32))


def to_owners(plan: RoutePlan, values: jax.Array, *, axis_name) -> jax.Array:
  """Sends per-unique-id values to their owners and merges duplicates.

  Args:
    plan: this device's `RoutePlan`.
    values: (unique_capacity, ...) one value per source-side unique id.

  Returns:
    (owner_capacity, ...) per owner row, summed over sources in source order;
    zero for padding rows (with one shard, where nothing moves: `values` of
    its padding slots, which must be zero as segment sums leave them).
  """
  if is_identity(plan, axis_name):
    # Padding slots have no ids, so a segment sum left them zero already.
    return values
  num_slots = plan.owner_inverse.shape[0]
  send = jnp.zeros((num_slots,) + values.shape[1:], values.dtype).at[
      _drop_negative(plan.send_slot, num_slots)].set(
          values, mode="drop", unique_indices=True)
  recv = _exchange(send, axis_name)
  owner_capacity = plan.owner_rows.shape[0]
  return jax.ops.segment_sum(
      recv, _drop_negative(plan.owner_inverse, owner_capacity),
      num_segments=owner_capacity)


def from_owners(plan: RoutePlan, owner_values: jax.Array, *,
                axis_name) -> jax.Array:
  """Returns per-owner-row values to every source that asked for them.

  Args:
    plan: this device's `RoutePlan`.
    owner_values: (owner_capacity, ...) values of `plan.owner_rows`.

  Returns:
    (unique_capacity, ...) per source-side unique id; zero for dropped ids.
  """
  if is_identity(plan, axis_name):
    return _zero_where(plan.send_slot < 0, owner_values)
  back = _take_or_zero(owner_values, plan.owner_inverse)
  return _take_or_zero(_exchange(back, axis_name), plan.send_slot)


def is_identity(plan: RoutePlan, axis_name) -> bool:
  """One shard and no capacity cut: unique slot i is owner row i (static).

  Then nothing travels, and a caller may fuse the source and owner sides.

  Then `send_slot[i]` is i (or -1 with a zero value) and so is
  `owner_inverse`: the exchange and both scatters can be skipped.
  """
  return (jax.lax.axis_size(axis_name) == 1
          and plan.send_slot.shape == plan.owner_inverse.shape
          == plan.owner_rows.shape)


def _zero_where(mask: jax.Array, x: jax.Array) -> jax.Array:
  return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)),
                   jnp.zeros((), x.dtype), x)


def _take_or_zero(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[idx] along axis 0, zero where idx < 0."""
  return jnp.take(x, _drop_negative(idx, x.shape[0]), axis=0, mode="fill",
                  fill_value=0)


def _exchange(x: jax.Array, axis_name) -> jax.Array:
  """all_to_all of equal blocks along axis 0: block j goes to device j."""
  return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)
