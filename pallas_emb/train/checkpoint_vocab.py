"""Checkpoints of tables with dynamic vocabularies: the id maps, their
metadata and sketches saved and restored with the tables.

For the synchronous API (`ShardedEmbedding.admit` / `lookup` /
`apply_gradients`), whose state is two dicts, `tables` (`TableState`s) and
`vocabs` (`pallas_emb.dynamic.VocabState`s). Steps are written through
`CheckpointDir`, so every array is checksummed and verified as it is read
back, as the `Checkpointer` of a `Trainer` does.

Restored onto the same mesh, a run continues bit for bit as if never
stopped. Onto another shard count the maps are rebuilt: an id's owner is its
key modulo the shard count, so every resident id is re-inserted into its new
owner's window (`sharding.id_map_reshard`) and its table row and slots move
with it, on the host. Its count and last step are kept; the sketch of ids
not yet admitted starts empty; an id that finds no free slot in its new
window is dropped, and counted in `VocabCheckpointer.resharded`. Resharded,
a run goes on from the same resident ids and rows, not bit for bit: new rows
are drawn from their new row numbers. A checkpoint written before padded
storage (`pallas_emb.packing.padded_width`) holds rows of widths that pad
unpadded; they are padded as they are restored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from pallas_emb import dynamic, packing
from pallas_emb import state as state_lib
from pallas_emb.dynamic import VocabState
from pallas_emb.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from pallas_emb.state import TableState
from pallas_emb.train.checkpoint_dir import CheckpointDir, StepUnreadable
from sharding import id_map, id_map_reshard, map_slots
from sharding.id_map import IdMap
from sharding.layout import RowLayout

# The checkpoint's maps place slots on rows as `sharding.map_slots` spreads
# them; checkpoints written before say nothing: their slot j was row j, and
# on an uneven layout they are re-inserted when restored.
SPREAD_SLOTS = "spread_map_slots"


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

  Attributes:
    resharded: after a restore onto another shard count, table name ->
      {"kept": resident ids re-inserted, "dropped": ids that found no slot};
      empty otherwise.

  Raises:
    CheckpointDirError: the directory cannot be written (unless read_only).
  """

  def __init__(self, directory: str, emb, max_to_keep: int = 3, read_only: bool = False):
    self.emb = emb
    self.dir = CheckpointDir(directory, max_to_keep=max_to_keep, writable=not read_only)
    self.resharded: dict[str, dict[str, int]] = {}

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
          "layout": g.spec.layout,
        }
        for g in self.emb.groups
      },
    }

  def save(self, step: int, tables, vocabs, extra: Mapping[str, Any] | None = None) -> int:
    """Writes `tables` and `vocabs` as checkpoint `step` (blocking until
    durable); `extra`: JSON-serialisable metadata (e.g. the data position)."""
    self.emb.check_on_mesh((tables, vocabs), "the tables or vocabularies")
    meta = {
      **self._meta(),
      state_lib.PADDED_ROWS: True,
      SPREAD_SLOTS: True,
      "extra": dict(extra or {}),
    }
    self.dir.write(step, _item(tables, vocabs), meta)
    return step

  def restore(self, tables, vocabs, step: int | None = None):
    """The newest intact checkpoint (or `step`), shaped and placed like the
    templates `tables`, `vocabs` (e.g. from `init`, `init_vocabularies`).

    Returns:
      (tables, vocabs, extra).

    Raises:
      CheckpointError: there is no checkpoint.
      CheckpointMismatchError: written for other tables or vocabularies.
      CheckpointCorruptError: the step does not read back intact.
    """
    steps = self.dir.steps()
    if not steps:
      raise CheckpointError(f"no checkpoint to restore in {self.dir.path!r}.")
    step = steps[0] if step is None else step
    self.resharded = {}
    try:
      meta = self.dir.read_meta(step)
      want = self._meta()
      if meta.get("tables") != want["tables"]:
        raise CheckpointMismatchError(
          f"checkpoint step {step} in {self.dir.path!r} was written for {meta.get('tables')}, "
          f"but this embedding has {want['tables']}; restore with the same table specs, or "
          "use a new checkpoint directory."
        )
      target = jax.tree.map(_abstract, _item(tables, vocabs))
      if meta["num_shards"] != want["num_shards"]:
        stacks = [g.name for g in self.emb.groups if g.members is not None]
        if stacks:
          # A stack's member offsets depend on the shard count.
          raise CheckpointMismatchError(
            f"checkpoint step {step} in {self.dir.path!r} was written on {meta['num_shards']} "
            f"shards and this embedding has {want['num_shards']}, with stacked tables "
            f"{stacks}: this checkpointer reshards unstacked tables only; restore on "
            f"{meta['num_shards']} shards, or save with stacking off."
          )
        target = self._saved_shapes(target, meta["num_shards"])
      unpadded = self._unpadded(meta)
      for name in unpadded:
        old, _ = self._layouts(name, meta["num_shards"])
        target["tables"][name] = state_lib.unpadded_state(self.emb.table_spec(name), old)
      item = self.dir.read_state(step, target, meta)
    except StepUnreadable as e:
      raise CheckpointCorruptError(
        f"checkpoint step {step} in {self.dir.path!r} is not intact: {e}."
      ) from None
    for name in unpadded:
      item["tables"][name] = self._pad(name, item["tables"][name], meta["num_shards"])
    spread = meta.get(SPREAD_SLOTS, False)
    if meta["num_shards"] != want["num_shards"] or not (spread or self._even(meta["num_shards"])):
      item = self._reshard(item, meta["num_shards"], spread)
    return (
      {k: TableState(d["table"], dict(d["slots"]), d["step"]) for k, d in item["tables"].items()},
      {k: VocabState(IdMap(**d["map"]), d["key"]) for k, d in item["vocabs"].items()},
      meta["extra"],
    )

  def _even(self, num_shards: int) -> bool:
    """Whether every dynamic table's map slots are its rows in order on
    `num_shards` shards (an even layout), spread or not."""
    return all(
      map_slots.max_gap(self._layouts(name, num_shards)[0]) == 0
      for name in self.emb.dynamic_tables()
    )

  def _unpadded(self, meta: dict) -> list[str]:
    """The physical tables saved before padded storage, unpadded."""
    return [
      g.name for g in self.emb.groups if state_lib.saved_unpadded(meta, self.emb.table_spec(g.name))
    ]

  def _pad(self, name: str, d: dict, saved_shards: int) -> dict:
    """Table `name` read unpadded -> stored as today (host arrays, to be
    resharded, when the shard count changed; else placed on this mesh)."""
    old, new = self._layouts(name, saved_shards)
    table, slots = state_lib.pad_unpadded(self.emb.table_spec(name), old, d["table"], d["slots"])
    if old.num_shards != new.num_shards:
      return {"table": table, "slots": slots, "step": d["step"]}
    return self._place(name, table, slots, d["step"])

  def _layouts(self, name: str, saved_shards: int) -> tuple[RowLayout, RowLayout]:
    return layouts(self.emb, name, saved_shards)

  def _saved_shapes(self, target: dict, saved_shards: int) -> dict:
    """Host arrays shaped as written on `saved_shards` shards."""
    out = {"tables": {}, "vocabs": {}}
    for name, d in target["tables"].items():
      spec = self.emb.table_spec(name)
      old, _ = self._layouts(name, saved_shards)
      n, rps = old.num_physical_rows, old.rows_per_shard
      specs = spec.optimizer.slot_specs()
      out["tables"][name] = {
        "table": np.zeros(packing.table_shape(n, spec.dim, spec.dtype, rps), d["table"].dtype),
        "slots": {
          k: np.zeros(specs[k].shape_for(n, spec.dim, rps), v.dtype) for k, v in d["slots"].items()
        },
        "step": np.zeros((), np.int32),
      }
    for name in target["vocabs"]:
      out["vocabs"][name] = saved_vocab(self.emb, name, saved_shards)
    return out

  def _reshard(self, item: dict, saved_shards: int, spread: bool = True) -> dict:
    """`item` read as written on `saved_shards` shards, rebuilt for this
    mesh: each map re-inserted, each resident row and its slots moved, each
    static table resharded by its layout. `spread`: the saved maps' slots
    are rows as `sharding.map_slots` spreads them (False: slot j was row j,
    as written before that)."""
    tables, vocabs = {}, {}
    for name, ts in item["tables"].items():
      old, new = self._layouts(name, saved_shards)
      if name in item["vocabs"]:
        tables[name], vocabs[name] = self._reinsert(
          name, ts, item["vocabs"][name], old, new, spread
        )
      else:
        spec = self.emb.table_spec(name)
        stored = state_lib.reshard_table(spec, old, new, ts["table"])
        tables[name] = self._place(
          name, stored, state_lib.reshard_slots(spec, old, new, ts["slots"]), ts["step"]
        )
    return {"tables": tables, "vocabs": vocabs}

  def _place(self, name: str, table, slots, step) -> dict:
    return place_table(self.emb, name, table, slots, step)

  def _reinsert(
    self, name: str, ts: dict, vocab: dict, old: RowLayout, new: RowLayout, spread: bool
  ):
    """(table, vocab) of dynamic table `name` for layout `new` (`reinsert`)."""
    table, vocab, _, self.resharded[name] = reinsert(self.emb, name, ts, vocab, old, new, spread)
    return table, vocab


def layouts(emb, name: str, saved_shards: int) -> tuple[RowLayout, RowLayout]:
  """Physical table `name`'s layouts as written on `saved_shards` shards and
  now (a replicated table's one shard is the same on any mesh)."""
  new = emb.layout(name)
  sharded = new.num_shards == emb.num_shards
  return RowLayout(new.num_rows, saved_shards if sharded else 1, new.kind), new


def saved_vocab(emb, name: str, saved_shards: int) -> dict:
  """Host arrays shaped as dynamic table `name`'s map and key were written
  on `saved_shards` shards (what a restore reads them into)."""
  v, (old, _) = emb.table_spec(name).vocabulary, layouts(emb, name, saved_shards)
  rps = old.rows_per_shard
  empty = id_map.init_map(saved_shards, rps, v.depth(), v.width_for(rps))
  return {"map": empty._asdict(), "key": np.zeros((2,), np.uint32)}


def place_table(emb, name: str, table, slots, step) -> dict:
  """A table's host arrays, stored for `emb`'s mesh, placed on it."""
  rows = emb.table_sharding(name)
  return {
    "table": jax.device_put(table, rows),
    "slots": {k: jax.device_put(x, rows) for k, x in slots.items()},
    "step": jax.device_put(np.asarray(step, np.int32), emb.sharding(rows=False)),
  }


def reinsert(emb, name: str, ts: dict, vocab: dict, old: RowLayout, new: RowLayout, spread: bool):
  """Dynamic table `name` of `emb` moved from layout `old` to `new`.

  Its map is re-inserted (`id_map_reshard.reshard`), and each kept id's row
  and slots move from its slot's row under `old` to its new slot's row
  (`map_slots`: a slot is a row of its shard; `spread`: the saved slots
  were spread, else slot j was row j). Rows nobody holds are zeros with
  fresh slots (an id taking one resets it).

  Args:
    ts: {"table", "slots", "step"} host arrays stored as under `old`.
    vocab: {"map": `IdMap` fields, "key"} host arrays of `old`'s shards.

  Returns:
    (table dict and vocab dict placed on `emb`'s mesh, (old.num_rows,)
    int32 each old logical row's new logical row, -1 where its id was
    dropped or it held none, {"kept": ids kept, "dropped": ids dropped}).
  """
  spec = emb.table_spec(name)
  v, rps = spec.vocabulary, new.rows_per_shard
  sketch = id_map.init_map(new.num_shards, rps, v.depth(), v.width_for(rps)).sketch.shape
  m, source_slots, dropped = id_map_reshard.reshard(
    IdMap(**vocab["map"]), new, min(v.probe_limit, rps), sketch
  )
  kept = np.flatnonzero(source_slots >= 0)
  moved = map_slots.physical_rows(new, kept)
  source = source_slots[kept]
  if spread:
    source = map_slots.physical_rows(old, source)
  rows = packing.table_rows(np.asarray(ts["table"]), spec.dim, spec.dtype)
  table = np.zeros((new.num_physical_rows, rows.shape[1]), rows.dtype)
  table[moved] = rows[source]
  specs, slots = spec.optimizer.slot_specs(), {}
  for k, x in ts["slots"].items():
    flat = specs[k].as_rows(np.asarray(x), spec.dim)
    out = np.full((new.num_physical_rows, flat.shape[1]), specs[k].init, flat.dtype)
    out[moved] = flat[source]
    slots[k] = specs[k].as_stored(out, spec.dim, rps)
  row_map = np.full((old.num_rows,), -1, np.int32)
  row_map[old.logical_of(source)] = new.logical_of(moved)
  stored = packing.table_stored(table, spec.dim, spec.dtype, rps)
  where = IdMap(*(emb.sharding(rows=s == dynamic.ROWS) for s in dynamic.MAP_SPECS))
  placed = {
    "map": {k: jax.device_put(x, s) for (k, x), s in zip(m._asdict().items(), where)},
    "key": jax.device_put(np.asarray(vocab["key"], np.uint32), emb.sharding(rows=False)),
  }
  stats = {"kept": int(kept.size), "dropped": dropped}
  return place_table(emb, name, stored, slots, ts["step"]), placed, row_map, stats
