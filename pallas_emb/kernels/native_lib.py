"""The native CPU library: where it is, whether it works, its FFI targets.

`pip install .` compiles `libpe_cpu.so` (sources in `csrc/`, built by CMake
through scikit-build-core) into this package's directory when the machine has
a C++17 compiler; without one the package installs without it. The library is
a plain shared object of XLA FFI handlers: no Python extension ABI, loaded
with ctypes, its handlers registered for the CPU platform with
`jax.ffi.register_ffi_target`.

It is looked for, in this order:

1. the path in the environment variable PALLAS_EMB_NATIVE_LIB;
2. next to this module (an installed package);
3. in the installed distribution `pallas-emb` (a source tree on sys.path,
   as under pytest, shadows the installed package but not its library);
4. in `build/` at the root of the source tree (`cmake -S . -B build &&
   cmake --build build`, the C++ development loop).

`status()` loads it once per process and runs one small call through XLA;
any failure (no library, a library built against an FFI API this jaxlib does
not accept, a platform other than CPU) makes the native backend unavailable,
with the reason, and the XLA path runs instead. The library is compiled for
the baseline of its architecture, so no CPU lacks its instructions.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import os
import pathlib
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

LIBRARY = "libpe_cpu.so"
ENV_VAR = "PALLAS_EMB_NATIVE_LIB"
DISTRIBUTION = "pallas-emb"

# The handlers of csrc/: unique_keys.cc, id_map.cc and sparse_update.cc.
UNIQUE_KEYS = "PeUniqueKeys"
KEY_PLAN, ID_MAP_STEP, ID_MAP_TRANSLATE1 = "PeKeyPlan", "PeIdMapStep", "PeIdMapTranslate1"
RULE_TARGETS = {
  "sgd": "PeSgd",
  "adagrad": "PeAdagrad",
  "rowwise_adagrad": "PeRowwiseAdagrad",
  "rowwise_adagrad_lazy": "PeRowwiseAdagradLazy",
  "lazy_adam": "PeLazyAdam",
  "ftrl": "PeFtrl",
}
TARGETS = (UNIQUE_KEYS, KEY_PLAN, ID_MAP_STEP, ID_MAP_TRANSLATE1) + tuple(
  prefix + kind for prefix in RULE_TARGETS.values() for kind in ("SegsumUpdate", "RowUpdate")
)

# csrc/profile.h's Phase enum, in order.
PHASES = (
  "unique_sort",
  "unique_outputs",
  "group_by_row",
  "segment_sum",
  "row_update",
  "norm_and_gate",
)

_HERE = pathlib.Path(__file__).resolve().parent
_SOURCE_ROOT = _HERE.parent.parent


class Status(NamedTuple):
  """Whether the native backend can run, and why not.

  Attributes:
    available: the library loaded, registered and passed its self-test.
    path: the library's path, if one was found.
    reason: why it is unavailable ("" when available).
  """

  available: bool
  path: str | None
  reason: str


def candidates() -> list[pathlib.Path]:
  """The paths looked at for the library, in order."""
  paths = []
  if os.environ.get(ENV_VAR):
    paths.append(pathlib.Path(os.environ[ENV_VAR]))
  paths.append(_HERE / LIBRARY)
  try:
    dist = importlib.metadata.distribution(DISTRIBUTION)
  except importlib.metadata.PackageNotFoundError:
    dist = None  # a source tree that was never installed: only build/ below
  if dist is not None:
    paths.append(pathlib.Path(dist.locate_file(f"pallas_emb/kernels/{LIBRARY}")))
  if (_SOURCE_ROOT / "pyproject.toml").exists():
    paths.append(_SOURCE_ROOT / "build" / LIBRARY)
  return paths


def _find() -> pathlib.Path | None:
  return next((p for p in candidates() if p.is_file()), None)


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, Status]:
  """Loads and registers the library once per process."""
  path = _find()
  if path is None:
    return None, Status(
      False,
      None,
      (
        f"{LIBRARY} was not built: `pip install .` compiles it when a C++17 "
        "compiler and cmake are present (looked in "
        f"{', '.join(str(p) for p in candidates())})"
      ),
    )
  try:
    lib = ctypes.CDLL(str(path))
    for name in TARGETS:
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    lib.PeSetProfiling.argtypes = [ctypes.c_int]
    lib.PeLastProfile.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    lib.PeLastProfile.restype = ctypes.c_int
  except (OSError, AttributeError) as e:
    return None, Status(False, str(path), f"{path} did not load: {e}")
  return lib, Status(True, str(path), "")


def _self_test() -> str:
  """ "" if one small call through XLA gives the expected result, else why."""
  keys = np.array([7, 3, 7, np.iinfo(np.int32).max, -2], np.int32)
  call = jax.ffi.ffi_call(
    UNIQUE_KEYS,
    (
      jax.ShapeDtypeStruct((4,), jnp.int32),
      jax.ShapeDtypeStruct((5,), jnp.int32),
      jax.ShapeDtypeStruct((), jnp.int32),
    ),
  )
  try:
    # Eagerly, even when the backend is first resolved inside a trace, and on
    # a device of this process: with several processes, jax.devices()[0] may
    # be another's, and a computation there waits for that process forever.
    with jax.ensure_compile_time_eval():
      out = jax.jit(call)(jax.device_put(keys, jax.local_devices(backend="cpu")[0]))
    got = [np.asarray(x).tolist() for x in out]
  except Exception as e:  # pylint: disable=broad-except
    return f"its self-test failed: {type(e).__name__}: {e}"
  big = int(np.iinfo(np.int32).max)
  want = [[-2, 3, 7, big], [2, 1, 2, -1, 0], 3]
  return "" if got == want else f"its self-test returned {got}, not {want}"


@functools.cache
def status() -> Status:
  """The native backend's `Status` on this process's CPU platform."""
  try:
    jax.local_devices(backend="cpu")
  except RuntimeError as e:
    return Status(False, None, f"JAX has no CPU platform: {e}")
  lib, st = _library()
  if lib is None:
    return st
  why = _self_test()
  return st._replace(available=False, reason=why) if why else st


def available() -> bool:
  """True if the native kernels can run here."""
  return status().available


@contextlib.contextmanager
def profiling() -> Iterator[None]:
  """Turns the native calls' phase timers on inside the block."""
  lib, _ = _library()
  if lib is None:
    yield
    return
  lib.PeSetProfiling(1)
  try:
    yield
  finally:
    lib.PeSetProfiling(0)


def last_profile() -> dict[str, float]:
  """Milliseconds per phase of the latest profiled native calls.

  Each phase holds the figure of the latest call that ran it (unique keys in
  the plan, the rest in the update); the one pass that sums and updates is
  split between "segment_sum" and "row_update" by the time each part took.
  """
  lib, _ = _library()
  if lib is None:
    return {}
  out = (ctypes.c_int64 * len(PHASES))()
  lib.PeLastProfile(out, len(PHASES))
  return {name: out[i] / 1e6 for i, name in enumerate(PHASES)}
