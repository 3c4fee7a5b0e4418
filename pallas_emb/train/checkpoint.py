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

from pallas_emb import async_emb, programs, tokens
from pallas_emb import state as state_lib
from pallas_emb.state import TableState
from pallas_emb.train.step import Trainer, TrainState
from sharding.layout import RowLayout


class CheckpointError(ValueError):
  """A checkpoint that does not fit the trainer it is restored into."""


# Token gradients between the mesh's device order and per-feature arrays.
_to_features = jax.jit(tokens.from_device_order, static_argnums=(1, 2, 3))
_to_devices = jax.jit(tokens.to_device_order, static_argnums=(1, 2))


def _token_layout(ctx, batch_shapes: Mapping[str, Any]):
  """(feature names, their (B, L)) of a context's table, as static tuples."""
  names = tuple(f.name for f in ctx.features)
  return names, tuple(tuple(int(v) for v in batch_shapes[n]) for n in names)


def _table_dict(ts: TableState) -> dict:
  return {"table": ts.table, "slots": dict(ts.slots), "step": ts.step}


def _abstract(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


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
    pending = {}
    for name, ctx in tr.contexts:
      names, shapes = _token_layout(ctx, batch_shapes)
      pending[name] = {"pending": state.pending[name].pending,
                       "grads": _to_features(state.pending[name].grads, names,
                                             shapes, ctx.group_size)}
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
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError("no checkpoint to restore in "
                            f"{self.manager.directory}.")
    meta = self.metadata(step)
    self._check_compatible(meta)
    item = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(self._target(template, meta))))["state"]
    tables = {name: self._table(name, meta, d)
              for name, d in item["tables"].items()}
    pending, lookups = self._pipeline(tables, item, meta, batch_at, step)
    return TrainState(item["params"], item["opt_state"], tables, pending,
                      lookups, item["step"])

  def _old_layout(self, name: str, meta: dict) -> RowLayout | None:
    """The saved layout of table `name`, or None if it is this trainer's."""
    info = meta["tables"][name]
    old = RowLayout(info["num_rows"], meta["num_shards"], info["layout"])
    return None if old == self.trainer.emb.layout(name) else old

  def _target(self, template: TrainState, meta: dict) -> dict:
    """What orbax restores into: this mesh's shardings where the layout is
    unchanged, host arrays of the saved layout where it changed."""
    tr = self.trainer
    tables = {}
    for name, ts in template.tables.items():
      old = self._old_layout(name, meta)
      if old is None:
        tables[name] = jax.tree.map(_abstract, _table_dict(ts))
        continue
      spec = tr.emb.table_spec(name)
      specs = spec.optimizer.slot_specs()
      tables[name] = {
          "table": np.zeros((old.num_physical_rows,) + ts.table.shape[1:],
                            ts.table.dtype),
          "slots": {k: np.zeros(specs[k].shape_for(
              old.num_physical_rows, spec.dim, old.rows_per_shard), v.dtype)
                    for k, v in ts.slots.items()},
          "step": np.zeros((), np.int32)}
    pending = {}
    for name, ctx in tr.contexts:
      names, shapes = _token_layout(ctx, meta["batch_shapes"])
      pending[name] = {
          "pending": jax.ShapeDtypeStruct(
              (), jnp.bool_, sharding=tr.emb.sharding(rows=False)),
          "grads": {n: jax.ShapeDtypeStruct((*shape, ctx.emb_width),
                                            jnp.float32,
                                            sharding=tr.emb.sharding())
                    for n, shape in zip(names, shapes)}}
    return {"params": jax.tree.map(_abstract, template.params),
            "opt_state": jax.tree.map(_abstract, template.opt_state),
            "tables": tables, "pending": pending,
            "lookup_acts": {name: jax.tree.map(_abstract,
                                               dict(template.lookups[name].acts))
                            for name, _ in tr.contexts},
            "step": _abstract(template.step)}

  def _table(self, name: str, meta: dict, d: dict) -> TableState:
    """A restored table on this mesh, resharded if its layout changed."""
    old = self._old_layout(name, meta)
    if old is None:
      return TableState(d["table"], dict(d["slots"]), d["step"])
    emb = self.trainer.emb
    new = emb.layout(name)
    slots = state_lib.reshard_slots(emb.table_spec(name), old, new, d["slots"])
    return TableState(
        jax.device_put(old.reshard(np.asarray(d["table"]), new), emb.sharding()),
        {k: jax.device_put(v, emb.sharding()) for k, v in slots.items()},
        jax.device_put(jnp.asarray(d["step"], jnp.int32),
                       emb.sharding(rows=False)))

  def _pipeline(self, tables, item, meta, batch_at, step):
    """The pending updates and started lookups of the async pipelines.

    Routing plans are not saved: they are functions of the ids, so they are
    planned again on this mesh from the batches at the data position.
    """
    tr = self.trainer
    pending, lookups = {}, {}
    if not tr.contexts:
      return pending, lookups
    pending_batch, next_batch = batch_at(step - 1), batch_at(step)
    for name, ctx in tr.contexts:
      started = async_emb.lookup_start(
          ctx, tables[name].table, ctx.table_inputs(next_batch["ids"]))
      lookups[name] = started._replace(acts=dict(item["lookup_acts"][name]))
      if tr.config.exact or step == 0:
        pending[name] = async_emb.empty_gradient_update(ctx)
        continue
      saved = item["pending"][name]
      names, _ = _token_layout(ctx, meta["batch_shapes"])
      routed = programs.plan(ctx.sharded_table, tuple(
          pending_batch["ids"][n] for n in names))
      pending[name] = async_emb.AsyncEmbGradientUpdate.from_residuals(
          routed, _to_devices(saved["grads"], names, ctx.group_size),
          saved["pending"])
    return pending, lookups

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
