"""`load_serving`: a serving artifact, checked and placed, as a `ServingModel`.

Loading reads the manifest and every file it names, checks each against its
SHA-256 before anything is used, and places the tables on one device or
row-sharded over a mesh. It needs no training state, optimizer or native
library: only the artifact, JAX and the host-side id conversions
(`requests`).

On a mesh, each table's rows are split over all of the mesh's devices
(padded with zero rows to a multiple of them, which no id reaches) and the
id maps are replicated; the exported programs, lowered for one device, are
partitioned by XLA for those shardings when first called.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_emb.errors import InputError, ServingArtifactError
from pallas_emb.hashing import HashRule
from pallas_emb.serving import artifact, program, requests
from pallas_emb.vocabulary import key_words


class ServingModel:
  """A loaded serving artifact: tables on devices, a lookup per feature.

  Attributes:
    path: the artifact's directory.
    manifest: its manifest (features, tables, shapes, versions, files).
    features: the feature names `lookup` takes.
    num_shards: S, the data shards of training: a `Ragged` request is packed
      for S (`pallas_emb.ragged(..., num_shards=S)`).
    mesh: the mesh the tables are sharded over, or None (one device).
  """

  def __init__(self, path: str, manifest: dict, tables, keys, programs, mesh):
    self.path, self.manifest, self.mesh = path, manifest, mesh
    self.features = tuple(manifest["features"])
    self.num_shards = int(manifest["num_shards"])
    self._tables, self._keys, self._programs = tables, keys, programs
    self._feature = {
      name: program.FeatureProgram(**f["program"]) for name, f in manifest["features"].items()
    }
    self._calls: dict[tuple[str, str], Any] = {}
    # The rows an id may read: the exported table's, before the loader's padding.
    self._rows = {name: np.int32(t["rows"]["shape"][0]) for name, t in manifest["tables"].items()}

  def __repr__(self) -> str:
    return f"ServingModel({self.path!r}, features={list(self.features)}, mesh={self.mesh})"

  def _table_of(self, feature: str) -> str:
    return self.manifest["features"][feature]["table"]

  def _seed(self, feature: str) -> int | None:
    dynamic = self.manifest["tables"][self._table_of(feature)].get("dynamic")
    return None if dynamic is None else dynamic["seed"]

  def lookup(self, ids: Mapping[str, Any]) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Embeddings of the features in `ids`, as the training lookup gives them.

    Args:
      ids: feature name -> its ids in any form the training lookup takes: a
        (B, L) integer array (-1 padding), `Weighted`, or `Ragged` packed for
        `num_shards`; for a dynamic table, raw ids (int64 or strings, -1
        padding) or their (..., 2) uint32 key words (`vocab_keys`).

    Returns:
      (acts, misses): feature -> (B, D) float32 pooled output, or (B, L, D)
      for a sequence; feature -> () int32 count of its ids (not padding) that
      got no row: ids outside the table, or raw ids not resident in a
      dynamic table's map, which read a zero row.
    """
    if not isinstance(ids, Mapping) or not ids:
      raise InputError(f"ids must be a non-empty mapping feature name -> ids, got {ids!r}.")
    acts, misses = {}, {}
    for name, x in ids.items():
      if name not in self._feature:
        raise InputError(f"no feature {name!r} in this artifact; its features are {self.features}.")
      form, args = requests.program_args(name, self._feature[name], x, self._seed(name))
      table = self._table_of(name)
      acts[name], misses[name] = self._call(name, form)(
        self._tables[table], self._keys.get(table, ()), self._rows[table], *args
      )
    return acts, misses

  def _call(self, feature: str, form: str):
    key = (feature, form)
    if key not in self._calls:
      self._calls[key] = jax.jit(
        self._programs[self.manifest["features"][feature]["programs"][form]].call
      )
    return self._calls[key]

  def hash_ids(self, raw: Mapping[str, Any]) -> dict[str, Any]:
    """Raw ids of hashed features -> their rows, by the `HashRule` the
    artifact records for each (other features pass through unchanged)."""
    out = dict(raw)
    for name, x in raw.items():
      rule = self.manifest["features"].get(name, {}).get("hashing")
      if rule is not None:
        num_rows = self.manifest["tables"][self._table_of(name)]["num_rows"]
        out[name] = HashRule(**rule).rows(x, num_rows)
    return out


def _auto(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """The mesh with Auto axes: the exported programs are partitioned by XLA,
  whichever axis types the caller's mesh has."""
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names)


def placed_rows(num_rows: int, parts: int) -> int:
  """A table's rows once placed over `parts` devices: a multiple of them,
  at least one row each (a symbolic size is at least 1)."""
  return max(-(-num_rows // parts) * parts, parts)


def _place_rows(rows: np.ndarray, mesh) -> jax.Array:
  """A table on the default device, or split by rows over every device of
  `mesh` (zero rows appended, `placed_rows`)."""
  pad = placed_rows(rows.shape[0], 1 if mesh is None else mesh.size) - rows.shape[0]
  if pad:
    rows = np.concatenate([rows, np.zeros((pad, *rows.shape[1:]), rows.dtype)])
  return jax.device_put(rows, None if mesh is None else NamedSharding(mesh, P(mesh.axis_names)))


def _place_keys(entry: dict, raw: np.ndarray, rows: np.ndarray, mesh) -> tuple:
  """A dynamic table's map as the program searches it: (hi, lo, row) sorted
  by 64-bit key, the sentinel last, replicated."""
  words = key_words(raw, entry["seed"], pad=None).reshape(-1, 2)
  order = np.lexsort((words[:, 1], words[:, 0]))
  sentinel = program.sentinel_keys()
  arrays = (
    np.concatenate([words[order, 0], sentinel[0]]),
    np.concatenate([words[order, 1], sentinel[1]]),
    np.concatenate([rows[order].astype(np.int32), sentinel[2]]),
  )
  replicated = None if mesh is None else NamedSharding(mesh, P())
  return tuple(jax.device_put(x, replicated) for x in arrays)


def load_serving(path: str, *, mesh: jax.sharding.Mesh | None = None) -> ServingModel:
  """Loads a serving artifact written by `export_serving`.

  Args:
    path: the artifact's directory.
    mesh: None: every table on the default device; a mesh: each table's rows
      split over all of its devices (for tables larger than one device).

  Returns:
    A `ServingModel`.

  Raises:
    ServingArtifactError: a missing, unreadable or corrupt file (named), or
      a manifest of another format version. Every file is checked before
      any is used.
  """
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise InputError(f"mesh must be None or a jax.sharding.Mesh, got {type(mesh).__name__}.")
  path = os.path.abspath(path)
  manifest = artifact.read_manifest(path)
  files = artifact.read_files(path, manifest)  # every file checked before any is parsed
  mesh_ = None if mesh is None else _auto(mesh)
  tables, keys = {}, {}
  for name, t in manifest["tables"].items():
    tables[name] = _place_rows(artifact.array(files, t["rows"]), mesh_)
    if "dynamic" in t:
      d = t["dynamic"]
      raw, rows = artifact.array(files, d["ids"]), artifact.array(files, d["rows"])
      keys[name] = _place_keys(d, raw, rows, mesh_)
  programs = {}
  for f in manifest["features"].values():
    for file in f["programs"].values():
      if file not in programs:
        programs[file] = _deserialize(files[file], os.path.join(path, file), manifest)
  return ServingModel(path, manifest, tables, keys, programs, mesh)


def _deserialize(data: bytes, where: str, manifest: dict) -> jax.export.Exported:
  try:
    return program.deserialize(data)
  except Exception as e:  # a program this JAX cannot read
    raise ServingArtifactError(
      f"serving program {where!r} does not deserialize ({type(e).__name__}: {e}); it was "
      f"written with JAX {manifest.get('jax_version')}: load it with a JAX that reads it."
    ) from e
