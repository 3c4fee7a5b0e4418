"""Each key's probe window, read from one shard's id map.

A key's window is the `probe_limit` slots of the map from its home slot on,
wrapping (`sharding.id_map`). A reader gives every key W lanes, each lane a
slot of the map, and says which lanes are the window and in what order:

* gathered: W = probe_limit, lane r is the window's r-th slot, each read by
  a gather of one element (n x probe_limit of them per array read);
* lane-dense: the map's arrays seen as (capacity / 128, 128) rows; each key
  reads the row holding its home slot and the next row (wrapping), W = 256,
  and lane j is the window's slot j - home % 128 when that lies in
  [0, probe_limit). A TPU gathers whole 128-lane rows as cheaply as single
  elements, so this reads the same windows in 2 gathers per key and array
  instead of probe_limit. It needs capacity % 128 == 0 and probe_limit <=
  129; an XLA:CPU gather moves every lane, so CPU keeps the gathered reads.

Pure functions of one device's map, inside `jax.shard_map` or not; no
collectives.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

LANES = 128


class Windows(NamedTuple):
  """Where each key's lanes lie in the map.

  Attributes:
    pos: (n, W) int32 the map slot of each lane.
    r: (n, W) int32 the lane's place in the window: the lane is in the
      window where 0 <= r < probe_limit.
    inside: (n, W) bool 0 <= r < probe_limit.
    rows: (n, 2) int32 the two 128-lane rows each key reads (lane-dense), or
      None (gathered).
  """

  pos: jax.Array
  r: jax.Array
  inside: jax.Array
  rows: jax.Array | None


def fits_lanes(capacity: int, probe_limit: int) -> bool:
  """Whether a map of `capacity` slots can be read lane-dense."""
  return capacity % LANES == 0 and probe_limit <= LANES + 1


def windows(home: jax.Array, capacity: int, probe_limit: int, lane_dense: bool) -> Windows:
  """The lanes of each key's window.

  Args:
    home: (n,) int32 each key's home slot, in [0, capacity).
    capacity: the map's slots.
    probe_limit: the window's length, at most `capacity`.
    lane_dense: read whole 128-lane rows (`fits_lanes` must hold).
  """
  if not lane_dense:
    r = jnp.broadcast_to(jnp.arange(probe_limit, dtype=jnp.int32), (home.shape[0], probe_limit))
    return Windows((home[:, None] + r) % capacity, r, jnp.ones(r.shape, bool), None)
  if not fits_lanes(capacity, probe_limit):
    raise ValueError(
      f"a lane-dense read needs capacity % {LANES} == 0 and probe_limit <= {LANES + 1}, got "
      f"capacity={capacity}, probe_limit={probe_limit}."
    )
  first = home // LANES
  rows = jnp.stack([first, (first + 1) % (capacity // LANES)], axis=1)
  lane = jnp.arange(2 * LANES, dtype=jnp.int32)
  pos = jnp.repeat(rows, LANES, axis=1) * LANES + lane % LANES
  r = lane - (home % LANES)[:, None]
  return Windows(pos, r, (r >= 0) & (r < probe_limit), rows)


def read(w: Windows, x: jax.Array) -> jax.Array:
  """(n, W) the value of (capacity,) `x` at each lane's slot."""
  if w.rows is None:
    return x[w.pos]
  by_row = x.reshape(-1, LANES)
  return jnp.concatenate([by_row[w.rows[:, 0]], by_row[w.rows[:, 1]]], axis=1)


def window_bits(w: Windows, x: jax.Array, probe_limit: int) -> jax.Array:
  """(n, ceil(probe_limit / 32)) uint32: bit r % 32 of word r // 32 is `x`
  (n, W) bool at the lane holding each key's r-th window slot. The rounds
  of `sharding.insert_rounds` read a window this way, one key's word at a
  time, instead of all W lanes every round."""
  words = -(-probe_limit // 32)
  bit = jnp.left_shift(jnp.uint32(1), (w.r % 32).astype(jnp.uint32))
  on = x & w.inside
  return jnp.stack(
    [
      jnp.sum(jnp.where(on & (w.r // 32 == k), bit, 0), axis=1, dtype=jnp.uint32)
      for k in range(words)
    ],
    axis=1,
  )


def slot_of(w: Windows, lane: jax.Array, capacity: int) -> jax.Array:
  """(n,) int32 the map slot of each key's `lane` (n,) int32, computed
  from the window's rows or home rather than gathered from `w.pos`
  (which would then be kept whole, (n, W))."""
  if w.rows is None:
    s = w.pos[:, 0] + lane  # the home slot, plus the lane's place
    return jnp.where(s >= capacity, s - capacity, s)
  row = jnp.where(lane < LANES, w.rows[:, 0], w.rows[:, 1])
  return row * LANES + lane % LANES
