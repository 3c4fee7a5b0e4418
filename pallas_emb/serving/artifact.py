"""A serving artifact's files: written with a checksum each, read back only
when every checksum holds.

The directory holds `manifest.json` and the files it names (tables, id maps,
programs). The manifest lists each file's SHA-256 and size, and is sealed by
the SHA-256 of its own canonical JSON (sorted keys, no spaces) without the
seal: a flipped byte in a file changes its hash; one in the manifest breaks
its JSON, changes a value (and so the seal) or changes the seal itself. So
no flipped byte anywhere is read as a model.

Writing goes to a fresh directory beside the target, renamed into place at
the end: a reader never sees half an artifact, and a crash leaves the old
one (at worst renamed beside the target, `.serving-*.old`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_emb.errors import CheckpointDirError, ServingArtifactError

MANIFEST = "manifest.json"
FORMAT = "pallas_emb.serving"
FORMAT_VERSION = 1


def _canonical(manifest: dict) -> bytes:
  return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: dict) -> dict:
  """`manifest` with its "seal": the SHA-256 of the rest."""
  body = {k: v for k, v in manifest.items() if k != "seal"}
  return {**body, "seal": hashlib.sha256(_canonical(body)).hexdigest()}


class Writer:
  """Collects an artifact's files in a staging directory; `commit` writes
  the manifest and moves the directory to `path`."""

  def __init__(self, path: str):
    self.path = os.path.abspath(path)
    _check_target(self.path)
    parent = os.path.dirname(self.path)
    try:
      os.makedirs(parent, exist_ok=True)
      self.staging = tempfile.mkdtemp(prefix=".serving-", dir=parent)
    except OSError as e:
      raise CheckpointDirError(
        f"cannot write a serving artifact under {parent!r}: {e}; pass a writable export path."
      ) from e
    self.files: dict[str, dict[str, Any]] = {}

  def add(self, name: str, data: bytes) -> str:
    """Writes `data` as file `name` (relative, "/"-separated); returns it."""
    full = os.path.join(self.staging, *name.split("/"))
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "wb") as f:
      f.write(data)
    self.files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    return name

  def add_array(self, name: str, x: np.ndarray) -> dict[str, Any]:
    """Writes `x`'s bytes (C order); returns its entry: file, shape, dtype."""
    x = np.ascontiguousarray(x)
    return {"file": self.add(name, x.tobytes()), "shape": list(x.shape), "dtype": x.dtype.name}

  def commit(self, manifest: dict) -> None:
    """Seals and writes the manifest, then puts the directory at `path`,
    replacing an artifact there."""
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": self.files}
    with open(os.path.join(self.staging, MANIFEST), "w") as f:
      json.dump(seal(body), f, indent=1, sort_keys=True)
    old = None
    if os.path.exists(self.path):  # `_check_target` made sure it is an artifact
      old = self.staging + ".old"
      os.replace(self.path, old)
    os.replace(self.staging, self.path)
    if old is not None:
      shutil.rmtree(old)

  def abort(self) -> None:
    shutil.rmtree(self.staging, ignore_errors=True)


def _check_target(path: str) -> None:
  """An export may write into a new or empty directory, or over an artifact;
  never over other files."""
  if not os.path.exists(path):
    return
  if not os.path.isdir(path):
    raise CheckpointDirError(f"serving export path {path!r} is a file; pass a directory path.")
  entries = os.listdir(path)
  if entries and MANIFEST not in entries:
    raise CheckpointDirError(
      f"serving export path {path!r} holds {len(entries)} entries and no {MANIFEST}: it is not "
      "a serving artifact, and would be replaced; pass a new or empty directory."
    )


def read_manifest(path: str) -> dict:
  """The manifest of the artifact at `path`, its seal checked.

  Raises:
    ServingArtifactError: no such directory or manifest, a manifest that is
      not JSON, of another format, or whose seal does not hold.
  """
  full = os.path.join(path, MANIFEST)
  if not os.path.isdir(path):
    raise ServingArtifactError(
      f"no serving artifact at {path!r}: not a directory; pass the directory "
      "pallas_emb.export_serving wrote."
    )
  try:
    with open(full, "rb") as f:
      manifest = json.loads(f.read())
  except FileNotFoundError as e:
    raise ServingArtifactError(
      f"serving artifact {path!r} has no {MANIFEST}; export it again with "
      "pallas_emb.export_serving."
    ) from e
  except (ValueError, UnicodeDecodeError) as e:
    raise ServingArtifactError(
      f"{full!r} is corrupt (not JSON: {e}); export the artifact again."
    ) from e
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise ServingArtifactError(
      f"{full!r} is not a pallas_emb serving manifest (format "
      f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, expected {FORMAT!r})."
    )
  if seal(manifest).get("seal") != manifest.get("seal"):
    raise ServingArtifactError(
      f"{full!r} is corrupt: its contents do not match its seal; export the artifact again."
    )
  if manifest.get("format_version") != FORMAT_VERSION:
    raise ServingArtifactError(
      f"{full!r} has format version {manifest.get('format_version')!r}; this pallas_emb reads "
      f"version {FORMAT_VERSION}: load it with the version that wrote it "
      f"({manifest.get('library_version')!r})."
    )
  return manifest


def read_files(path: str, manifest: dict) -> dict[str, bytes]:
  """Every file the manifest lists, each checked against it.

  Raises:
    ServingArtifactError: a file is missing or unreadable, or its size or
      SHA-256 is not the manifest's.
  """
  return {name: _read_file(path, name, entry) for name, entry in sorted(manifest["files"].items())}


def _read_file(path: str, name: str, entry: dict) -> bytes:
  full = os.path.join(path, *name.split("/"))
  try:
    with open(full, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ServingArtifactError(
      f"serving artifact file {full!r} cannot be read ({e}); export the artifact again."
    ) from e
  digest = hashlib.sha256(data).hexdigest()
  if len(data) != entry["bytes"] or digest != entry["sha256"]:
    raise ServingArtifactError(
      f"serving artifact file {full!r} is corrupt: {len(data)} bytes with SHA-256 "
      f"{digest[:16]}..., the manifest says {entry['bytes']} bytes with "
      f"{entry['sha256'][:16]}...; export the artifact again."
    )
  return data


def array(files: dict[str, bytes], entry: dict) -> np.ndarray:
  """The array an `add_array` entry describes, from the checked files."""
  return np.frombuffer(files[entry["file"]], jnp.dtype(entry["dtype"])).reshape(entry["shape"])
