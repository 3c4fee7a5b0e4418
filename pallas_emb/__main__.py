"""`python -m pallas_emb`: the main job (see pallas_emb/main.py, --help)."""

import os
import re
import sys

# Simulated CPU devices must be requested before JAX creates its CPU client,
# i.e. before absl parses flags; read --devices here. (It has no effect on
# TPU or GPU, whose devices are real.)
_COUNT_FLAG = "--xla_force_host_platform_device_count"
_match = re.search(r"--devices[= ](\d+)", " ".join(sys.argv[1:]))
if _COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" {_COUNT_FLAG}={_match.group(1) if _match else 8}").strip()

from pallas_emb import supervisor  # noqa: E402

if __name__ == "__main__" and supervisor.needed(sys.argv[1:]):
  # One process of several: run the job in a worker that is watched for a
  # lost peer (see pallas_emb/supervisor.py).
  sys.exit(supervisor.supervise(sys.argv[1:]))

from absl import app  # noqa: E402

from pallas_emb import main  # noqa: E402

if __name__ == "__main__":
  app.run(main.main)
