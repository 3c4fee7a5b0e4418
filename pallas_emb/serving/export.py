"""`export_serving`: trained tables and their id maps -> a serving artifact.

What is kept is what a lookup reads, at its logical shape: each logical table
in logical row order, unpadded, unpacked and unstacked, in its own dtype,
without optimizer slots; of a dynamic table only its resident ids' rows, and
its map as (raw id, row) pairs; each hashed feature's rule; and per feature
the lookup as `jax.export` programs (`program`). So the artifact is the size
of the logical tables (plus 12 bytes per resident id and a few kilobytes of
programs), whatever the training mesh, stacking or optimizer.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

import pallas_emb
from pallas_emb.errors import InputError
from pallas_emb.hashing import HashRule
from pallas_emb.serving import program
from pallas_emb.serving.artifact import Writer


def _check(emb, tables, vocabularies, features) -> None:
  emb.check_tables(tables, emb.table_names, slots=False)
  dynamic = emb.dynamic_tables()
  missing = [n for n in dynamic if not isinstance(vocabularies, Mapping) or n not in vocabularies]
  if missing:
    raise InputError(
      f"tables {missing} have dynamic vocabularies: pass their maps as "
      "vocabularies={name: VocabState} (what emb.admit returns), or the artifact "
      "could not find their ids."
    )
  if features is None:
    return
  if not isinstance(features, Mapping):
    raise InputError(
      f"features must be None or a mapping feature name -> HashRule, got {type(features).__name__}."
    )
  names = {f.name: f for f in emb.features}
  for name, rule in features.items():
    if name not in names:
      raise InputError(f"features names {name!r}, which is not a feature; they are {list(names)}.")
    if not isinstance(rule, HashRule):
      raise InputError(
        f"features[{name!r}] must be a pallas_emb.HashRule (the seed and pad its raw ids "
        f"were hashed with), got {rule!r}."
      )
    if names[name].table in dynamic:
      raise InputError(
        f"feature {name!r} reads dynamic table {names[name].table!r}, whose raw ids "
        "go through its id map, not a hash: drop it from features."
      )


def _logical(emb, tables, vocabularies) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
  """Logical table -> (its rows to keep, raw ids of a dynamic table's rows).
  Every process takes part (the host copies gather the shards)."""
  out = {}
  for spec in emb.tables:
    rows = emb.logical_table(tables, spec.name)
    raw = None
    if spec.vocabulary is not None:
      raw, resident = emb.resident_rows(vocabularies, spec.name)
      rows = rows[resident]
    out[spec.name] = (rows, raw)
  return out


def export_serving(
  emb,
  tables: Mapping[str, Any],
  path: str,
  *,
  vocabularies: Mapping[str, Any] | None = None,
  features: Mapping[str, HashRule] | None = None,
) -> str:
  """Writes a self-contained serving artifact of a trained embedding.

  The directory holds each logical table (no padding rows, packing,
  stacking or slots), each dynamic table's resident (raw id, row) pairs,
  each hashed feature's `HashRule`, one `jax.export` lookup program per
  feature and input form (CPU and TPU, no kernels: the XLA path) and
  `manifest.json` (features, tables, shapes, dtypes, versions, a SHA-256 per
  file, sealed). `load_serving` reads it with none of the training state.

  Call it on every process of a multi-process run (the tables are gathered
  collectively); process 0 writes the directory.

  Args:
    emb: the `ShardedEmbedding` the tables were trained with.
    tables: physical table name -> `TableState` (after the last update: with
      the async pipeline, `Trainer.flush` first).
    path: the artifact's directory: new, empty, or an earlier artifact (which
      is replaced whole, once the new one is written).
    vocabularies: dynamic table name -> `VocabState`; required when there
      are dynamic tables.
    features: feature name -> `HashRule` for features whose raw ids were
      hashed (recorded, for `ServingModel.hash_ids`).

  Returns:
    The artifact's absolute path.

  Raises:
    InputError: tables or maps that are missing or do not fit `emb`.
    CheckpointDirError: `path` holds other files, or cannot be written.
  """
  _check(emb, tables, vocabularies, features)
  kept = _logical(emb, tables, vocabularies)
  if jax.process_index() != 0:
    return os.path.abspath(path)
  writer = Writer(path)
  try:
    manifest = {
      "library_version": pallas_emb.__version__,
      "jax_version": jax.__version__,
      "num_shards": emb.num_shards,
      "tables": _write_tables(writer, emb, kept),
    }
    manifest["features"] = _write_features(writer, emb, manifest["tables"], features or {})
    writer.commit(manifest)
  except BaseException:
    writer.abort()
    raise
  return writer.path


def _write_tables(writer: Writer, emb, kept) -> dict[str, dict]:
  out = {}
  for i, spec in enumerate(emb.tables):
    rows, raw = kept[spec.name]
    entry = {
      "num_rows": spec.num_rows,
      "dim": spec.dim,
      "dtype": spec.dtype.name,
      "rows": writer.add_array(f"tables/{i}.bin", rows),
    }
    if raw is not None:
      entry["dynamic"] = {
        "seed": spec.vocabulary.seed,
        "ids": writer.add_array(f"maps/{i}.ids.bin", raw.astype(np.int64)),
        "rows": writer.add_array(f"maps/{i}.rows.bin", np.arange(raw.shape[0], dtype=np.int32)),
      }
    out[spec.name] = entry
  return out


def _write_features(writer: Writer, emb, tables: dict, rules: Mapping[str, HashRule]) -> dict:
  """Each feature's entry; features of one kind share their programs' files."""
  files: dict[tuple, str] = {}
  out = {}
  for f in emb.features:
    t = tables[f.table]
    p = program.FeatureProgram(f.combiner, t["dtype"], "dynamic" in t, emb.num_shards)
    forms = {}
    for form in p.forms():
      if (p, form) not in files:
        files[p, form] = writer.add(
          f"programs/{len(files)}.{form}.jaxexport", program.export(p, form)
        )
      forms[form] = files[p, form]
    rule = rules.get(f.name)
    out[f.name] = {
      "table": f.table,
      "program": dataclasses.asdict(p),
      "programs": forms,
      "hashing": None if rule is None else dataclasses.asdict(rule),
    }
  return out
