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

`ShardedTable` (its own module) is the static description both halves
share; `programs` wraps these functions in `shard_map` and `jax.jit`. The
update has three forms: a table alone, a stack of tables (each member gated
alone), and one device on the native backend (one pass); all three gate and
clip with `norms.gate_and_clip`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_emb import kernels, norms, packing, pooling
from pallas_emb.inputs import token_shape
from pallas_emb.optimizers.base import reads_step
from pallas_emb.shard_kernels import fused_update
from pallas_emb.sharded_table import ShardedTable
from pallas_emb.stacking import members as members_lib
from pallas_emb.state import TableMetrics, TableResiduals
from pallas_emb.tokens import concat_tokens, split_tokens
from sharding.dedup import Unique, dedup
from sharding.layout import SENTINEL
from sharding.route import (
  PLAN_SCALARS,
  RoutePlan,
  empty_plan,
  from_owners,
  is_identity,
  plan_route,
  to_owners,
)

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
  unique = dedup(jnp.concatenate(ids), t.layout, caps.unique, t.dedup_method, impl=impl)
  plan = plan_route(
    unique,
    rows_per_shard=t.layout.rows_per_shard,
    num_shards=t.num_shards,
    route_capacity=caps.route,
    owner_capacity=caps.owner,
    axis_name=t.axis,
    method=t.dedup_method,
    unique_impl=impl,
  )
  if t.members is None:
    unique = unique._replace(num_overflow=unique.num_overflow + sum(dropped))
    return unique, plan, None
  num_unique, overflow, demand = members_lib.source_counts(t.members, t.layout, unique, plan)
  for member, d in zip(t.members.feature_member, dropped):
    overflow = overflow.at[member].add(d)
  return unique, plan, (invalid, num_unique, overflow, demand)


def make_residuals(unique: Unique, plan: RoutePlan, weights, counts=None) -> TableResiduals:
  """`counts`: per-member (invalid, unique, overflow, route demand) of a
  stacked table, which replace the scalars."""
  if counts is not None:
    invalid, num_unique, overflow, demand = counts
    unique = unique._replace(num_invalid=invalid, num_unique=num_unique, num_overflow=overflow)
    plan = plan._replace(route_demand=demand, num_overflow=jnp.zeros_like(overflow))
  # Per-device values get a leading axis, so that shard_map concatenates
  # them into (S,) (or (S, M)) arrays.
  return TableResiduals(
    weights=tuple(weights),
    plan=plan._replace(**{f: getattr(plan, f)[None] for f in PLAN_SCALARS}),
    num_invalid=unique.num_invalid[None],
    num_overflow=unique.num_overflow[None],
    num_unique=unique.num_unique[None],
  )


def pool_all(t: ShardedTable, blocks: Sequence, rows: jax.Array, has_row: jax.Array):
  """Every feature's (output, residual weights) from its token rows."""
  shapes = [token_shape(x) for x in blocks]
  return zip(
    *(
      pooling.pool(x, r, v, f.combiner)
      for f, x, r, v in zip(
        t.features, blocks, split_tokens(rows, shapes), split_tokens(has_row, shapes)
      )
    )
  )


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
  slot_rows = kernels.gather(
    table,
    plan.recv_rows,
    dtype=t.spec.dtype,
    backend=t.backend,
    dim=t.spec.dim,
    # On one shard the slots are the owner's unique rows, ascending.
    ascending=is_identity(plan, t.axis),
  )
  rows = from_owners(plan, packing.padded(slot_rows, t.route_width(t.spec.dim)), axis_name=t.axis)
  rows = packing.unpadded(rows, t.spec.dim)
  outs, weights = pool_all(t, blocks, rows, plan.token_slot >= 0)
  return outs, make_residuals(unique, plan, weights, counts)


def empty_shard(t: ShardedTable, tokens_per_shard: int) -> tuple[TableResiduals, jax.Array]:
  """Residuals and zero token gradients of a batch that routes nothing."""
  caps = t.capacities
  unique = Unique(
    keys=jnp.full((caps.unique,), SENTINEL, jnp.int32),
    inverse=jnp.full((tokens_per_shard,), -1, jnp.int32),
    num_unique=jnp.zeros((), jnp.int32),
    num_overflow=jnp.zeros((), jnp.int32),
    num_invalid=jnp.zeros((), jnp.int32),
  )
  plan = empty_plan(
    num_ids=tokens_per_shard,
    num_shards=t.num_shards,
    route_capacity=caps.route,
    owner_capacity=caps.owner,
    method=t.dedup_method,
  )
  grads = jnp.zeros((tokens_per_shard, t.spec.dim), jnp.float32)
  counts = None
  if t.members is not None:
    counts = (jnp.zeros((t.members.count,), jnp.int32),) * 4
  return make_residuals(unique, plan, (), counts), grads


# -- update -----------------------------------------------------------------------


def token_grads_shard(
  t: ShardedTable, weights: Sequence[jax.Array], feature_grads: Sequence[jax.Array]
) -> jax.Array:
  """This device's (n, D) per-token gradient, in its lookup's token order."""
  return concat_tokens(
    [pooling.expand(g, w, f.combiner) for f, g, w in zip(t.features, feature_grads, weights)]
  )


def grad_norm_shard(t: ShardedTable, res: TableResiduals, token_grads: jax.Array) -> jax.Array:
  """The global norm of all the summed row gradients the update would apply
  (of a stack: over every member), for a clipping norm over several tables."""
  return norms.global_norm(to_owners(res.plan, token_grads, axis_name=t.axis), t.axis)


def update_shard(
  t: ShardedTable,
  table,
  slots,
  step,
  res: TableResiduals,
  token_grads: jax.Array,
  gate: jax.Array,
  clip=None,
):
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
    (its metrics are (M,)) and `step` is (M,): each member's advances when
    it is applied.
  """
  token_grads = packing.padded(token_grads, t.route_width(t.spec.dim))
  if t.members is not None:
    update = _update_stack
  elif (
    clip is None
    and t.spec.max_grad_norm is None
    and is_identity(res.plan, t.axis)
    and kernels.fuses_segment_sum(t.backend, t.spec.optimizer, t.spec.dtype)
  ):
    update = _update_in_one_pass
  else:
    update = _update_table
  table, slots, norm, apply, write, owner_demand = update(
    t, table, slots, step, res, token_grads, gate, clip
  )
  return table, slots, step + write.astype(jnp.int32), _metrics(t, res, norm, apply, owner_demand)


def _psum(t: ShardedTable, x: jax.Array) -> jax.Array:
  # Per-device counts arrive as (1,) or, per member, (1, M).
  return jax.lax.psum(jnp.sum(x, axis=0), t.axis)


def _update_in_one_pass(t: ShardedTable, table, slots, step, res, token_grads, gate, clip):
  """One device on the native backend, nothing to route or clip: the slot
  sums, norm, gate and update are one native pass."""
  del clip
  opt = t.spec.optimizer
  has_rows = _psum(t, res.plan.num_owner_unique) > 0
  table, slots, norm = kernels.segment_sum_update(
    table,
    slots,
    res.plan.owner_rows,
    res.plan.token_slot,
    packing.unpadded(token_grads, t.spec.dim),
    opt.scalars(step),
    gate & has_rows,
    optimizer=opt,
    dtype=t.spec.dtype,
    dim=t.spec.dim,
  )
  apply, _ = norms.gate_and_clip(norm, gate, has_rows)
  return table, slots, norm, apply, apply, res.plan.owner_demand


def _update_table(t: ShardedTable, table, slots, step, res, token_grads, gate, clip):
  """A table alone: route, norm over all devices, gate and clip, update."""
  grads = to_owners(res.plan, token_grads, axis_name=t.axis)
  norm = norms.global_norm(grads, t.axis)
  apply, scale = norms.gate_and_clip(
    norm, gate, _psum(t, res.plan.num_owner_unique) > 0, clip=clip, max_norm=t.spec.max_grad_norm
  )
  if scale is not None:
    grads = grads * scale
  table, slots = fused_update(t, table, slots, step, res.plan.owner_rows, grads, apply)
  return table, slots, norm, apply, apply, res.plan.owner_demand


def _update_stack(t: ShardedTable, table, slots, step, res, token_grads, gate, clip):
  """A stack: each member has its own norm, gate, clip and step (`step` is
  (M,)); the rows of a member not applied leave the update
  (`members.keep_rows`)."""
  n, rows = t.members.count, res.plan.owner_rows
  grads = to_owners(res.plan, token_grads, axis_name=t.axis)
  member = members_lib.member_of_local(t.members, t.layout, rows, jax.lax.axis_index(t.axis))
  owner_demand = members_lib.count(member, n)[None]
  norm = norms.member_norms(grads, member, n, t.axis)
  # Every member shares max_grad_norm (`stacking.plan.stack_key`).
  apply, scale = norms.gate_and_clip(
    norm, gate, _psum(t, owner_demand) > 0, clip=clip, max_norm=t.spec.max_grad_norm
  )
  if scale is not None:
    per_row = jnp.concatenate([jnp.broadcast_to(scale, (n,)), jnp.ones((1,))])
    grads = grads * per_row[member][:, None]
  table, slots = _update_members(t, table, slots, step, rows, grads, member, apply)
  return table, slots, norm, apply, apply, owner_demand


def _update_members(t: ShardedTable, table, slots, steps, rows, grads, member, apply):
  """The fused update of the rows of a stack's applied members, each at its
  own step: a member skipped or without ids does not advance, so that it
  trains bit for bit as it would alone.

  One fused update of all of them when the optimizer's row math does not
  read the step (`reads_step`); otherwise one per distinct step among the
  applied members (one as long as no member was ever left behind), in a
  loop that runs as often as there are such steps.

  Args:
    steps: (M,) int32 each member's updates so far.
    rows, grads, member: (C,) owner rows, (C, D) their gradients, (C,) the
      member of each row (M: none).
    apply: (M,) bool.
  """

  def update(table, slots, members, step):
    keep = jnp.concatenate([members, jnp.zeros((1,), bool)])[member]
    kept_rows, kept_grads = members_lib.keep_rows(rows, grads, keep)
    return fused_update(t, table, slots, step, kept_rows, kept_grads, jnp.any(members), steps=steps)

  if not reads_step(t.spec.optimizer, t.spec.dim):
    return update(table, slots, apply, steps[0])

  def one_step(carry):
    table, slots, todo = carry
    step = steps[jnp.argmax(todo)]
    at_step = todo & (steps == step)
    table, slots = update(table, slots, at_step, step)
    return table, slots, todo & ~at_step

  table, slots, _ = jax.lax.while_loop(lambda c: jnp.any(c[2]), one_step, (table, slots, apply))
  return table, slots


def _metrics(t: ShardedTable, res: TableResiduals, norm, apply, owner_demand) -> TableMetrics:
  pmax = lambda x: jax.lax.pmax(jnp.max(x, axis=0), t.axis)
  return TableMetrics(
    unique_ids=_psum(t, owner_demand)
    if t.members is not None
    else _psum(t, res.plan.num_owner_unique),
    invalid_ids=_psum(t, res.num_invalid),
    overflow_ids=_psum(t, res.num_overflow) + _psum(t, res.plan.num_overflow),
    grad_norm=norm,
    applied=apply,
    max_unique_per_shard=pmax(res.num_unique),
    max_ids_per_route=pmax(res.plan.route_demand),
    max_rows_per_owner=pmax(owner_demand),
  )
