"""Moving ids to the shards that own their rows, and values both ways.

Every function here runs inside `jax.shard_map` over the table axis: each
device is at once a *source* (it holds a data shard's ids) and an *owner* (it
holds a row shard). A source sends each of its distinct ids once, to its
owner, in a buffer of `num_shards * route_capacity` slots (one block per
owner); every id of the source maps to the slot of its distinct id
(`RoutePlan.token_slot`). One plan serves both directions:

* lookup: owners read the rows of the slots they received, `from_owners`
  returns them, and each id takes its slot's row;
* update: `to_owners` sums each source's per-id gradients into its slots,
  sends them, and each owner sums the same row arriving from several sources
  (fixed source order, so the sum is deterministic).

So per direction a source runs one row gather or one segment sum, and the
ids map to their slots without a gather when dedup sorted them ("sort"): the
slots are computed in sorted order and scattered back, which is what the
TPU compiler handles well (see `sharding.dedup`). The plan then also keeps
both sums' ids in that sorted order (`token_sums`, `owner_sums`), so that
`to_owners` does not sort them again (`sharding.sorted_sums`).

Buffers are static: each source sends at most `route_capacity` ids to each
owner, and each owner merges at most `owner_capacity` distinct rows. Ids over
either capacity are counted as overflow and dropped (zero row, no update).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sharding.dedup import Unique, UniqueImpl, unique_keys
from sharding.layout import SENTINEL
from sharding.sorted_sums import SortedSlots, in_order, none_of, of_dedup, segment_sum


class RoutePlan(NamedTuple):
  """Per-device routing of one table's ids (all int32).

  Attributes:
    token_slot: (n,) slot `owner * route_capacity + position` of each id of
      this source in the send buffer, -1 if it has none (padding, invalid,
      or dropped for capacity).
    send_keys: (num_shards * route_capacity,) physical row this source sent
      in each slot, SENTINEL for an empty slot: its distinct ids, grouped by
      owner.
    recv_rows: (num_shards * route_capacity,) local row asked for in each
      slot this owner received, -1 for an empty slot.
    owner_rows: (owner_capacity,) distinct local rows this owner must
      read/update, ascending, -1 padding. Distinct: the update kernel relies
      on it.
    owner_inverse: (num_shards * route_capacity,) slot in `owner_rows` of
      each received id, -1 for an empty or dropped slot; None where
      `owner_sums` holds it in sorted order.
    num_owner_unique: () distinct rows received by this owner (kept).
    num_overflow: () ids dropped by this device for route or owner capacity.
    route_demand: () the most ids this source had for one owner, before
      the route capacity cut them.
    owner_demand: () distinct rows this owner received, before the owner
      capacity cut them.
    token_sums: `token_slot` in ascending slot order (the dedup's sort), or
      None where the dedup did not sort ("search").
    owner_sums: the received ids' slots in `owner_rows` in ascending order
      (the merge's sort), or None where the merge did not sort. Only the
      segment sum of `to_owners` reads them, so a plan holds them once:
      as `owner_inverse` or as `owner_sums` (which saves the scatter that
      would put them back in received order).
  """

  token_slot: jax.Array
  send_keys: jax.Array
  recv_rows: jax.Array
  owner_rows: jax.Array
  owner_inverse: jax.Array | None
  num_owner_unique: jax.Array
  num_overflow: jax.Array
  route_demand: jax.Array
  owner_demand: jax.Array
  token_sums: SortedSlots | None = None
  owner_sums: SortedSlots | None = None


# The per-device scalar fields of a RoutePlan.
PLAN_SCALARS = ("num_owner_unique", "num_overflow", "route_demand", "owner_demand")


def empty_plan(
  *,
  num_ids: int,
  num_shards: int,
  route_capacity: int,
  owner_capacity: int,
  method: str = "search",
) -> RoutePlan:
  """The plan of a device that routes nothing (no id, no owner row).

  Shaped like `plan_route`'s result for the same capacities and dedup
  `method`, so an update that applies nothing has the same structure as one
  that does.
  """
  full = lambda n: jnp.full((n,), -1, jnp.int32)
  zero = jnp.zeros((), jnp.int32)
  slots = num_shards * route_capacity
  return RoutePlan(
    token_slot=full(num_ids),
    send_keys=jnp.full((slots,), SENTINEL, jnp.int32),
    recv_rows=full(slots),
    owner_rows=full(owner_capacity),
    owner_inverse=None if method == "sort" else full(slots),
    num_owner_unique=zero,
    num_overflow=zero,
    route_demand=zero,
    owner_demand=zero,
    token_sums=none_of(num_ids) if method == "sort" else None,
    owner_sums=none_of(slots) if method == "sort" else None,
  )


def _drop_negative(idx: jax.Array, size: int) -> jax.Array:
  # JAX wraps negative indices like NumPy; send -1 out of bounds instead.
  return jnp.where(idx < 0, size, idx)


def _slots(keys: jax.Array, ranks: jax.Array, *, rows_per_shard: int, route_capacity: int):
  """Send slots of ascending keys, without a gather.

  Args:
    keys: ascending physical rows (SENTINEL last).
    ranks: each key's rank among the distinct keys, -1 for none; ascending
      over the keys that have one.

  Returns:
    (slot, position, owner): the send slot of each key (-1 for none), its
    position among its owner's keys (negative for none), and its owner.
  """
  has = ranks >= 0
  owner = jnp.where(has, keys // rows_per_shard, -1)
  prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), owner[:-1]])
  # Each owner's keys are one run; the rank of its first key, carried along
  # the run by a running max (ranks ascend), gives each key's position.
  first = jax.lax.cummax(jnp.where(has & (owner != prev), ranks, -1))
  position = jnp.where(has, ranks - first, -1)
  fits = has & (position < route_capacity)
  return jnp.where(fits, owner * route_capacity + position, -1), position, owner


def plan_route(
  unique: Unique,
  *,
  rows_per_shard: int,
  num_shards: int,
  route_capacity: int,
  owner_capacity: int,
  axis_name,
  method: str = "search",
  unique_impl: UniqueImpl | None = None,
) -> RoutePlan:
  """Buckets a source's distinct physical rows by owner and exchanges them.

  Args:
    unique: this source's dedup of its ids (`sharding.dedup.dedup`): keys
      are distinct physical rows, ascending, hence grouped by owner.
    rows_per_shard: rows held by each owner (`RowLayout.rows_per_shard`).
    num_shards: size of `axis_name`.
    route_capacity: ids one source may send to one owner.
    owner_capacity: distinct rows one owner may receive.
    axis_name: the mesh axis the table is sharded over.
    method: how the owner merges what it receives (`dedup.unique_keys`).
    unique_impl: the merge's `unique_keys` implementation (`impl`).
  """
  keys = unique.keys
  capacity = keys.shape[0]
  valid = keys != SENTINEL
  slot, position, owner = _slots(
    keys,
    jnp.where(valid, jnp.arange(capacity, dtype=jnp.int32), -1),
    rows_per_shard=rows_per_shard,
    route_capacity=route_capacity,
  )
  token_sums = None
  if unique.order is not None:
    # Sorted inputs: their slots come out in sorted order; scatter them back.
    sorted_slot = _slots(
      unique.sorted_keys,
      unique.sorted_slot,
      rows_per_shard=rows_per_shard,
      route_capacity=route_capacity,
    )[0]
    token_slot = jnp.zeros_like(sorted_slot).at[unique.order].set(sorted_slot, unique_indices=True)
    token_sums = SortedSlots(unique.order, sorted_slot)
  else:
    token_slot = jnp.where(unique.inverse >= 0, jnp.take(slot, jnp.maximum(unique.inverse, 0)), -1)
  num_slots = num_shards * route_capacity
  send_rows = (
    jnp.full((num_slots,), -1, jnp.int32)
    .at[_drop_negative(slot, num_slots)]
    .set(keys - owner * rows_per_shard, mode="drop", unique_indices=True)
  )
  recv_rows = exchange(send_rows, axis_name)
  slot_owner = jnp.arange(num_slots, dtype=jnp.int32) // route_capacity
  send_keys = jnp.where(send_rows >= 0, send_rows + slot_owner * rows_per_shard, SENTINEL)
  if num_shards == 1 and owner_capacity >= num_slots:
    # One source: what arrives is already distinct and ascending, so the
    # owner-side merge is the identity and its sort can be skipped.
    merged = _identity_merge(recv_rows, owner_capacity)
  else:
    merged = unique_keys(
      jnp.where(recv_rows >= 0, recv_rows, SENTINEL), owner_capacity, method, impl=unique_impl
    )
  owner_inverse, owner_sums = merged.inverse, None
  if method == "sort":
    owner_inverse, owner_sums = None, of_dedup(merged)
    if owner_sums is None:
      # The identity merge did not sort: its slots ascend as they arrived.
      owner_sums = in_order(merged.inverse)
  return RoutePlan(
    token_slot=token_slot,
    send_keys=send_keys,
    recv_rows=recv_rows,
    owner_rows=jnp.where(merged.keys != SENTINEL, merged.keys, -1),
    owner_inverse=owner_inverse,
    num_owner_unique=jnp.minimum(merged.num_unique, owner_capacity),
    num_overflow=jnp.sum(valid & (slot < 0), dtype=jnp.int32) + merged.num_overflow,
    # A run's last key has position run length - 1.
    route_demand=jnp.max(position) + 1,
    owner_demand=merged.num_unique,
    token_sums=token_sums,
    owner_sums=owner_sums,
  )


def _identity_merge(rows: jax.Array, capacity: int) -> Unique:
  valid = rows >= 0
  pad = capacity - rows.shape[0]
  keys = jnp.pad(jnp.where(valid, rows, SENTINEL), (0, pad), constant_values=SENTINEL)
  count = jnp.sum(valid, dtype=jnp.int32)
  return Unique(
    keys=keys,
    inverse=jnp.where(valid, jnp.arange(rows.shape[0], dtype=jnp.int32), -1),
    num_unique=count,
    num_overflow=jnp.zeros((), jnp.int32),
    num_invalid=jnp.zeros((), jnp.int32),
  )


def to_owners(plan: RoutePlan, values: jax.Array, *, axis_name) -> jax.Array:
  """Sums per-id values into their slots, sends them, merges duplicates.

  Args:
    plan: this device's `RoutePlan`.
    values: (n, ...) one value per id of this source (ids without a slot
      are dropped).

  Returns:
    (owner_capacity, ...) per owner row, summed in id order per source, then
    over sources in source order; zero for padding rows. The same bits
    whether or not the plan keeps the sums' sorted orders.
  """
  num_slots = plan.recv_rows.shape[0]
  send = segment_sum(values, plan.token_slot, num_slots, plan.token_sums)
  if is_identity(plan, axis_name):
    # One source and every slot its own owner row: nothing moves or merges.
    return send
  return segment_sum(
    exchange(send, axis_name), plan.owner_inverse, plan.owner_rows.shape[0], plan.owner_sums
  )


def take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[idx] along axis 0, zero where idx < 0."""
  return jnp.take(x, _drop_negative(idx, x.shape[0]), axis=0, mode="fill", fill_value=0)


def from_owners(
  plan: RoutePlan,
  slot_values: jax.Array,
  *,
  axis_name,
  take: Callable[[jax.Array, jax.Array], jax.Array] = take_rows,
) -> jax.Array:
  """Returns what owners computed per received slot to the ids that asked.

  Args:
    plan: this device's `RoutePlan`.
    slot_values: (num_shards * route_capacity, ...) the owner's value for
      each slot it received (e.g. the rows of `plan.recv_rows`).
    take: how each id takes its slot's value, `take_rows` semantics (the
      caller may pass a faster row gather for its platform).

  Returns:
    (n, ...) per id of this source; zero for ids without a slot.
  """
  back = slot_values if is_identity(plan, axis_name) else exchange(slot_values, axis_name)
  return take(back, plan.token_slot)


def is_identity(plan: RoutePlan, axis_name) -> bool:
  """One shard and no capacity cut: slot i is owner row i (static).

  Then nothing travels: `to_owners` is one segment sum of the ids' values
  by `token_slot`, and a caller may fuse it with what the owner does next.
  """
  return jax.lax.axis_size(axis_name) == 1 and plan.recv_rows.shape == plan.owner_rows.shape


def exchange(x: jax.Array, axis_name) -> jax.Array:
  """all_to_all of equal blocks along axis 0: block j goes to device j."""
  return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)
