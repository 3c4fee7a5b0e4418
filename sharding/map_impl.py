"""What one owner's step of an id map yields, and the interface of a map
step computed elsewhere (the native CPU kernels, `pallas_emb.kernels`),
which `sharding.id_map.translate` calls in place of its own XLA code and
which returns the same bits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax


class OwnerStep(NamedTuple):
  """What an owner's step yields (`owner_step`, or an `OwnerStepImpl`).

  Attributes:
    map: the owner's new `sharding.id_map.IdMap`.
    slot: (n,) int32 local slot of each distinct key received, in rank
      order; -1 for none.
    slot_uid: (n,) int32 rank of each received slot's key, -1 for an empty
      slot.
    reset: (n,) int32 local slots given a new key this step, in rank order,
      then -1.
    evictions, inserts, not_admitted, failed: () int32 this owner's counts.
  """

  map: Any  # a `sharding.id_map.IdMap`
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
