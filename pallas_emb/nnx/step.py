"""A training step written the NNX way over an `Embed` and a dense module.

    loss, aux = dense(acts, batch)             # the dense module's __call__
    metrics = train_step(embed, dense, optimizer, batch, next_batch)

`nnx.value_and_grad` differentiates the dense module's `nnx.Param` leaves and the
looked-up embeddings; `optimizer` (an `nnx.Optimizer` over the dense module
only) updates the former, `Embed` applies the latter with the sparse (fused)
update. The order of the calls is the functional `Trainer`'s, pipeline by
pipeline (see `pallas_emb.train.step`).
"""

from __future__ import annotations

import jax
from flax import nnx

from pallas_emb.nnx.embed import Embed
from pallas_emb.train import emb_update, vocab_step


def _dense_grads(dense: nnx.Module, acts, batch):
  def loss_fn(dense, acts):
    return dense(acts, batch)

  return nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(dense, acts)


@nnx.jit
def _step(embed: Embed, dense: nnx.Module, optimizer: nnx.Optimizer, batch, next_batch):
  if not embed.config.use_async_emb:
    acts, res = embed.sync_lookup(batch["ids"])
    (loss, aux), (g_dense, g_acts) = _dense_grads(dense, acts, batch)
    optimizer.update(dense, g_dense)
    emb_metrics = embed.sync_update(res, g_acts)
  elif embed.config.exact:
    acts = embed.lookup_done()
    (loss, aux), (g_dense, g_acts) = _dense_grads(dense, acts, batch)
    optimizer.update(dense, g_dense)
    emb_metrics = embed.exact_update(g_acts, next_batch["ids"], loss)
  else:
    acts = embed.lookup_done()
    # The previous step's gradient: no data dependence on this forward.
    started = embed.async_start()
    (loss, aux), (g_dense, g_acts) = _dense_grads(dense, acts, batch)
    optimizer.update(dense, g_dense)
    emb_metrics = embed.async_done(started, g_acts, next_batch["ids"], loss)
  out = {"loss": loss, "aux": aux, "emb": emb_metrics}
  if embed.emb.dynamic_tables():
    out["vocab"] = embed.admission.get_value()
  return out


def train_step(
  embed: Embed, dense: nnx.Module, optimizer: nnx.Optimizer, batch, next_batch=None
) -> dict:
  """One training step on `batch`; updates the three modules in place.

  Args:
    embed: the tables.
    dense: an `nnx.Module` whose `__call__(acts, batch)` returns (loss, aux),
      acts mapping feature -> embedding.
    optimizer: `nnx.Optimizer(dense, tx, wrt=nnx.Param)`.
    batch: {"ids": feature -> (B, L) ids, ...} as global arrays.
    next_batch: the next step's batch (async and exact pipelines start its
      lookup here; at the last step any batch of the same shapes, then
      `flush`).

  Returns:
    {"loss", "aux", "emb": table -> metrics}, as `Trainer.step`.
  """
  batch, next_batch = (vocab_step.host_ids(embed.emb, b) for b in (batch, next_batch))
  batch, next_batch = emb_update.step_batches(
    embed.emb.mesh, embed.contexts, batch, next_batch, vocab_step.dynamic_features(embed.emb)
  )
  return _step(embed, dense, optimizer, batch, next_batch)


@nnx.jit
def _flush(embed: Embed):
  return embed.flush_pending()


def flush(embed: Embed) -> dict:
  """Applies the pending update (async) -> table name -> metrics."""
  return _flush(embed)


@nnx.jit
def _evaluate(embed: Embed, dense: nnx.Module, batch):
  return dense(embed(batch["ids"]), batch)


def evaluate(embed: Embed, dense: nnx.Module, batch):
  """(loss, aux) of `batch` on the current tables, nothing updated."""
  batch = vocab_step.host_ids(embed.emb, batch)
  return _evaluate(
    embed, dense, emb_update.int32_batch(batch, vocab_step.dynamic_features(embed.emb))
  )


def replicate(module: nnx.Module, embed: Embed) -> None:
  """Puts a module's state (dense parameters, optimizer state) replicated
  on `embed`'s mesh, as `Trainer.init` puts its dense state: the step's
  inputs then live on the mesh its tables live on."""
  nnx.update(module, jax.device_put(nnx.state(module), embed.emb.sharding(rows=False)))
