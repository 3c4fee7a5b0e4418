"""The asynchronous embedding update, with the reference system's calls.

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

Misuse raises `AsyncEmbStateError` (see `tracker`): done without start, a
second start before done, and a lookup while the update is in flight.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_emb import programs, validate
from pallas_emb.async_emb.context import AsyncEmbContextHandle, tie
from pallas_emb.async_emb.protocol import (
  AsyncEmbGradientUpdate,
  EmbLookup,
  EmbOptState,
  no_fused_update_message,
  supports_async_emb,
)
from pallas_emb.async_emb.tracker import IN_FLIGHT
from pallas_emb.ids import int32_ids


def lookup_start(
  context: AsyncEmbContextHandle, table: jax.Array, ids: Mapping[str, jax.Array], gate=None
) -> EmbLookup:
  """Starts the lookup of the context's features.

  Args:
    context: the table's context.
    table: its stored array (`TableState.table`).
    ids: feature -> (B, L) int32 or int64 (see `pallas_emb.ids`) for the
      table's features.
    gate: any array; the lookup reads the table only after it is computed.

  Raises:
    AsyncEmbStateError: while an update of the table is in flight.
    PlacementError: ids committed to devices outside the context's mesh.
    MeshMismatchError: a table of another mesh.
  """
  IN_FLIGHT.check_idle(context, "lookup_start")
  t = context.sharded_table
  validate.check_lookup(t, table, ids, context.tokens_per_batch)
  ids = int32_ids(ids)  # on the host for NumPy ids: before jit can wrap
  outs, res = programs.lookup(t, tie(table, gate), tuple(ids[f.name] for f in t.features))
  return EmbLookup(dict(zip((f.name for f in t.features), outs)), res)


def lookup_done(context: AsyncEmbContextHandle, lookup: EmbLookup) -> dict[str, jax.Array]:
  """The embeddings of a started lookup: feature -> (B, dim) or (B, L, dim)."""
  del context
  return lookup.acts


def make_gradient_update(
  context: AsyncEmbContextHandle, lookup: EmbLookup, grads: Mapping[str, jax.Array]
) -> AsyncEmbGradientUpdate:
  """Packs the gradient w.r.t. a lookup's outputs as a pending update."""
  t = context.sharded_table
  validate.check_feature_grads(
    context.name, t.features, grads, [lookup.acts[f.name].shape for f in t.features]
  )
  validate.check_on_mesh(
    (lookup.residuals, grads),
    t.mesh,
    f"the lookup or gradients of table {t.name!r}",
    "pass this context's lookup_start result and gradients on its mesh or on the host.",
  )
  token_grads = programs.token_gradients(
    t, lookup.residuals, tuple(grads[f.name] for f in t.features)
  )
  return AsyncEmbGradientUpdate.from_residuals(
    lookup.residuals, token_grads, jnp.asarray(True), context.identity
  )


def empty_gradient_update(context: AsyncEmbContextHandle) -> AsyncEmbGradientUpdate:
  """The update that applies nothing (first step, after a flush)."""
  t = context.sharded_table
  res, token_grads = programs.empty_residuals(t, context.tokens_per_rank)
  # Replicated on the table's mesh, as a step's own flag is: a flag of no
  # placement differs in type, and the step's program compiled twice.
  pending = jax.device_put(jnp.asarray(False), NamedSharding(t.mesh, P()))
  return AsyncEmbGradientUpdate.from_residuals(res, token_grads, pending, context.identity)


def gradient_update_start(
  context: AsyncEmbContextHandle,
  update: AsyncEmbGradientUpdate,
  table: jax.Array,
  state: EmbOptState,
  gate=None,
):
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
    UpdateMismatchError: `update` was made by another context (another
      table, optimizer or mesh).
    MeshMismatchError: `table` or `state` lives on another mesh.
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
