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
   `age_sketch`), and those whose estimate reaches `admit_after` are
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
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharding import insert_rounds, key_route, map_slots, probe_window, reorder
from sharding.key_route import PAD
from sharding.layout import RowLayout

MISS = -2  # a token's row when it has none (-1 is padding, as the static path's)
# A sketch row is halved once it holds width / SKETCH_SAMPLE_DIVISOR increments.
SKETCH_SAMPLE_DIVISOR = 4
_MUL1, _MUL2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_SALTS = np.array([0x9E3779B9, 0x7F4A7C15, 0xF39CC060, 0x5CEDC834, 0x1B873593, 0xCC9E2D51,
                   0xE6546B64, 0x27D4EB2F], np.uint32)  # fmt: skip


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


def sketch_slots(hi, lo, depth: int, width: int):
  """(depth, n) counter of each key in each sketch row (NumPy or JAX)."""
  xp = np if isinstance(hi, np.ndarray) else jnp
  out = []
  for d in range(depth):
    x = (hi ^ _SALTS[d % len(_SALTS)]) * _MUL1
    x = (x ^ lo ^ np.uint32(d)) * _MUL2
    x = x ^ (x >> np.uint32(16))
    out.append((x % np.uint32(width)).astype(xp.int32))
  return xp.stack(out) if out else xp.zeros((0, hi.shape[0]), xp.int32)


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


def sketch_sample(width: int) -> int:
  """Increments a sketch row may hold before it is halved (`age_sketch`)."""
  return max(width // SKETCH_SAMPLE_DIVISOR, 1)


def age_sketch(sketch):
  """The sketch halved (every counter, rounded down) when its fullest row
  holds `sketch_sample(width)` or more: TinyLFU's reset. A row then never
  holds more than a quarter of its width plus one step's increments, so a
  counter another key shares reads 1/4 on average however long the stream
  (without it a full sketch reads every key as seen). (depth, width) int32,
  NumPy or JAX; the native map (csrc/id_map.cc) does the same."""
  xp = np if isinstance(sketch, np.ndarray) else jnp
  full = xp.max(xp.sum(sketch, axis=1)) >= sketch_sample(sketch.shape[1])
  return xp.where(full, sketch >> 1, sketch)


def _victims(last, count, inside, step, *, policy: str, ttl):
  """(has, lane, least) the policy's victim in each window, from the
  windows' (n, W) `last` and `count`: the lane of the least count (lfu) /
  least recent step, ties to the earlier place in the window (lanes are in
  window order); `least` (lfu) the victim's count, read here rather than
  gathered from `count` by lane."""
  ok = inside & (last >= 0) & (last < step - 1)
  if policy == "ttl":
    ok &= step - last >= ttl
  tie, least = ok, None
  if policy == "lfu":
    c = jnp.where(ok, count, jnp.inf)
    least = jnp.min(c, axis=1, keepdims=True)
    tie = ok & (c == least)
  lst = jnp.where(tie, last, np.iinfo(np.int32).max)
  tie &= lst == jnp.min(lst, axis=1, keepdims=True)
  has, lane = jnp.any(ok, axis=1), jnp.argmax(tie, axis=1).astype(jnp.int32)
  return has, lane, None if least is None else least[:, 0]


def _sweep(m: IdMap, *, policy, evict_every, decay, ttl):
  """(map, evicted) after the periodic sweep, if this step has one."""
  if evict_every is None:
    return m, jnp.zeros((), jnp.int32)
  now = (m.step > 0) & (m.step % evict_every == 0)
  count = m.count
  if policy == "lfu" and decay != 1:
    count = jnp.where(now, count * jnp.float32(decay), count)
  gone = jnp.zeros(m.last.shape, bool)
  if ttl is not None:
    gone = now & (m.last >= 0) & (m.step - m.last >= ttl)
  return m._replace(count=count, last=jnp.where(gone, -1, m.last)), jnp.sum(gone, dtype=jnp.int32)


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


class OwnerStep(NamedTuple):
  """What an owner's step yields (`owner_step`, or an `OwnerStepImpl`).

  Attributes:
    map: the owner's new `IdMap`.
    slot: (n,) int32 local slot of each distinct key received, in rank
      order; -1 for none.
    slot_uid: (n,) int32 rank of each received slot's key, -1 for an empty
      slot.
    reset: (n,) int32 local slots given a new key this step, in rank order,
      then -1.
    evictions, inserts, not_admitted, failed: () int32 this owner's counts.
  """

  map: IdMap
  slot: jax.Array
  slot_uid: jax.Array
  reset: jax.Array
  evictions: jax.Array
  inserts: jax.Array
  not_admitted: jax.Array
  failed: jax.Array


# An owner's step computed elsewhere (the native CPU kernels): called as
# `owner_step` is, it returns the same bits, as `OwnerStep`'s fields in order
# (a tuple will do; its map one of `IdMap`'s arrays).
OwnerStepImpl = Callable[..., OwnerStep]
# A source's `key_route.plan` before its all_to_alls: (hi, lo, valid,
# num_shards=, capacity=) -> (token_slot, send_hi, send_lo, send_count).
PlanImpl = Callable[..., tuple[jax.Array, jax.Array, jax.Array, jax.Array]]
# A one-shard map's whole step computed elsewhere, the plan, the owner's step
# and the answers in one call: (m, hi, lo, valid, usable, key_capacity=,
# train=, **policy) -> (map, token_slot (T,) int32 each token's local slot or
# -1, then `OwnerStep`'s reset, evictions, inserts, not_admitted, failed).
OneShardImpl = Callable[..., tuple]


class MapImpl(NamedTuple):
  """A map's step computed elsewhere, the same bits (the native CPU
  kernels): the source's plan, the owner's step, and optionally a
  one-shard map's whole step, which replaces both on a one-shard axis."""

  plan: PlanImpl
  owner_step: OwnerStepImpl
  one_shard: OneShardImpl | None = None


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
  `sharding.probe_window`), the same results."""
  u_hi, u_lo, u_cnt, u_valid, slot_uid = key_route.distinct(recv_hi, recv_lo, recv_count)
  n, capacity = u_hi.shape[0], m.key_hi.shape[0]
  home = (u_lo % np.uint32(capacity)).astype(jnp.int32)
  w = probe_window.windows(
    home, capacity, probe_limit, lane_dense and probe_window.fits_lanes(capacity, probe_limit)
  )
  read = functools.partial(probe_window.read, w)
  zero = jnp.zeros((), jnp.int32)
  evicted = inserts = not_admitted = failed = zero
  step = m.step
  if train:
    m, evicted = _sweep(m, policy=policy, evict_every=evict_every, decay=decay, ttl=ttl)
  match = w.inside & (read(m.last) >= 0) & (read(m.key_hi) == u_hi[:, None])
  match &= (read(m.key_lo) == u_lo[:, None]) & u_valid[:, None]
  slot = jnp.max(jnp.where(match, w.pos, -1), axis=1)  # one lane at most matches
  found = slot >= 0
  reset = jnp.full((n,), -1, jnp.int32)
  if train:
    # Resident keys are used now, so no insert takes their slots as victims;
    # their counts are written at the end, with the new keys' (one scatter
    # per array: on a TPU each costs per index, whatever it writes).
    m = m._replace(last=m.last.at[jnp.where(found, slot, capacity)].set(step, mode="drop"))
    waiting = u_valid & ~found
    if admit_after > 1:
      depth, width = m.sketch.shape
      cells = sketch_slots(u_hi, u_lo, depth, width)
      inc = jnp.where(waiting, u_cnt, 0)
      rows = jnp.broadcast_to(jnp.arange(depth)[:, None], cells.shape)
      sketch = age_sketch(m.sketch).at[rows, cells].add(jnp.broadcast_to(inc, cells.shape))
      m = m._replace(sketch=sketch)
      estimate = jnp.min(sketch[rows, cells], axis=0)
      admitted = waiting & (estimate >= admit_after)
    else:
      admitted, estimate = waiting, u_cnt
    not_admitted = jnp.sum(waiting & ~admitted, dtype=jnp.int32)
    # The map as this step's inserts find it (they write it once, at the
    # end): a slot is free if it was at the step's start and no round has
    # claimed it; a victim must have been used, not in this step or the last.
    # One read of `last` for both: a read before the rounds for the free
    # slots and another after them for the victims moved fewer bytes, but
    # XLA then kept one more (n, 128) array (v5e:2x2 pod_check at 4,096
    # examples per chip: 431.9 against 381.9 MiB temp).
    last = read(m.last)
    empty = last < 0 if usable is None else (last < 0) & read(usable)
    free = probe_window.window_bits(w, empty, probe_limit)
    won = insert_rounds.insert(free, home, admitted, capacity, probe_limit, w.rows is not None)
    slot = jnp.where(won >= 0, won, slot)
    left = admitted & (won < 0)
    count = read(m.count)  # here, not before the rounds: one (n, W) array fewer through them
    if evict_on_insert:
      has, lane, least = _victims(last, count, w.inside, step, policy=policy, ttl=ttl)
      s = probe_window.slot_of(w, lane, capacity)
      if policy == "lfu":  # a one-off never pushes out a more frequent id
        has &= least <= estimate.astype(jnp.float32)
      # Victims are held slots, the rounds' free ones: no claim of theirs
      # competes with a round's.
      win = reorder.first_claims(s, left & has, capacity)
      slot = jnp.where(win, s, slot)
      left &= ~win
      evicted += jnp.sum(win, dtype=jnp.int32)
    new = admitted & ~left
    held = jnp.sum(
      jnp.where(w.inside & (w.pos == slot[:, None]) & found[:, None], count, 0), axis=1
    )
    cnt = u_cnt.astype(jnp.float32)
    m = _take(m, slot, new | found, u_hi, u_lo, jnp.where(found, held + cnt, cnt), step, capacity)
    reset = reorder.compact(new, slot, n, -1)
    inserts = jnp.sum(new, dtype=jnp.int32)
    failed = jnp.sum(left, dtype=jnp.int32)
    m = m._replace(step=step + 1)
  return OwnerStep(m, slot, slot_uid, reset, evicted, inserts, not_admitted, failed)


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
