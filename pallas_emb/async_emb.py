"""The asynchronous embedding update, with the reference system's interface.

The table update of step t-1 runs while the dense part of step t computes:

    acts_t   = lookup_done(ctx, lookup_t)                 # started in step t-1
    pins, table, state, m = gradient_update_start(ctx, update_tm1, table, state)
    loss, g  = dense forward/backward on acts_t           # overlaps the update
    norm, valid, pin = gradient_update_done(ctx, gate=loss)
    lookup_tp1 = lookup_start(ctx, table, ids_tp1, gate=pin)  # after the update
    update_t = make_gradient_update(ctx, lookup_t, g["acts"])

Embeddings are exactly one step stale; dense parameters are not. Inside one
XLA program "asynchronous" means the update has no data dependence on the
dense forward, so the scheduler overlaps them (its all_to_alls run while the
MLP computes). `gate` arguments are never read: they only order calls through
data dependencies (`jax.lax.optimization_barrier`).

An `AsyncEmbContextHandle` describes one table and follows its in-flight
update between `gradient_update_start` and `gradient_update_done`: done without
start, a second start before done, and a lookup while the update is in flight
raise `AsyncEmbStateError`. The checks run when Python runs the calls, i.e.
eagerly at every call and under `jax.jit` at trace time, so start and done
must be in the same traced function (or both eager).

Differences from the reference, all because tables are row-sharded:
`unique_tokens` holds each data shard's unique ids (sharded, not replicated),
and the update carries the lookup's routing plan so that the owners need not
route again.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Mapping, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import get_opaque_trace_state
from jax.sharding import Mesh, PartitionSpec as P

from pallas_emb import embedding as emb_lib
from pallas_emb.embedding import ShardedEmbedding, TableResiduals, TableState
from pallas_emb.errors import AsyncEmbStateError, InputError
from pallas_emb.spec import FeatureSpec, TableSpec
from sharding.layout import SENTINEL
from sharding.route import RoutePlan


def no_fused_update_message(opt) -> str:
  """The reference's sentence for an optimizer without a fused update."""
  return ("use_async_emb requires an embedding optimizer implementing "
          f"AsyncEmbOptimizer, and {type(opt).__name__} has no fused table "
          "update")


class AsyncEmbGradientUpdate(NamedTuple):
  """A deferred embedding gradient (one table), applied by the next step.

  Attributes:
    unique_tokens: (S * unique_capacity,) int32 physical row ids of each data
      shard's unique ids, padded with a fill id >= vocab. Sharded.
    grads: (tokens_per_batch, dim) float32 gradient per id, already weighted
      by the combiner. Sharded over the data axis.
    segment_ids: (tokens_per_batch,) int32 index of each id into its shard's
      unique_tokens; -1 = no gradient (padding, invalid, overflow).
    pending: bool scalar; False for the empty update (first step, after a
      flush): nothing is applied.
    plan: the lookup's `RoutePlan` (which owner holds which unique id).
    num_invalid: (S,) int32 invalid ids per data shard in that lookup.
    num_overflow: (S,) int32 unique-capacity overflow per data shard.
  """

  unique_tokens: jax.Array
  grads: jax.Array
  segment_ids: jax.Array
  pending: jax.Array
  plan: Optional[RoutePlan] = None
  num_invalid: Optional[jax.Array] = None
  num_overflow: Optional[jax.Array] = None


class EmbOptState(NamedTuple):
  """The optimizer state of one table: slots and the applied-update count."""

  slots: dict[str, jax.Array]
  step: jax.Array


class EmbLookup(NamedTuple):
  """A started lookup: the embeddings and what the update will need."""

  acts: dict[str, jax.Array]
  residuals: TableResiduals


@runtime_checkable
class AsyncEmbOptimizer(Protocol):
  """An embedding optimizer with a fused, asynchronous table update.

  Both defaults raise; `supports_async_emb` tells whether a class really
  overrides them (an `isinstance` check alone does not: every subclass of
  this protocol has the methods).
  """

  def gradient_update_start(self, context, update, table, state, gate=None):
    """Launches the update -> (pins, table, state, metrics)."""
    raise NotImplementedError(no_fused_update_message(self))

  def gradient_update_done(self, context, gate=None):
    """Collects the update -> (norm, valid, done_pin)."""
    raise NotImplementedError(no_fused_update_message(self))


def supports_async_emb(opt: Any) -> bool:
  """True when `type(opt)` implements both protocol methods itself."""
  cls = type(opt)
  for name in ("gradient_update_start", "gradient_update_done"):
    impl = getattr(cls, name, None)
    if not callable(impl) or impl is getattr(AsyncEmbOptimizer, name):
      return False
  return True


def registered_async_emb_optimizers() -> tuple[type, ...]:
  """The optimizers of this package that implement the fused async update."""
  from pallas_emb import optimizers  # pylint: disable=g-import-not-at-top
  return (optimizers.SGD, optimizers.Adagrad, optimizers.RowWiseAdagrad,
          optimizers.LazyAdam)


class _InFlight(NamedTuple):
  norm: jax.Array
  valid: jax.Array
  done_pin: jax.Array
  trace: Any


@dataclasses.dataclass(frozen=True)
class AsyncEmbContextHandle:
  """One table's static async context, and the record of its in-flight update.

  Hashable (the record is excluded from hash and equality), so it can be a
  static argument of `jax.jit`. Build it with `make_context_handle`.

  Attributes:
    context_id: an id for messages and logs.
    embedding: a one-table `ShardedEmbedding` (spec, features, mesh, backend).
    table_axis: the mesh axis the table is sharded over (the communicator).
    data_axis: the mesh axes the tokens are sharded over (== (table_axis,)).
    tokens_per_batch: ids per global batch over all the table's features.
    emb_width: the row width (the table's dim).
    num_unique: unique-id capacity per data shard as asked; the buffers hold
      `embedding.routing(...).capacities.unique` (rounded up to 8, capped at
      the vocabulary).
    group_size: devices along table_axis.
    tokens_per_rank: tokens_per_batch // group_size.
  """

  context_id: int
  embedding: ShardedEmbedding
  table_axis: str
  data_axis: tuple[str, ...]
  tokens_per_batch: int
  emb_width: int
  num_unique: int
  group_size: int
  tokens_per_rank: int
  _in_flight: dict = dataclasses.field(default_factory=dict, compare=False,
                                       hash=False, repr=False)

  @property
  def spec(self) -> TableSpec:
    return self.embedding.tables[0]

  @property
  def name(self) -> str:
    return self.spec.name

  @property
  def mesh(self) -> Mesh:
    return self.embedding.mesh

  @property
  def in_flight(self) -> bool:
    """Whether an update was started and not yet collected."""
    return "update" in self._in_flight

  def reset(self) -> None:
    """Forgets an in-flight record (after a trace that failed between start
    and done)."""
    self._in_flight.clear()

  def _check_idle(self, call: str) -> None:
    if self.in_flight:
      what = ("scheduled an update start before the pending update done"
              if call == "gradient_update_start" else
              "looked up the table while its gradient update is in flight")
      raise AsyncEmbStateError(
          f"{call} on table {self.name!r} (context {self.context_id}) "
          f"{what}: call gradient_update_done(context, gate) first. If a "
          "previous trace failed between start and done, call "
          "context.reset().")

  def _arm(self, record: _InFlight) -> None:
    # The caller checked `_check_idle` before tracing the update.
    self._in_flight["update"] = record

  def _disarm(self) -> _InFlight:
    record = self._in_flight.get("update")
    if record is None:
      raise AsyncEmbStateError(
          f"gradient_update_done on table {self.name!r} (context "
          f"{self.context_id}): update_done has no armed update_start to "
          "consume; call gradient_update_start(context, update, table, "
          "state) first.")
    if record.trace != get_opaque_trace_state(convention="flax"):
      raise AsyncEmbStateError(
          f"gradient_update_done on table {self.name!r} (context "
          f"{self.context_id}) runs in another trace than its "
          "gradient_update_start: call both in the same jitted function (or "
          "both eagerly). Call context.reset() to drop the stale record.")
    del self._in_flight["update"]
    return record


def make_context_handle(
    mesh: Mesh,
    table_axis: str,
    *,
    data_axis,
    tokens_per_batch: int,
    emb_width: int,
    num_unique: int,
    table: TableSpec,
    features: Sequence[FeatureSpec] | None = None,
    backend: str | None = None,
    num_devices_per_node: int | None = None,
    context_id: int = 0,
) -> AsyncEmbContextHandle:
  """Builds the immutable async context of one row-sharded table.

  Args:
    mesh: the device mesh.
    table_axis: mesh axis the table's rows are sharded over.
    data_axis: mesh axis (or tuple of axes) the tokens are sharded over; must
      be `table_axis` (each device is both a data shard and a row owner).
    tokens_per_batch: ids per global batch, over all features of the table.
    emb_width: the table's dim.
    num_unique: unique-id capacity per data shard (overflow is dropped and
      counted), rounded up to a multiple of 8 and capped at the vocabulary.
    table: the table's `TableSpec`.
    features: the features that read it; default one sequence feature named
      like the table.
    backend: "pallas" | "interpret" | "xla" | None (by platform).
    num_devices_per_node: accepted for compatibility; must divide the number
      of devices when given (TPU slices need no node grouping).
    context_id: an id for messages.

  Raises:
    ValueError: for an axis not in the mesh, a `table_axis` missing from
      `data_axis`, more than one token shard per communicator rank, sizes
      not divisible by the group size, or a width that is not the table's.
  """
  axes = tuple(mesh.axis_names)
  if table_axis not in axes:
    raise ValueError(f"table_axis {table_axis!r} is not a mesh axis; the mesh "
                     f"axes are {axes}.")
  data_axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
  for a in data_axes:
    if a not in axes:
      raise ValueError(f"data_axis {a!r} is not a mesh axis; the mesh axes "
                       f"are {axes}.")
  if table_axis not in data_axes:
    raise ValueError(
        f"table_axis {table_axis!r} is missing from data_axis {data_axes}: the "
        "tokens must be sharded over the axis the table is sharded over.")
  group = mesh.shape[table_axis]
  token_shards = int(np.prod([mesh.shape[a] for a in data_axes]))
  if token_shards != group:
    raise ValueError(
        f"data_axis {data_axes} splits the tokens into {token_shards} shards "
        f"but the communicator (table_axis {table_axis!r}) has {group} ranks: "
        "more than one token shard per communicator rank is not supported; "
        f"use data_axis={table_axis!r}.")
  for field, value in (("tokens_per_batch", tokens_per_batch), ("emb_width", emb_width),
                       ("num_unique", num_unique)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise ValueError(f"{field} must be an int, got {value!r} of type "
                       f"{type(value).__name__}.")
  tokens_per_batch, emb_width, num_unique = int(tokens_per_batch), int(emb_width), int(num_unique)
  if tokens_per_batch < 1 or tokens_per_batch % group:
    raise ValueError(
        f"tokens_per_batch={tokens_per_batch!r} must be a positive multiple "
        f"of the group size {group} (devices along {table_axis!r}).")
  if emb_width != table.dim:
    raise ValueError(f"emb_width={emb_width} does not match table "
                     f"{table.name!r}'s dim={table.dim}.")
  if num_unique < 1:
    raise ValueError(f"num_unique must be a positive int, got {num_unique!r}.")
  if num_devices_per_node is not None and (
      num_devices_per_node < 1 or mesh.size % num_devices_per_node):
    raise ValueError(
        f"num_devices_per_node={num_devices_per_node} must divide the "
        f"{mesh.size} devices of the mesh.")
  spec = dataclasses.replace(table, unique_capacity=num_unique)
  features = tuple(features or (FeatureSpec(table.name, table.name, None),))
  emb = ShardedEmbedding((spec,), features, mesh, table_axis, backend)
  return AsyncEmbContextHandle(
      context_id=context_id, embedding=emb, table_axis=table_axis,
      data_axis=data_axes, tokens_per_batch=tokens_per_batch,
      emb_width=emb_width, num_unique=num_unique, group_size=group,
      tokens_per_rank=tokens_per_batch // group)


def context_handles(emb: ShardedEmbedding, ids: Mapping[str, Any], *,
                    backend: str | None = None) -> dict[str, AsyncEmbContextHandle]:
  """One context per looked-up table of `emb`, sized for batches like `ids`."""
  tokens = emb.check_ids(ids)
  handles = {}
  for i, (name, per_shard) in enumerate(tokens.items()):
    spec = emb.table_spec(name)
    layout = emb.layout(name)
    caps = emb_lib.Capacities.for_table(spec, layout, per_shard)
    handles[name] = make_context_handle(
        emb.mesh, emb.axis, data_axis=emb.axis,
        tokens_per_batch=per_shard * emb.num_shards, emb_width=spec.dim,
        num_unique=caps.unique, table=spec, features=emb.features_of(name),
        backend=backend or emb.backend, context_id=i)
  return handles


def _tie(x, gate):
  """`x` after `gate` is computed (an ordering-only dependency)."""
  if gate is None:
    return x
  x, _ = jax.lax.optimization_barrier((x, gate))
  return x


def _check_table(context: AsyncEmbContextHandle, table, slots=None) -> None:
  context.embedding.check_tables(
      {context.name: TableState(table, dict(slots or {}), None)}, [context.name],
      slots=slots is not None)


def lookup_start(context: AsyncEmbContextHandle, table: jax.Array,
                 ids: Mapping[str, jax.Array], gate=None) -> EmbLookup:
  """Starts the lookup of the context's features.

  Args:
    context: the table's context.
    table: its stored array (`TableState.table`).
    ids: feature -> (B, L) int32 for the table's features.
    gate: any array; the lookup reads the table only after it is computed.

  Raises:
    AsyncEmbStateError: while an update of the table is in flight.
  """
  context._check_idle("lookup_start")
  emb = context.embedding
  tokens = emb.check_ids(ids)[context.name] * emb.num_shards
  if tokens != context.tokens_per_batch:
    raise InputError(
        f"lookup_start on table {context.name!r}: the ids hold {tokens} "
        f"tokens, but the context was made for tokens_per_batch="
        f"{context.tokens_per_batch}; make a context for this batch shape.")
  _check_table(context, table)
  acts, res = _jit_lookup(emb, context.name, _tie(table, gate), dict(ids))
  return EmbLookup(acts, res)


def lookup_done(context: AsyncEmbContextHandle, lookup: EmbLookup) -> dict[str, jax.Array]:
  """The embeddings of a started lookup: feature -> (B, dim) or (B, L, dim)."""
  del context
  return lookup.acts


def make_gradient_update(context: AsyncEmbContextHandle, lookup: EmbLookup,
                         grads: Mapping[str, jax.Array]) -> AsyncEmbGradientUpdate:
  """Packs the gradient w.r.t. a lookup's outputs as a pending update."""
  for f in context.embedding.features:
    if f.name not in grads:
      raise InputError(f"grads are missing feature {f.name!r} of table "
                       f"{context.name!r}.")
    if tuple(grads[f.name].shape) != tuple(lookup.acts[f.name].shape):
      raise InputError(
          f"gradient of feature {f.name!r} has shape {grads[f.name].shape}; "
          f"expected {lookup.acts[f.name].shape} like its lookup output.")
  res = lookup.residuals
  token_grads = _jit_token_gradients(context.embedding, context.name, res,
                                     dict(grads))
  return gradient_update_from(res, token_grads, jnp.asarray(True))


def gradient_update_from(residuals: TableResiduals, token_grads: jax.Array,
                         pending) -> AsyncEmbGradientUpdate:
  """An update from a lookup's (or `ShardedEmbedding.plan`'s) residuals and
  per-id gradients (S * tokens_per_shard, dim) in its per-device order."""
  return AsyncEmbGradientUpdate(
      unique_tokens=residuals.unique_keys, grads=token_grads,
      segment_ids=residuals.inverse, pending=pending, plan=residuals.plan,
      num_invalid=residuals.num_invalid, num_overflow=residuals.num_overflow)


def empty_gradient_update(context: AsyncEmbContextHandle) -> AsyncEmbGradientUpdate:
  """The update that applies nothing (first step, after a flush)."""
  return _jit_empty_update(context.embedding, context.name,
                           context.tokens_per_rank)


def gradient_update_start(context: AsyncEmbContextHandle,
                          update: AsyncEmbGradientUpdate, table: jax.Array,
                          state: EmbOptState, gate=None):
  """Launches the table's optimizer update; see `AsyncEmbOptimizer`.

  Args:
    context: the table's context.
    update: the `AsyncEmbGradientUpdate` to apply (from
      `make_gradient_update`, or `empty_gradient_update`).
    table: (S * rows_per_shard, storage_width) the stored table
      (`TableState.table`), float32 or uint32 words of bfloat16.
    state: its `EmbOptState` (slots (S * rows_per_shard, width), step).
    gate: any array; the update starts only after it is computed.

  `table` and `state` are donated when called eagerly (inside a jitted step
  the step's own donation applies): use the ones returned.

  Returns:
    (pins, table, state, metrics): pins = (grad_norm, applied) arrays of the
    update; the updated table and `EmbOptState`; metrics: dict of
    "unique_ids", "invalid_ids", "overflow_ids", "grad_norm", "applied" (of
    the lookup this gradient came from: embedding metrics lag one step).

  Raises:
    NotImplementedError: if the table's optimizer has no fused update.
  """
  opt = context.spec.optimizer
  if not supports_async_emb(opt):
    raise NotImplementedError(no_fused_update_message(opt))
  return opt.gradient_update_start(context, update, table, state, gate)


def gradient_update_done(context: AsyncEmbContextHandle, gate=None):
  """Collects the in-flight update -> (norm, valid, done_pin).

  `valid` is False when the update was skipped (non-finite norm, or an empty
  update); then table and slots were left bit-for-bit unchanged. `done_pin`
  is computed by the update: pass it as the `gate` of the next lookup.
  """
  opt = context.spec.optimizer
  if not supports_async_emb(opt):
    raise NotImplementedError(no_fused_update_message(opt))
  return opt.gradient_update_done(context, gate)


# -- the implementation our optimizers use (see optimizers.base) ----------------

def fused_gradient_update_start(opt, context: AsyncEmbContextHandle,
                                update: AsyncEmbGradientUpdate, table,
                                state: EmbOptState, gate=None):
  """`AsyncEmbOptimizer.gradient_update_start` through the fused update."""
  if opt != context.spec.optimizer:
    raise InputError(
        f"gradient_update_start was called on {opt!r}, but table "
        f"{context.name!r} is trained by {context.spec.optimizer!r}; call it "
        "on the table's optimizer (or use async_emb.gradient_update_start).")
  context._check_idle("gradient_update_start")
  _check_update(context, update)
  _check_table(context, table, state.slots)
  res = TableResiduals(
      unique_keys=update.unique_tokens, inverse=update.segment_ids,
      weights=(), plan=update.plan, num_invalid=update.num_invalid,
      num_overflow=update.num_overflow)
  new, metrics = _jit_update(context.embedding, context.name,
                             TableState(_tie(table, gate), dict(state.slots),
                                        state.step),
                             res, update.pending, update.grads)
  context._arm(_InFlight(metrics.grad_norm, metrics.applied, new.step,
                         get_opaque_trace_state(convention="flax")))
  pins = (metrics.grad_norm, metrics.applied)
  return pins, new.table, EmbOptState(new.slots, new.step), metrics._asdict()


def fused_gradient_update_done(opt, context: AsyncEmbContextHandle, gate=None):
  """`AsyncEmbOptimizer.gradient_update_done` through the fused update."""
  del opt
  record = context._disarm()
  out = (record.norm, record.valid, record.done_pin)
  return _tie(out, gate)


def _check_update(context: AsyncEmbContextHandle, update) -> None:
  if not isinstance(update, AsyncEmbGradientUpdate) or update.plan is None:
    raise InputError(
        f"gradient_update_start on table {context.name!r} needs an "
        "AsyncEmbGradientUpdate from make_gradient_update or "
        f"empty_gradient_update, got {type(update).__name__}.")
  want = (context.tokens_per_batch, context.emb_width)
  if tuple(update.grads.shape) != want:
    raise InputError(
        f"update.grads of table {context.name!r} has shape "
        f"{tuple(update.grads.shape)}, but the context expects {want} "
        "(tokens_per_batch, emb_width).")


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jit_lookup(emb, name, table, ids):
  return emb_lib.lookup_table(emb, name, table, ids)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jit_token_gradients(emb, name, res, grads):
  return emb_lib.token_gradients(emb, name, res, grads)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2,))
def _jit_update(emb, name, state, res, pending, token_grads):
  return emb_lib.update_table(emb, name, state, res, pending,
                              token_grads=token_grads)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jit_empty_update(emb, name, tokens_per_rank):
  routing = emb.routing(name, tokens_per_rank)
  caps, s = routing.capacities, emb.num_shards

  def shard_fn():
    # Each device makes its own block: no array is built unsharded first
    # (which a mesh with Explicit axes refuses to reshard inside jit).
    full = lambda n, v: jnp.full((n,), v, jnp.int32)
    plan = RoutePlan(send_slot=full(caps.unique, -1),
                     owner_rows=full(caps.owner, -1),
                     owner_inverse=full(s * caps.route, -1),
                     num_owner_unique=full(1, 0), num_overflow=full(1, 0))
    return (full(caps.unique, SENTINEL),
            jnp.zeros((tokens_per_rank, routing.spec.dim), jnp.float32),
            full(tokens_per_rank, -1), plan, full(1, 0), full(1, 0))

  keys, grads, segments, plan, invalid, overflow = jax.shard_map(
      shard_fn, mesh=emb.mesh, in_specs=(), out_specs=P(emb.axis),
      check_vma=False)()
  return AsyncEmbGradientUpdate(
      unique_tokens=keys, grads=grads, segment_ids=segments,
      pending=jnp.asarray(False), plan=plan, num_invalid=invalid,
      num_overflow=overflow)
