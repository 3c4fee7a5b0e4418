"""Checkpoints of a `TrainState` with orbax, the pending update included.

A preemption loses nothing: besides tables, slots, dense parameters, their
optimizer state and the step, a checkpoint holds the deferred embedding
gradient of the async pipeline and the started lookup of the next batch
(`checkpoint_pending`). Nothing saved depends on the device count:

* tables and slots are saved per logical table, each in the physical layout
  it would have alone (whether or not it is stacked with others, see
  `pallas_emb.stacking`), with its own step, together with that layout, and
  restored through `RowLayout.reshard` when the shard count changed: a
  checkpoint restores with stacking on or off and under any grouping; rows
  narrower than 128 lanes are saved packed as that layout's shards pack
  them (`pallas_emb.packing`) and repacked for the new layout on restore;
  rows of widths that pad are saved padded, and a checkpoint written
  before padded storage (no "padded_rows" in its metadata) is padded as
  it is restored;
* the pending update and the lookup's embeddings are saved per logical
  table and feature, in batch order; routing plans are not saved;
* dynamic tables' id maps are saved with them (`checkpoint_maps`: on
  another shard count they are re-inserted, and rows move with their ids).

A trainer of the same pipeline and batch shapes restores the pending update
as it was: a run restored onto the same mesh continues bit for bit as if
never stopped. A trainer of another batch size or pipeline (sync, exact)
gets the pending update applied at restore: it continues as a run that
flushed at that step.

Every step is verified as it is read back (`checkpoint_dir`): restore takes
the newest step that reads back intact, says which newer ones it skipped and
why, and raises `CheckpointCorruptError` when none does. A checkpoint
written with other tables or optimizers is refused with
`CheckpointMismatchError` before any array is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import packing
from pallas_emb import state as state_lib
from pallas_emb.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from pallas_emb.inputs import token_shape
from pallas_emb.state import TableState
from pallas_emb.train import checkpoint_maps, checkpoint_pending, vocab_step
from pallas_emb.train.checkpoint_dir import CheckpointDir, StepUnreadable
from pallas_emb.train.step import Trainer, TrainState
from sharding.layout import RowLayout

__all__ = ["CheckpointError", "Checkpointer", "Restored"]

log = logging.getLogger("pallas_emb.checkpoint")


def _table_dict(ts: TableState) -> dict:
  return {"table": ts.table, "slots": dict(ts.slots), "step": ts.step}


def _abstract(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


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
      MeshMismatchError: `state` is not on this trainer's mesh.
    """
    tr = self.trainer
    tr.emb.check_on_mesh(state, "the train state")
    step = int(jax.device_get(state.step))
    pending, lookup_acts = checkpoint_pending.save_items(tr, state, batch_shapes)
    item = {
      "params": state.params,
      "opt_state": state.opt_state,
      "tables": {k: _table_dict(v) for k, v in tr.emb.member_states(state.tables).items()},
      "pending": pending,
      "lookup_acts": lookup_acts,
      "step": state.step,
    }
    if state.vocabs:  # absent otherwise, as in checkpoints written before maps were saved
      item["vocabs"] = checkpoint_maps.save_item(state.vocabs)
    meta = {
      checkpoint_maps.META: sorted(state.vocabs),
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
      # The pending update's token ids are saved (it can be applied at
      # restore); earlier checkpoints lack them.
      "pending_ids": True,
      state_lib.PADDED_ROWS: True,
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
        device arrays or host arrays), of this trainer's batch size. The
        started lookup is of `batch_at(step)`; restored as saved (same
        pipeline and batch shapes), the pending update is routed again
        from `batch_at(step - 1)`.
      step: restore this step or fail; default: the newest intact one.

    Raises:
      CheckpointError: there is no checkpoint.
      CheckpointMismatchError: tables or optimizers differ from the
        trainer's.
      CheckpointCorruptError: no step (or not `step`) reads back intact.
      MeshMismatchError: `template` is not on this trainer's mesh.
    """
    tr = self.trainer
    tr.emb.check_on_mesh(template, "the template state")
    candidates = self.dir.steps() if step is None else [step]
    if not candidates:
      raise CheckpointError(f"no checkpoint to restore in {self.directory!r}.")
    skipped = []
    for s in candidates:
      try:
        meta = self.dir.read_meta(s)
        self._check_compatible(meta, s)
        # Rows that move (dynamic tables on another shard count) take the
        # pending update with them: it is applied at restore.
        as_saved = self._as_saved(meta, batch_at(s)) and not checkpoint_maps.resharded(tr.emb, meta)
        item = self.dir.read_state(s, self._target(template, meta, as_saved, s), meta)
      except StepUnreadable as e:
        skipped.append((s, str(e)))
        log.warning("checkpoint step %d in %s is not intact, skipped: %s", s, self.directory, e)
        continue
      vocabs, moved, row_maps = checkpoint_maps.restore(tr.emb, item, meta)
      tables = tr.emb.from_member_states(
        {
          name: TableState(**moved[name]) if name in moved else self._table(name, meta, d)
          for name, d in item["tables"].items()
        }
      )
      translate = checkpoint_maps.translator(tr.emb, vocabs)
      if as_saved:
        pending, lookups = checkpoint_pending.restore_as_saved(
          tr, tables, item, meta["batch_shapes"], batch_at, s, translate
        )
      else:
        self._check_flushable(meta, item, s)
        saved = checkpoint_maps.move_pending(tr.emb, item["pending"], row_maps)
        tables = checkpoint_pending.apply_saved(tr.emb, tables, saved)
        pending, lookups = checkpoint_pending.restore_flushed(tr, tables, batch_at, s, translate)
      if self.dir.writable:
        for bad, _ in skipped:
          self.dir.quarantine(bad)
      state = TrainState(
        item["params"], item["opt_state"], tables, pending, lookups, item["step"], vocabs
      )
      return Restored(state, s, meta, tuple(skipped))
    reasons = "; ".join(f"step {s}: {why}" for s, why in skipped)
    raise CheckpointCorruptError(
      f"no intact checkpoint in {self.directory!r} ({reasons}). Restore "
      "the directory from a backup, or move it away to train from "
      "scratch."
    )

  def _old_layout(self, name: str, meta: dict) -> RowLayout | None:
    """The saved layout of table `name`, or None if it is this trainer's
    and stored as today."""
    info = meta["tables"][name]
    old = RowLayout(info["num_rows"], meta["num_shards"], info["layout"])
    if self._unpadded(name, meta):
      return old
    return None if old == self.trainer.emb.logical_layout(name) else old

  def _unpadded(self, name: str, meta: dict) -> bool:
    """Whether table `name` was saved before padded storage, unpadded."""
    return state_lib.saved_unpadded(meta, self.trainer.emb.logical_spec(name))

  def _target(self, template: TrainState, meta: dict, as_saved: bool, step: int) -> dict:
    """What orbax restores into: this mesh's shardings where the layout is
    unchanged, host arrays of the saved layout where it changed; the pending
    update on this mesh when restored as saved, else as host arrays."""
    tr = self.trainer
    tables = {}
    for name, ts in tr.emb.member_states(template.tables).items():
      old = self._old_layout(name, meta)
      if old is None:
        tables[name] = jax.tree.map(_abstract, _table_dict(ts))
        continue
      spec = tr.emb.logical_spec(name)
      specs = spec.optimizer.slot_specs()
      if self._unpadded(name, meta):
        tables[name] = state_lib.unpadded_state(spec, old)
        continue
      tables[name] = {
        "table": np.zeros(
          packing.table_shape(old.num_physical_rows, spec.dim, spec.dtype, old.rows_per_shard),
          ts.table.dtype,
        ),
        "slots": {
          k: np.zeros(
            specs[k].shape_for(old.num_physical_rows, spec.dim, old.rows_per_shard), v.dtype
          )
          for k, v in ts.slots.items()
        },
        "step": np.zeros((), np.int32),
      }
    if as_saved:
      pending, lookup_acts = checkpoint_pending.device_targets(tr, template, meta["batch_shapes"])
      if not meta.get("pending_ids"):
        for v in pending.values():
          del v["ids"]
    else:
      host = self.dir.host_target(step)
      pending, lookup_acts = host.get("pending", {}), host.get("lookup_acts", {})
    target = {
      "params": jax.tree.map(_abstract, template.params),
      "opt_state": jax.tree.map(_abstract, template.opt_state),
      "tables": tables,
      "pending": pending,
      "lookup_acts": lookup_acts,
      "step": _abstract(template.step),
    }
    if meta.get(checkpoint_maps.META):
      target["vocabs"] = checkpoint_maps.target(tr.emb, template.vocabs, meta)
    return target

  def _table(self, name: str, meta: dict, d: dict) -> TableState:
    """A restored table on this mesh, resharded if its layout changed."""
    old = self._old_layout(name, meta)
    if old is None:
      return TableState(d["table"], dict(d["slots"]), d["step"])
    emb = self.trainer.emb
    new = emb.logical_layout(name)
    spec = emb.logical_spec(name)
    table, slots = d["table"], d["slots"]
    if self._unpadded(name, meta):
      table, slots = state_lib.pad_unpadded(spec, old, table, slots)
    slots = state_lib.reshard_slots(spec, old, new, slots)
    return TableState(
      jax.device_put(state_lib.reshard_table(spec, old, new, table), emb.sharding()),
      {k: jax.device_put(v, emb.sharding()) for k, v in slots.items()},
      jax.device_put(jnp.asarray(d["step"], jnp.int32), emb.sharding(rows=False)),
    )

  def _as_saved(self, meta: dict, batch) -> bool:
    """Whether the pending update restores as saved: the same pipeline and
    batch shapes (otherwise it is applied at restore)."""
    cfg = self.trainer.config
    ids = vocab_step.row_shaped(self.trainer.emb, batch["ids"])  # key words: their rows' shape
    shapes = {k: list(token_shape(v)) for k, v in ids.items()}
    return (meta["use_async_emb"], meta["exact"]) == (cfg.use_async_emb, cfg.exact) and all(
      shapes.get(k) == v for k, v in meta["batch_shapes"].items()
    )

  def _check_flushable(self, meta: dict, item: dict, step: int) -> None:
    """Checkpoints written before the pending update's token ids were saved
    restore a pending update only as saved."""
    if meta.get("pending_ids") or not any(bool(v["pending"]) for v in item["pending"].values()):
      return
    raise CheckpointMismatchError(
      f"checkpoint step {step} in {self.directory!r} holds a pending update "
      f"of batches shaped {dict(sorted(meta['batch_shapes'].items()))} "
      f"(use_async_emb={meta['use_async_emb']}, exact={meta['exact']}) "
      "without its token ids (written by an earlier pallas_emb), so it can "
      "be applied only by the same pipeline and batch size: resume with "
      "those, or from a checkpoint written since."
    )

  def _check_compatible(self, meta: dict, step: int) -> None:
    """Refuses a checkpoint of other tables or optimizers than this
    trainer's (each would restore wrongly shaped state, or right-shaped
    state that means something else)."""
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
