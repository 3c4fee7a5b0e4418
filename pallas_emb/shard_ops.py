"""One table's sparse step on one device: the lookup and the update.

Everything here runs inside `jax.shard_map` over the table axis, on one
device's blocks: its data shard's ids and gradients and its row shard of the
table and slots. Each device is at once a source (of ids) and an owner (of
rows). Top to bottom:

    lookup:  dedup -> plan_route -> gather -> from_owners -> combine
    update:  expand -> segment sum -> to_owners -> norm and gate
             -> fused update
             (one device on the native backend: segment sum, norm, gate and
             update are one native pass)

`ShardedTable` is the static description both halves share; `programs`
wraps these functions in `shard_map` and `jax.jit`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pallas_emb import kernels
from pallas_emb.capacity import Capacities
from pallas_emb.spec import FeatureSpec, TableSpec
from pallas_emb.state import TableMetrics, TableResiduals
from pallas_emb.tokens import concat_tokens, split_tokens
from sharding.dedup import Unique, dedup
from sharding.layout import SENTINEL, RowLayout
from sharding.route import (
    RoutePlan, empty_plan, from_owners, is_identity, plan_route, to_owners)


@dataclasses.dataclass(frozen=True)
class ShardedTable:
  """One table as its sparse step sees it: static and hashable.

  Attributes:
    spec: the table.
    features: the features that read it, in token order.
    layout: where its rows live.
    capacities: its buffer sizes for this batch shape.
    mesh: the device mesh.
    axis: the mesh axis rows and data are sharded over.
    backend: "pallas", "interpret", "xla" or "native".
  """

  spec: TableSpec
  features: tuple[FeatureSpec, ...]
  layout: RowLayout
  capacities: Capacities
  mesh: Mesh
  axis: str
  backend: str

  @property
  def name(self) -> str:
    return self.spec.name

  @property
  def num_shards(self) -> int:
    return self.layout.num_shards


# -- lookup -----------------------------------------------------------------------

def _route(t: ShardedTable, ids: jax.Array) -> tuple[Unique, RoutePlan, jax.Array]:
  """Dedup and routing of this device's (n,) ids -> (unique, plan, has_row).

  `has_row` is whether each id got a row: in range, and not dropped for
  unique or route capacity (an owner never drops one: its capacity covers
  all it can receive).
  """
  caps = t.capacities
  impl = kernels.unique_impl(t.backend)
  unique = dedup(ids, t.layout, caps.unique, impl=impl)
  plan = plan_route(unique.keys, rows_per_shard=t.layout.rows_per_shard,
                    num_shards=t.num_shards, route_capacity=caps.route,
                    owner_capacity=caps.owner, axis_name=t.axis,
                    unique_impl=impl)
  has_row = (unique.inverse >= 0) & (
      jnp.take(plan.send_slot, jnp.maximum(unique.inverse, 0)) >= 0)
  return unique, plan, has_row


def _residuals(unique: Unique, plan: RoutePlan, weights) -> TableResiduals:
  # Per-device scalars get a leading axis, so that shard_map concatenates
  # them into (S,) arrays.
  return TableResiduals(
      unique_keys=unique.keys, inverse=unique.inverse, weights=tuple(weights),
      plan=plan._replace(num_owner_unique=plan.num_owner_unique[None],
                         num_overflow=plan.num_overflow[None]),
      num_invalid=unique.num_invalid[None],
      num_overflow=unique.num_overflow[None])


def combine(rows: jax.Array, has_row: jax.Array, combiner):
  """(b, L, D) rows and (b, L) validity -> (output, per-token weights).

  Ids without a row contribute zero; "mean" and "sqrtn" count only the ids
  that got a row.
  """
  weights = has_row.astype(jnp.float32)
  if combiner is None:
    return rows, weights
  count = jnp.maximum(jnp.sum(weights, axis=1, keepdims=True), 1.0)
  if combiner == "mean":
    weights = weights / count
  elif combiner == "sqrtn":
    weights = weights * jax.lax.rsqrt(count)
  return jnp.sum(rows * weights[..., None], axis=1), weights


def plan_shard(t: ShardedTable, feature_ids: Sequence[jax.Array]) -> TableResiduals:
  """The residuals of a lookup of this device's ids, reading no row.

  Args:
    feature_ids: per feature of `t`, this device's (b, L) int32 ids.
  """
  unique, plan, has_row = _route(t, concat_tokens(feature_ids))
  blocks = split_tokens(has_row, [x.shape for x in feature_ids])
  weights = [combine(jnp.zeros(v.shape + (0,)), v, f.combiner)[1]
             for f, v in zip(t.features, blocks)]
  return _residuals(unique, plan, weights)


def lookup_shard(t: ShardedTable, table: jax.Array,
                 feature_ids: Sequence[jax.Array]):
  """This device's embeddings of every feature of `t`.

  Args:
    table: (rows_per_shard, storage_width) this device's row shard.
    feature_ids: per feature, this device's (b, L) int32 ids; -1 is
      padding, other ids outside [0, num_rows) are invalid.

  Returns:
    (outputs, residuals): per feature (b, dim) float32 (pooled) or
    (b, L, dim) (sequence), zero for ids without a row; this device's
    `TableResiduals`.
  """
  caps = t.capacities
  unique, plan, has_row = _route(t, concat_tokens(feature_ids))
  owner_rows = kernels.gather(table, plan.owner_rows, dtype=t.spec.dtype,
                              backend=t.backend)
  unique_rows = from_owners(plan, owner_rows, axis_name=t.axis)
  rows = jnp.take(unique_rows, jnp.where(unique.inverse < 0, caps.unique,
                                         unique.inverse),
                  axis=0, mode="fill", fill_value=0)
  shapes = [x.shape for x in feature_ids]
  outs, weights = zip(*(
      combine(r, v, f.combiner) for f, r, v in zip(
          t.features, split_tokens(rows, shapes), split_tokens(has_row, shapes))))
  return outs, _residuals(unique, plan, weights)


def empty_shard(t: ShardedTable, tokens_per_shard: int
                ) -> tuple[TableResiduals, jax.Array]:
  """Residuals and zero token gradients of a batch that routes nothing."""
  caps = t.capacities
  unique = Unique(keys=jnp.full((caps.unique,), SENTINEL, jnp.int32),
                  inverse=jnp.full((tokens_per_shard,), -1, jnp.int32),
                  num_unique=jnp.zeros((), jnp.int32),
                  num_overflow=jnp.zeros((), jnp.int32),
                  num_invalid=jnp.zeros((), jnp.int32))
  plan = empty_plan(unique_capacity=caps.unique, num_shards=t.num_shards,
                    route_capacity=caps.route, owner_capacity=caps.owner)
  grads = jnp.zeros((tokens_per_shard, t.spec.dim), jnp.float32)
  return _residuals(unique, plan, ()), grads


# -- update -----------------------------------------------------------------------

def expand_grads(grads: jax.Array, weights: jax.Array, combiner) -> jax.Array:
  """Gradient w.r.t. one feature's output -> (b, L, D) per-token gradient."""
  grads = grads.astype(jnp.float32)
  if combiner is None:
    return grads
  if combiner == "sum":
    # The weights are 1 for every id that has a row and 0 for the others,
    # whose inverse is -1 anyway: multiplying would only cost a token-sized
    # temporary (on CPU, its page faults cost more than the whole segment sum).
    return jnp.broadcast_to(grads[:, None, :], weights.shape + grads.shape[-1:])
  return grads[:, None, :] * weights[..., None]


def token_grads_shard(t: ShardedTable, weights: Sequence[jax.Array],
                      feature_grads: Sequence[jax.Array]) -> jax.Array:
  """This device's (n, D) per-token gradient, in its lookup's token order."""
  return concat_tokens([expand_grads(g, w, f.combiner) for f, g, w in zip(
      t.features, feature_grads, weights)])


def update_shard(t: ShardedTable, table, slots, step, res: TableResiduals,
                 token_grads: jax.Array, gate: jax.Array):
  """This device's sparse, fused update of its row shard.

  Args:
    table, slots: this device's row shard of the table and its slots.
    step: () int32 updates applied so far.
    res: this device's `TableResiduals`.
    token_grads: (n, dim) float32 gradient per token (already weighted).
    gate: bool scalar; False skips the update (e.g. an empty async update).

  Returns:
    (table, slots, step, TableMetrics): nothing is written unless the global
    gradient norm is finite and `gate` is True.
  """
  caps = t.capacities
  opt = t.spec.optimizer
  if (is_identity(res.plan, t.axis)
      and kernels.fuses_segment_sum(t.backend, opt, t.spec.dtype)):
    # Nothing travels: sum, norm, gate and update in one pass over the rows.
    table, slots, norm = kernels.segment_sum_update(
        table, slots, res.plan.owner_rows, res.inverse, token_grads,
        opt.scalars(step), gate, optimizer=opt, dtype=t.spec.dtype)
    apply = jnp.isfinite(norm) & gate
  else:
    unique_grads = jax.ops.segment_sum(
        token_grads, jnp.where(res.inverse < 0, caps.unique, res.inverse),
        num_segments=caps.unique)
    owner_grads = to_owners(res.plan, unique_grads, axis_name=t.axis)
    norm = jnp.sqrt(jax.lax.psum(jnp.sum(owner_grads * owner_grads), t.axis))
    apply = jnp.isfinite(norm) & gate
    table, slots = kernels.fused_update(
        table, slots, res.plan.owner_rows, owner_grads, opt.scalars(step),
        apply, optimizer=opt, dtype=t.spec.dtype,
        backend=t.backend if opt.runs_in_kernel else "xla")
  psum = lambda x: jax.lax.psum(jnp.sum(x), t.axis)
  metrics = TableMetrics(
      unique_ids=psum(res.plan.num_owner_unique),
      invalid_ids=psum(res.num_invalid),
      overflow_ids=psum(res.num_overflow) + psum(res.plan.num_overflow),
      grad_norm=norm, applied=apply)
  return table, slots, step + apply.astype(jnp.int32), metrics
