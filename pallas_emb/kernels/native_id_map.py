"""The dynamic vocabulary's id map on the native CPU kernels (csrc/id_map.cc).

Three drop-ins for `sharding.id_map.translate`'s `impl`, bit for bit what
the XLA code computes (tests/test_owner_step.py on random maps,
tests/test_dynamic_vocab.py against the pure-Python reference):

* `plan`: a source's buckets before the all_to_all (`key_route.buckets`):
  a counting sort by owner, then a bucket sort of each owner's keys;
* `owner_step`: an owner's step between the all_to_alls (`id_map.owner_step`):
  dedup, sweep, lookup, sketch, insertion rounds and victims, in one pass
  over the keys received; the map is updated in place (aliased);
* `one_shard_step`: both, and each token's answer, in one call, for a
  table on one shard (no send buffers between two calls, no gathers of the
  answers in XLA: the drift benchmark's step about 4.5% faster).

Why: XLA:CPU runs the map's sorts, per-key gathers and per-round scatters
one loop each; the drift benchmark's step of 4,096 ids at 16,384 rows took
5.6 ms with the XLA map (9 times the static table's whole step), and these
two calls take about 0.06 and 0.13 ms of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.kernels import native_lib

# csrc/id_map.cc's policy codes.
POLICY_CODES = {"lfu": 0, "lru": 1, "ttl": 2}


def plan(hi: jax.Array, lo: jax.Array, valid: jax.Array, *, num_shards: int, capacity: int):
  """`sharding.key_route.buckets` natively: (token_slot (T,) int32,
  send_hi, send_lo (num_shards * capacity,) uint32, send_count int32)."""
  slots = num_shards * capacity
  return jax.ffi.ffi_call(
    native_lib.KEY_PLAN,
    (
      jax.ShapeDtypeStruct(hi.shape, jnp.int32),
      jax.ShapeDtypeStruct((slots,), jnp.uint32),
      jax.ShapeDtypeStruct((slots,), jnp.uint32),
      jax.ShapeDtypeStruct((slots,), jnp.int32),
    ),
  )(hi, lo, valid, num_shards=np.int64(num_shards), capacity=np.int64(capacity))


def _policy_attrs(
  probe_limit, admit_after, policy, evict_on_insert, evict_every, decay, ttl, train
):
  return dict(
    probe_limit=np.int64(probe_limit),
    admit_after=np.int64(admit_after),
    policy=np.int64(POLICY_CODES[policy]),
    evict_on_insert=bool(evict_on_insert),
    evict_every=np.int64(evict_every or 0),
    decay=np.float32(decay),
    ttl=np.int64(-1 if ttl is None else ttl),
    train=bool(train),
  )


def owner_step(
  m,
  recv_hi: jax.Array,
  recv_lo: jax.Array,
  recv_count: jax.Array,
  usable: jax.Array,
  *,
  probe_limit: int,
  admit_after: int,
  policy: str,
  evict_on_insert: bool,
  evict_every: int | None,
  decay: float,
  ttl: int | None,
  train: bool,
):
  """`sharding.id_map.owner_step` natively, same arguments; returns its
  fields as a tuple (the map as a tuple of `IdMap`'s six arrays)."""
  n = recv_hi.shape[0]
  per_key = jax.ShapeDtypeStruct((n,), jnp.int32)
  map_shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in m)
  out = jax.ffi.ffi_call(
    native_lib.ID_MAP_STEP,
    (*map_shapes, per_key, per_key, per_key, jax.ShapeDtypeStruct((4,), jnp.int32)),
    input_output_aliases={i: i for i in range(len(map_shapes))},
  )(
    *m,
    recv_hi,
    recv_lo,
    recv_count,
    usable,
    **_policy_attrs(
      probe_limit, admit_after, policy, evict_on_insert, evict_every, decay, ttl, train
    ),
  )
  new_map, (slot, slot_uid, reset, stats) = tuple(out[:6]), out[6:]
  return (new_map, slot, slot_uid, reset, *(stats[i] for i in range(4)))


def one_shard_step(m, hi, lo, valid, usable, *, key_capacity: int, **policy):
  """`sharding.id_map.translate`'s `OneShardImpl`: a one-shard map's plan,
  owner step and answers in one native call. `policy`: `owner_step`'s
  keywords.
  Returns (the map as a tuple, token_slot (T,) int32 each token's slot or
  -1, reset (key_capacity,) int32, evictions, inserts, not_admitted,
  failed)."""
  map_shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in m)
  out = jax.ffi.ffi_call(
    native_lib.ID_MAP_TRANSLATE1,
    (
      *map_shapes,
      jax.ShapeDtypeStruct(hi.shape, jnp.int32),
      jax.ShapeDtypeStruct((key_capacity,), jnp.int32),
      jax.ShapeDtypeStruct((4,), jnp.int32),
    ),
    input_output_aliases={i: i for i in range(len(map_shapes))},
  )(*m, hi, lo, valid, usable, key_capacity=np.int64(key_capacity), **_policy_attrs(**policy))
  new_map, (token_slot, reset, stats) = tuple(out[:6]), out[6:]
  return (new_map, token_slot, reset, *(stats[i] for i in range(4)))
