"""The main job's dynamic vocabularies (--vocabulary=dynamic): which tables
take raw ids, and batches whose ids for them are key words.

The tables every one of whose features reads raw user or item ids (the
data's `raw_inputs`) become dynamic: `--capacity` rows each (default: the static table's),
admitting an id after `--admit_after` occurrences and evicting by
`--policy`. Their features' ids are the data's raw ids (MovieLens' own user
and item ids; the synthetic log's ids), turned into (B, L, 2) uint32 key
words on the host as each batch is read (`KeyWordInputs`), so the feeder
places words, not int32 ids, on the devices.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from absl import app

from pallas_emb.job.feature_inputs import BatchMap
from pallas_emb.job.flags import FLAGS
from pallas_emb.vocabulary import DynamicVocabulary, vocab_keys


def vocabulary() -> DynamicVocabulary:
  """The flags' vocabulary."""
  return DynamicVocabulary(admit_after=FLAGS.admit_after, policy=FLAGS.policy)


def check_flags() -> None:
  """Refuses what --vocabulary=dynamic does not support yet, before anything
  compiles."""
  if FLAGS.vocabulary != "dynamic":
    return
  if FLAGS.workload == "dlrm":
    raise app.UsageError(
      "--vocabulary=dynamic does not support --workload=dlrm (its ids are row ids, not raw "
      "ids); use --workload=default."
    )
  if FLAGS.capacity < 0:
    raise app.UsageError(f"--capacity={FLAGS.capacity} must be >= 0 (0: the static rows).")


def dynamic_tables(features, sources: Mapping[str, str], raw_inputs) -> dict[str, int]:
  """Table -> its static rows, of the tables whose every feature reads one
  of `raw_inputs` (`sources`: feature -> dataset input)."""
  out = {}
  for f in features:
    out.setdefault(f.table, (f.num_rows, []))[1].append(sources.get(f.name, f.name))
  return {t: rows for t, (rows, srcs) in out.items() if all(s in raw_inputs for s in srcs)}


def table_options(dataset, features, sources: Mapping[str, str]) -> dict[str, dict]:
  """`TableSpec` arguments of the dynamic tables (empty for --vocabulary=static).

  Raises:
    UsageError: --vocabulary=dynamic on data with no raw-id table.
  """
  if FLAGS.vocabulary != "dynamic":
    return {}
  tables = dynamic_tables(features, sources, getattr(dataset, "raw_inputs", ()))
  if not tables:
    raise app.UsageError(
      f"--vocabulary=dynamic: {FLAGS.data} has no table read only by raw user or item ids; "
      "use --vocabulary=static."
    )
  vocab = vocabulary()
  return {
    t: {"vocabulary": vocab, "num_rows": FLAGS.capacity or rows} for t, rows in tables.items()
  }


class KeyWordInputs(BatchMap):
  """`inputs` (a dataset, or `FeatureInputs`) whose `words` features' ids
  are the key words of their raw ids (`dataset.raw_ids(input, ids)` where
  the dataset has it, else the ids themselves); other attributes are the
  inputs'.

  Args:
    inputs: what the model's features read.
    dataset: the data source (its `raw_ids`).
    words: feature -> (its dataset input, the `DynamicVocabulary` of its table).
  """

  def __init__(self, inputs, dataset, words: Mapping[str, tuple[str, DynamicVocabulary]]):
    self.source, self.dataset, self.words = inputs, dataset, dict(words)

  def __getattr__(self, name):  # the inputs' features, sizes, window
    if name == "source":  # not set yet (a copy being made): no recursion
      raise AttributeError(name)
    return getattr(self.source, name)

  def _map(self, batch: dict) -> dict:
    raw_ids = getattr(self.dataset, "raw_ids", lambda _, ids: np.asarray(ids, np.int64))
    ids = dict(batch["ids"])
    for feature, (source, vocab) in self.words.items():
      ids[feature] = vocab_keys(raw_ids(source, np.asarray(ids[feature])), vocab)
    return {**batch, "ids": ids}
