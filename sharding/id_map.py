"""A fixed-capacity id -> row map per shard: the dynamic vocabulary's state
and its step, with static shapes only.

Every function here runs inside `jax.shard_map` over the table axis (the
`init_map` shapes excepted, which are global): each device owns the map of
its row shard, `capacity` open-addressing slots, slot j being a physical row
of the shard (`sharding.map_slots`; slot j is row j on an even layout). Keys
are 64-bit, as two uint32 words (high, low), already well-mixed hashes of
the raw ids (`pallas_emb.vocabulary`):
the owner of a key is `high % num_shards`, its home slot `low % capacity`,
and it may live in the `probe_limit` slots from its home on (linear
probing, wrapping; a lookup reads the whole window, so evictions leave no
tombstones).

One step (`translate`), on every device:

1. each source sends each of its distinct keys, with its occurrences, to
   its owner (`sharding.key_route`: one all_to_all, `key_capacity` keys per
   owner); each owner sorts what it received (high, low) and dedups it,
   summing the occurrences. The rank of a key in that order is its priority
   in every conflict below;
2. when training: a sweep on every `evict_every`-th step (LFU counts times
   `decay`; ids idle for `ttl` steps or more evicted); resident keys are
   found in their window (count += occurrences, last = step); the others
   are counted in the count-min sketch (first halved, if full:
   `sharding.sketch.age_sketch`), and those whose estimate reaches `admit_after` are
   inserted: in round r = 0..P-1 each one still waiting
   claims slot home + r if it is free, the lowest rank winning a slot
   claimed twice; those left take the policy's victim in their window
   (one round, lowest rank first; keys used in this step or the previous
   one are never victims: the async pipeline applies a step's update one
   step late, and it must not land on a row given to another id;
   under "lfu" only a victim whose count is at most the newcomer's count,
   its occurrences this step or its sketch estimate: TinyLFU's rule, so a
   one-off does not push out a frequent id), and the rest fail. A new key
   starts with count = its occurrences;
3. each owner answers the logical row of every key it received (or a
   miss), and the answers go back to the sources by the same route.

Per device the cost follows its own tokens, as in the static path: it sorts
its tokens, and sends, dedups and answers `num_shards x key_capacity` keys.
The source's sort (`key_route.buckets`) and the owner's steps 1 and 2
(`owner_step`) may be computed elsewhere, bit for bit (`translate`'s
`impl`: the native CPU kernels). On a TPU the windows are read as 128-lane
rows (`sharding.probe_window`). Evaluation (`train=False`) reads only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharding import eviction, insert_rounds, key_route, map_slots, probe_window, reorder
from sharding.key_route import PAD
from sharding.layout import RowLayout
from sharding.map_impl import MapImpl, OwnerStep
from sharding.sketch import age_sketch, sketch_slots

MISS = -2  # a token's row when it has none (-1 is padding, as the static path's)


class IdMap(NamedTuple):
  """The map of one shard (global arrays: shards concatenated on axis 0).

  Attributes:
    key_hi, key_lo: (capacity,) uint32 the key held by each slot.
    count: (capacity,) float32 occurrences since insertion (decayed by
      sweeps under "lfu").
    last: (capacity,) int32 the last step that used the slot's key, -1 for
      an empty slot.
    sketch: (depth, width) int32 count-min sketch of keys not resident;
      (1, 1) unused when depth is 0.
    step: () int32 training steps translated so far (replicated).
  """

  key_hi: jax.Array
  key_lo: jax.Array
  count: jax.Array
  last: jax.Array
  sketch: jax.Array
  step: jax.Array


class Translation(NamedTuple):
  """What one step of the map yields on one device.

  Attributes:
    rows: (T,) int32 logical row of each of this source's tokens; -1 for
      padding, MISS for an id with no row (not admitted, failed, or read
      only).
    reset: (n,) int32 local slots given a new key this step (their table
      rows and slots start afresh), first, then -1.
    occupancy, inserts, evictions, not_admitted, failed, misses: () int32
      totals over devices: slots held after the step; keys inserted; keys
      evicted (by sweeps and by inserts); distinct keys not admitted yet;
      admitted keys that found no slot; tokens with no row.
  """

  rows: jax.Array
  reset: jax.Array
  occupancy: jax.Array
  inserts: jax.Array
  evictions: jax.Array
  not_admitted: jax.Array
  failed: jax.Array
  misses: jax.Array


def init_map(num_shards: int, capacity: int, depth: int, width: int) -> IdMap:
  """An empty map, global shapes (host NumPy arrays)."""
  n = num_shards * capacity
  return IdMap(
    key_hi=np.zeros((n,), np.uint32),
    key_lo=np.zeros((n,), np.uint32),
    count=np.zeros((n,), np.float32),
    last=np.full((n,), -1, np.int32),
    sketch=np.zeros((num_shards * max(depth, 1), width if depth else 1), np.int32),
    step=np.zeros((), np.int32),
  )


def _take(m: IdMap, slot, win, hi, lo, count, step, capacity) -> IdMap:
  at = jnp.where(win, slot, capacity)
  # A scatter per array, not one of the arrays stacked (`dedup.set_at`):
  # the stack copies the map (v5e:2x2 pod_check: +80 MiB temp per chip).
  put = lambda x, v: x.at[at].set(v, mode="drop")
  return m._replace(
    key_hi=put(m.key_hi, hi),
    key_lo=put(m.key_lo, lo),
    count=put(m.count, count),
    last=put(m.last, jnp.broadcast_to(step, at.shape)),
  )


class _Keys(NamedTuple):
  """The distinct keys an owner received, in rank order, (n,) each, and
  their probe windows."""

  hi: jax.Array
  lo: jax.Array
  count: jax.Array  # occurrences this step
  valid: jax.Array  # a key, not padding
  uid: jax.Array  # rank of each received slot's key (`OwnerStep.slot_uid`)
  home: jax.Array  # home slot
  window: probe_window.Windows

  def read(self, x):
    """(n, W) values of per-slot array x in each key's window."""
    return probe_window.read(self.window, x)


def _received(m: IdMap, hi, lo, count, probe_limit: int, lane_dense: bool) -> _Keys:
  """Phase 1: the received keys deduplicated (occurrences summed), their
  home slots and windows."""
  u_hi, u_lo, u_cnt, u_valid, uid = key_route.distinct(hi, lo, count)
  capacity = m.key_hi.shape[0]
  home = (u_lo % np.uint32(capacity)).astype(jnp.int32)
  dense = lane_dense and probe_window.fits_lanes(capacity, probe_limit)
  w = probe_window.windows(home, capacity, probe_limit, dense)
  return _Keys(u_hi, u_lo, u_cnt, u_valid, uid, home, w)


def _match(m: IdMap, k: _Keys) -> jax.Array:
  """(n,) the slot holding each key, -1 for none."""
  w = k.window
  match = w.inside & (k.read(m.last) >= 0) & (k.read(m.key_hi) == k.hi[:, None])
  match &= (k.read(m.key_lo) == k.lo[:, None]) & k.valid[:, None]
  return jnp.max(jnp.where(match, w.pos, -1), axis=1)  # one lane at most matches


def _admission(m: IdMap, k: _Keys, waiting, admit_after: int):
  """(map, admitted, estimate): the waiting keys counted in the sketch
  (aged first), and those whose estimate reaches `admit_after`."""
  if admit_after <= 1:
    return m, waiting, k.count
  depth, width = m.sketch.shape
  cells = sketch_slots(k.hi, k.lo, depth, width)
  inc = jnp.where(waiting, k.count, 0)
  rows = jnp.broadcast_to(jnp.arange(depth)[:, None], cells.shape)
  sketch = age_sketch(m.sketch).at[rows, cells].add(jnp.broadcast_to(inc, cells.shape))
  estimate = jnp.min(sketch[rows, cells], axis=0)
  return m._replace(sketch=sketch), waiting & (estimate >= admit_after), estimate


def _free_slots(m: IdMap, k: _Keys, admitted, usable, probe_limit: int):
  """(won, last): the slot each admitted key claims in the insertion rounds
  (-1: none), and the windows' `last` they and the victims read.

  The map as this step's inserts find it (they write it once, at the end):
  a slot is free if it was at the step's start and no round has claimed it;
  a victim must have been used, not in this step or the last. One read of
  `last` for both: a read before the rounds for the free slots and another
  after them for the victims moved fewer bytes, but XLA then kept one more
  (n, 128) array (v5e:2x2 pod_check at 4,096 examples per chip: 431.9
  against 381.9 MiB temp)."""
  capacity, w = m.key_hi.shape[0], k.window
  last = k.read(m.last)
  empty = last < 0 if usable is None else (last < 0) & k.read(usable)
  free = probe_window.window_bits(w, empty, probe_limit)
  won = insert_rounds.insert(free, k.home, admitted, capacity, probe_limit, w.rows is not None)
  return won, last


def _victim_slots(k: _Keys, last, count, waiting, estimate, step, capacity, *, policy, ttl):
  """((n,) bool the keys still `waiting` that take their window's victim,
  (n,) the victims' slots), from the windows' `last` and `count`."""
  has, lane, least = eviction.victims(last, count, k.window.inside, step, policy=policy, ttl=ttl)
  s = probe_window.slot_of(k.window, lane, capacity)
  if policy == "lfu":  # a one-off never pushes out a more frequent id
    has &= least <= estimate.astype(jnp.float32)
  # Victims are held slots, the rounds' free ones: no claim of theirs
  # competes with a round's.
  return reorder.first_claims(s, waiting & has, capacity), s


def owner_step(
  m: IdMap,
  recv_hi: jax.Array,
  recv_lo: jax.Array,
  recv_count: jax.Array,
  usable: jax.Array | None,
  *,
  probe_limit: int,
  admit_after: int,
  policy: str,
  evict_on_insert: bool,
  evict_every: int | None,
  decay: float,
  ttl: int | None,
  train: bool,
  lane_dense: bool = False,
) -> OwnerStep:
  """Steps 1 and 2 of the module docstring on one owner: the keys it
  received (`key_route.KeyRoute`'s recv arrays, (n,)), deduplicated and
  looked up, counted, admitted and inserted. `usable` (capacity,) bool:
  the slots whose physical row holds a logical row (None: every slot; on
  a TPU a read of a constant costs as much as any other). `lane_dense`: read the
  probe windows as 128-lane rows where the map allows (a TPU's way;
  `sharding.probe_window`), the same results.

  Phases: receive (dedup, windows); sweep; match; admission (sketch);
  insertion rounds into free slots; victims for the rest; one write of the
  map."""
  k = _received(m, recv_hi, recv_lo, recv_count, probe_limit, lane_dense)
  n, capacity = k.hi.shape[0], m.key_hi.shape[0]
  zero = jnp.zeros((), jnp.int32)
  if not train:
    reset = jnp.full((n,), -1, jnp.int32)
    return OwnerStep(m, _match(m, k), k.uid, reset, zero, zero, zero, zero)
  step = m.step
  count, last, evicted = eviction.sweep(
    m.count, m.last, m.step, policy=policy, evict_every=evict_every, decay=decay, ttl=ttl
  )
  m = m._replace(count=count, last=last)
  slot = _match(m, k)
  found = slot >= 0
  # Resident keys are used now, so no insert takes their slots as victims;
  # their counts are written at the end, with the new keys' (one scatter per
  # array: on a TPU each costs per index, whatever it writes).
  m = m._replace(last=m.last.at[jnp.where(found, slot, capacity)].set(step, mode="drop"))
  waiting = k.valid & ~found
  m, admitted, estimate = _admission(m, k, waiting, admit_after)
  won, last = _free_slots(m, k, admitted, usable, probe_limit)
  slot = jnp.where(won >= 0, won, slot)
  left = admitted & (won < 0)
  count = k.read(m.count)  # here, not before the rounds: one (n, W) array fewer through them
  if evict_on_insert:
    win, s = _victim_slots(k, last, count, left, estimate, step, capacity, policy=policy, ttl=ttl)
    slot = jnp.where(win, s, slot)
    left &= ~win
    evicted += jnp.sum(win, dtype=jnp.int32)
  new = admitted & ~left
  w = k.window
  held = jnp.sum(jnp.where(w.inside & (w.pos == slot[:, None]) & found[:, None], count, 0), axis=1)
  cnt = k.count.astype(jnp.float32)
  m = _take(m, slot, new | found, k.hi, k.lo, jnp.where(found, held + cnt, cnt), step, capacity)
  return OwnerStep(
    m._replace(step=step + 1),
    slot,
    k.uid,
    reorder.compact(new, slot, n, -1),
    evicted,
    jnp.sum(new, dtype=jnp.int32),
    jnp.sum(waiting & ~admitted, dtype=jnp.int32),
    jnp.sum(left, dtype=jnp.int32),
  )


def translate(
  m: IdMap,
  words: jax.Array,
  *,
  layout: RowLayout,
  axis_name,
  key_capacity: int,
  train: bool,
  impl: MapImpl | None = None,
  lane_dense: bool = False,
  **policy,
) -> tuple[IdMap, Translation]:
  """One step of this shard's map (see the module docstring).

  Args:
    m: this shard's `IdMap`.
    words: (T, 2) uint32 key words of this source's tokens, (PAD, PAD) for
      padding.
    layout: the table's rows (capacity = `layout.rows_per_shard`); slot j
      is physical row `map_slots.slot_rows(layout, shard, j)`, and slots
      whose row holds no logical row are never used.
    key_capacity: distinct keys this source may send one owner
      (`sharding.key_route`); the tokens of keys beyond it get no row.
    train: False reads only: nothing is counted, inserted or evicted.
    impl: a `MapImpl` (the native CPU kernels); None runs
      `key_route.plan` and `owner_step`.
    lane_dense: `owner_step`'s (without `impl`).
    **policy: `owner_step`'s probe_limit, admit_after, policy,
      evict_on_insert, evict_every, decay and ttl.

  Returns:
    (the new map, the `Translation`).
  """
  shards, capacity = layout.num_shards, layout.rows_per_shard
  me = jax.lax.axis_index(axis_name)
  valid = ~((words[:, 0] == PAD) & (words[:, 1] == PAD))
  usable = None  # every slot's row holds a logical row
  if layout.num_physical_rows != layout.num_rows:
    usable = map_slots.usable(layout, me, jnp.arange(capacity, dtype=jnp.int32))
  if impl is not None and usable is None:  # the native kernels take the array
    usable = jnp.ones((capacity,), bool)
  row_of = lambda slot: jnp.where(
    slot >= 0, map_slots.logical_rows(layout, me, jnp.maximum(slot, 0)), MISS
  )
  if shards == 1 and impl is not None and impl.one_shard is not None:
    out = impl.one_shard(
      m, words[:, 0], words[:, 1], valid, usable, key_capacity=key_capacity, train=train, **policy
    )
    m, rows, (reset, *counts) = IdMap(*out[0]), jnp.where(valid, row_of(out[1]), -1), out[2:]
  else:
    route = key_route.plan(
      words[:, 0],
      words[:, 1],
      valid,
      num_shards=shards,
      capacity=key_capacity,
      axis_name=axis_name,
      impl=impl and impl.plan,
    )
    step_fn = impl.owner_step if impl else functools.partial(owner_step, lane_dense=lane_dense)
    step = OwnerStep(
      *step_fn(m, route.recv_hi, route.recv_lo, route.recv_count, usable, train=train, **policy)
    )
    m, row = IdMap(*step.map), row_of(step.slot)
    answer = jnp.where(step.slot_uid >= 0, row[jnp.maximum(step.slot_uid, 0)], MISS)
    rows = jnp.where(valid, key_route.answer(route, answer, axis_name=axis_name, fill=MISS), -1)
    reset, counts = step.reset, (step.evictions, step.inserts, step.not_admitted, step.failed)
  evictions, inserts, not_admitted, failed = (jax.lax.psum(x, axis_name) for x in counts)
  return m, Translation(
    rows=rows,
    reset=reset,
    occupancy=jax.lax.psum(jnp.sum(m.last >= 0, dtype=jnp.int32), axis_name),
    inserts=inserts,
    evictions=evictions,
    not_admitted=not_admitted,
    failed=failed,
    misses=jax.lax.psum(jnp.sum(rows == MISS, dtype=jnp.int32), axis_name),
  )
