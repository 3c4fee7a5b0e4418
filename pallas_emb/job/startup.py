"""What a program of this package sets before JAX starts: no TPU probe on
a machine without a TPU, and JAX's INFO lines off.

With `jax[tpu]` installed (the test extra brings it, for deviceless TPU
compiles), JAX initialises libtpu on any machine unless told which
platforms to use, and on a CPU machine libtpu prints a screenful of errors
about hosts it cannot find before JAX falls back to the CPU ("Unable to
initialize backend 'tpu'"). A program that only runs where it is (the main
job, the CPU benchmark) asks for the CPU when the machine has no TPU device
and no GPU: a TPU VM has /dev/accel* or /dev/vfio/* devices, a GPU machine
/dev/nvidia*. `JAX_PLATFORMS`, when set, wins. Imports nothing heavy.
"""

from __future__ import annotations

import glob
import logging
import os
import sys

_ACCELERATORS = ("/dev/accel*", "/dev/vfio/*", "/dev/nvidia[0-9]*")


def has_accelerator() -> bool:
  """Whether this machine has a TPU or GPU device file."""
  return any(glob.glob(pattern) for pattern in _ACCELERATORS)


def cpu_unless_accelerator() -> None:
  """JAX_PLATFORMS=cpu on a machine without an accelerator (when unset)."""
  if "JAX_PLATFORMS" not in os.environ and not has_accelerator():
    os.environ["JAX_PLATFORMS"] = "cpu"


def quiet_jax_logging(argv: list[str] | None = None) -> None:
  """JAX's INFO lines off (absl's -v / --verbosity on the command line keeps
  them)."""
  argv = sys.argv[1:] if argv is None else argv
  if not any(a == "-v" or a.startswith(("-v=", "--v=", "--verbosity")) for a in argv):
    logging.getLogger("jax").setLevel(logging.WARNING)
