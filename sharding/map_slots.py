"""Which physical row each slot of a shard's id map is.

A dynamic table's shard has `rows_per_shard` physical rows, and on an uneven
layout only the first `used` of them hold a logical row (`RowLayout`: the
last shard of "range", or the tail of every shard of "mod" when the rows do
not divide evenly, and each shard's rows round up to whole groups of 128).
If map slot j were physical row j, those rows would form one run at the end
of the map: a key whose home slot lies there would find its whole probe
window without a row, and never get one, even in an empty table (96 ids
into 512 rows over 3 shards: 31 refused).

So the slots are mapped to rows by a permutation that spreads the minority
(the rows without a logical row, or the rows with one when they are fewer)
evenly over the map, one in every q = rows_per_shard // minority slots:

    tail <= used:  slot j is a tail row iff j < tail * q and j % q == q - 1
    tail >  used:  slot j is a used row iff j < used * q and j % q == q - 1

The majority take the other slots in order. When the tail is at most half the
shard, no two tail slots are adjacent, so every window of two or more slots
holds a usable one (`max_gap`); an even layout is the identity. Everything
here is integer arithmetic on NumPy or JAX arrays (traced shard numbers
too), no gathers.
"""

from __future__ import annotations

import numpy as np

from sharding.layout import RowLayout, _xp


def used_rows(layout: RowLayout, shard):
  """Logical rows held by shard `shard` (an int, or a traced int32 scalar):
  the first `used_rows` of its physical rows."""
  xp = _xp(shard)
  c, v, s = layout.rows_per_shard, layout.num_rows, layout.num_shards
  if layout.kind == "mod":
    used = (v - shard + s - 1) // s
  else:
    used = v - shard * c
  return xp.clip(used, 0, c)


def _xp_of(*xs):
  """numpy if every x is a host value, else jax.numpy."""
  mods = [_xp(x) for x in xs]
  return next((m for m in mods if m is not np), np)


def slot_rows(layout: RowLayout, shard, slots):
  """The local physical row of each map slot in `slots` of shard `shard`
  (the permutation of the module docstring)."""
  xp = _xp_of(slots, shard)
  c = layout.rows_per_shard
  used = used_rows(layout, shard)
  tail = c - used
  minority = xp.maximum(xp.minimum(tail, used), 1)
  q = c // minority
  before = xp.minimum(minority, slots // q)  # minority slots before slot j
  marked = (slots < minority * q) & (slots % q == q - 1)
  spread_tail = xp.where(marked, used + slots // q, slots - before)
  spread_used = xp.where(marked, slots // q, used + slots - before)
  rows = xp.where(tail <= used, spread_tail, spread_used)
  return xp.where((tail == 0) | (used == 0), slots, rows)


def logical_rows(layout: RowLayout, shard, slots):
  """The logical row held at each map slot of shard `shard` (-1: none)."""
  return layout.logical_of(shard * layout.rows_per_shard + slot_rows(layout, shard, slots))


def physical_rows(layout: RowLayout, global_slots):
  """Global physical rows of global map slots (shards concatenated)."""
  c = layout.rows_per_shard
  shard = global_slots // c
  return shard * c + slot_rows(layout, shard, global_slots % c)


def usable(layout: RowLayout, shard, slots):
  """Whether each map slot's row holds a logical row."""
  return slot_rows(layout, shard, slots) < used_rows(layout, shard)


def max_gap(layout: RowLayout) -> int:
  """The longest run of map slots without a logical row, over all shards and
  around the wrap: a probe window must be longer to always hold a usable
  slot (0 on an even layout)."""
  c, gap = layout.rows_per_shard, 0
  for shard in range(layout.num_shards):
    used = int(used_rows(layout, shard))
    tail = c - used
    if tail == 0:
      continue
    if used == 0:
      return c
    if tail <= used:
      gap = max(gap, 1)
      continue
    q = c // used
    # Used slots at q - 1, 2q - 1, ..., used * q - 1: gaps of q - 1 between
    # them, and the wrap from the last to the first.
    gap = max(gap, q - 1, c - used * q + q - 1)
  return gap
