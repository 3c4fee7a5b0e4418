"""Pallas' TPU race detector, read so that its verdict does not depend on luck.

`RACES` turns the detector on with a vector clock entry per DMA in flight
(the default, one per core, misses DMA-vs-DMA races). The detector still
approximates one clock per DMA by those few entries, drawn for each DMA from
numpy's global generator: two racing DMAs that draw the same entry look
ordered and the race is missed (about one run in ten for the update kernel's
duplicate write-backs). It never reports a race that is not there, so
`races_found` runs the kernel a few times with seeded draws and reports a race
if any run saw one: the outcome no longer depends on what ran before in the
process, and the global generator is put back afterwards.
"""

import jax
import numpy as np
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

RACES = pltpu.InterpretParams(detect_races=True, vector_clock_size=8)


def races_found(fn, seeds=(0, 1, 2)) -> bool:
  """Whether any run of `fn` (which interprets kernels with `RACES`), one per
  seed of the detector's draws, reports a race."""
  saved = np.random.get_state()
  try:
    for seed in seeds:
      np.random.seed(seed)
      # The detector's state is global to the interpreter and replaced at the
      # start of each interpreted kernel; reset it so a failure elsewhere
      # cannot leak into this reading.
      pltpu.reset_tpu_interpret_mode_state()
      jax.block_until_ready(fn())
      if tpu_interpreter.races.races_found:
        return True
    return False
  finally:
    np.random.set_state(saved)
