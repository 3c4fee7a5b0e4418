"""A fixed-capacity id -> row map per shard: the dynamic vocabulary's state
and its step, with static shapes only.

Every function here runs inside `jax.shard_map` over the table axis (the
`init_map` shapes excepted, which are global): each device owns the map of
its row shard, `capacity` open-addressing slots, slot j being its physical
row `shard * capacity + j`. Keys are 64-bit, as two uint32 words (high,
low), already well-mixed hashes of the raw ids (`pallas_emb.vocabulary`):
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
   are counted in the count-min sketch, and those whose estimate reaches
   `admit_after` are inserted: in round r = 0..P-1 each one still waiting
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
Evaluation (`train=False`) reads only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharding import key_route
from sharding.key_route import PAD
from sharding.layout import RowLayout

# Rows of a token: -1 padding (as the static path), MISS when no row.
MISS = -2
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
      rows and slots start afresh), -1 padding.
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


def _dedup(hi, lo, count):
  """Sorted distinct keys of the slots with a count, their counts summed:
  (u_hi, u_lo, u_count, u_valid, slot_uid)."""
  n = hi.shape[0]
  idx = jnp.arange(n, dtype=jnp.int32)
  k0, sh, sl, sidx, scount = jax.lax.sort(
    ((count <= 0).astype(jnp.uint32), hi, lo, idx, count), num_keys=3
  )
  sown = k0 == 0
  first = jnp.concatenate([jnp.ones((1,), bool), (sh[1:] != sh[:-1]) | (sl[1:] != sl[:-1])])
  new = sown & first
  uid = jnp.where(sown, jnp.cumsum(new, dtype=jnp.int32) - 1, -1)
  at = jnp.where(new, uid, n)
  u_hi = jnp.zeros((n,), jnp.uint32).at[at].set(sh, mode="drop")
  u_lo = jnp.zeros((n,), jnp.uint32).at[at].set(sl, mode="drop")
  u_count = jax.ops.segment_sum(jnp.where(sown, scount, 0), jnp.where(sown, uid, n), num_segments=n)
  u_valid = idx < jnp.sum(new, dtype=jnp.int32)
  slot_uid = jnp.zeros((n,), jnp.int32).at[sidx].set(uid, unique_indices=True)
  return u_hi, u_lo, u_count, u_valid, slot_uid


def _claim(slot, want, rank, claims):
  """(win, claims): which keys that `want` a `slot` win it (the lowest rank
  per slot), and `claims` with their ranks recorded.

  `claims` (capacity,) int32 is made once per step: a claimed slot is taken
  by its winner at once, and a taken slot is never claimed again in the
  step (probes claim free slots; victims are slots not used this step), so
  no round needs a fresh capacity-sized array.
  """
  capacity = claims.shape[0]
  claims = claims.at[jnp.where(want, slot, capacity)].min(rank, mode="drop")
  return want & (claims[jnp.minimum(slot, capacity - 1)] == rank), claims


def _victims(m: IdMap, pos, step, *, policy: str, ttl):
  """(has, p) the policy's victim in each window: the position of the
  least count (lfu) / least recent step, ties to the earlier one."""
  last = m.last[pos]
  ok = (last >= 0) & (last < step - 1)
  if policy == "ttl":
    ok &= step - last >= ttl
  tie = ok
  if policy == "lfu":
    c = jnp.where(ok, m.count[pos], jnp.inf)
    tie = ok & (c == jnp.min(c, axis=1, keepdims=True))
  lst = jnp.where(tie, last, np.iinfo(np.int32).max)
  tie &= lst == jnp.min(lst, axis=1, keepdims=True)
  return jnp.any(ok, axis=1), jnp.argmax(tie, axis=1).astype(jnp.int32)


def _sweep(m: IdMap, usable, *, policy, evict_every, decay, ttl):
  """(map, evicted) after the periodic sweep, if this step has one."""
  if evict_every is None:
    return m, jnp.zeros((), jnp.int32)
  now = (m.step > 0) & (m.step % evict_every == 0)
  count = m.count
  if policy == "lfu" and decay != 1:
    count = jnp.where(now, count * jnp.float32(decay), count)
  gone = jnp.zeros_like(usable)
  if ttl is not None:
    gone = now & (m.last >= 0) & (m.step - m.last >= ttl)
  return m._replace(count=count, last=jnp.where(gone, -1, m.last)), jnp.sum(gone, dtype=jnp.int32)


def _take(m: IdMap, slot, win, hi, lo, cnt, step, capacity) -> IdMap:
  at = jnp.where(win, slot, capacity)
  put = lambda x, v: x.at[at].set(v, mode="drop")
  return m._replace(
    key_hi=put(m.key_hi, hi),
    key_lo=put(m.key_lo, lo),
    count=put(m.count, cnt.astype(jnp.float32)),
    last=put(m.last, jnp.broadcast_to(step, at.shape)),
  )


def translate(
  m: IdMap,
  words: jax.Array,
  *,
  layout: RowLayout,
  axis_name,
  key_capacity: int,
  probe_limit: int,
  admit_after: int,
  policy: str,
  evict_on_insert: bool,
  evict_every: int | None,
  decay: float,
  ttl: int | None,
  train: bool,
) -> tuple[IdMap, Translation]:
  """One step of this shard's map (see the module docstring).

  Args:
    m: this shard's `IdMap`.
    words: (T, 2) uint32 key words of this source's tokens, (PAD, PAD) for
      padding.
    layout: the table's rows (capacity = `layout.rows_per_shard`); slots
      whose physical row holds no logical row are never used.
    key_capacity: distinct keys this source may send one owner
      (`sharding.key_route`); the tokens of keys beyond it get no row.
    train: False reads only: nothing is counted, inserted or evicted.

  Returns:
    (the new map, the `Translation`).
  """
  shards, capacity = layout.num_shards, layout.rows_per_shard
  me = jax.lax.axis_index(axis_name)
  valid = ~((words[:, 0] == PAD) & (words[:, 1] == PAD))
  route = key_route.plan(
    words[:, 0], words[:, 1], valid, num_shards=shards, capacity=key_capacity, axis_name=axis_name
  )
  u_hi, u_lo, u_cnt, u_valid, slot_uid = _dedup(route.recv_hi, route.recv_lo, route.recv_count)
  n = u_hi.shape[0]
  rank = jnp.arange(n, dtype=jnp.int32)
  usable = layout.logical_of(me * capacity + jnp.arange(capacity, dtype=jnp.int32)) >= 0
  home = (u_lo % np.uint32(capacity)).astype(jnp.int32)
  pos = (home[:, None] + jnp.arange(probe_limit, dtype=jnp.int32)) % capacity
  zero = jnp.zeros((), jnp.int32)
  evicted = inserts = not_admitted = failed = zero
  step = m.step
  if train:
    m, evicted = _sweep(m, usable, policy=policy, evict_every=evict_every, decay=decay, ttl=ttl)
  match = (m.last[pos] >= 0) & (m.key_hi[pos] == u_hi[:, None]) & (m.key_lo[pos] == u_lo[:, None])
  match &= u_valid[:, None]
  found = jnp.any(match, axis=1)
  slot = jnp.where(found, jnp.sum(jnp.where(match, pos, 0), axis=1), -1)
  reset = jnp.full((n,), -1, jnp.int32)
  if train:
    at = jnp.where(found, slot, capacity)
    m = m._replace(
      count=m.count.at[at].add(u_cnt.astype(jnp.float32), mode="drop"),
      last=m.last.at[at].set(step, mode="drop"),
    )
    waiting = u_valid & ~found
    if admit_after > 1:
      depth, width = m.sketch.shape
      cells = sketch_slots(u_hi, u_lo, depth, width)
      inc = jnp.where(waiting, u_cnt, 0)
      rows = jnp.broadcast_to(jnp.arange(depth)[:, None], cells.shape)
      sketch = m.sketch.at[rows, cells].add(jnp.broadcast_to(inc, cells.shape))
      m = m._replace(sketch=sketch)
      estimate = jnp.min(sketch[rows, cells], axis=0)
      admitted = waiting & (estimate >= admit_after)
    else:
      admitted, estimate = waiting, u_cnt
    not_admitted = jnp.sum(waiting & ~admitted, dtype=jnp.int32)
    left = admitted
    claims = jnp.full((capacity,), np.iinfo(np.int32).max, jnp.int32)
    for r in range(probe_limit):
      s = pos[:, r]
      win, claims = _claim(s, left & (m.last[s] < 0) & usable[s], rank, claims)
      m = _take(m, s, win, u_hi, u_lo, u_cnt, step, capacity)
      slot = jnp.where(win, s, slot)
      left &= ~win
    if evict_on_insert:
      has, p = _victims(m, pos, step, policy=policy, ttl=ttl)
      s = jnp.take_along_axis(pos, p[:, None], axis=1)[:, 0]
      if policy == "lfu":  # a one-off never pushes out a more frequent id
        has &= m.count[s] <= estimate.astype(jnp.float32)
      win, _ = _claim(s, left & has, rank, claims)
      m = _take(m, s, win, u_hi, u_lo, u_cnt, step, capacity)
      slot = jnp.where(win, s, slot)
      left &= ~win
      evicted += jnp.sum(win, dtype=jnp.int32)
    new = admitted & ~left
    reset = jnp.where(new, slot, -1)
    inserts = jnp.sum(new, dtype=jnp.int32)
    failed = jnp.sum(left, dtype=jnp.int32)
    m = m._replace(step=step + 1)
  row = jnp.where(slot >= 0, layout.logical_of(me * capacity + jnp.maximum(slot, 0)), MISS)
  answer = jnp.where(slot_uid >= 0, row[jnp.maximum(slot_uid, 0)], MISS)
  rows = jnp.where(valid, key_route.answer(route, answer, axis_name=axis_name, fill=MISS), -1)
  total = lambda x: jax.lax.psum(x, axis_name)
  return m, Translation(
    rows=rows,
    reset=reset,
    occupancy=total(jnp.sum(m.last >= 0, dtype=jnp.int32)),
    inserts=total(inserts),
    evictions=total(evicted),
    not_admitted=total(not_admitted),
    failed=total(failed),
    misses=total(jnp.sum(rows == MISS, dtype=jnp.int32)),
  )


def reshard(m: IdMap, new: RowLayout, probe_limit: int, sketch_shape):
  """A host map, whatever shard count wrote it, re-inserted for `new`'s.

  Runs on the host (NumPy), when a checkpoint is restored onto another
  shard count. Every resident key goes to its owner and window under `new`
  (`high % shards`, `low % capacity`, `probe_limit` slots), keeping its
  count and last step; keys are placed in rounds as `translate` inserts
  them: in round r each key still waiting claims slot home + r if it is
  free and usable, and of keys claiming one slot the one of highest count
  (then latest step, then smallest key) wins. Keys left after the last
  round are dropped. The sketch of keys not yet admitted starts empty
  (`sketch_shape`): its counters are per shard and not per key.

  Args:
    m: the whole map as NumPy arrays (global slots, shards concatenated).
    new: the table's layout now.
    probe_limit: the window under `new` (at most `new.rows_per_shard`).
    sketch_shape: the new sketch's (rows, width).

  Returns:
    (the new map; (new.num_physical_rows,) int64 the old slot whose key each
    new slot holds, -1 where empty; the number of keys dropped).
  """
  m = IdMap(*(np.asarray(x) for x in m))
  held = np.flatnonzero(m.last >= 0)
  held = held[np.lexsort((m.key_lo[held], m.key_hi[held], -m.last[held], -m.count[held]))]
  shards, capacity = new.num_shards, new.rows_per_shard
  base = (m.key_hi[held] % np.uint32(shards)).astype(np.int64) * capacity
  home = (m.key_lo[held] % np.uint32(capacity)).astype(np.int64)
  usable = new.logical_of(np.arange(new.num_physical_rows, dtype=np.int64)) >= 0
  source = np.full((new.num_physical_rows,), -1, np.int64)
  waiting = np.ones(held.shape, bool)
  for r in range(probe_limit):
    cand = base + (home + r) % capacity
    want = np.flatnonzero(waiting & usable[cand] & (source[cand] < 0))
    # Keys are in priority order: a slot's first claimant takes it.
    slots, first = np.unique(cand[want], return_index=True)
    source[slots] = held[want[first]]
    waiting[want[first]] = False
  taken = source >= 0
  out = init_map(shards, capacity, 0, 1)._replace(
    sketch=np.zeros(sketch_shape, np.int32), step=m.step.astype(np.int32)
  )
  for name in ("key_hi", "key_lo", "count", "last"):
    getattr(out, name)[taken] = getattr(m, name)[source[taken]]
  return out, source, int(waiting.sum())
