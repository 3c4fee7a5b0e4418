"""Moving 64-bit keys to the shards that own them, and answers back.

The dynamic vocabulary's counterpart of `sharding.route`: every function
here runs inside `jax.shard_map` over the table axis, each device being at
once a *source* (it holds a data shard's raw ids, as (high, low) uint32 key
words) and an *owner* (it holds the id map of its row shard,
`sharding.id_map`). A key's owner is its high word modulo the shard count
(the words are well-mixed hashes, so keys spread evenly).

A source sorts its keys by (owner, high, low) and sends each distinct key
once, with its number of occurrences, in a buffer of `num_shards *
capacity` slots (one block per owner), by one all_to_all per array. The
owner merges what its sources sent (`distinct`: a key sent by several
sources once, its counts summed) and answers one value per slot it
received (the key's row), and the same plan returns the answers: every
token takes its key's slot's answer. So a
chip sorts, sends and answers about `num_shards * capacity` keys (1.25 x its
tokens, plus a slack, with the default capacity), whatever the chip count.

A source with more than `capacity` distinct keys for one owner drops the
rest: their tokens get no row (the map counts them as misses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharding import reorder
from sharding.dedup import set_at
from sharding.route import exchange

PAD = np.uint32(0xFFFFFFFF)  # both words of an empty slot (and of padding)


class KeyRoute(NamedTuple):
  """One device's routing of its tokens' keys (see the module docstring).

  Attributes:
    token_slot: (T,) int32 send slot `owner * capacity + position` of each
      token's key, -1 for padding or a key dropped for capacity.
    recv_hi, recv_lo: (num_shards * capacity,) uint32 keys this owner
      received, one block per source; (PAD, PAD) for an empty slot.
    recv_count: (num_shards * capacity,) int32 occurrences of each received
      key at its source, 0 for an empty slot.
  """

  token_slot: jax.Array
  recv_hi: jax.Array
  recv_lo: jax.Array
  recv_count: jax.Array


def plan(
  hi: jax.Array,
  lo: jax.Array,
  valid: jax.Array,
  *,
  num_shards: int,
  capacity: int,
  axis_name,
  impl: Callable | None = None,
) -> KeyRoute:
  """Buckets this source's distinct keys by owner and sends them.

  Args:
    hi, lo: (T,) uint32 key words of this source's tokens.
    valid: (T,) bool false for padding.
    num_shards: size of `axis_name`.
    capacity: distinct keys one source may send to one owner.
    axis_name: the mesh axis the table is sharded over.
    impl: `buckets`'s work computed elsewhere, the same bits (the native CPU
      kernels); None runs `buckets`.
  """
  token_slot, send_hi, send_lo, send_count = (impl or buckets)(
    hi, lo, valid, num_shards=num_shards, capacity=capacity
  )
  return KeyRoute(
    token_slot=token_slot,
    recv_hi=exchange(send_hi, axis_name),
    recv_lo=exchange(send_lo, axis_name),
    recv_count=exchange(send_count, axis_name),
  )


def buckets(hi: jax.Array, lo: jax.Array, valid: jax.Array, *, num_shards: int, capacity: int):
  """A source's send buffers, before the all_to_all: (token_slot (T,) int32
  (`KeyRoute`'s), send_hi, send_lo (num_shards * capacity,) uint32 each
  distinct key once in its owner's block, (PAD, PAD) elsewhere, and
  send_count (num_shards * capacity,) int32 its occurrences)."""
  t = hi.shape[0]
  slots = num_shards * capacity
  owner = jnp.where(valid, (hi % np.uint32(num_shards)).astype(jnp.int32), num_shards)
  idx = jnp.arange(t, dtype=jnp.int32)
  so, sh, sl, sidx = jax.lax.sort((owner, hi, lo, idx), num_keys=3)
  has = so < num_shards
  first = jnp.concatenate(
    [jnp.ones((1,), bool), (so[1:] != so[:-1]) | (sh[1:] != sh[:-1]) | (sl[1:] != sl[:-1])]
  )
  new = has & first
  rank = jnp.cumsum(new, dtype=jnp.int32) - 1  # of each token's key among the distinct keys
  # An owner's keys are one run of the sorted order: the rank of its first
  # key, carried along the run by a running max (ranks ascend), gives each
  # key's position in its owner's block.
  starts = new & jnp.concatenate([jnp.ones((1,), bool), so[1:] != so[:-1]])
  position = rank - jax.lax.cummax(jnp.where(starts, rank, -1))
  fits = has & (position < capacity)
  slot = jnp.where(fits, so * capacity + position, -1)
  at = jnp.where(new & fits, slot, slots)
  # A key's occurrences: the length of its run (a key fits or not whole).
  occurrences = _run_totals(new | ~has, jnp.ones((t,), jnp.int32))
  pad = jnp.full((slots,), PAD, jnp.uint32)
  send_hi, send_lo, count = set_at(
    (pad, pad, jnp.zeros((slots,), jnp.int32)), at, (sh, sl, occurrences)
  )
  token_slot = reorder.invert(sidx, slot)
  return token_slot, send_hi, send_lo, count


def _run_totals(starts, values):
  """(n,) the sum of `values` (int32, >= 0) over the run that begins at
  each place (its run: up to the next place in `starts`, (n,) bool)."""
  total = jnp.cumsum(values)  # ascending: the nearest run end has the least
  ends = jnp.concatenate([starts[1:], jnp.ones((1,), bool)])
  to_end = jax.lax.cummin(jnp.where(ends, total, jnp.iinfo(jnp.int32).max), reverse=True)
  return to_end - total + values


def answer(route: KeyRoute, values: jax.Array, *, axis_name, fill) -> jax.Array:
  """(T,) each token's value: `values` (num_shards * capacity,), the
  owner's answer per slot it received, sent back to the sources; `fill`
  for a token without a slot."""
  back = exchange(values, axis_name)
  at = jnp.maximum(route.token_slot, 0)
  return jnp.where(route.token_slot >= 0, back[at], jnp.asarray(fill, values.dtype))


def distinct(hi: jax.Array, lo: jax.Array, count: jax.Array):
  """An owner's distinct keys among the slots it received (`KeyRoute`'s
  recv arrays, (n,)): the slots with a count, sorted by (high, low) and
  deduplicated, their counts summed. A key's place in that order is its
  rank. Returns (u_hi, u_lo (n,) uint32, u_count (n,) int32, u_valid (n,)
  bool: the first `num distinct` places, slot_uid (n,) int32 each slot's
  rank, -1 for an empty slot)."""
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
  occurrences = _run_totals(new | ~sown, jnp.where(sown, scount, 0))
  zeros = jnp.zeros((n,), jnp.uint32)
  u_hi, u_lo, u_count = set_at((zeros, zeros, zeros.astype(jnp.int32)), at, (sh, sl, occurrences))
  u_valid = idx < jnp.sum(new, dtype=jnp.int32)
  slot_uid = reorder.invert(sidx, uid)
  return u_hi, u_lo, u_count, u_valid, slot_uid
