"""Checkpoints of a `TrainState` with orbax, the pending update included.

A preemption loses nothing: besides tables, slots, dense parameters, their
optimizer state and the step, a checkpoint holds the deferred embedding
gradient of the async pipeline (the reference flushes it before a checkpoint
and never saves it). Nothing saved depends on the device count:

* tables and slots are saved per logical table, each in the physical layout
  it would have alone (whether or not it is stacked with others, see
  `pallas_emb.stacking`) together with that layout, and restored through
  `RowLayout.reshard` when the shard count changed: a checkpoint restores
  with stacking on or off and under any grouping;
* the pending gradient is saved per logical table and feature, as (B, L,
  dim) token gradients in batch order, not in the per-device order of the
  routing; so are the embeddings of the started lookup (B, dim) or (B, L,
  dim);
* routing plans are not saved: restore plans them again on its own mesh
  from the batches at the data position, which the caller supplies.

A run restored onto the same mesh continues bit-for-bit as if never stopped.

Every step is verified as it is read back (`checkpoint_dir`): restore takes
the newest step that reads back intact, says which newer ones it skipped and
why, and raises `CheckpointCorruptError` when none does. A checkpoint
written with other tables, optimizer, batch shapes or pipeline is refused
with `CheckpointMismatchError` before any array is read.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import async_emb, placement, programs, tokens
from pallas_emb import state as state_lib
from pallas_emb.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from pallas_emb.inputs import token_shape
from pallas_emb.state import TableState
from pallas_emb.train.checkpoint_dir import CheckpointDir, StepUnreadable
from pallas_emb.train.step import Trainer, TrainState
from sharding.layout import RowLayout

__all__ = ["CheckpointError", "Checkpointer", "Restored"]

log = logging.getLogger("pallas_emb.checkpoint")


# Token gradients between the mesh's device order and per-feature arrays,
# both row-sharded (`sharding`).
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _to_features(x, names, shapes, num_shards, sharding):
  fn = lambda x: tokens.from_device_order(x, names, shapes, num_shards)
  return placement.rearrange(fn, sharding)(x)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _to_devices(per_feature, names, num_shards, sharding):
  fn = lambda x: tokens.to_device_order(x, names, num_shards)
  return placement.rearrange(fn, sharding)(per_feature)


def _token_layout(ctx, batch_shapes: Mapping[str, Any]):
  """(feature names, their (B, L)) of a context's table, as static tuples."""
  names = tuple(f.name for f in ctx.features)
  return names, tuple(tuple(int(v) for v in batch_shapes[n]) for n in names)


def _table_dict(ts: TableState) -> dict:
  return {"table": ts.table, "slots": dict(ts.slots), "step": ts.step}


def _abstract(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _members(trainer: Trainer, name: str) -> tuple[str, ...]:
  """The logical tables stored in physical table `name`."""
  return next(tuple(t.name for t in g.tables) for g in trainer.emb.groups if g.name == name)


def _per_table(trainer: Trainer, name: str, per_feature: Mapping) -> dict:
  """Feature -> value of physical table `name` -> logical table ->
  feature -> value."""
  return {
    t: {f.name: per_feature[f.name] for f in trainer.emb.logical_features(t)}
    for t in _members(trainer, name)
  }


def _optimizer_meta(opt) -> dict:
  return {"optimizer": type(opt).__name__, "slots": sorted(opt.slot_specs())}


class Restored(NamedTuple):
  """What `Checkpointer.restore_verified` restored.

  Attributes:
    state: the `TrainState`.
    step: the checkpoint step it came from.
    meta: that step's metadata (`extra` holds what the caller saved).
    skipped: (step, why) of each newer step that did not read back intact,
      newest first; they were renamed to STEP.corrupt (unless read-only).
  """

  state: TrainState
  step: int
  meta: dict
  skipped: tuple[tuple[int, str], ...]


class Checkpointer:
  """Saves and restores a trainer's state in `directory` (orbax).

  Args:
    directory: where step directories go (created; it must be writable).
    trainer: the `Trainer` whose states are saved.
    max_to_keep: checkpoints kept.
    read_only: only restore (from a directory this process cannot write).

  Raises:
    CheckpointDirError: the directory cannot be written (unless read_only).
  """

  def __init__(
    self, directory: str, trainer: Trainer, max_to_keep: int = 3, read_only: bool = False
  ):
    self.trainer = trainer
    self.dir = CheckpointDir(directory, max_to_keep=max_to_keep, writable=not read_only)

  @property
  def directory(self) -> str:
    return self.dir.path

  def latest_step(self) -> int | None:
    """The newest step present (intact or not)."""
    steps = self.dir.steps()
    return steps[0] if steps else None

  def save(
    self,
    state: TrainState,
    batch_shapes: Mapping[str, tuple[int, int]],
    extra: Mapping[str, Any] | None = None,
  ) -> int:
    """Writes a checkpoint named by `state.step` (blocking until durable).

    Args:
      state: the state after a step (not donated yet).
      batch_shapes: feature -> (B, L) of the training batches.
      extra: JSON-serialisable metadata (e.g. the data position).

    Raises:
      CheckpointDirError: the write failed (permissions, full disk...).
    """
    tr = self.trainer
    step = int(jax.device_get(state.step))
    pending, lookup_acts = {}, {}
    for name, ctx in tr.contexts:
      names, shapes = _token_layout(ctx, batch_shapes)
      grads = _to_features(
        state.pending[name].grads, names, shapes, ctx.group_size, tr.emb.sharding()
      )
      pending.update(
        (t, {"pending": state.pending[name].pending, "grads": g})
        for t, g in _per_table(tr, name, grads).items()
      )
      # The started lookup's embeddings are saved rather than recomputed on
      # restore, so a resumed run is bit-identical whatever XLA fuses them
      # into.
      lookup_acts.update(_per_table(tr, name, state.lookups[name].acts))
    item = {
      "params": state.params,
      "opt_state": state.opt_state,
      "tables": {k: _table_dict(v) for k, v in tr.emb.member_states(state.tables).items()},
      "pending": pending,
      "lookup_acts": lookup_acts,
      "step": state.step,
    }
    meta = {
      "step": step,
      "num_shards": tr.emb.num_shards,
      "tables": {
        t.name: {
          "num_rows": t.num_rows,
          "dim": t.dim,
          "dtype": str(np.dtype(t.dtype)),
          "layout": t.layout,
          **_optimizer_meta(t.optimizer),
        }
        for t in tr.emb.tables
      },
      "use_async_emb": tr.config.use_async_emb,
      "exact": tr.config.exact,
      "batch_shapes": {k: list(v) for k, v in batch_shapes.items()},
      "extra": dict(extra or {}),
    }
    self.dir.write(step, item, meta)
    return step

  def metadata(self, step: int | None = None) -> dict:
    """The verified metadata of `step` (the latest by default).

    Raises:
      CheckpointCorruptError: it does not read back intact.
    """
    step = self.latest_step() if step is None else step
    try:
      return self.dir.read_meta(step)
    except StepUnreadable as e:
      raise CheckpointCorruptError(
        f"checkpoint step {step} in {self.directory!r} is not intact: {e}."
      ) from None

  def restore(
    self, template: TrainState, batch_at: Callable[[int], Any], step: int | None = None
  ) -> TrainState:
    """`restore_verified(...).state`."""
    return self.restore_verified(template, batch_at, step).state

  def restore_verified(
    self, template: TrainState, batch_at: Callable[[int], Any], step: int | None = None
  ) -> Restored:
    """Restores the newest intact checkpoint into this trainer's mesh.

    Each step is read back and checked against its checksums, newest first;
    a step that is not intact is skipped (with a warning naming it and
    why), and renamed to STEP.corrupt so that training can write it again
    (unless the checkpointer is read-only).

    Args:
      template: a state of this trainer (e.g. from `init`): gives the
        structure and shardings of the dense state. It is not modified.
      batch_at: data position -> the training batch at that index (global
        device arrays or host arrays). The pending update is rebuilt from
        `batch_at(step - 1)`, the started lookup from `batch_at(step)`.
      step: restore this step or fail; default: the newest intact one.

    Raises:
      CheckpointError: there is no checkpoint.
      CheckpointMismatchError: tables, optimizer, batch shapes or pipeline
        differ from the trainer's.
      CheckpointCorruptError: no step (or not `step`) reads back intact.
    """
    candidates = self.dir.steps() if step is None else [step]
    if not candidates:
      raise CheckpointError(f"no checkpoint to restore in {self.directory!r}.")
    skipped = []
    for s in candidates:
      try:
        meta = self.dir.read_meta(s)
        self._check_compatible(meta, batch_at(s), s)
        item = self.dir.read_state(s, self._target(template, meta), meta)
      except StepUnreadable as e:
        skipped.append((s, str(e)))
        log.warning("checkpoint step %d in %s is not intact, skipped: %s", s, self.directory, e)
        continue
      tables = self.trainer.emb.from_member_states(
        {name: self._table(name, meta, d) for name, d in item["tables"].items()}
      )
      pending, lookups = self._pipeline(tables, item, meta, batch_at, s)
      if self.dir.writable:
        for bad, _ in skipped:
          self.dir.quarantine(bad)
      state = TrainState(item["params"], item["opt_state"], tables, pending, lookups, item["step"])
      return Restored(state, s, meta, tuple(skipped))
    reasons = "; ".join(f"step {s}: {why}" for s, why in skipped)
    raise CheckpointCorruptError(
      f"no intact checkpoint in {self.directory!r} ({reasons}). Restore "
      "the directory from a backup, or move it away to train from "
      "scratch."
    )

  def _old_layout(self, name: str, meta: dict) -> RowLayout | None:
    """The saved layout of table `name`, or None if it is this trainer's."""
    info = meta["tables"][name]
    old = RowLayout(info["num_rows"], meta["num_shards"], info["layout"])
    return None if old == self.trainer.emb.logical_layout(name) else old

  def _target(self, template: TrainState, meta: dict) -> dict:
    """What orbax restores into: this mesh's shardings where the layout is
    unchanged, host arrays of the saved layout where it changed."""
    tr = self.trainer
    tables = {}
    for name, ts in tr.emb.member_states(template.tables).items():
      old = self._old_layout(name, meta)
      if old is None:
        tables[name] = jax.tree.map(_abstract, _table_dict(ts))
        continue
      spec = tr.emb.logical_spec(name)
      specs = spec.optimizer.slot_specs()
      tables[name] = {
        "table": np.zeros((old.num_physical_rows,) + ts.table.shape[1:], ts.table.dtype),
        "slots": {
          k: np.zeros(
            specs[k].shape_for(old.num_physical_rows, spec.dim, old.rows_per_shard), v.dtype
          )
          for k, v in ts.slots.items()
        },
        "step": np.zeros((), np.int32),
      }
    pending, lookup_acts = {}, {}
    for name, ctx in tr.contexts:
      names, shapes = _token_layout(ctx, meta["batch_shapes"])
      grads = {
        n: jax.ShapeDtypeStruct((*shape, ctx.emb_width), jnp.float32, sharding=tr.emb.sharding())
        for n, shape in zip(names, shapes)
      }
      flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=tr.emb.sharding(rows=False))
      pending.update(
        (t, {"pending": flag, "grads": g}) for t, g in _per_table(tr, name, grads).items()
      )
      lookup_acts.update(
        _per_table(tr, name, jax.tree.map(_abstract, dict(template.lookups[name].acts)))
      )
    return {
      "params": jax.tree.map(_abstract, template.params),
      "opt_state": jax.tree.map(_abstract, template.opt_state),
      "tables": tables,
      "pending": pending,
      "lookup_acts": lookup_acts,
      "step": _abstract(template.step),
    }

  def _table(self, name: str, meta: dict, d: dict) -> TableState:
    """A restored table on this mesh, resharded if its layout changed."""
    old = self._old_layout(name, meta)
    if old is None:
      return TableState(d["table"], dict(d["slots"]), d["step"])
    emb = self.trainer.emb
    new = emb.logical_layout(name)
    slots = state_lib.reshard_slots(emb.logical_spec(name), old, new, d["slots"])
    return TableState(
      jax.device_put(old.reshard(np.asarray(d["table"]), new), emb.sharding()),
      {k: jax.device_put(v, emb.sharding()) for k, v in slots.items()},
      jax.device_put(jnp.asarray(d["step"], jnp.int32), emb.sharding(rows=False)),
    )

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
      members = _members(tr, name)
      started = async_emb.lookup_start(ctx, tables[name].table, ctx.table_inputs(next_batch["ids"]))
      lookups[name] = started._replace(
        acts={k: v for t in members for k, v in item["lookup_acts"][t].items()}
      )
      if tr.config.exact or step == 0:
        pending[name] = async_emb.empty_gradient_update(ctx)
        continue
      # The members of a stack were saved with the same pending flag.
      flag = item["pending"][members[0]]["pending"]
      grads = {k: v for t in members for k, v in item["pending"][t]["grads"].items()}
      names, _ = _token_layout(ctx, meta["batch_shapes"])
      routed = programs.plan(ctx.sharded_table, tuple(pending_batch["ids"][n] for n in names))
      pending[name] = async_emb.AsyncEmbGradientUpdate.from_residuals(
        routed, _to_devices(grads, names, ctx.group_size, tr.emb.sharding()), flag, ctx.identity
      )
    return pending, lookups

  def _check_compatible(self, meta: dict, batch, step: int) -> None:
    """Refuses a checkpoint of other tables, optimizers, batch shapes or
    pipeline than this trainer's (each would restore wrongly shaped state,
    or right-shaped state that means something else)."""
    tr = self.trainer
    where = f"checkpoint step {step} in {self.directory!r}"
    for t in tr.emb.tables:
      saved = meta["tables"].get(t.name)
      want = {"num_rows": t.num_rows, "dim": t.dim, "dtype": str(np.dtype(t.dtype))}
      if saved is None or any(saved[k] != v for k, v in want.items()):
        raise CheckpointMismatchError(
          f"{where} has table {t.name!r} as {saved}, but the trainer's is "
          f"{want}; restore with the same table specs, or use a new "
          "checkpoint directory."
        )
      opt = _optimizer_meta(t.optimizer)
      if "optimizer" in saved and any(saved[k] != v for k, v in opt.items()):
        raise CheckpointMismatchError(
          f"{where} trained table {t.name!r} with {saved['optimizer']} "
          f"(slots {saved['slots']}), but the trainer's optimizer is "
          f"{opt['optimizer']} (slots {opt['slots']}); resume with the "
          "optimizer the checkpoint was written with, or use a new "
          "checkpoint directory."
        )
    shapes = {k: list(token_shape(v)) for k, v in sorted(batch["ids"].items())}
    if any(shapes.get(k) != v for k, v in meta["batch_shapes"].items()):
      raise CheckpointMismatchError(
        f"{where} was written for batches of ids shaped "
        f"{dict(sorted(meta['batch_shapes'].items()))}, but the batches now "
        f"are {shapes}; "
        "resume with the batch size the checkpoint was written with, or "
        "use a new checkpoint directory."
      )
    if (meta["use_async_emb"], meta["exact"]) != (tr.config.use_async_emb, tr.config.exact):
      raise CheckpointMismatchError(
        f"{where} was written by the "
        f"use_async_emb={meta['use_async_emb']}, exact={meta['exact']} "
        "pipeline; restore it with the same TrainConfig."
      )
