"""Checkpoints of a `TrainState` with orbax, the pending update included.

A preemption loses nothing: besides tables, slots, dense parameters, their
optimizer state and the step, a checkpoint holds the deferred embedding
gradient of the async pipeline (the reference flushes it before a checkpoint
and never saves it). Nothing saved depends on the device count:

* tables and slots are saved in their physical layout together with it, and
  restored through `RowLayout.reshard` when the shard count changed;
* the pending gradient is saved per feature, as (B, L, dim) token gradients
  in batch order, not in the per-device order of the routing; so are the
  embeddings of the started lookup (B, dim) or (B, L, dim);
* routing plans are not saved: they are functions of the ids, so restore
  plans them again on its own mesh from the batches at the data position,
  which the caller supplies.

A run restored onto the same mesh continues bit-for-bit as if never stopped.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from pallas_emb import async_emb
from pallas_emb.embedding import TableState
from pallas_emb.train.step import Trainer, TrainState, table_features
from sharding.layout import RowLayout


class CheckpointError(ValueError):
  """A checkpoint that does not fit the trainer it is restored into."""


def _feature_token_grads(ctx: async_emb.AsyncEmbContextHandle, grads: jax.Array,
                         shapes: tuple[tuple[str, int, int], ...]) -> dict[str, jax.Array]:
  """(S * n, dim) in per-device token order -> feature -> (B, L, dim)."""
  dims = {name: (b, l) for name, b, l in shapes}
  per_device = grads.reshape(ctx.group_size, -1, grads.shape[-1])
  out, start = {}, 0
  for f in ctx.embedding.features:
    b, l = dims[f.name]
    size = b // ctx.group_size * l
    out[f.name] = per_device[:, start:start + size].reshape(b, l, grads.shape[-1])
    start += size
  return out


def _device_token_grads(ctx: async_emb.AsyncEmbContextHandle,
                        per_feature: Mapping[str, jax.Array]) -> jax.Array:
  """feature -> (B, L, dim) -> (S * n, dim) in this mesh's per-device order."""
  blocks = [per_feature[f.name].reshape(ctx.group_size, -1, ctx.emb_width)
            for f in ctx.embedding.features]
  return jnp.concatenate(blocks, axis=1).reshape(-1, ctx.emb_width)


_jit_feature_grads = jax.jit(_feature_token_grads, static_argnums=(0, 2))
_jit_device_grads = jax.jit(_device_token_grads, static_argnums=0)


class Checkpointer:
  """Saves and restores a trainer's state in `directory` (orbax).

  Args:
    directory: where step directories go (created).
    trainer: the `Trainer` whose states are saved.
    max_to_keep: checkpoints kept.
  """

  def __init__(self, directory: str, trainer: Trainer, max_to_keep: int = 3):
    self.trainer = trainer
    self.manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, state: TrainState, batch_shapes: Mapping[str, tuple[int, int]],
           extra: Mapping[str, Any] | None = None) -> int:
    """Writes a checkpoint named by `state.step` (blocking until durable).

    Args:
      state: the state after a step (not donated yet).
      batch_shapes: feature -> (B, L) of the training batches.
      extra: JSON-serialisable metadata (e.g. the data position).
    """
    tr = self.trainer
    step = int(jax.device_get(state.step))
    shapes = tuple((f, int(b), int(l)) for f, (b, l) in sorted(batch_shapes.items()))
    pending = {name: {"pending": state.pending[name].pending,
                      "grads": _jit_feature_grads(ctx, state.pending[name].grads, shapes)}
               for name, ctx in tr.contexts}
    # The started lookup's embeddings are saved rather than recomputed on
    # restore, so a resumed run is bit-identical whatever XLA fuses them into.
    lookup_acts = {name: dict(state.lookups[name].acts) for name, _ in tr.contexts}
    item = {"params": state.params, "opt_state": state.opt_state,
            "tables": {k: _table_dict(v) for k, v in state.tables.items()},
            "pending": pending, "lookup_acts": lookup_acts, "step": state.step}
    meta = {"step": step, "num_shards": tr.emb.num_shards,
            "tables": {t.name: {"num_rows": t.num_rows, "dim": t.dim,
                                "dtype": str(np.dtype(t.dtype)), "layout": t.layout}
                       for t in tr.emb.tables},
            "use_async_emb": tr.config.use_async_emb, "exact": tr.config.exact,
            "batch_shapes": {k: list(v) for k, v in batch_shapes.items()},
            "extra": dict(extra or {})}
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(item), meta=ocp.args.JsonSave(meta)))
    self.manager.wait_until_finished()
    return step

  def metadata(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    return self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, template: TrainState,
              batch_at: Callable[[int], Any], step: int | None = None) -> TrainState:
    """Restores a checkpoint into this trainer's mesh.

    Args:
      template: a state of this trainer (e.g. from `init`): gives the
        structure and shardings of the dense state. It is not modified.
      batch_at: data position -> the training batch at that index (global
        device arrays or host arrays). The pending update is rebuilt from
        `batch_at(step - 1)`, the started lookup from `batch_at(step)`.
      step: which checkpoint; the latest by default.

    Raises:
      CheckpointError: tables or pipeline differ from the trainer's.
    """
    tr = self.trainer
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError("no checkpoint to restore in "
                            f"{self.manager.directory}.")
    meta = self.metadata(step)
    self._check_compatible(meta)
    # A table keeps its physical order only if both the shard count and the
    # layout kind are unchanged; otherwise it goes through logical order.
    same_layout = {t.name: meta["num_shards"] == tr.emb.num_shards
                   and meta["tables"][t.name]["layout"] == t.layout
                   for t in tr.emb.tables}
    as_abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    tables_target = {}
    for name, ts in template.tables.items():
      if same_layout[name]:
        tables_target[name] = jax.tree.map(as_abstract, _table_dict(ts))
      else:
        old = RowLayout(meta["tables"][name]["num_rows"], meta["num_shards"],
                        meta["tables"][name]["layout"])
        host = lambda x, old=old: np.zeros((old.num_physical_rows,) + x.shape[1:], x.dtype)
        tables_target[name] = {"table": host(ts.table),
                               "slots": {k: host(v) for k, v in ts.slots.items()},
                               "step": np.zeros((), np.int32)}
    pending_target = {}
    for name, ctx in tr.contexts:
      shapes = meta["batch_shapes"]
      pending_target[name] = {
          "pending": jax.ShapeDtypeStruct((), jnp.bool_, sharding=tr.emb.sharding(rows=False)),
          "grads": {f.name: jax.ShapeDtypeStruct(
              (shapes[f.name][0], shapes[f.name][1], ctx.emb_width), jnp.float32,
              sharding=tr.emb.sharding())
                    for f in ctx.embedding.features}}
    acts_target = {name: jax.tree.map(as_abstract, dict(template.lookups[name].acts))
                   for name, _ in tr.contexts}
    target = {"params": jax.tree.map(as_abstract, template.params),
              "opt_state": jax.tree.map(as_abstract, template.opt_state),
              "tables": tables_target, "pending": pending_target,
              "lookup_acts": acts_target, "step": as_abstract(template.step)}
    item = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"]

    tables = {}
    for name, d in item["tables"].items():
      if same_layout[name]:
        tables[name] = TableState(d["table"], dict(d["slots"]), d["step"])
      else:
        tables[name] = self._reshard(name, meta, d)
    pending, lookups = {}, {}
    if tr.contexts:
      pending_batch, next_batch = batch_at(step - 1), batch_at(step)
      for name, ctx in tr.contexts:
        started = async_emb.lookup_start(
            ctx, tables[name].table, table_features(ctx, next_batch["ids"]))
        lookups[name] = started._replace(acts=dict(item["lookup_acts"][name]))
        saved = item["pending"][name]
        if tr.config.exact or step == 0:
          pending[name] = async_emb.empty_gradient_update(ctx)
          continue
        # The routing is a function of the ids: plan it again on this mesh.
        routed = ctx.embedding.plan(table_features(ctx, pending_batch["ids"]))[name]
        pending[name] = async_emb.gradient_update_from(
            routed, _jit_device_grads(ctx, saved["grads"]), saved["pending"])
    return TrainState(item["params"], item["opt_state"], tables, pending,
                      lookups, item["step"])

  def _check_compatible(self, meta: dict) -> None:
    tr = self.trainer
    for t in tr.emb.tables:
      saved = meta["tables"].get(t.name)
      want = {"num_rows": t.num_rows, "dim": t.dim, "dtype": str(np.dtype(t.dtype))}
      if saved is None or any(saved[k] != v for k, v in want.items()):
        raise CheckpointError(
            f"checkpoint table {t.name!r} is {saved}, but the trainer's is "
            f"{want}; restore with the same table specs.")
    if (meta["use_async_emb"], meta["exact"]) != (tr.config.use_async_emb, tr.config.exact):
      raise CheckpointError(
          "the checkpoint was written by the "
          f"use_async_emb={meta['use_async_emb']}, exact={meta['exact']} "
          "pipeline; restore it with the same TrainConfig.")

  def _reshard(self, name: str, meta: dict, d) -> TableState:
    emb = self.trainer.emb
    info = meta["tables"][name]
    old = RowLayout(info["num_rows"], meta["num_shards"], info["layout"])
    new = emb.layout(name)
    put = lambda x: jax.device_put(old.reshard(np.asarray(x), new), emb.sharding())
    return TableState(put(d["table"]), {k: put(v) for k, v in d["slots"].items()},
                      jax.device_put(jnp.asarray(d["step"], jnp.int32),
                                     emb.sharding(rows=False)))


def _table_dict(ts: TableState) -> dict:
  return {"table": ts.table, "slots": dict(ts.slots), "step": ts.step}
