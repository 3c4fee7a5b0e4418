"""The process environment a deviceless TPU compile needs, set before JAX
initialises.

libtpu reads these once, when JAX first creates its backends: the compiling
process runs on the CPU platform, must not look for a TPU or its metadata
server, and describes TPU topologies from them. Run the compile in a process
without network access (the test suite uses `unshare -n`): libtpu has
nothing to reach there.
"""

from __future__ import annotations

import os
import sys

# XLA:TPU schedules all-to-alls as start/done pairs only with this flag; then
# the async pipeline's table update can overlap the dense compute.
ASYNC_ALL_TO_ALL = "--xla_tpu_enable_async_all_to_all=true"

_DEFAULTS = {
  # libtpu takes /tmp/libtpu_lockfile to keep a TPU to one process; a
  # deviceless compile uses no TPU, and several may run at once.
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
  "JAX_PLATFORMS": "cpu",
  "TPU_SKIP_MDS_QUERY": "1",
  "TPU_WORKER_HOSTNAMES": "localhost",
  "TPU_ACCELERATOR_TYPE": "v5litepod-4",
}


def prepare(async_all_to_all: bool = True) -> None:
  """Sets the environment of a deviceless TPU compile in this process.

  A process may compile case after case (`pod_check.__main__.main` called
  again): once JAX is imported, a call passes if the environment already
  holds what it would set.

  Raises:
    RuntimeError: JAX was imported before the environment was set, so
      libtpu would not see it.
  """
  if "jax" in sys.modules:
    if not _prepared(async_all_to_all):
      raise RuntimeError(
        "pallas_emb.pod_check.env.prepare() must run before JAX is imported; "
        "start a fresh process with `python -m pallas_emb.pod_check`."
      )
    return
  for key, value in _DEFAULTS.items():
    os.environ.setdefault(key, value)
  # A deviceless executable cannot be read back from a persistent cache
  # ("PjRtCompiler must be constructed with a Client"): don't write one.
  os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
  args = os.environ.get("LIBTPU_INIT_ARGS", "")
  if async_all_to_all and ASYNC_ALL_TO_ALL not in args:
    os.environ["LIBTPU_INIT_ARGS"] = f"{args} {ASYNC_ALL_TO_ALL}".strip()


def _prepared(async_all_to_all: bool) -> bool:
  """Whether the environment holds what `prepare` would set."""
  return (
    all(key in os.environ for key in _DEFAULTS)
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ
    and (not async_all_to_all or ASYNC_ALL_TO_ALL in os.environ.get("LIBTPU_INIT_ARGS", ""))
  )
