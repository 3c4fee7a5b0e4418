"""Which implementation runs the gather and the fused update.

* "pallas": Mosaic kernels, TPU only;
* "interpret": the same kernels in Pallas' TPU interpreter (tests on CPU);
* "xla": plain XLA ops, the test oracle and the path on GPU;
* "native": C++ kernels through jax.ffi on CPU (`native.py`): dedup, and the
  sum, gate and optimizer update in one pass; an optimizer or dtype they do
  not implement runs the XLA path, call by call.

The default follows the devices the tables live on (a mesh of TPUs ->
"pallas"; of CPUs -> "native" when its library is built and works here, else
"xla"; anything else -> "xla"), not the process's default platform: a mesh over the
TPU devices of `jax.experimental.topologies.get_topology_desc` compiles the
Mosaic kernels from a CPU host. The environment variable PALLAS_EMB_BACKEND
overrides the default for a whole process, e.g. to run a test suite in
interpret mode.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

from pallas_emb.errors import BackendError
from pallas_emb.kernels import native_lib

BACKENDS = ("pallas", "interpret", "xla", "native")
ENV_VAR = "PALLAS_EMB_BACKEND"


def platform_of(devices: Sequence[jax.Device] | None = None) -> str:
  """The platform of `devices` ("tpu", "cpu", "gpu"), or JAX's default."""
  if devices is None or not len(devices):
    return jax.default_backend()
  platforms = {d.platform for d in devices}
  if len(platforms) != 1:
    raise BackendError(
      f"the mesh mixes platforms {sorted(platforms)}; put the tables on devices of one platform."
    )
  return platforms.pop()


def default_backend(devices: Sequence[jax.Device] | None = None) -> str:
  """The backend used when none is given, for tables on `devices`."""
  env = os.environ.get(ENV_VAR)
  if env:
    return check_backend(env, devices)
  platform = platform_of(devices)
  if platform == "tpu":
    return "pallas"
  if platform == "cpu" and native_lib.available():
    return "native"
  return "xla"


def check_name(backend: str) -> str:
  """Validates a backend name."""
  if backend not in BACKENDS:
    raise BackendError(f"backend must be one of {BACKENDS}, got {backend!r}.")
  return backend


def check_backend(backend: str, devices: Sequence[jax.Device] | None = None) -> str:
  """Validates a backend name; "pallas" also needs TPU devices, "native" CPU
  devices and its library."""
  check_name(backend)
  platform = platform_of(devices)
  if backend == "pallas" and platform != "tpu":
    raise BackendError(
      f"backend 'pallas' compiles Mosaic kernels and needs a TPU mesh, but "
      f"the tables are on {platform!r} devices; use 'interpret' to run the "
      "kernels in the TPU interpreter, or 'xla'."
    )
  if backend == "native":
    if platform != "cpu":
      raise BackendError(
        f"backend 'native' runs C++ kernels on CPU devices, but the tables "
        f"are on {platform!r} devices; use 'xla' (or the default)."
      )
    status = native_lib.status()
    if not status.available:
      raise BackendError(
        f"backend 'native' is unavailable: {status.reason}. Install a C++17 "
        "compiler and cmake and reinstall (pip install .), or use 'xla'."
      )
  return backend


def resolve_backend(backend: str | None, devices: Sequence[jax.Device] | None = None) -> str:
  """`backend`, validated, or the default for tables on `devices`."""
  return default_backend(devices) if backend is None else check_backend(backend, devices)
