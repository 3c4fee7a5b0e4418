"""Test setup: simulated CPU devices, before JAX is imported anywhere.

Nine host devices, and every test mesh is built over devices 1..n, never
device 0. Why: under `shard_map`, Pallas' TPU interpreter moves each operand
through an io_callback that runs on device 0; once a per-device operand reaches
about 100 KiB, the callback for device 0's own shard waits in the
interpreter's barrier while holding the thread the others need, and the test
deadlocks. Keeping device 0 out of the mesh leaves it free for the callbacks.

XLA:CPU may also not use FMA instructions (`--xla_cpu_max_isa=AVX`: x86 AVX
has no FMA). Inside a fusion XLA:CPU contracts `a * b + c` into one fused
multiply-add, rounded once, and which products it contracts depends on how it
fused the graph around them. The Pallas kernels in interpret mode compute the
same ops as the XLA oracle but inside a differently fused graph, so with FMA
the two can differ in the last bit (LazyAdam does); without it every op rounds
once on every path and the kernels are compared with the oracle bit for bit.

Compiles are the suite's main cost, so they are made cheaper and fewer:
XLA:CPU compiles without its expensive LLVM passes (`--xla_backend_
optimization_level=0`: 1.6x faster compiles, the same results), with its
classic loop emitters rather than the MLIR fusion emitters (`--xla_cpu_use_
fusion_emitters=false`: test_stacking's 185 compiles take 18 s instead of 42,
its CPU time 35 s instead of 77, its results bit for bit the same), and each
program's code generated as one module, not split for threads that two cores
do not have (`--xla_cpu_parallel_codegen_split_count=1`: 10% less CPU time
again); and one persistent compilation cache per run, in a fresh directory
that every subprocess inherits (the job, README blocks, benchmarks), reads
back what another module or process compiled before (or, given
`JAX_COMPILATION_CACHE_DIR`, that directory: the quick loop keeps one across
runs, so an edit recompiles only the programs it changed). A jaxlib that no longer
knows the last two flags would abort on them, so they are set only after a
child process accepted them (once per run: the answer travels in the
environment).

JAX's in-memory compilation caches are cleared after each test module. Every XLA:CPU
executable keeps a few memory mappings of its JIT-compiled code for as long as
it is cached, and the whole suite compiles enough (the TPU interpreter most of
all) to pass Linux's default limit of 65,530 mappings per process; LLVM then
aborts the process inside a compile. No module reuses what another compiled
(`small_trainer` builds its trainer again in each module that asks).
"""

import atexit
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile

# What a process the tests start compiles with (it picks its device count).
CHILD_FLAGS = {
  "--xla_cpu_max_isa": "AVX",
  "--xla_backend_optimization_level": "0",
  "--xla_llvm_disable_expensive_passes": "true",
}
# Flags a later jaxlib may not know (XLA aborts on an unknown flag).
_NEWER_FLAGS = {
  "--xla_cpu_use_fusion_emitters": "false",
  "--xla_cpu_parallel_codegen_split_count": "1",
}


def _xla_accepts(flags: dict[str, str]) -> bool:
  """Whether this jaxlib's XLA:CPU starts with `flags` (an unknown flag is
  fatal, so a child process asks). Answered once per run: the controller's
  answer is in the environment of the workers and children it starts."""
  key = "PALLAS_EMB_TESTS_XLA_ACCEPTS"
  if key not in os.environ:
    probe = subprocess.run(
      [sys.executable, "-c", "import jax; jax.devices('cpu')"],
      env=dict(
        os.environ, XLA_FLAGS=" ".join(f"{k}={v}" for k, v in flags.items()), JAX_PLATFORMS="cpu"
      ),
      capture_output=True,
      timeout=120,
    )
    os.environ[key] = "1" if probe.returncode == 0 else "0"
  return os.environ[key] == "1"


if _xla_accepts(_NEWER_FLAGS):
  CHILD_FLAGS.update(_NEWER_FLAGS)
_TEST_FLAGS = {"--xla_force_host_platform_device_count": "9", **CHILD_FLAGS}
_flags = re.sub(rf"({'|'.join(_TEST_FLAGS)})=\S+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = " ".join(
  [_flags.strip(), *(f"{k}={v}" for k, v in _TEST_FLAGS.items())]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="pallas_emb_tests_jit_")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
# Every program is cached, however quick its compile. (No size cap: JAX's
# needs the `filelock` package, without which every cache read fails.)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (must follow the flags)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from fail_fast import pytest_configure  # noqa: E402, F401  (a hook of this conftest)

NUM_DEVICES = 8
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
  """The environment of a process the tests start: this one's (its
  compilation cache included), CPU only, the repository importable, and
  `CHILD_FLAGS` without a device count (the child asks for its own)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  env["XLA_FLAGS"] = " ".join(f"{k}={v}" for k, v in CHILD_FLAGS.items())
  env.update(extra)
  return env


MESH_KINDS = ("auto", "explicit")


def make_mesh(num_devices: int = NUM_DEVICES, axis: str = "x", kind: str = "auto"):
  """A 1-D mesh over devices 1..num_devices (device 0 is kept free).

  `kind`: "auto" (`jax.sharding.Mesh`'s default axis type) or "explicit"
  (`jax.make_mesh`'s): every public API must work on both.
  """
  devices = jax.devices()
  if len(devices) < num_devices + 1:
    raise RuntimeError(
      f"need {num_devices + 1} devices, have {len(devices)}: XLA_FLAGS was "
      "set after JAX initialised its backends"
    )
  types = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}[kind]
  return jax.sharding.Mesh(np.array(devices[1 : num_devices + 1]), (axis,), axis_types=(types,))


def pytest_collection_modifyitems(config, items):
  """The quick loop (`-m "not slow"`) and CI (`-m "not grid"`) run a subset
  of the large parameter grids. A module names it in `QUICK`: {test function
  name: predicate over the case's parameters}; the other cases of that test
  are marked `grid` (and slow), which a full run (no -m) runs too. A test
  marked `grid` by hand is slow as well."""
  del config
  for item in items:
    quick = getattr(item.module, "QUICK", {}).get(item.originalname)
    if quick is not None and not quick(item.callspec.params):
      item.add_marker(pytest.mark.grid)
    if item.get_closest_marker("grid"):
      item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  yield
  jax.clear_caches()
  small_trainer.cache_clear()


@pytest.fixture(params=MESH_KINDS)
def mesh_kind(request) -> str:
  """Each mesh kind in turn ("auto", "explicit"), for `make_mesh(kind=)`."""
  return request.param


@pytest.fixture
def mesh8():
  return make_mesh(8)


@pytest.fixture
def mesh1():
  return make_mesh(1)


@functools.cache
def small_trainer(num_devices: int = NUM_DEVICES, layout: str = "mod"):
  """(trainer, model, feeder) of a small ranking job, made once per session:
  tests that train it share its compiled step (a new trainer, even an equal
  one, compiles again: its optax closures differ)."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  import optax  # pylint: disable=g-import-not-at-top

  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  from pallas_emb import data as data_lib  # pylint: disable=g-import-not-at-top
  from pallas_emb.data.feed import GlobalBatches  # pylint: disable=g-import-not-at-top
  from pallas_emb.job.model import build_ranking  # pylint: disable=g-import-not-at-top

  dataset = data_lib.SyntheticClickLog(num_users=500, num_items=300, eval_examples=256)
  emb, model = build_ranking(
    dataset,
    make_mesh(num_devices),
    emb_dim=8,
    backend="xla",
    optimizer=pe.RowWiseAdagrad(0.05, half_life_steps=None),
  )
  if layout != "mod":
    emb = dataclasses.replace(
      emb, tables=tuple(dataclasses.replace(t, layout=layout) for t in emb.tables)
    )
  feeder = GlobalBatches(dataset, 64, emb.sharding())
  trainer = pe.make_trainer(emb, model.loss, optax.adam(1e-3), pe.TrainConfig(), feeder.train(0))
  return trainer, model, feeder


def use_tpu_reorder(monkeypatch) -> None:
  """From now on in this test, `sharding.reorder.per_platform` takes the
  TPU forms whatever the platform: the programs traced are those a TPU
  compiles. jit's caches are cleared, so no program crosses the switch."""
  from sharding import reorder

  jax.clear_caches()
  monkeypatch.setattr(reorder, "per_platform", lambda tpu_form, other_form, *args: tpu_form(*args))
