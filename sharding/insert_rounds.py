"""The id map's insertion rounds: waiting keys claim free slots of their
probe windows, round by round (`sharding.id_map`, step 2).

In round r every key still waiting claims the r-th slot of its window if
that slot was free at the step's start; the lowest rank wins a slot claimed
twice, and a slot taken in an earlier round is lost to later claimants. A
claim's value is round * n + rank, kept by a scatter-min in `claims`
(capacity,): a slot's earlier claim keeps the smaller value, so the rounds
need no other state, and the map is written once, after them.

A key's window reaches the rounds as bits (`probe_window.window_bits`): a
round reads one word per key, not the key's W lanes, and nothing (n, W)
wide lives through the loop. A round costs a scatter and a gather of every
key, whoever still waits, and the rounds run while any key has a free slot
ahead. Few keys usually do after the first rounds (a full map's newcomers
find no free slot at all; most others win one of their first lanes), so
once they fit a tenth of the keys they are gathered and the later rounds
run over them alone; the claims, and so every winner, are the same.

On a TPU a scatter or a gather costs about 4 us even for a few hundred
indices, and the few keys' rounds (about 15 a step) were 9 us each. There
the few are up to `DENSE_KEYS` and their rounds keep no claims array: two
keys of one round collide only if they share a home, and a key j that won
in round w holds key i's window slot w + (home_j - home_i), so a round is
two (k, k) comparisons and reductions (`_dense_rounds`), after one read of
the claims so far in the keys' windows.

Pure functions of one device's arrays, inside `jax.shard_map` or not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sharding import probe_window, reorder
from sharding.reorder import compact

UNCLAIMED = np.iinfo(np.int32).max


def claim(slot, want, value, claims):
  """(win, claims): which keys that `want` a `slot` win it (the least
  `value` per slot), and `claims` with their values recorded."""
  capacity = claims.shape[0]
  claims = claims.at[jnp.where(want, slot, capacity)].min(value, mode="drop")
  return want & (claims[jnp.minimum(slot, capacity - 1)] == value), claims


def _last_bit(bits):
  """(n,) the highest r whose bit is set in (n, words) `bits`, -1 for none."""
  top = [
    jnp.where(b != 0, 32 * k + 31 - jax.lax.clz(b).astype(jnp.int32), -1)
    for k, b in enumerate(bits.T)
  ]
  return functools.reduce(jnp.maximum, top)


def _rounds(claims, free, home, waiting, rank, num_keys: int, probe_limit: int, r0=0, few=None):
  """(round reached, claims, slot (k,) won or -1, still waiting) of rounds
  over k keys (`free`: their (k, words) window bits, `home` their home
  slots) from round `r0`: while any key has a free slot ahead or, with
  `few`, while more than `few` keys do."""
  capacity = claims.shape[0]
  last_free = _last_bit(free)  # -1: nothing to claim

  def more(c):
    r, _, _, left = c
    ahead = left & (last_free >= r)
    go = (r < probe_limit) & jnp.any(ahead)
    return go if few is None else go & (jnp.sum(ahead, dtype=jnp.int32) > few)

  def round_(c):
    r, claims, slot, left = c
    word = jax.lax.dynamic_index_in_dim(free, r // 32, axis=1, keepdims=False)
    has = (word >> (r % 32).astype(jnp.uint32)) & 1 == 1
    s = home + r
    s = jnp.where(s >= capacity, s - capacity, s)
    win, claims = claim(s, left & has, r * num_keys + rank, claims)
    return r + 1, claims, jnp.where(win, s, slot), left & ~win

  slot = jnp.full(rank.shape, -1, jnp.int32)
  r, claims, slot, left = jax.lax.while_loop(
    more, round_, (jnp.asarray(r0, jnp.int32), claims, slot, waiting)
  )
  return r, claims, slot, left & (last_free >= r)


_NONE = -(2**30)  # a round no key won, a window offset out of reach: their sums stay < 0


def _dense_rounds(free, home, waiting, r0, capacity: int, probe_limit: int):
  """(k,) int32 the slot each of k keys (in rank order) wins, -1 for none,
  in the rounds from `r0` on, with no claims array: key j, won in round
  won[j], holds key i's window slot won[j] + d[i, j] (d: j's home less
  i's, mod capacity, when under probe_limit), and keys of one round
  collide only at one home. A round is two (k, k) reductions and no
  scatter or gather: a TPU's way for a few keys (`insert`). `free` must
  already omit the slots that earlier rounds took."""
  k = home.shape[0]
  last_free = _last_bit(free)
  d = home[None, :] - home[:, None]
  d = jnp.where(d < 0, d + capacity, d)
  d = jnp.where(d < probe_limit, d, _NONE)
  rank = jnp.arange(k, dtype=jnp.int32)
  same = (d == 0) & (rank[None, :] < rank[:, None])  # an earlier key of the same home

  def more(c):
    r, _, _, left = c
    return (r < probe_limit) & jnp.any(left & (last_free >= r))

  def round_(c):
    r, won, slot, left = c
    word = jax.lax.dynamic_index_in_dim(free, r // 32, axis=1, keepdims=False)
    want = left & ((word >> (r % 32).astype(jnp.uint32)) & 1 == 1)
    want &= ~jnp.any(won[None, :] + d == r, axis=1)
    win = want & ~jnp.any(same & want[None, :], axis=1)
    s = home + r
    s = jnp.where(s >= capacity, s - capacity, s)
    return r + 1, jnp.where(win, r, won), jnp.where(win, s, slot), left & ~win

  none = jnp.full((k,), _NONE, jnp.int32)
  c = (jnp.asarray(r0, jnp.int32), none, jnp.full((k,), -1, jnp.int32), waiting)
  return jax.lax.while_loop(more, round_, c)[2]


def _few_rounds(claims, free, home, waiting, _, r0, *, lane_dense: bool, probe_limit: int):
  """`_dense_rounds` after the claims so far, read from the keys' windows."""
  capacity = claims.shape[0]
  w = probe_window.windows(home, capacity, probe_limit, lane_dense)
  taken = probe_window.read(w, claims) != UNCLAIMED
  free &= ~probe_window.window_bits(w, taken, probe_limit)
  return _dense_rounds(free, home, waiting, r0, capacity, probe_limit)


def _claim_rounds(claims, free, home, waiting, rank, r0, *, num_keys: int, probe_limit: int):
  """`_rounds` of a few keys from round `r0`, their claims' values those of
  their ranks among all `num_keys` keys (`rank`, their index there)."""
  return _rounds(claims, free, home, waiting, rank, num_keys, probe_limit, r0=r0)[2]


def _insert(free, home, waiting, *, few: int, few_rounds, capacity: int, probe_limit: int):
  """Every key's rounds while more than `few` keys may still win a slot,
  then the rest's, gathered (rank order kept: the i-th key left is at i, n
  pads; its claims' values are those of its rank), by `few_rounds`."""
  n = waiting.shape[0]
  rank = jnp.arange(n, dtype=jnp.int32)
  claims = jnp.full((capacity,), UNCLAIMED, jnp.int32)
  may = waiting & jnp.any(free != 0, axis=1)
  if few >= n:
    return few_rounds(claims, free, home, may, rank, 0)
  r, claims, slot, left = _rounds(claims, free, home, may, rank, n, probe_limit, few=few)
  idx = compact(left, rank, few, n)
  valid, key = idx < n, jnp.minimum(idx, n - 1)
  sub_free = jnp.where(valid[:, None], free[key], 0)
  got = few_rounds(claims, sub_free, home[key], valid, key, r)
  return slot.at[idx].set(got, mode="drop")


# Keys that `_dense_rounds` takes at most: its (k, k) arrays grow as k^2.
DENSE_KEYS = 512


def insert(free, home, waiting, capacity: int, probe_limit: int, lane_dense: bool = False):
  """The rounds of one step.

  The keys' rounds while more than a tenth of them may still win, then the
  rest's, by claims. On a TPU, where a round by claims is a scatter and a
  gather, the rest are up to `DENSE_KEYS` keys' rounds without claims
  (`_dense_rounds`), if that is more than a tenth.

  Args:
    free: (n, ceil(probe_limit / 32)) uint32 each key's window slots free at
      the step's start, as bits (`sharding.probe_window.window_bits`).
    home: (n,) int32 each key's home slot (its window's slot r is home + r,
      wrapping).
    waiting: (n,) bool the keys to insert (admitted, not resident).
    capacity: the map's slots.
    probe_limit: the rounds (the window's length).
    lane_dense: the windows' reads (`sharding.probe_window`), on a TPU.

  Returns:
    (n,) int32 the slot each key won, -1 for none.
  """
  n = waiting.shape[0]
  if (probe_limit + 1) * n >= 2**31:
    raise ValueError(f"(probe_limit + 1) * keys = {(probe_limit + 1) * n} must fit int32.")
  kw = dict(capacity=capacity, probe_limit=probe_limit)
  claim_rounds = functools.partial(_claim_rounds, num_keys=n, probe_limit=probe_limit)
  by_claims = functools.partial(_insert, few=max(1, n // 10), few_rounds=claim_rounds, **kw)
  if n // 10 > DENSE_KEYS:
    return by_claims(free, home, waiting)
  dense = functools.partial(_few_rounds, lane_dense=lane_dense, probe_limit=probe_limit)
  tpu = functools.partial(_insert, few=min(n, DENSE_KEYS), few_rounds=dense, **kw)
  return reorder.per_platform(tpu, by_claims, free, home, waiting)
