"""One replicated table's sparse step on one device: no all_to_all.

A small table (`TableSpec.placement="replicated"`, or below
`ShardedEmbedding.replicate_below` rows) is stored whole on every device of
the axis (`ShardedTable.replicated`; its layout has one shard). The lookup
is local: dedup, one gather, each id takes its distinct id's row. The
update is the sharded table's math with every device as the one owner:

    per-id gradients -> segment sum per distinct id (as a source does)
    -> all_gather of the distinct ids and their sums, in device order
    -> merge: the same row's sums added in source order (fixed: the result
       is deterministic and, with exact sums, bit-identical to the sharded
       table's) -> norm and gate -> the fused update, the same on every
       device, so the replicas stay identical.

The residuals have the sharded table's structure; of the plan only
`token_slot` (each id's distinct slot) and `send_keys` (the distinct rows)
are used, the owner fields are the source's own (the merge happens in the
update).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_emb import kernels, norms, pooling
from pallas_emb.shard_kernels import fused_update
from pallas_emb.shard_ops import make_residuals, pool_all
from pallas_emb.sharded_table import ShardedTable
from pallas_emb.state import TableMetrics, TableResiduals
from sharding.dedup import Unique, dedup, unique_keys
from sharding.layout import SENTINEL
from sharding.route import RoutePlan, take_rows
from sharding.sorted_sums import of_dedup, segment_sum


def _rows(keys: jax.Array) -> jax.Array:
  return jnp.where(keys != SENTINEL, keys, -1)


def _plan(t: ShardedTable, blocks: Sequence) -> tuple[Unique, RoutePlan]:
  ids, dropped = zip(*(pooling.token_ids(x) for x in blocks))
  unique = dedup(jnp.concatenate(ids), t.layout, t.capacities.unique, t.dedup_method)
  unique = unique._replace(num_overflow=unique.num_overflow + sum(dropped))
  rows = _rows(unique.keys)
  zero = jnp.zeros((), jnp.int32)
  kept = jnp.minimum(unique.num_unique, unique.keys.shape[0])
  return unique, RoutePlan(
    token_slot=unique.inverse,
    send_keys=unique.keys,
    recv_rows=rows,
    owner_rows=rows,
    owner_inverse=jnp.where(rows >= 0, jnp.arange(rows.shape[0], dtype=jnp.int32), -1),
    num_owner_unique=kept,
    num_overflow=zero,
    # Every distinct id goes to the one (local) owner.
    route_demand=unique.num_unique,
    owner_demand=kept,
    token_sums=of_dedup(unique),
  )


def plan_shard(t: ShardedTable, blocks: Sequence) -> TableResiduals:
  """The residuals of a lookup of this device's ids, reading no row."""
  unique, plan = _plan(t, blocks)
  has_row = plan.token_slot >= 0
  _, weights = pool_all(t, blocks, jnp.zeros(has_row.shape + (0,)), has_row)
  return make_residuals(unique, plan, weights)


def lookup_shard(t: ShardedTable, table: jax.Array, blocks: Sequence):
  """This device's embeddings from its whole copy of the table."""
  unique, plan = _plan(t, blocks)
  slot_rows = kernels.gather(
    table,
    plan.owner_rows,
    dtype=t.spec.dtype,
    backend=t.backend,
    dim=t.spec.dim,
    ascending=True,
  )
  rows = take_rows(slot_rows, plan.token_slot)
  outs, weights = pool_all(t, blocks, rows, plan.token_slot >= 0)
  return outs, make_residuals(unique, plan, weights)


def empty_shard(t: ShardedTable, tokens_per_shard: int) -> tuple[TableResiduals, jax.Array]:
  """Residuals and zero token gradients of a batch that routes nothing."""
  # One feature block of padding, (b, L) as every block is.
  unique, plan = _plan(t, [jnp.full((tokens_per_shard, 1), -1, jnp.int32)])
  grads = jnp.zeros((tokens_per_shard, t.spec.dim), jnp.float32)
  return make_residuals(unique, plan, ()), grads


def owner_capacity(t: ShardedTable) -> int:
  """Distinct rows the merge may hold: every source's, capped at the rows."""
  return min(t.mesh.shape[t.axis] * t.capacities.unique, t.layout.rows_per_shard)


def _merged_grads(t: ShardedTable, res: TableResiduals, token_grads):
  """(merge, per-row summed gradients, capacity): every device's distinct
  rows and their sums, gathered in device order and added per row."""
  plan = res.plan
  send = segment_sum(token_grads, plan.token_slot, plan.send_keys.shape[0], plan.token_sums)
  keys = jax.lax.all_gather(plan.send_keys, t.axis, tiled=True)
  sums = jax.lax.all_gather(send, t.axis, tiled=True)
  cap = owner_capacity(t)
  merged = unique_keys(keys, cap, t.dedup_method)
  return merged, segment_sum(sums, merged.inverse, cap, of_dedup(merged)), cap


def grad_norm_shard(t: ShardedTable, res: TableResiduals, token_grads: jax.Array) -> jax.Array:
  """The norm `update_shard` reports, alone (see `shard_ops`)."""
  return norms.local_norm(_merged_grads(t, res, token_grads)[1])


def update_shard(t: ShardedTable, table, slots, step, res, token_grads, gate, clip=None):
  """The fused update of this device's copy (see the module docstring);
  same arguments and results as `shard_ops.update_shard`."""
  merged, grads, cap = _merged_grads(t, res, token_grads)
  # Every device holds the whole gradient: the norm needs no collective.
  norm = norms.local_norm(grads)
  unique_ids = jnp.minimum(merged.num_unique, cap)
  apply, scale = norms.gate_and_clip(
    norm, gate, unique_ids > 0, clip=clip, max_norm=t.spec.max_grad_norm
  )
  if scale is not None:
    grads = grads * scale
  table, slots = fused_update(t, table, slots, step, _rows(merged.keys), grads, apply)
  psum = lambda x: jax.lax.psum(jnp.sum(x), t.axis)
  pmax = lambda x: jax.lax.pmax(jnp.max(x), t.axis)
  metrics = TableMetrics(
    unique_ids=unique_ids,
    invalid_ids=psum(res.num_invalid),
    overflow_ids=psum(res.num_overflow) + merged.num_overflow,
    grad_norm=norm,
    applied=apply,
    max_unique_per_shard=pmax(res.num_unique),
    max_ids_per_route=pmax(res.plan.route_demand),
    max_rows_per_owner=merged.num_unique,
  )
  return table, slots, step + apply.astype(jnp.int32), metrics
