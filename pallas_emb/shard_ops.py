"""One table's sparse step on one device: the lookup and the update.

Everything here runs inside `jax.shard_map` over the table axis, on one
device's blocks: its data shard's ids and gradients and its row shard of the
table and slots. Each device is at once a source (of ids) and an owner (of
rows). Top to bottom:

    lookup:  dedup -> plan_route -> gather -> from_owners -> combine
    update:  expand -> to_owners (segment sum, exchange, merge) -> norm and
             gate -> fused update
             (one device on the native CPU backend: segment sum, norm, gate
             and update are one native pass)

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
from pallas_emb.kernels.backend import platform_of
from pallas_emb.spec import FeatureSpec, TableSpec
from pallas_emb.state import TableMetrics, TableResiduals
from pallas_emb.tokens import concat_tokens, split_tokens
from sharding.dedup import Unique, dedup
from sharding.layout import SENTINEL, RowLayout
from sharding.route import (
    PLAN_SCALARS, RoutePlan, empty_plan, from_owners, is_identity, plan_route,
    to_owners)


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

  @property
  def dedup_method(self) -> str:
    """How dedup finds each id's slot: binary search on CPU, where it is
    fastest; a sort that carries positions elsewhere (see `sharding.dedup`)."""
    return "search" if platform_of(self.mesh.devices.flat) == "cpu" else "sort"


# -- lookup -----------------------------------------------------------------------

def _route(t: ShardedTable, ids: jax.Array) -> tuple[Unique, RoutePlan]:
  """Dedup and routing of this device's (n,) ids.

  An id got a row iff `plan.token_slot >= 0`: it is in range, and was not
  dropped for unique or route capacity (an owner never drops one: its
  capacity covers all it can receive).
  """
  caps = t.capacities
  impl = kernels.unique_impl(t.backend)
  unique = dedup(ids, t.layout, caps.unique, t.dedup_method, impl=impl)
  plan = plan_route(unique, rows_per_shard=t.layout.rows_per_shard,
                    num_shards=t.num_shards, route_capacity=caps.route,
                    owner_capacity=caps.owner, axis_name=t.axis,
                    method=t.dedup_method, unique_impl=impl)
  return unique, plan


def _residuals(unique: Unique, plan: RoutePlan, weights) -> TableResiduals:
  # Per-device scalars get a leading axis, so that shard_map concatenates
  # them into (S,) arrays.
  return TableResiduals(
      weights=tuple(weights),
      plan=plan._replace(**{f: getattr(plan, f)[None] for f in PLAN_SCALARS}),
      num_invalid=unique.num_invalid[None],
      num_overflow=unique.num_overflow[None],
      num_unique=unique.num_unique[None])


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
  unique, plan = _route(t, concat_tokens(feature_ids))
  blocks = split_tokens(plan.token_slot >= 0, [x.shape for x in feature_ids])
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
  unique, plan = _route(t, concat_tokens(feature_ids))
  # Owners read the rows of the slots they received (one read per source
  # that asked), and each id takes its slot's row.
  slot_rows = kernels.gather(table, plan.recv_rows, dtype=t.spec.dtype,
                             backend=t.backend)
  rows = from_owners(plan, slot_rows, axis_name=t.axis,
                     take=lambda x, idx: kernels.gather(
                         x, idx, dtype=jnp.float32, backend=t.backend))
  has_row = plan.token_slot >= 0
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
  plan = empty_plan(num_ids=tokens_per_shard, num_shards=t.num_shards,
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


def _global_norm(x: jax.Array, axis: str) -> jax.Array:
  """The L2 norm of `x` over all devices of `axis`, without overflow.

  Squaring first overflows float32 once the norm passes ~1.8e19 although
  every element is finite, so the elements are first divided by the
  largest power of two <= the global max |x| (exact: it only moves
  exponents). A non-finite element still gives a non-finite norm.
  """
  peak = jax.lax.pmax(jnp.max(jnp.abs(x), initial=0.0), axis)
  # That power of two is the exponent bits of `peak` alone: exact, unlike
  # float32 exp2/log2, which flush to zero near the smallest normal.
  scale = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(peak, jnp.uint32) & jnp.uint32(0x7F800000),
      jnp.float32)
  scale = jnp.where(jnp.isfinite(peak) & (scale > 0), scale, 1.0)
  scaled = x / scale
  return scale * jnp.sqrt(jax.lax.psum(jnp.sum(scaled * scaled), axis))


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
    (table, slots, step, TableMetrics): nothing is written, and the step
    does not advance, unless the global gradient norm is finite, `gate` is
    True and some id has a row (an update with no rows, e.g. a batch of
    padding, is nothing to apply).
  """
  psum = lambda x: jax.lax.psum(jnp.sum(x), t.axis)
  pmax = lambda x: jax.lax.pmax(jnp.max(x), t.axis)
  unique_ids = psum(res.plan.num_owner_unique)
  opt = t.spec.optimizer
  if (is_identity(res.plan, t.axis)
      and kernels.fuses_segment_sum(t.backend, opt, t.spec.dtype)):
    # Nothing travels: the slot sums, norm, gate and update are one pass.
    table, slots, norm = kernels.segment_sum_update(
        table, slots, res.plan.owner_rows, res.plan.token_slot, token_grads,
        opt.scalars(step), gate & (unique_ids > 0), optimizer=opt,
        dtype=t.spec.dtype)
    apply = jnp.isfinite(norm) & gate & (unique_ids > 0)
  else:
    owner_grads = to_owners(res.plan, token_grads, axis_name=t.axis)
    norm = _global_norm(owner_grads, t.axis)
    apply = jnp.isfinite(norm) & gate & (unique_ids > 0)
    table, slots = kernels.fused_update(
        table, slots, res.plan.owner_rows, owner_grads, opt.scalars(step),
        apply, optimizer=opt, dtype=t.spec.dtype,
        backend=t.backend if opt.runs_in_kernel else "xla")
  metrics = TableMetrics(
      unique_ids=unique_ids,
      invalid_ids=psum(res.num_invalid),
      overflow_ids=psum(res.num_overflow) + psum(res.plan.num_overflow),
      grad_norm=norm, applied=apply,
      max_unique_per_shard=pmax(res.num_unique),
      max_ids_per_route=pmax(res.plan.route_demand),
      max_rows_per_owner=pmax(res.plan.owner_demand))
  return table, slots, step + apply.astype(jnp.int32), metrics
