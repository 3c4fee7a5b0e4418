"""One table's sparse step on one device: the lookup and the update.

Everything here runs inside `jax.shard_map` over the table axis, on one
device's blocks: its data shard's ids and gradients and its row shard of the
table and slots. Each device is at once a source (of ids) and an owner (of
rows). Top to bottom:

    lookup:  dedup -> plan_route -> gather -> from_owners -> pool
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

from pallas_emb import kernels, members as members_lib, pooling
from pallas_emb.capacity import Capacities
from pallas_emb.inputs import token_shape
from pallas_emb.kernels.backend import platform_of
from pallas_emb.members import Members
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
    members: the member tables when this is a stack of several (see
      `pallas_emb.members`): then the counts of `TableResiduals` and every
      field of `TableMetrics` are per member, (M,).
    replicated: stored whole on every device (`layout` has one shard) and
      stepped by `pallas_emb.replicated_ops` instead.
  """

  spec: TableSpec
  features: tuple[FeatureSpec, ...]
  layout: RowLayout
  capacities: Capacities
  mesh: Mesh
  axis: str
  backend: str
  members: Members | None = None
  replicated: bool = False

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

def _route(t: ShardedTable, blocks: Sequence):
  """Dedup and routing of this device's ids of every feature of `t`.

  An id got a row iff `plan.token_slot >= 0`: it is in range, and was not
  dropped for unique or route capacity (an owner never drops one: its
  capacity covers all it can receive). Ragged ids past a shard's capacity
  count as unique-capacity overflow.

  Returns:
    (unique, plan, counts): `counts` are a stack's per-member (invalid,
    unique, overflow, route demand), None for a table alone.
  """
  caps = t.capacities
  ids, dropped = zip(*(pooling.token_ids(x) for x in blocks))
  if t.members is not None:
    ids, invalid = members_lib.remap_ids(t.members, ids)
  # A stack's per-member counts read the sorted keys, which the native
  # dedup does not return.
  impl = kernels.unique_impl(t.backend) if t.members is None else None
  unique = dedup(jnp.concatenate(ids), t.layout, caps.unique, t.dedup_method,
                 impl=impl)
  plan = plan_route(unique, rows_per_shard=t.layout.rows_per_shard,
                    num_shards=t.num_shards, route_capacity=caps.route,
                    owner_capacity=caps.owner, axis_name=t.axis,
                    method=t.dedup_method, unique_impl=impl)
  if t.members is None:
    unique = unique._replace(num_overflow=unique.num_overflow + sum(dropped))
    return unique, plan, None
  num_unique, overflow, demand = members_lib.source_counts(
      t.members, t.layout, unique, plan)
  for member, d in zip(t.members.feature_member, dropped):
    overflow = overflow.at[member].add(d)
  return unique, plan, (invalid, num_unique, overflow, demand)


def make_residuals(unique: Unique, plan: RoutePlan, weights,
               counts=None) -> TableResiduals:
  """`counts`: per-member (invalid, unique, overflow, route demand) of a
  stacked table, which replace the scalars."""
  if counts is not None:
    invalid, num_unique, overflow, demand = counts
    unique = unique._replace(num_invalid=invalid, num_unique=num_unique,
                             num_overflow=overflow)
    plan = plan._replace(route_demand=demand,
                         num_overflow=jnp.zeros_like(overflow))
  # Per-device values get a leading axis, so that shard_map concatenates
  # them into (S,) (or (S, M)) arrays.
  return TableResiduals(
      weights=tuple(weights),
      plan=plan._replace(**{f: getattr(plan, f)[None] for f in PLAN_SCALARS}),
      num_invalid=unique.num_invalid[None],
      num_overflow=unique.num_overflow[None],
      num_unique=unique.num_unique[None])


def pool_all(t: ShardedTable, blocks: Sequence, rows: jax.Array,
             has_row: jax.Array):
  """Every feature's (output, residual weights) from its token rows."""
  shapes = [token_shape(x) for x in blocks]
  return zip(*(pooling.pool(x, r, v, f.combiner) for f, x, r, v in zip(
      t.features, blocks, split_tokens(rows, shapes),
      split_tokens(has_row, shapes))))


def plan_shard(t: ShardedTable, blocks: Sequence) -> TableResiduals:
  """The residuals of a lookup of this device's ids, reading no row.

  Args:
    blocks: per feature of `t`, this device's block of its input: (b, L)
      int32 ids, or a `Weighted` or `Ragged` block (`pallas_emb.inputs`).
  """
  unique, plan, counts = _route(t, blocks)
  has_row = plan.token_slot >= 0
  _, weights = pool_all(t, blocks, jnp.zeros(has_row.shape + (0,)), has_row)
  return make_residuals(unique, plan, weights, counts)


def lookup_shard(t: ShardedTable, table: jax.Array, blocks: Sequence):
  """This device's embeddings of every feature of `t`.

  Args:
    table: (rows_per_shard, storage_width) this device's row shard.
    blocks: per feature, this device's block of its input (see
      `plan_shard`); -1 is padding, other ids outside [0, num_rows) are
      invalid.

  Returns:
    (outputs, residuals): per feature (b, dim) float32 (pooled) or
    (b, L, dim) (sequence), zero for ids without a row; this device's
    `TableResiduals`.
  """
  unique, plan, counts = _route(t, blocks)
  # Owners read the rows of the slots they received (one read per source
  # that asked), and each id takes its slot's row.
  slot_rows = kernels.gather(table, plan.recv_rows, dtype=t.spec.dtype,
                             backend=t.backend)
  rows = from_owners(plan, slot_rows, axis_name=t.axis,
                     take=lambda x, idx: kernels.gather(
                         x, idx, dtype=jnp.float32, backend=t.backend))
  outs, weights = pool_all(t, blocks, rows, plan.token_slot >= 0)
  return outs, make_residuals(unique, plan, weights, counts)


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
  counts = None
  if t.members is not None:
    counts = (jnp.zeros((t.members.count,), jnp.int32),) * 4
  return make_residuals(unique, plan, (), counts), grads


# -- update -----------------------------------------------------------------------

def token_grads_shard(t: ShardedTable, weights: Sequence[jax.Array],
                      feature_grads: Sequence[jax.Array]) -> jax.Array:
  """This device's (n, D) per-token gradient, in its lookup's token order."""
  return concat_tokens([pooling.expand(g, w, f.combiner) for f, g, w in zip(
      t.features, feature_grads, weights)])


def grad_norm_shard(t: ShardedTable, res: TableResiduals,
                    token_grads: jax.Array) -> jax.Array:
  """The global norm of all the summed row gradients the update would apply
  (of a stack: over every member), for a clipping norm over several tables."""
  return _global_norm(to_owners(res.plan, token_grads, axis_name=t.axis),
                      t.axis)


def _global_norm(x: jax.Array, axis: str) -> jax.Array:
  """The L2 norm of `x` over all devices of `axis`, without overflow.

  One pass squares and sums. Squaring overflows float32 once the norm
  passes ~1.8e19 although every element is finite (and underflows for
  norms below ~1e-19), so only then, decided on the replicated sum (every
  device takes the same branch), a second computation first divides the
  elements by the largest power of two <= the global max |x| (exact: it only
  moves exponents). A non-finite element still gives a non-finite norm.
  """
  sq = jax.lax.psum(jnp.sum(x * x), axis)

  def rescaled():
    scale = members_lib.pow2_floor(
        jax.lax.pmax(jnp.max(jnp.abs(x), initial=0.0), axis))
    scaled = x / scale
    return scale * jnp.sqrt(jax.lax.psum(jnp.sum(scaled * scaled), axis))

  safe = jnp.isfinite(sq) & (sq > 2.0 ** -60)
  return jax.lax.cond(safe, lambda: jnp.sqrt(sq), rescaled)


def clip_scale(norm: jax.Array, clip) -> tuple[jax.Array, jax.Array]:
  """(scale, finite) of a clipping (max_norm, clip_norm), see
  `update_shard`: max_norm / clip_norm where that is below 1, else 1."""
  max_norm, clip_norm = clip
  finite = jnp.isfinite(clip_norm)
  return jnp.where(clip_norm > max_norm,
                   max_norm / jnp.where(finite, clip_norm, 1.0), 1.0), finite


def update_shard(t: ShardedTable, table, slots, step, res: TableResiduals,
                 token_grads: jax.Array, gate: jax.Array, clip=None):
  """This device's sparse, fused update of its row shard.

  Args:
    table, slots: this device's row shard of the table and its slots.
    step: () int32 updates applied so far.
    res: this device's `TableResiduals`.
    token_grads: (n, dim) float32 gradient per token (already weighted).
    gate: bool scalar; False skips the update (e.g. an empty async update).
    clip: None, or (max_norm, norm) float32 scalars of a clipping over
      several tables: the gradients are scaled by max_norm / norm when norm
      exceeds max_norm (and nothing is written if norm is not finite).
      Without it the table's own `max_grad_norm` (if any) clips by its own
      norm (each member of a stack by its own).

  Returns:
    (table, slots, step, TableMetrics): nothing is written, and the step
    does not advance, unless the global gradient norm is finite, `gate` is
    True and some id has a row (an update with no rows, e.g. a batch of
    padding, is nothing to apply). Of a stack, each member is gated alone
    (its metrics are (M,)); the stack's one step advances when any member
    is applied.
  """
  # Per-device counts arrive as (1,) or, per member, (1, M).
  psum = lambda x: jax.lax.psum(jnp.sum(x, axis=0), t.axis)
  pmax = lambda x: jax.lax.pmax(jnp.max(x, axis=0), t.axis)
  rows, owner_demand = res.plan.owner_rows, res.plan.owner_demand
  opt = t.spec.optimizer
  own_clip = clip is None and t.spec.max_grad_norm is not None
  if (t.members is None and clip is None and not own_clip
      and is_identity(res.plan, t.axis)
      and kernels.fuses_segment_sum(t.backend, opt, t.spec.dtype)):
    # Nothing travels: the slot sums, norm, gate and update are one pass.
    unique_ids = psum(res.plan.num_owner_unique)
    table, slots, norm = kernels.segment_sum_update(
        table, slots, rows, res.plan.token_slot, token_grads,
        opt.scalars(step), gate & (unique_ids > 0), optimizer=opt,
        dtype=t.spec.dtype)
    apply = write = jnp.isfinite(norm) & gate & (unique_ids > 0)
  else:
    owner_grads = to_owners(res.plan, token_grads, axis_name=t.axis)
    if t.members is None:
      norm = _global_norm(owner_grads, t.axis)
      unique_ids = psum(res.plan.num_owner_unique)
      apply = jnp.isfinite(norm) & gate & (unique_ids > 0)
      if own_clip:
        clip = (jnp.float32(t.spec.max_grad_norm), norm)
      if clip is not None:
        scale, finite = clip_scale(norm, clip)
        owner_grads, apply = owner_grads * scale, apply & finite
      write = apply
    else:
      n = t.members.count
      member = members_lib.member_of_local(t.members, t.layout, rows,
                                           jax.lax.axis_index(t.axis))
      owner_demand = members_lib.count(member, n)[None]
      norm = members_lib.global_norms(owner_grads, member, n, t.axis)
      unique_ids = psum(owner_demand)
      apply = jnp.isfinite(norm) & gate & (unique_ids > 0)
      if own_clip:  # every member shares max_grad_norm (`stacking.stack_key`)
        clip = (jnp.float32(t.spec.max_grad_norm), norm)
      if clip is not None:
        scale, finite = clip_scale(norm, clip)
        per_row = jnp.concatenate([jnp.broadcast_to(scale, (n,)),
                                   jnp.ones((1,))])
        owner_grads = owner_grads * per_row[member][:, None]
        apply &= finite
      rows, owner_grads = members_lib.keep_rows(rows, owner_grads, jnp.concatenate(
          [apply, jnp.zeros((1,), bool)])[member])
      write = jnp.any(apply)
    table, slots = kernels.fused_update(
        table, slots, rows, owner_grads, opt.scalars(step), write,
        optimizer=opt, dtype=t.spec.dtype,
        backend=t.backend if opt.runs_in_kernel else "xla")
  metrics = TableMetrics(
      unique_ids=unique_ids,
      invalid_ids=psum(res.num_invalid),
      overflow_ids=psum(res.num_overflow) + psum(res.plan.num_overflow),
      grad_norm=norm, applied=apply,
      max_unique_per_shard=pmax(res.num_unique),
      max_ids_per_route=pmax(res.plan.route_demand),
      max_rows_per_owner=pmax(owner_demand))
  return table, slots, step + write.astype(jnp.int32), metrics
