"""The sizes of a checkpoint step's array files, recorded when it is written
and checked before a restore reads them.

Why: orbax restores a step's arrays with many concurrent tensorstore reads.
When one of them fails on a truncated or deleted file, orbax closes its
event loop while the others are still in flight, and each of those then
prints "Exception ignored ... Event loop is closed" when it completes:
hundreds of tracebacks around one skipped step, and an error that names a
TensorStore spec rather than the file. A stat of each file (nothing is
read) finds such a file first and names it, and orbax is not asked to read
the step at all.

What a size cannot see, a file of the right length with other bytes, is
still found: by orbax's decoder, or by the arrays' checksums (`integrity`).
A step without a record (written before records, or killed between the
save and the record) is read as before.

The record, `pallas_emb_files.json` beside the step's items:

    {"files": {"state/d/8f3e...": 20480, ...}, "digest": sha256 of "files"}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

log = logging.getLogger("pallas_emb.checkpoint")

NAME = "pallas_emb_files.json"
# The item whose files are recorded: the arrays (the metadata item is one
# small JSON file that orbax reads alone).
ITEM = "state"


def _sizes(step_dir: str) -> dict[str, int]:
  """Relative path -> size of every file under the step's array item."""
  root = os.path.join(step_dir, ITEM)
  return {
    os.path.relpath(os.path.join(d, f), step_dir): os.path.getsize(os.path.join(d, f))
    for d, _, files in os.walk(root)
    for f in files
  }


def _digest(files: dict[str, int]) -> str:
  return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def record(step_dir: str) -> None:
  """Writes the record of the step in `step_dir` (after its save; one
  process). Atomic: a reader sees the whole record or none.

  Raises:
    OSError: it could not be written.
  """
  files = _sizes(step_dir)
  path = os.path.join(step_dir, NAME)
  with open(path + ".tmp", "w") as f:
    json.dump({"files": files, "digest": _digest(files)}, f, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)


def problem(step_dir: str) -> str | None:
  """Why the step's array files are not as written (the first file that is
  missing or of another size), or None: as written, or no usable record."""
  try:
    with open(os.path.join(step_dir, NAME)) as f:
      saved = json.load(f)
    files = saved["files"]
    if not isinstance(files, dict) or saved["digest"] != _digest(files):
      raise ValueError("its digest does not match")
  except FileNotFoundError:
    return None
  except (OSError, ValueError, KeyError, TypeError) as e:
    # The record is a shortcut, not the authority: the read and the
    # checksums still decide.
    log.warning("ignoring %s (%s: %s)", os.path.join(step_dir, NAME), type(e).__name__, e)
    return None
  for name, size in sorted(files.items()):
    try:
      got = os.path.getsize(os.path.join(step_dir, name))
    except FileNotFoundError:
      return f"{name} is missing"
    if got != size:
      return f"{name} has {got} bytes where {size} were written"
  return None
