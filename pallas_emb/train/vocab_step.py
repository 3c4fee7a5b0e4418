"""The dynamic tables' half of a training step: raw ids become rows before
the static path, inside the step's own program.

A `Trainer` over an embedding with dynamic tables (`TableSpec(vocabulary=)`)
carries their maps in `TrainState.vocabs`. A batch gives those tables'
features raw ids (NumPy int64 or strings, -1 padding), or their (B, L, 2)
uint32 key words (`pe.vocab_keys`). The host turns raw ids into key words
before the step (`host_ids`: JAX has no int64 by default); in the step,
`admit` translates them, counting, inserting and evicting, and resets the
rows given a new id (`ShardedEmbedding.admit`, inlined), and the rows go on
to the lookup as the ids of a static table would. Evaluation translates
read-only (`read`).

When each batch is admitted:

* sync: batch t in step t, before its lookup;
* exact and async: these pipelines look batch t+1 up inside step t, on the
  table as step t leaves it, so step t admits batch t+1, after the table
  update that step applies (step t's gradient in exact, step t-1's in
  async) and before that lookup; `Trainer.init` admits batch 0. The map
  thus steps once per step, one batch ahead of the dense model. In async,
  step t's gradient is applied in step t+1, after batch t+1 was admitted:
  the map never gives a row used by the previous batch to a new id (its
  victims are never keys of the current or the previous map step), so the
  late update lands on the rows its ids still hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pallas_emb.dynamic import as_words
from pallas_emb.inputs import ids_of, with_ids


def dynamic_features(emb) -> tuple[str, ...]:
  """The features that read a dynamic table of `emb`."""
  return tuple(f.name for n in emb.dynamic_tables() for f in emb.features_of(n))


def host_ids(emb, batch):
  """`batch` with its dynamic features' ids as key words (host NumPy for raw
  ids; words pass through); None and batches without ids pass through."""
  if not emb.dynamic_tables() or not isinstance(batch, Mapping) or "ids" not in batch:
    return batch
  ids = dict(batch["ids"])
  for table in emb.dynamic_tables():
    vocab = emb.table_spec(table).vocabulary
    for f in emb.features_of(table):
      if f.name in ids:
        words = as_words(f.name, ids_of(ids[f.name]), vocab, emb.num_shards)
        ids[f.name] = with_ids(ids[f.name], words)
  return {**batch, "ids": ids}


def row_shaped(emb, ids: Mapping[str, Any]) -> dict[str, Any]:
  """`ids` with each dynamic feature's ids replaced by int32 zeros of the
  shape its rows will have (what the lookup's capacities are sized for)."""
  out = dict(ids)
  for name in dynamic_features(emb):
    if name in out:
      x = ids_of(out[name])
      if not hasattr(x, "shape"):  # a list; global device arrays are read by shape only
        x = np.asarray(x)
      shape = x.shape[:-1] if np.dtype(x.dtype) == np.uint32 else x.shape
      out[name] = with_ids(out[name], np.zeros(shape, np.int32))
  return out


def admit(emb, tables, vocabs, ids):
  """Training translation, in a traced step: (ids with rows for the
  dynamic features, tables, vocabs, table -> `VocabMetrics` as a dict)."""
  names = dynamic_features(emb)
  if not names:
    return ids, tables, vocabs, {}
  rows, tables, vocabs, metrics = emb.admit(tables, vocabs, {n: ids[n] for n in names})
  return {**ids, **rows}, tables, vocabs, {k: m._asdict() for k, m in metrics.items()}


def read(emb, vocabs, ids):
  """Read-only translation (evaluation): ids with rows for the dynamic
  features; nothing is counted, inserted or evicted."""
  names = dynamic_features(emb)
  if not names:
    return ids
  rows, _ = emb.read_rows(vocabs, {n: ids[n] for n in names})
  return {**ids, **rows}
