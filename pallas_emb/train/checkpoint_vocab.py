"""Checkpoints of tables with dynamic vocabularies: the id maps, their
metadata and sketches saved and restored with the tables.

For the synchronous API (`ShardedEmbedding.admit` / `lookup` /
`apply_gradients`), whose state is two dicts, `tables` (`TableState`s) and
`vocabs` (`pallas_emb.dynamic.VocabState`s). Steps are written through
`CheckpointDir`, so every array is checksummed and verified as it is read
back, as the `Checkpointer` of a `Trainer` does.

Restored onto the same mesh, a run continues bit for bit as if never
stopped. The maps are placed by shard (an id's owner is its key modulo the
shard count), so a checkpoint restores only onto the shard count it was
written with: another one is refused (`CheckpointMismatchError`) before any
array is read. Resharding would re-insert every resident id and move its
row; it is not implemented.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from pallas_emb.dynamic import VocabState
from pallas_emb.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from pallas_emb.state import TableState
from pallas_emb.train.checkpoint_dir import CheckpointDir, StepUnreadable
from sharding.id_map import IdMap


def _abstract(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _item(tables: Mapping[str, TableState], vocabs: Mapping[str, VocabState]) -> dict:
  return {
    "tables": {
      k: {"table": v.table, "slots": dict(v.slots), "step": v.step} for k, v in tables.items()
    },
    "vocabs": {k: {"map": v.map._asdict(), "key": v.key} for k, v in vocabs.items()},
  }


class VocabCheckpointer:
  """Saves and restores `(tables, vocabs)` of an embedding in `directory`.

  Args:
    directory: where step directories go (created; it must be writable).
    emb: the `ShardedEmbedding` whose states are saved.
    max_to_keep: checkpoints kept.
    read_only: only restore.

  Raises:
    CheckpointDirError: the directory cannot be written (unless read_only).
  """

  def __init__(self, directory: str, emb, max_to_keep: int = 3, read_only: bool = False):
    self.emb = emb
    self.dir = CheckpointDir(directory, max_to_keep=max_to_keep, writable=not read_only)

  def _meta(self) -> dict:
    return {
      "num_shards": self.emb.num_shards,
      "tables": {
        g.name: {
          "num_rows": g.spec.num_rows,
          "dim": g.spec.dim,
          "dtype": str(np.dtype(g.spec.dtype)),
          "optimizer": type(g.spec.optimizer).__name__,
          "vocabulary": repr(g.spec.vocabulary),
        }
        for g in self.emb.groups
      },
    }

  def save(self, step: int, tables, vocabs, extra: Mapping[str, Any] | None = None) -> int:
    """Writes `tables` and `vocabs` as checkpoint `step` (blocking until
    durable); `extra`: JSON-serialisable metadata (e.g. the data position)."""
    self.emb.check_on_mesh((tables, vocabs), "the tables or vocabularies")
    self.dir.write(step, _item(tables, vocabs), {**self._meta(), "extra": dict(extra or {})})
    return step

  def restore(self, tables, vocabs, step: int | None = None):
    """The newest intact checkpoint (or `step`), shaped and placed like the
    templates `tables`, `vocabs` (e.g. from `init`, `init_vocabularies`).

    Returns:
      (tables, vocabs, extra).

    Raises:
      CheckpointError: there is no checkpoint.
      CheckpointMismatchError: written for other tables, vocabularies or
        another shard count.
      CheckpointCorruptError: the step does not read back intact.
    """
    steps = self.dir.steps()
    if not steps:
      raise CheckpointError(f"no checkpoint to restore in {self.dir.path!r}.")
    step = steps[0] if step is None else step
    try:
      meta = self.dir.read_meta(step)
      want = self._meta()
      if {k: meta.get(k) for k in want} != want:
        raise CheckpointMismatchError(
          f"checkpoint step {step} in {self.dir.path!r} was written for {meta.get('tables')} "
          f"on {meta.get('num_shards')} shards, but this embedding has {want['tables']} on "
          f"{want['num_shards']}; restore with the same specs and shard count (dynamic "
          "vocabularies do not reshard), or use a new checkpoint directory."
        )
      target = jax.tree.map(_abstract, _item(tables, vocabs))
      item = self.dir.read_state(step, target, meta)
    except StepUnreadable as e:
      raise CheckpointCorruptError(
        f"checkpoint step {step} in {self.dir.path!r} is not intact: {e}."
      ) from None
    return (
      {k: TableState(d["table"], dict(d["slots"]), d["step"]) for k, d in item["tables"].items()},
      {k: VocabState(IdMap(**d["map"]), d["key"]) for k, d in item["vocabs"].items()},
      meta["extra"],
    )
