"""`python -m pallas_emb`: the main job (see pallas_emb/job/, --help)."""

import sys

from pallas_emb.job import cpu_devices, startup

# Before JAX creates its CPU client, i.e. before absl parses flags.
cpu_devices.request("devices", 8)
startup.cpu_unless_accelerator()
startup.quiet_jax_logging()

from pallas_emb.job import supervisor  # noqa: E402

if __name__ == "__main__" and supervisor.needed(sys.argv[1:]):
  # One process of several: run the job in a worker that is watched for a
  # lost peer (see pallas_emb/job/supervisor.py).
  sys.exit(supervisor.supervise(sys.argv[1:]))

from absl import app  # noqa: E402

from pallas_emb.job import run  # noqa: E402

if __name__ == "__main__":
  app.run(run.main)
