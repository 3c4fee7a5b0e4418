"""Segment sums of per-id values in an order a sort has already found.

`jax.ops.segment_sum` by unsorted segment ids is a scatter-add, and XLA:TPU
lowers every such scatter-add as three ops: a sort of the ids carrying their
positions, a gather of the values in that order, and a scatter-add told its
ids are sorted. Routing sums twice per step (`route.to_owners`: each
source's ids into its send slots, then each owner's received slots into its
rows), each time by slots whose ascending order the "sort" dedup of the
lookup already computed (`Unique.order`). `SortedSlots` keeps that order, so
each sum is the gather and the sorted scatter-add alone: W-TPU's async step
compiled for v5e:2x2 sorts twice instead of four times (86,016 and 107,776
keys a step; one sort of 86k ids measured 0.67 ms on a v5e). The owner's
slots are then kept only in sorted order (`RoutePlan.owner_sums`), so the
scatter that would put them back in received order is not run either (one
107,776-index scatter less a step).

The two forms give the same bits wherever the unsorted scatter-add adds in
input order (XLA:CPU): the sort is stable, so each segment still adds its
values in input order. An id without a slot joins the run before it with a
+0.0, which changes no sum: a sum that starts at +0.0 is never -0.0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sharding.dedup import Unique


class SortedSlots(NamedTuple):
  """The ids of a segment sum in ascending slot order (int32).

  Attributes:
    order: (n,) input position of each id, the ids in ascending slot order;
      a stable order, so the ids of one slot stay in input order.
    slot: (n,) the slot of each id in that order, -1 for an id without
      one. The slots that are >= 0 ascend; a -1 may stand anywhere.
  """

  order: jax.Array
  slot: jax.Array


def of_dedup(unique: Unique) -> SortedSlots | None:
  """Each input's slot in `unique.keys`, in the order the "sort" dedup
  found; None from a dedup that did not sort ("search")."""
  return None if unique.order is None else SortedSlots(unique.order, unique.sorted_slot)


def in_order(slot: jax.Array) -> SortedSlots:
  """`SortedSlots` of ids already in slot order (`slot`: (n,), the slots
  that are >= 0 ascending): the order is the identity."""
  return SortedSlots(jnp.arange(slot.shape[0], dtype=jnp.int32), slot)


def none_of(n: int) -> SortedSlots:
  """`SortedSlots` of n ids none of which has a slot."""
  return in_order(jnp.full((n,), -1, jnp.int32))


def segment_sum(
  values: jax.Array,
  slot: jax.Array | None,
  num_slots: int,
  sorted_slots: SortedSlots | None = None,
) -> jax.Array:
  """(num_slots, ...) sum of `values` (n, ...) per slot.

  Args:
    slot: (n,) int32 each id's slot, -1 for an id whose value goes nowhere;
      unused (may be None) with `sorted_slots`.
    sorted_slots: the same ids' slots in ascending order: the sum gathers
      the values in that order and adds them by sorted ids, without the
      sort XLA:TPU would otherwise run. Without it, one unsorted segment
      sum by `slot`.
  """
  if sorted_slots is None:
    ids = jnp.where(slot < 0, num_slots, slot)
    return jax.ops.segment_sum(values, ids, num_segments=num_slots)
  order, sorted_slot = sorted_slots
  has = sorted_slot >= 0
  # Each id without a slot adds zero to the slot before it (or to slot 0),
  # which keeps the ids ascending.
  ids = jnp.maximum(jax.lax.cummax(sorted_slot), 0)
  ordered = values.at[order].get(mode="promise_in_bounds", unique_indices=True)
  ordered = jnp.where(has.reshape(has.shape + (1,) * (values.ndim - 1)), ordered, 0)
  return jax.ops.segment_sum(ordered, ids, num_segments=num_slots, indices_are_sorted=True)
