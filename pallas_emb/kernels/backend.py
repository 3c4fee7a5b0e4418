"""Which implementation runs the gather and the fused update.

* "pallas": Mosaic kernels, TPU only;
* "interpret": the same kernels in Pallas' TPU interpreter (tests on CPU);
* "xla": plain XLA ops, the test oracle and the fast path on CPU and GPU.

The default follows the platform (TPU -> "pallas", else "xla") and can be
overridden for a whole process with the environment variable
PALLAS_EMB_BACKEND, e.g. to run a test suite in interpret mode.
"""

from __future__ import annotations

import os

import jax

from pallas_emb.errors import BackendError

BACKENDS = ("pallas", "interpret", "xla")
ENV_VAR = "PALLAS_EMB_BACKEND"


def default_backend() -> str:
  """The backend used when none is given."""
  env = os.environ.get(ENV_VAR)
  if env:
    return check_backend(env)
  return "pallas" if jax.default_backend() == "tpu" else "xla"


def check_name(backend: str) -> str:
  """Validates a backend name."""
  if backend not in BACKENDS:
    raise BackendError(
        f"backend must be one of {BACKENDS}, got {backend!r}.")
  return backend


def check_backend(backend: str) -> str:
  """Validates a backend name; "pallas" also needs a TPU."""
  check_name(backend)
  if backend == "pallas" and jax.default_backend() != "tpu":
    raise BackendError(
        f"backend 'pallas' compiles Mosaic kernels and needs a TPU, but JAX's "
        f"platform is {jax.default_backend()!r}; use 'interpret' to run the "
        "kernels in the TPU interpreter, or 'xla'.")
  return backend


def resolve_backend(backend: str | None) -> str:
  return default_backend() if backend is None else check_backend(backend)
