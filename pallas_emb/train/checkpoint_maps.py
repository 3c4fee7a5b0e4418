"""The dynamic tables' id maps in a `Trainer` checkpoint
(`train.checkpoint.Checkpointer`).

Each dynamic table's map and key are saved beside the tables. Restored on
the same shard count they come back as saved, and a run continues bit for
bit. Restored on another shard count, each map is re-inserted for the new
shards, and its ids' rows and slots move with them
(`checkpoint_vocab.reinsert`). The pending update's rows, saved as logical
rows, move the same way, and the update is applied at restore, as a run
that flushed there would apply it. The sketch of ids not yet admitted starts
empty. An id whose new window is full is dropped.

A lookup that restore starts (the async pipelines' next batch) translates
its ids read-only with the restored maps (`train.vocab_step.read`). Those
ids were admitted before the checkpoint was written, so they read the rows
the saved run had.
"""

from __future__ import annotations

import jax
import numpy as np

from pallas_emb.dynamic import VocabState
from pallas_emb.train import vocab_step
from pallas_emb.train.checkpoint_vocab import layouts, reinsert, saved_vocab
from sharding.id_map import IdMap

META = "vocabularies"  # the dynamic tables whose maps a checkpoint holds


def save_item(vocabs) -> dict:
  """What a checkpoint holds of the maps: table -> {"map", "key"}."""
  return {k: {"map": v.map._asdict(), "key": v.key} for k, v in vocabs.items()}


def resharded(emb, meta: dict) -> bool:
  """Whether restoring moves the dynamic tables' rows (another shard count)."""
  return bool(meta.get(META)) and meta["num_shards"] != emb.num_shards


def target(emb, template_vocabs, meta: dict) -> dict:
  """What orbax restores the maps into: the template's placement on the same
  shard count, host arrays of the saved shards' shapes otherwise."""
  if not resharded(emb, meta):
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return jax.tree.map(abstract, save_item(template_vocabs))
  return {name: saved_vocab(emb, name, meta["num_shards"]) for name in meta[META]}


def restore(emb, item: dict, meta: dict):
  """(vocabs, tables, row maps) from a read checkpoint `item`: the maps as
  `VocabState`s; on another shard count also each dynamic table re-inserted
  (`TableState` fields, placed) and its old logical row -> new logical row
  (-1: dropped), else ({}, {}) for those."""
  if not resharded(emb, meta):
    saved = item.get("vocabs", {})
    return {k: VocabState(IdMap(**d["map"]), d["key"]) for k, d in saved.items()}, {}, {}
  vocabs, tables, row_maps = {}, {}, {}
  for name, d in item["vocabs"].items():
    old, new = layouts(emb, name, meta["num_shards"])
    table, vocab, row_maps[name], _ = reinsert(emb, name, item["tables"][name], d, old, new, True)
    tables[name] = table
    vocabs[name] = VocabState(IdMap(**vocab["map"]), vocab["key"])
  return vocabs, tables, row_maps


def move_pending(emb, pending: dict, row_maps: dict) -> dict:
  """The saved pending update's rows of each moved table mapped to their
  new rows (host arrays; -1 stays -1)."""
  out = dict(pending)
  for name, rows in row_maps.items():
    if name not in out:
      continue
    entry = dict(out[name])
    moved = {}
    for feature, ids in entry["ids"].items():
      ids = np.asarray(ids)
      moved[feature] = np.where(ids >= 0, rows[np.maximum(ids, 0)], -1).astype(np.int32)
    entry["ids"] = moved
    out[name] = entry
  return out


def translator(emb, vocabs):
  """ids -> ids with rows for the dynamic features (read-only), for the
  lookups restore starts."""
  if not vocabs:
    return lambda ids: ids
  return lambda ids: vocab_step.read(emb, vocabs, vocab_step.host_ids(emb, {"ids": ids})["ids"])
