"""`Embed`: the sharded tables as a Flax NNX module.

The tables, their optimizer slots and update counts are NNX state
(`EmbTable`, `EmbSlots`, `EmbStep`), and so, for the asynchronous pipelines,
are the deferred gradient (`EmbPending`) and the started lookup of the next
batch (`EmbNextLookup`): `nnx.state(model)` is the whole training state, and
checkpoints through orbax as it is.

The tables are trained with this library's sparse update (fused, for the
asynchronous pipelines), never with `nnx.Optimizer` on a dense gradient: a
train step differentiates only the dense part with respect to the looked-up
embeddings and hands that gradient to `Embed` (see `pallas_emb.nnx.step`).
The calls are those of the functional `Trainer` (`pallas_emb.train`), in
the same order, so both train bit for bit alike.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_emb import async_emb
from pallas_emb.dynamic import VocabMetrics
from pallas_emb.embedding import ShardedEmbedding
from pallas_emb.errors import InputError
from pallas_emb.ids import int32_ids
from pallas_emb.state import TableState
from pallas_emb.train import emb_update, vocab_step
from pallas_emb.train.config import TrainConfig, validate_config


class EmbTable(nnx.Variable):
  """table name -> stored table (`packing.table_shape`), rows sharded."""


class EmbSlots(nnx.Variable):
  """table name -> slot name -> stored optimizer slot (`SlotSpec.shape_for`), rows sharded."""


class EmbStep(nnx.Variable):
  """table name -> () int32 updates applied to the table."""


class EmbPending(nnx.Variable):
  """table name -> the deferred `AsyncEmbGradientUpdate` (async pipelines)."""


class EmbNextLookup(nnx.Variable):
  """table name -> the started `EmbLookup` of the next batch (async)."""


class EmbVocab(nnx.Variable):
  """dynamic table name -> its `VocabState` (the id map), rows sharded."""


class EmbAdmission(nnx.Variable):
  """dynamic table name -> `VocabMetrics` fields of the latest admission."""


class Embed(nnx.Module):
  """Row-sharded embedding tables as NNX state, looked up in `__call__`.

  Args:
    emb: the `ShardedEmbedding` (tables, features, mesh).
    key: initialises the tables (`emb.init(key)`), unless `tables` is given.
    config: the pipeline (`TrainConfig`): sync, async (one step stale, as
      the reference) or exact.
    first_ids: feature -> (B, L) ids of the first training batch; the async
      and exact pipelines start its lookup here (as `Trainer.init`) and make
      their contexts for its shapes. Not needed for sync.
    tables: table name -> `TableState` to start from instead of `key`.
    vocabs: dynamic table name -> `VocabState` to start from; default
      `emb.init_vocabularies(key)`. Dynamic tables take raw ids (host NumPy
      int64 or strings) or key words, and each pipeline admits a batch
      into their maps when the `Trainer`'s does (`train.vocab_step`).

  Raises:
    ConfigError: at construction, an async config with a table optimizer
      that has no fused update (e.g. `OptaxRows`), with the message of
      `validate_config`.
    InputError: an async config without `first_ids`.
  """

  def __init__(
    self,
    emb: ShardedEmbedding,
    *,
    key: jax.Array | None = None,
    config: TrainConfig = TrainConfig(),
    first_ids: Mapping[str, jax.Array] | None = None,
    tables: Mapping[str, TableState] | None = None,
    vocabs: Mapping | None = None,
  ):
    validate_config(config, emb)
    if tables is None:
      if key is None:
        raise InputError("Embed needs key (to initialise the tables) or tables (to start from).")
      tables = emb.init(key)
    if vocabs is None and emb.dynamic_tables():
      if key is None:
        raise InputError("Embed with dynamic tables needs key or vocabs (their id maps).")
      vocabs = emb.init_vocabularies(key)
    self.emb, self.config = emb, config
    self.vocab = EmbVocab(dict(vocabs or {}))
    # Zeros until the first admission, in the shape every later one has:
    # the jitted step then sees one structure of state.
    self.admission = EmbAdmission(
      jax.device_put(
        {n: {k: jnp.zeros((), jnp.int32) for k in VocabMetrics._fields} for n in vocabs or {}},
        emb.sharding(rows=False),
      )
    )
    self.table = EmbTable({n: t.table for n, t in tables.items()})
    self.slots = EmbSlots({n: dict(t.slots) for n, t in tables.items()})
    self.step = EmbStep({n: t.step for n, t in tables.items()})
    self.contexts = ()
    if config.use_async_emb:
      if first_ids is None:
        raise InputError(
          "Embed with use_async_emb=True needs first_ids, the ids of the "
          "first training batch: its lookup starts here and the contexts "
          "are made for its shapes."
        )
      first_ids = vocab_step.host_ids(emb, {"ids": first_ids})["ids"]
      self.contexts = tuple(
        async_emb.context_handles(emb, vocab_step.row_shaped(emb, first_ids)).items()
      )
      first_ids, tables, vocabs, _ = vocab_step.admit(
        emb, dict(tables), dict(vocabs or {}), first_ids
      )
      first_ids = int32_ids(first_ids)
      self._set_tables(tables)
      self.vocab.set_value(vocabs)
      self.pending = EmbPending({n: async_emb.empty_gradient_update(c) for n, c in self.contexts})
      self.next_lookup = EmbNextLookup(
        {
          n: async_emb.lookup_start(c, tables[n].table, c.table_inputs(first_ids))
          for n, c in self.contexts
        }
      )

  @property
  def tables(self) -> dict[str, TableState]:
    """table name -> `TableState` of the current state."""
    table, slots, step = self.table.get_value(), self.slots.get_value(), self.step.get_value()
    return {n: TableState(table[n], slots[n], step[n]) for n in table}

  def _set_tables(self, tables: Mapping[str, TableState]) -> None:
    self.table.set_value({n: t.table for n, t in tables.items()})
    self.slots.set_value({n: dict(t.slots) for n, t in tables.items()})
    self.step.set_value({n: t.step for n, t in tables.items()})

  def __call__(self, ids: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Embeddings of `ids` on the current tables, nothing updated (dynamic
    tables' ids read their maps, read-only).

    Args:
      ids: feature -> (B, L) int32 or int64 ids, batch-sharded on the mesh;
        a dynamic table's as (B, L, 2) uint32 key words (`pe.vocab_keys`).

    Returns:
      feature -> (B, dim) (combined) or (B, L, dim) float32.
    """
    ids = vocab_step.read(self.emb, self.vocab.get_value(), ids)
    return self.emb.lookup(self.tables, ids)[0]

  def admit(self, ids):
    """Training translation of the dynamic tables' ids (inserts, evicts,
    resets new rows) -> ids with their rows; the metrics go to
    `admission`. Static ids pass through."""
    ids, tables, vocabs, metrics = vocab_step.admit(
      self.emb, self.tables, self.vocab.get_value(), ids
    )
    if vocabs:
      self._set_tables(tables)
      self.vocab.set_value(vocabs)
      self.admission.set_value(metrics)
    return ids

  # The three pipelines, each split at the dense step; `pallas_emb.nnx.step`
  # calls them in order.

  def sync_lookup(self, ids):
    """Sync: (acts, residuals) of `ids` (admitted first); give the
    residuals back to `sync_update` with the gradient."""
    ids = self.admit(ids)
    return self.emb.lookup(self.tables, ids)

  def sync_update(self, residuals, grads) -> dict:
    """Sync: applies feature -> gradient w.r.t. `sync_lookup`'s acts ->
    table name -> metrics."""
    tables, m = self.emb.apply_gradients(self.tables, residuals, grads)
    self._set_tables(tables)
    return emb_update.sync_metrics(m)

  def lookup_done(self) -> dict[str, jax.Array]:
    """Async and exact: this batch's embeddings (started the step before)."""
    acts, lookups = {}, self.next_lookup.get_value()
    for name, ctx in self.contexts:
      acts.update(async_emb.lookup_done(ctx, lookups[name]))
    return acts

  def async_start(self) -> dict:
    """Async: starts the previous step's pending update (it overlaps the
    dense step) -> table name -> the update's metrics."""
    tables, started, pending = self.tables, {}, self.pending.get_value()
    for name, ctx in self.contexts:
      tables[name], started[name] = emb_update.start_update(ctx, pending[name], tables[name])
    self._set_tables(tables)
    return started

  def async_done(self, started, grads, next_ids, gate) -> dict:
    """Async: defers this step's gradient, collects the started update and
    starts the lookup of `next_ids` -> table name -> metrics."""
    old, lookups = self.pending.get_value(), self.next_lookup.get_value()
    pending = {
      name: async_emb.make_gradient_update(ctx, lookups[name], ctx.table_inputs(grads))
      for name, ctx in self.contexts
    }
    self.pending.set_value(pending)
    return self._collect(old, started, next_ids, gate)

  def exact_update(self, grads, next_ids, gate) -> dict:
    """Exact: applies this step's gradient, then starts the lookup of
    `next_ids` -> table name -> metrics."""
    tables, updates, started = self.tables, {}, {}
    lookups = self.next_lookup.get_value()
    for name, ctx in self.contexts:
      updates[name] = async_emb.make_gradient_update(ctx, lookups[name], ctx.table_inputs(grads))
      tables[name], started[name] = emb_update.start_update(ctx, updates[name], tables[name], gate)
    self._set_tables(tables)
    return self._collect(updates, started, next_ids, gate)

  def _collect(self, updates, started, next_ids, gate) -> dict:
    """Admits `next_ids` (after the started updates), collects the updates
    and starts the lookup of `next_ids` -> table name -> metrics."""
    next_ids = self.admit(next_ids)
    metrics, next_lookup = emb_update.collect_updates(
      self.contexts, self.tables, updates, started, next_ids, gate
    )
    self.next_lookup.set_value(next_lookup)
    return metrics

  def flush_pending(self) -> dict:
    """Applies the pending update (async) -> table name -> metrics; the
    trajectory is unchanged (see `Trainer.flush`)."""
    tables, metrics = self.tables, {}
    pending = dict(self.pending.get_value()) if self.contexts else {}
    for name, ctx in self.contexts:
      tables[name], metrics[name] = emb_update.flush_update(ctx, tables[name], pending[name])
      pending[name] = async_emb.empty_gradient_update(ctx)
    self._set_tables(tables)
    if self.contexts:
      self.pending.set_value(pending)
    return metrics
