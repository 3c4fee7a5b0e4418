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

The record, `pallas_emb_files.json` beside the step's items, is sealed by
a digest as the step's metadata is (`integrity.seal`):

    {"files": {"state/d/8f3e...": 20480, ...}, "digest": "..."}
"""

from __future__ import annotations

import json
import logging
import os

from pallas_emb.train import integrity

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


def record(step_dir: str) -> None:
  """Writes the record of the step in `step_dir` (after its save; one
  process). Atomic: a reader sees the whole record or none.

  Raises:
    OSError: it could not be written.
  """
  files = _sizes(step_dir)
  path = os.path.join(step_dir, NAME)
  with open(path + ".tmp", "w") as f:
    json.dump(integrity.seal({"files": files}), f, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)


def problem(step_dir: str) -> str | None:
  """Why the step's array files are not as written (the first file that is
  missing or of another size), or None: as written, or no usable record."""
  try:
    with open(os.path.join(step_dir, NAME)) as f:
      saved = json.load(f)
    why = integrity.seal_problem(saved)
    if why:
      raise ValueError(why)
    files = saved["files"]
    if not isinstance(files, dict):
      raise TypeError(f"its files are a {type(files).__name__}, not a dict")
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
