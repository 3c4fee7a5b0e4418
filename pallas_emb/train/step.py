"""The training step: dense parameters with optax, tables with the fused update.

Three pipelines, chosen by `TrainConfig`:

* async (use_async_emb=True, exact=False), the reference's schedule. Step t
  gets batch t's embeddings from the lookup started in step t-1, starts the
  update with step t-1's gradient (it overlaps the dense forward), collects
  it after the loss, starts the lookup of batch t+1 on the updated table
  (it overlaps the backward) and returns step t's gradient as the next
  pending update. Embeddings are exactly one step stale.
* exact (use_async_emb=True, exact=True): the same calls, but step t's own
  gradient is applied within step t, before the lookup of batch t+1.
* sync (use_async_emb=False): lookup, backward and sparse update in order,
  with any embedding optimizer.

Dynamic tables (`TableSpec(vocabulary=)`) take raw ids; each step admits a
batch into their maps before its lookup, in the same program
(`train.vocab_step`, which says which batch each pipeline admits when).

The dense update is never skipped when an embedding update is (a non-finite
embedding gradient norm skips only that table's update, as in the
reference): wrap `dense_tx` in `optax.apply_if_finite` to skip dense steps too.

`flush` applies the pending update; it changes nothing in the trajectory (the
next step would have applied it before its next lookup anyway), so evaluation
after a flush sees every gradient so far without perturbing training.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pallas_emb import async_emb
from pallas_emb.async_emb import AsyncEmbContextHandle, AsyncEmbGradientUpdate, EmbLookup
from pallas_emb.dynamic import VocabState
from pallas_emb.embedding import ShardedEmbedding
from pallas_emb.errors import InputError
from pallas_emb.ids import int32_ids
from pallas_emb.state import TableState
from pallas_emb.train import emb_update, vocab_step
from pallas_emb.train.config import TrainConfig, validate_config

# loss_fn(params, acts, batch) -> (loss, aux): acts maps feature -> embedding.
LossFn = Callable[[Any, Mapping[str, jax.Array], Any], tuple[jax.Array, Any]]


class TrainState(NamedTuple):
  """Everything a step carries (a pytree; checkpoint it whole).

  Attributes:
    params: dense parameters.
    opt_state: their optax state.
    tables: physical table name (`ShardedEmbedding.table_names`: a stack of
      tables or one table) -> `TableState`.
    pending: table name -> the deferred `AsyncEmbGradientUpdate` (async
      pipeline); an empty update (exact); {} (sync).
    lookups: table name -> the started `EmbLookup` of the next batch (async
      and exact pipelines); empty for sync.
    step: () int32 steps taken.
    vocabs: dynamic table name -> its `VocabState` (the id maps); empty
      without dynamic tables.
  """

  params: Any
  opt_state: Any
  tables: dict[str, TableState]
  pending: dict[str, AsyncEmbGradientUpdate]
  lookups: dict[str, EmbLookup]
  step: jax.Array
  vocabs: dict[str, VocabState] = {}


@dataclasses.dataclass(frozen=True)
class Trainer:
  """A jitted training step over a dense model and sharded tables.

  Build with `make_trainer`. Batches are dicts with an "ids" entry (feature
  -> (B, L) int32 or int64, see `pallas_emb.ids`) and anything else
  `loss_fn` reads (labels, dense inputs).

  Attributes:
    emb: the embedding configuration.
    loss_fn: `(params, acts, batch) -> (loss, aux)`.
    dense_tx: the dense parameters' optax transformation.
    config: the validated `TrainConfig`.
    contexts: (table name, `AsyncEmbContextHandle`) pairs (async pipelines).
  """

  emb: ShardedEmbedding
  loss_fn: LossFn
  dense_tx: optax.GradientTransformation
  config: TrainConfig
  contexts: tuple[tuple[str, AsyncEmbContextHandle], ...] = ()

  @property
  def pipeline(self) -> Callable:
    """The step function of the configured pipeline."""
    if not self.config.use_async_emb:
      return _sync_step
    return _exact_step if self.config.exact else _async_step

  def init(
    self, params, tables: Mapping[str, TableState], batch, vocabs: Mapping | None = None
  ) -> TrainState:
    """The state before step 0; starts the lookup of `batch` (async and
    exact pipelines, which admit it into the dynamic tables' maps first).

    Args:
      params: the dense parameters.
      tables: `emb.init(key)` or restored table states (donated).
      batch: the first batch.
      vocabs: `emb.init_vocabularies(key)` (donated), required when the
        embedding has dynamic tables.

    Raises:
      InputError: dynamic tables without `vocabs`, or `vocabs` of other
        tables.
    """
    vocabs = self._check_vocabs(vocabs)
    tables = dict(tables)
    lookups, pending = {}, {}
    if self.contexts:
      ids = vocab_step.host_ids(self.emb, batch)["ids"]
      ids, tables, vocabs, _ = vocab_step.admit(self.emb, tables, vocabs, ids)
      ids = int32_ids(ids)
    for name, ctx in self.contexts:
      lookups[name] = async_emb.lookup_start(ctx, tables[name].table, ctx.table_inputs(ids))
      pending[name] = async_emb.empty_gradient_update(ctx)
    # Replicated on the mesh, as the step returns them: otherwise the second
    # step would see new input shardings and compile again.
    params, opt_state, step = jax.device_put(
      (params, self.dense_tx.init(params), jnp.zeros((), jnp.int32)), self.emb.sharding(rows=False)
    )
    return TrainState(params, opt_state, tables, pending, lookups, step, vocabs)

  def _check_vocabs(self, vocabs) -> dict:
    want = set(self.emb.dynamic_tables())
    got = set(vocabs or {})
    if want != got:
      raise InputError(
        f"the embedding's dynamic tables are {sorted(want)}, but vocabs holds "
        f"{sorted(got)}; pass vocabs=emb.init_vocabularies(key) (or restored maps) to init."
      )
    return dict(vocabs or {})

  def step(self, state: TrainState, batch, next_batch=None):
    """One training step on `batch` -> (state, metrics). `state` is donated.

    Args:
      state: from `init` or the previous step; for async and exact
        pipelines its lookups hold `batch`'s embeddings.
      batch: this step's batch.
      next_batch: the next step's batch (async and exact pipelines start its
        lookup here); the sync pipeline does not read, convert or place it,
        and compiles one program whatever it is (None included).

    Returns:
      (state, metrics): metrics has "loss", "aux", and "emb": table ->
      {"grad_norm", "applied", "skipped", "unique_ids", "invalid_ids",
      "overflow_ids", "max_unique_per_shard", "max_ids_per_route",
      "max_rows_per_owner"} (see `TableMetrics`; for async, of the update
      applied in this step, i.e. of step t-1's batch).

    Raises:
      MeshMismatchError: `state` holds arrays of another mesh (e.g. another
        trainer's); PlacementError: so do the batches' ids.
    """
    self.emb.check_on_mesh(state, "the train state")
    if not self.config.use_async_emb:
      # Unread by the step: converting, checking and passing it cost a sync
      # step host time (a dynamic table's key words most), and a None at
      # one step and a batch at another would compile the step twice.
      next_batch = None
    batch, next_batch = (vocab_step.host_ids(self.emb, b) for b in (batch, next_batch))
    batch, next_batch = emb_update.step_batches(
      self.emb.mesh, self.contexts, batch, next_batch, vocab_step.dynamic_features(self.emb)
    )
    return _jit_step(self, state, batch, next_batch)

  def flush(self, state: TrainState):
    """Applies the pending update -> (state, metrics). `state` is donated."""
    self.emb.check_on_mesh(state, "the train state")
    return _jit_flush(self, state)

  def evaluate(self, state: TrainState, batch):
    """(loss, aux) of `batch` on the current tables, without updating.

    The lookups run as each table's own lookup program (`emb.lookup`), not
    inlined into one evaluation program: `init` of the async and exact
    pipelines compiled them for the training batch's shape, so evaluating
    batches of that shape compiles only `loss_fn`. (One program of lookups
    and loss compiled for 4.7 s on a v5e chip for the main job, and for
    9.8 s on CPU for DLRM, at the end of each run.)"""
    self.emb.check_on_mesh(state, "the train state")
    batch = vocab_step.host_ids(self.emb, batch)
    batch = emb_update.int32_batch(batch, vocab_step.dynamic_features(self.emb))
    ids = vocab_step.read(self.emb, state.vocabs, batch["ids"])
    acts, _ = self.emb.lookup(state.tables, ids)
    return _jit_loss(self, state.params, acts, batch)


def make_trainer(
  emb: ShardedEmbedding,
  loss_fn: LossFn,
  dense_tx: optax.GradientTransformation,
  config: TrainConfig,
  example_batch,
) -> Trainer:
  """Validates the config, then builds the trainer for batches like
  `example_batch`.

  Raises:
    ConfigError: before anything is traced, if `config.use_async_emb` meets
      a table optimizer without a fused update.
  """
  validate_config(config, emb)
  contexts = ()
  if config.use_async_emb:
    ids = vocab_step.row_shaped(emb, example_batch["ids"])
    contexts = tuple(async_emb.context_handles(emb, ids).items())
  return Trainer(emb, loss_fn, dense_tx, config, contexts)


def _dense_step(tr: Trainer, params, opt_state, acts, batch):
  (loss, aux), (g_params, g_acts) = jax.value_and_grad(tr.loss_fn, argnums=(0, 1), has_aux=True)(
    params, acts, batch
  )
  updates, opt_state = tr.dense_tx.update(g_params, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, aux, g_acts


def _sync_step(tr: Trainer, state: TrainState, batch, next_batch):
  """Lookup, dense step and sparse update, in order (any optimizer)."""
  del next_batch
  ids, tables, vocabs, vm = vocab_step.admit(tr.emb, state.tables, state.vocabs, batch["ids"])
  acts, res = tr.emb.lookup(tables, ids)
  params, opt_state, loss, aux, g_acts = _dense_step(tr, state.params, state.opt_state, acts, batch)
  tables, m = tr.emb.apply_gradients(tables, res, g_acts)
  emb_metrics = emb_update.sync_metrics(m)
  state = state._replace(
    params=params, opt_state=opt_state, tables=tables, step=state.step + 1, vocabs=vocabs
  )
  return state, _metrics(loss, aux, emb_metrics, vm)


def _async_step(tr: Trainer, state: TrainState, batch, next_batch):
  """The reference's schedule: step t-1's update overlaps step t's dense
  forward; embeddings are one step stale."""
  tables, started, pending = dict(state.tables), {}, {}
  acts = {}
  for name, ctx in tr.contexts:
    acts.update(async_emb.lookup_done(ctx, state.lookups[name]))
  # Step t-1's gradient: no data dependence on this step's forward.
  for name, ctx in tr.contexts:
    tables[name], started[name] = emb_update.start_update(ctx, state.pending[name], tables[name])
  params, opt_state, loss, aux, g_acts = _dense_step(tr, state.params, state.opt_state, acts, batch)
  for name, ctx in tr.contexts:
    pending[name] = async_emb.make_gradient_update(
      ctx, state.lookups[name], ctx.table_inputs(g_acts)
    )
  # Batch t+1 into the maps, on the tables step t-1's gradient updated.
  next_ids, tables, vocabs, vm = vocab_step.admit(tr.emb, tables, state.vocabs, next_batch["ids"])
  emb_metrics, lookups = emb_update.collect_updates(
    tr.contexts, tables, state.pending, started, next_ids, loss
  )
  state = TrainState(params, opt_state, tables, pending, lookups, state.step + 1, vocabs)
  return state, _metrics(loss, aux, tr.emb.metrics_by_table(emb_metrics), vm)


def _exact_step(tr: Trainer, state: TrainState, batch, next_batch):
  """The async calls with no staleness: step t's gradient is applied within
  step t, before the lookup of batch t+1."""
  tables, updates, started = dict(state.tables), {}, {}
  acts = {}
  for name, ctx in tr.contexts:
    acts.update(async_emb.lookup_done(ctx, state.lookups[name]))
  params, opt_state, loss, aux, g_acts = _dense_step(tr, state.params, state.opt_state, acts, batch)
  for name, ctx in tr.contexts:
    updates[name] = async_emb.make_gradient_update(
      ctx, state.lookups[name], ctx.table_inputs(g_acts)
    )
    tables[name], started[name] = emb_update.start_update(ctx, updates[name], tables[name], loss)
  # Batch t+1 into the maps, on the tables step t's gradient updated.
  next_ids, tables, vocabs, vm = vocab_step.admit(tr.emb, tables, state.vocabs, next_batch["ids"])
  emb_metrics, lookups = emb_update.collect_updates(
    tr.contexts, tables, updates, started, next_ids, loss
  )
  state = TrainState(params, opt_state, tables, state.pending, lookups, state.step + 1, vocabs)
  return state, _metrics(loss, aux, tr.emb.metrics_by_table(emb_metrics), vm)


def _metrics(loss, aux, emb_metrics, vocab_metrics) -> dict:
  """A step's metrics; "vocab" (table -> `VocabMetrics` fields) only with
  dynamic tables."""
  out = {"loss": loss, "aux": aux, "emb": emb_metrics}
  if vocab_metrics:
    out["vocab"] = vocab_metrics
  return out


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _jit_step(tr: Trainer, state: TrainState, batch, next_batch):
  return tr.pipeline(tr, state, batch, next_batch)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _jit_flush(tr: Trainer, state: TrainState):
  tables, pending, emb_metrics = dict(state.tables), dict(state.pending), {}
  for name, ctx in tr.contexts:
    tables[name], emb_metrics[name] = emb_update.flush_update(
      ctx, tables[name], state.pending[name]
    )
    pending[name] = async_emb.empty_gradient_update(ctx)
  return (
    state._replace(tables=tables, pending=pending),
    {"emb": tr.emb.metrics_by_table(emb_metrics)},
  )


@functools.partial(jax.jit, static_argnums=0)
def _jit_loss(tr: Trainer, params, acts, batch):
  return tr.loss_fn(params, acts, batch)
