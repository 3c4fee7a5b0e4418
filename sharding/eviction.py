"""Eviction in a dynamic vocabulary's map: the periodic sweep, and the
policy's victim in each probe window (when an admitted key finds no free
slot). Functions of one shard's per-slot arrays or of its keys' windows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def victims(last, count, inside, step, *, policy: str, ttl):
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


def sweep(count, last, step, *, policy: str, evict_every: int | None, decay: float, ttl):
  """(count, last, evicted) of a shard's (capacity,) slots after the periodic
  sweep, if step `step` has one: "lfu" counts times `decay`, keys idle for
  `ttl` steps or more evicted (last = -1)."""
  if evict_every is None:
    return count, last, jnp.zeros((), jnp.int32)
  now = (step > 0) & (step % evict_every == 0)
  if policy == "lfu" and decay != 1:
    count = jnp.where(now, count * jnp.float32(decay), count)
  gone = jnp.zeros(last.shape, bool)
  if ttl is not None:
    gone = now & (last >= 0) & (step - last >= ttl)
  return count, jnp.where(gone, -1, last), jnp.sum(gone, dtype=jnp.int32)
