"""The member tables of a stacked table, as one device's step sees them.

Tables of the same width, dtype, optimizer and layout kind are stored as one
physical table (`pallas_emb.stacking` decides which); member `m` holds the
stacked rows `[starts[m], starts[m] + sizes[m])`, and rows between members
are padding that no id reaches. The physical table is deduplicated, routed
and updated as one, but what a user sees of a table stays per member:

* ids: a member's ids are offset into its rows before dedup; ids outside the
  member's own range stay invalid (counted for that member, never another
  member's row);
* counts: distinct, overflowing and routed ids are segment sums over each
  key's member;
* the update: each member has its own gradient norm and gate; the rows of a
  member that is not applied are taken out of the fused update (see
  `keep_rows`), so a non-finite gradient in one member skips only its rows.

Everything here runs inside `shard_map` on one device's blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from sharding.layout import SENTINEL, RowLayout
from sharding.reorder import compact

# What a member's id outside its range becomes: invalid for dedup (< 0) and
# not padding (-1), so it is counted as invalid, never routed.
INVALID_ID = -2


@dataclasses.dataclass(frozen=True)
class Members:
  """Where each member of a stacked table lives (static, hashable).

  Attributes:
    starts: the first stacked row of each member (ascending).
    sizes: the rows of each member.
    feature_member: the member each feature of the stacked table reads, in
      the table's token order.
    tags: each member's `packing.table_tag` (its stochastic rounding's).
  """

  starts: tuple[int, ...]
  sizes: tuple[int, ...]
  feature_member: tuple[int, ...]
  tags: tuple[int, ...] = ()

  @property
  def count(self) -> int:
    return len(self.starts)


def member_of(m: Members, rows: jax.Array) -> jax.Array:
  """Member of each stacked logical row; `m.count` for padding, gaps and
  negative rows (out of range for `num_segments=m.count`)."""
  starts = jnp.asarray(m.starts, jnp.int32)
  ends = starts + jnp.asarray(m.sizes, jnp.int32)
  idx = jnp.searchsorted(starts, rows, side="right").astype(jnp.int32) - 1
  at = jnp.maximum(idx, 0)
  inside = (rows >= 0) & (idx >= 0) & (rows < ends[at])
  return jnp.where(inside, at, m.count)


def member_of_local(m: Members, layout: RowLayout, local: jax.Array, shard: jax.Array) -> jax.Array:
  """Member of each local row of shard `shard` (-1 rows: `m.count`)."""
  logical = layout.logical_of(shard * layout.rows_per_shard + jnp.maximum(local, 0))
  return jnp.where(local >= 0, member_of(m, logical), m.count)


def member_of_keys(m: Members, layout: RowLayout, keys: jax.Array, present: jax.Array) -> jax.Array:
  """Member of each physical key where `present` (else `m.count`)."""
  logical = layout.logical_of(jnp.where(present, keys, 0))
  return jnp.where(present, member_of(m, logical), m.count)


def count(member: jax.Array, num: int) -> jax.Array:
  """(num,) int32 occurrences of each member index (others are dropped)."""
  return jax.ops.segment_sum(jnp.ones_like(member), member, num_segments=num)


def remap_ids(m: Members, feature_ids: Sequence[jax.Array]) -> tuple[list[jax.Array], jax.Array]:
  """Each feature's member ids -> stacked ids, and (M,) invalid per member.

  -1 stays padding; an id outside [0, size) of its member becomes
  `INVALID_ID`, counted for that member.
  """
  out, invalid = [], jnp.zeros((m.count,), jnp.int32)
  for member, ids in zip(m.feature_member, feature_ids):
    ok = (ids >= 0) & (ids < m.sizes[member])
    out.append(jnp.where(ok, ids + m.starts[member], jnp.where(ids == -1, -1, INVALID_ID)))
    invalid = invalid.at[member].add(jnp.sum(~ok & (ids != -1), dtype=jnp.int32))
  return out, invalid


def source_counts(m: Members, layout: RowLayout, unique, plan):
  """Per-member counts of one source's dedup and routing.

  Args:
    unique: this source's `sharding.dedup.Unique` (with `sorted_keys`).
    plan: its `RoutePlan`.

  Returns:
    (num_unique, num_overflow, route_demand), each (M,) int32: distinct
    valid ids, those dropped (over unique or route capacity), and the most
    ids of the member this source had for one owner.
  """
  n, shards = m.count, layout.num_shards
  sk = unique.sorted_keys
  prev = jnp.concatenate([jnp.full((1,), SENTINEL, jnp.int32), sk[:-1]])
  first = (sk != SENTINEL) & (sk != prev)
  num_unique = count(member_of_keys(m, layout, sk, first), n)
  sent = plan.send_keys != SENTINEL
  num_sent = count(member_of_keys(m, layout, plan.send_keys, sent), n)
  kept = unique.keys != SENTINEL
  member = member_of_keys(m, layout, unique.keys, kept)
  owner = jnp.where(kept, unique.keys // layout.rows_per_shard, 0)
  per_owner = jax.ops.segment_sum(
    jnp.ones_like(member),
    jnp.where(member < n, member * shards + owner, n * shards),
    num_segments=n * shards,
  )
  route_demand = jnp.max(per_owner.reshape(n, shards), axis=1)
  return num_unique, num_unique - num_sent, route_demand


def keep_rows(rows: jax.Array, grads: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Rows (and their gradients) where `keep`, moved to the front.

  The fused update kernel requires its rows ascending with the -1 padding
  last; `rows` are, and a stable compaction keeps them so: the kept rows
  stay in order, the others become -1 padding at the end (gradient zero).
  The Pallas kernel and the XLA path then see the same rows.

  Args:
    rows: (C,) int32 local rows ascending, -1 padding last.
    grads: (C, D) their gradients.
    keep: (C,) bool.
  """
  keep = keep & (rows >= 0)
  size = rows.shape[0]
  return compact(keep, rows, size, -1), compact(keep, grads, size, 0)


def init_rows(m: Members, initializer, keys: jax.Array, logical: jax.Array, dim: int) -> jax.Array:
  """(n, dim) float32 initial rows of stacked logical rows: row r of member
  i is `initializer(fold_in(keys[i], r))`, as if the member were alone;
  zero for padding and gaps."""
  member = member_of(m, logical)
  inside = member < m.count
  at = jnp.where(inside, member, 0)
  local = jnp.where(inside, logical - jnp.asarray(m.starts, jnp.int32)[at], 0)
  row_keys = jax.vmap(jax.random.fold_in)(keys[at], local)
  rows = jax.vmap(lambda k: initializer(k, (dim,), jnp.float32))(row_keys)
  return jnp.where(inside[:, None], rows.astype(jnp.float32), 0.0)
