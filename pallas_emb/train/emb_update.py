"""The table half of a training step, shared by every front end.

The functional `Trainer` (`train.step`) and the Flax NNX layer
(`pallas_emb.nnx`) run the same calls in the same order through these
functions, so the two train bit for bit alike.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from pallas_emb import async_emb, validate
from pallas_emb.async_emb import EmbOptState
from pallas_emb.errors import InputError
from pallas_emb.ids import int32_ids
from pallas_emb.state import TableState

# What a step reports of each table's update, besides norm, applied, skipped.
COUNTS = (
  "unique_ids",
  "invalid_ids",
  "overflow_ids",
  "max_unique_per_shard",
  "max_ids_per_route",
  "max_rows_per_owner",
)


def step_batches(mesh, contexts, batch, next_batch, keep=()):
  """Validates a step's batches; returns them with int32 ids (converted on
  the host for NumPy ids: JAX would wrap NumPy int64 ids as they enter the
  jitted step), but for the features in `keep` (dynamic tables' key words).

  Raises:
    PlacementError: ids committed to devices outside `mesh`.
    InputError: an async or exact pipeline (`contexts`) without next_batch.
  """
  for b in (batch, next_batch):
    if b is not None:
      validate.check_placement(b["ids"], mesh)
  if contexts and next_batch is None:
    raise InputError(
      "the async and exact pipelines need next_batch: step t starts the "
      "lookup of batch t+1; pass the next batch (any batch of the same "
      "shapes at the last step, then flush)."
    )
  return int32_batch(batch, keep), int32_batch(next_batch, keep)


def int32_batch(batch, keep=()):
  """`batch` with int32 ids (see `step_batches`), but for the features in
  `keep`; None stays None."""
  if not isinstance(batch, Mapping) or "ids" not in batch:
    return batch
  ids = {k: v if k in keep else int32_ids(v) for k, v in batch["ids"].items()}
  return {**batch, "ids": ids}


def table_metrics(m: Mapping[str, jax.Array], pending, norm, valid) -> dict:
  """One table's step metrics: "grad_norm", "applied", "skipped" and the
  `COUNTS` of the update's metrics `m`."""
  # Skipped: a pending update with rows that was not applied (non-finite
  # norm). An update without rows is nothing to apply, not a skip.
  skipped = pending & jnp.logical_not(valid) & (m["unique_ids"] > 0)
  return {"grad_norm": norm, "applied": valid, "skipped": skipped, **{k: m[k] for k in COUNTS}}


def sync_metrics(m) -> dict:
  """`table_metrics` of every table of a synchronous `apply_gradients`."""
  return {
    k: table_metrics(v._asdict(), jnp.asarray(True), v.grad_norm, v.applied) for k, v in m.items()
  }


def start_update(ctx, update, table_state: TableState, gate=None):
  """Starts `update` on one table -> (TableState, the update's metrics)."""
  _, table, opt_state, m = async_emb.gradient_update_start(
    ctx, update, table_state.table, EmbOptState(table_state.slots, table_state.step), gate
  )
  return TableState(table, opt_state.slots, opt_state.step), m


def collect_update(ctx, tables, update, started, next_ids, gate):
  """Collects the started update of `ctx`'s table, then starts the lookup of
  the next batch's ids on the updated table -> (metrics, lookup)."""
  norm, valid, pin = async_emb.gradient_update_done(ctx, gate=gate)
  lookup = async_emb.lookup_start(ctx, tables[ctx.name].table, ctx.table_inputs(next_ids), gate=pin)
  return table_metrics(started, update.pending, norm, valid), lookup


def collect_updates(contexts, tables, updates, started, next_ids, gate):
  """`collect_update` of every (name, context) of `contexts`, `updates` and
  `started` by name -> (table -> metrics, table -> the next batch's lookup)."""
  metrics, lookups = {}, {}
  for name, ctx in contexts:
    metrics[name], lookups[name] = collect_update(
      ctx, tables, updates[name], started[name], next_ids, gate
    )
  return metrics, lookups


def flush_update(ctx, table_state: TableState, update):
  """Applies a pending update now -> (TableState, metrics)."""
  table_state, m = start_update(ctx, update, table_state)
  norm, valid, _ = async_emb.gradient_update_done(ctx)
  return table_state, table_metrics(m, update.pending, norm, valid)
