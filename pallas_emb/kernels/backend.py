"""Which implementation runs the gather and the fused update.

* "pallas": Mosaic kernels, TPU only;
* "interpret": the same kernels in Pallas' TPU interpreter (tests on CPU);
* "xla": plain XLA ops, the test oracle and the path on GPU;
* "native": C++ kernels through jax.ffi on CPU (`native.py`): dedup, and the
  sum, gate and optimizer update in one pass; an optimizer or dtype they do
  not implement runs the XLA path, call by call.

The default follows the platform: TPU -> "pallas"; CPU -> "native" when its
library is built and works here, else "xla"; anything else -> "xla". The
environment variable PALLAS_EMB_BACKEND overrides it for a whole process,
e.g. to run a test suite in interpret mode.
"""

from __future__ import annotations

import os

import jax

from pallas_emb.errors import BackendError
from pallas_emb.kernels import native_lib

BACKENDS = ("pallas", "interpret", "xla", "native")
ENV_VAR = "PALLAS_EMB_BACKEND"


def default_backend() -> str:
  """The backend used when none is given."""
  env = os.environ.get(ENV_VAR)
  if env:
    return check_backend(env)
  platform = jax.default_backend()
  if platform == "tpu":
    return "pallas"
  if platform == "cpu" and native_lib.available():
    return "native"
  return "xla"


def check_name(backend: str) -> str:
  """Validates a backend name."""
  if backend not in BACKENDS:
    raise BackendError(
        f"backend must be one of {BACKENDS}, got {backend!r}.")
  return backend


def check_backend(backend: str) -> str:
  """Validates a backend name; "pallas" also needs a TPU, "native" a CPU
  and its library."""
  check_name(backend)
  platform = jax.default_backend()
  if backend == "pallas" and platform != "tpu":
    raise BackendError(
        f"backend 'pallas' compiles Mosaic kernels and needs a TPU, but JAX's "
        f"platform is {platform!r}; use 'interpret' to run the "
        "kernels in the TPU interpreter, or 'xla'.")
  if backend == "native":
    if platform != "cpu":
      raise BackendError(
          f"backend 'native' runs C++ kernels on CPU devices, but JAX's "
          f"platform is {platform!r}; use 'xla' (or the default).")
    status = native_lib.status()
    if not status.available:
      raise BackendError(
          f"backend 'native' is unavailable: {status.reason}. Install a C++17 "
          "compiler and cmake and reinstall (pip install .), or use 'xla'.")
  return backend


def resolve_backend(backend: str | None) -> str:
  return default_backend() if backend is None else check_backend(backend)
