"""The jitted programs of one table over global arrays, written once.

Each program runs a `shard_ops` function on every device through
`per_device`, the one `shard_map` wrapper, and is jitted with the static
`ShardedTable` as its first argument. The synchronous API, the asynchronous
API and checkpoints all call these: there is one compiled lookup, one update
(donating the table state, so it happens in place) and so on per table and
batch shape. Called inside another jitted function they are inlined.

Arguments and results are global arrays, row-sharded (P(axis)) or
replicated (P()); per-feature arguments are tuples in `t.features` order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_emb import norms, placement, replicated_ops, shard_ops
from pallas_emb.sharded_table import ShardedTable
from pallas_emb.state import TableMetrics, TableResiduals, TableState, init_shard

ROWS, REPLICATED = "rows", "replicated"


def _ops(t: ShardedTable):
  """The per-device functions of `t`: `shard_ops`, or `replicated_ops` for a
  table stored whole on every device."""
  return replicated_ops if t.replicated else shard_ops


def _stored(t: ShardedTable) -> str:
  """How the table and slots of `t` are placed."""
  return REPLICATED if t.replicated else ROWS


def per_device(t: ShardedTable, fn: Callable, in_specs: Sequence[str], out_specs) -> Callable:
  """`fn` run on every device of `t.mesh` over `t.axis` (`shard_map`).

  Args:
    fn: a function of per-device blocks.
    in_specs: one of ROWS (split over the axis) or REPLICATED per argument.
    out_specs: a pytree prefix of ROWS / REPLICATED for the results.

  Returns:
    A function of global arrays. It first places each argument as its spec
    says (`placement.place`): `shard_map` requires the matching sharding
    already.
  """
  spec = lambda s: P(t.axis) if s == ROWS else P()
  place = lambda x, s: placement.place(x, NamedSharding(t.mesh, spec(s)))

  def call(*args):
    mapped = jax.shard_map(
      fn,
      mesh=t.mesh,
      in_specs=tuple(spec(s) for s in in_specs),
      out_specs=jax.tree.map(spec, out_specs),
      check_vma=False,
    )
    return mapped(*(place(x, s) for x, s in zip(args, in_specs)))

  return call


@functools.partial(jax.jit, static_argnums=0)
def init(t: ShardedTable, key: jax.Array) -> TableState:
  """The initial state of `t`; each device generates only its rows.

  `key`: a PRNG key, or of a stack one per member, (M,) (see `init_shard`).
  """

  def fn(k):
    shard = 0 if t.replicated else jax.lax.axis_index(t.axis)
    return init_shard(t.spec, t.layout, k, shard, t.members)

  table, slots = per_device(t, fn, [REPLICATED], _stored(t))(key)
  return TableState(
    table, slots, jnp.zeros(() if t.members is None else (t.members.count,), jnp.int32)
  )


@functools.partial(jax.jit, static_argnums=0)
def plan(t: ShardedTable, feature_ids: tuple[jax.Array, ...]) -> TableResiduals:
  """The residuals of a lookup of (B, L) ids per feature, reading no row."""
  fn = lambda *ids: _ops(t).plan_shard(t, ids)
  return per_device(t, fn, [ROWS] * len(feature_ids), ROWS)(*feature_ids)


@functools.partial(jax.jit, static_argnums=0)
def lookup(t: ShardedTable, table: jax.Array, feature_ids: tuple[jax.Array, ...]):
  """-> (per-feature outputs, `TableResiduals`); see `shard_ops.lookup_shard`."""
  fn = lambda table, *ids: _ops(t).lookup_shard(t, table, ids)
  return per_device(t, fn, [_stored(t)] + [ROWS] * len(feature_ids), ROWS)(table, *feature_ids)


@functools.partial(jax.jit, static_argnums=0)
def token_gradients(
  t: ShardedTable, res: TableResiduals, feature_grads: tuple[jax.Array, ...]
) -> jax.Array:
  """Gradients w.r.t. the outputs -> (S * tokens_per_shard, dim) per token."""
  fn = lambda weights, *grads: shard_ops.token_grads_shard(t, weights, grads)
  return per_device(t, fn, [ROWS] * (1 + len(feature_grads)), ROWS)(res.weights, *feature_grads)


def _update(
  t: ShardedTable,
  state: TableState,
  res: TableResiduals,
  gate,
  grads: tuple[jax.Array, ...],
  token_grads_of: Callable,
  clip=None,
):
  def fn(table, slots, step, res, gate, clip, *grads):
    return _ops(t).update_shard(t, table, slots, step, res, token_grads_of(res, grads), gate, clip)

  stored = _stored(t)
  table, slots, step, metrics = per_device(
    t,
    fn,
    [stored, stored, REPLICATED, ROWS, REPLICATED, REPLICATED] + [ROWS] * len(grads),
    (stored, stored, REPLICATED, REPLICATED),
  )(state.table, state.slots, state.step, res, jnp.asarray(gate, jnp.bool_), clip, *grads)
  return TableState(table, slots, step), metrics


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def apply_gradients(
  t: ShardedTable,
  state: TableState,
  res: TableResiduals,
  feature_grads: tuple[jax.Array, ...],
  gate,
  clip=None,
) -> tuple[TableState, TableMetrics]:
  """The update from gradients w.r.t. the lookup's outputs (per feature).

  Expanding them to tokens happens inside the update: no token-sized array
  exists between the two. `state` is donated. `clip`: None or (max_norm,
  norm), see `shard_ops.update_shard`.
  """
  return _update(
    t,
    state,
    res,
    gate,
    feature_grads,
    lambda res, grads: shard_ops.token_grads_shard(t, res.weights, grads),
    clip,
  )


@functools.partial(jax.jit, static_argnums=0)
def global_grad_norm(
  ts: tuple[ShardedTable, ...],
  residuals: tuple[TableResiduals, ...],
  feature_grads: tuple[tuple[jax.Array, ...], ...],
) -> jax.Array:
  """() sqrt(sum over tables of the squared global norm of the summed row
  gradients each update would apply); the largest norm scales the squares,
  so they cannot overflow float32."""

  def one(t, res, grads):
    def fn(res, *grads):
      return _ops(t).grad_norm_shard(t, res, shard_ops.token_grads_shard(t, res.weights, grads))

    return per_device(t, fn, [ROWS] * (1 + len(grads)), REPLICATED)(res, *grads)

  return norms.combine_norms(jnp.stack([one(*x) for x in zip(ts, residuals, feature_grads)]))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def apply_token_gradients(
  t: ShardedTable, state: TableState, res: TableResiduals, token_grads: jax.Array, gate
) -> tuple[TableState, TableMetrics]:
  """The update from (S * tokens_per_shard, dim) per-token gradients (the
  pending async update). `state` is donated."""
  return _update(t, state, res, gate, (token_grads,), lambda res, grads: grads[0])


@functools.partial(jax.jit, static_argnums=(0, 1))
def empty_residuals(t: ShardedTable, tokens_per_shard: int) -> tuple[TableResiduals, jax.Array]:
  """Residuals and zero token gradients of a batch that routes nothing."""
  fn = lambda: _ops(t).empty_shard(t, tokens_per_shard)
  return per_device(t, fn, [], ROWS)()


@functools.partial(jax.jit, static_argnums=0)
def token_rows(t: ShardedTable, token_slot: jax.Array, send_keys: jax.Array) -> jax.Array:
  """(S * tokens_per_shard,) int32 the logical row (of a stack: the stacked
  row) each token's gradient updates, -1 for none (padding, invalid, dropped
  for capacity): what a pending update applies, without its routing.

  `token_slot`, `send_keys`: its `RoutePlan`'s (an `AsyncEmbGradientUpdate`'s
  `segment_ids` and `unique_tokens`).
  """

  def fn(slot, keys):
    return jnp.where(slot >= 0, t.layout.logical_of(keys[jnp.maximum(slot, 0)]), -1)

  return per_device(t, fn, [ROWS, ROWS], ROWS)(token_slot, send_keys)
