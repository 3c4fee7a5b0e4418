"""A directory of checkpoint steps: written durably, read back verified.

Each step is an orbax checkpoint of two items: "state", a pytree of arrays,
and "meta", JSON that records a checksum of every array and is itself sealed
by a digest (`integrity`), plus a record of the array files' sizes
(`checkpoint_files`). Reading a step back checks all three, so a flipped
bit, a truncated or deleted file, or a step whose metadata is gone is found,
and named, instead of restored.

Saves are synchronous. With orbax's asynchronous saves, a save that cannot
create its directory (read-only or full disk) leaves non-daemon threads
waiting up to 20 minutes for a signal that never comes, and the process
hangs at exit; a checkpoint here blocks until durable anyway, so nothing is
lost by saving in the caller's thread, and an I/O error is an immediate
`CheckpointDirError`. The directory is also probed before training.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from pallas_emb.errors import CheckpointDirError
from pallas_emb.train import checkpoint_files, integrity

log = logging.getLogger("pallas_emb.checkpoint")

_QUARANTINE = ".corrupt"


class StepUnreadable(Exception):
  """One step does not read back intact (the reason is the message)."""


def check_writable(directory: str) -> str:
  """Creates `directory` if needed and proves a file can be written there.

  Returns:
    The absolute path.

  Raises:
    CheckpointDirError: naming the directory, the OS error and the fix.
  """
  path = os.path.abspath(directory)
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-") as f:
      f.write(b"pallas_emb")
      f.flush()
      os.fsync(f.fileno())
  except OSError as e:
    raise CheckpointDirError(
      e.errno,
      f"checkpoint directory {path!r} is not writable "
      f"({e.strerror or e}); pass a --checkpoint_dir this process can "
      "create and write files in, or fix its permissions.",
    ) from e
  return path


def _all_processes(ok: bool) -> bool:
  """Whether `ok` holds on every process (the same answer on each), so that
  no process goes on to a collective that another one skips."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _attempt(what: str, fn: Callable[[], Any]) -> Any:
  """`fn()`, or `StepUnreadable` if it fails on any process."""
  try:
    result, reason = fn(), None
  except StepUnreadable as e:
    result, reason = None, str(e)
  except Exception as e:  # pylint: disable=broad-exception-caught
    # orbax and tensorstore raise whatever their decoder hits (ValueError,
    # KeyError, OSError, JSONDecodeError...) for a damaged file.
    detail = " ".join(str(e).split())[:300]  # one line: it goes in a log
    result, reason = None, f"{what}: {type(e).__name__}: {detail}"
  if not _all_processes(reason is None):
    raise StepUnreadable(reason or f"{what} failed on another process")
  return result


def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
    registry.add("state", args, ocp.StandardCheckpointHandler)
  for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
    registry.add("meta", args, ocp.JsonCheckpointHandler)
  return registry


class CheckpointDir:
  """The checkpoint steps in `directory`.

  Args:
    directory: the directory (created when writable).
    max_to_keep: steps kept; older ones are deleted after a save.
    writable: False opens it read-only (for `verify`).

  Raises:
    CheckpointDirError: a writable directory that cannot be written.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3, writable: bool = True):
    self.path = check_writable(directory) if writable else os.path.abspath(directory)
    self.writable = writable
    self.manager = ocp.CheckpointManager(
      self.path,
      handler_registry=_registry(),
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=writable,
        read_only=not writable,
        enable_async_checkpointing=False,
      ),
    )

  def steps(self) -> list[int]:
    """The steps present, newest first."""
    return sorted(self.manager.all_steps(), reverse=True)

  def write(self, step: int, state: Any, meta: dict) -> None:
    """Saves `state` (arrays) and `meta` (JSON) as `step`, durably, with a
    checksum of every array recorded in the sealed metadata.

    Raises:
      CheckpointDirError: the write failed (permissions, full disk...).
    """
    meta = integrity.seal({**meta, "checksums": integrity.checksums(state)})
    try:
      self.manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
      )
      self.manager.wait_until_finished()
      if jax.process_index() == 0:
        checkpoint_files.record(self._step_dir(step))
    except OSError as e:
      raise CheckpointDirError(
        e.errno,
        f"writing checkpoint step {step} in {self.path!r} failed "
        f"({e.strerror or e}); free space or fix the permissions, then "
        "resume from the last step written.",
      ) from e

  def read_meta(self, step: int) -> dict:
    """The metadata of `step`, its seal checked.

    Raises:
      StepUnreadable: it cannot be read, or does not match its digest.
    """
    meta = _attempt(
      "reading its metadata",
      lambda: self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
        "meta"
      ],
    )
    if not isinstance(meta, dict):
      raise StepUnreadable("its metadata is not a JSON object")
    if "digest" not in meta and "checksums" not in meta:
      log.warning(
        "checkpoint step %d in %s has no checksums (written before "
        "pallas_emb verified checkpoints); restoring it unverified.",
        step,
        self.path,
      )
      return meta
    problem = integrity.seal_problem(meta)
    if problem:
      raise StepUnreadable(problem)
    return meta

  def read_state(self, step: int, target: Any, meta: dict) -> Any:
    """The arrays of `step` restored into `target` (abstract arrays with
    shardings, or host arrays), checked against their checksums.

    Raises:
      StepUnreadable: a file cannot be read or decoded, or an array differs
        from the one saved.
    """

    def read():
      # Before orbax reads: its failed read of a short or missing file
      # floods stderr (`checkpoint_files`).
      problem = checkpoint_files.problem(self._step_dir(step))
      if problem:
        raise StepUnreadable(f"its array files are not as written: {problem}")
      restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
      )
      return restored["state"]

    state = _attempt("reading its arrays", read)
    if "checksums" in meta:
      problems = integrity.mismatches(meta["checksums"], state)
      if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise StepUnreadable(problems[0] + more)
    return state

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.path, str(step))

  def verify(self, step: int) -> tuple[dict, int]:
    """Reads `step` whole, as host arrays, without a trainer.

    Returns:
      (its metadata, the number of arrays checked).

    Raises:
      StepUnreadable: why it is not intact.
    """
    meta = self.read_meta(step)
    state = self.read_state(step, self.host_target(step), meta)
    return meta, len(jax.tree.leaves(state))

  def host_target(self, step: int) -> Any:
    """Host arrays shaped like the arrays of `step` (a restore target).

    Raises:
      StepUnreadable: its array metadata cannot be read.
    """
    saved = _attempt(
      "reading its array metadata", lambda: self.manager.item_metadata(step)["state"]
    )
    if saved is None:
      raise StepUnreadable("its array metadata is missing")
    # np.zeros maps zero pages lazily: no table-sized memory until read.
    return jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), saved)

  def quarantine(self, step: int) -> str:
    """Renames step `step` out of the way (kept for inspection), so that a
    run resumed from an older step can write that step again.

    Returns:
      The new path (STEP.corrupt, or STEP.corrupt-N if that exists).
    """
    old = self._step_dir(step)
    new = old + _QUARANTINE
    n = 1
    while os.path.exists(new):
      new, n = f"{old}{_QUARANTINE}-{n}", n + 1
    if jax.process_index() == 0:
      os.rename(old, new)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

      multihost_utils.sync_global_devices(f"pallas_emb quarantine {step}")
    self.manager.reload()
    return new
