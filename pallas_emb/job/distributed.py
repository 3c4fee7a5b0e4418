"""The job's processes and devices: multi-host start-up and the mesh.

One process, or several started alike (`--coordinator_address`,
`--num_processes`, `--process_id` or the JAX_* environment variables), each
bringing all its devices. On CPU the processes exchange collectives through
gloo.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from absl import app

from pallas_emb.job.flags import FLAGS


def log(*args) -> None:
  """Prints on process 0 only."""
  if jax.process_index() == 0:
    print(*args, flush=True)


def initialize() -> None:
  """`jax.distributed.initialize` when the flags or environment name several
  processes; nothing for one."""
  address = FLAGS.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  num = FLAGS.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
  if not address and not num:
    return
  pid = FLAGS.process_id
  if pid is None and "JAX_PROCESS_ID" in os.environ:
    pid = int(os.environ["JAX_PROCESS_ID"])
  if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # A lost process is noticed by the coordination service, which then stops
  # the others; `supervisor` names it and the last checkpoint.
  jax.distributed.initialize(
    coordinator_address=address,
    num_processes=num or None,
    process_id=pid,
    heartbeat_timeout_seconds=FLAGS.heartbeat_timeout,
  )


def make_mesh() -> jax.sharding.Mesh:
  """The 1-D mesh ("x") of --devices devices of this process, or of every
  process's devices; refuses a batch size the mesh or processes don't divide."""
  devices = jax.devices()
  local = jax.local_device_count()
  if FLAGS.devices is not None and FLAGS.devices > local:
    raise app.UsageError(f"--devices={FLAGS.devices} but this process has only {local} devices.")
  if jax.process_count() > 1:
    mesh_devices = devices  # every process brings all its devices
  else:
    mesh_devices = devices[: FLAGS.devices or len(devices)]
  for what, n in (("devices of the mesh", len(mesh_devices)), ("processes", jax.process_count())):
    if FLAGS.batch_size % n:
      raise app.UsageError(f"--batch_size={FLAGS.batch_size} must be a multiple of the {n} {what}.")
  return jax.sharding.Mesh(np.array(mesh_devices), ("x",))
