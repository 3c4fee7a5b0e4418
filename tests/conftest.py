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
"""

import os
import re

_COUNT_FLAG = "--xla_force_host_platform_device_count"
_ISA_FLAG = "--xla_cpu_max_isa"
_flags = re.sub(rf"({_COUNT_FLAG}|{_ISA_FLAG})=\S+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} {_COUNT_FLAG}=9 {_ISA_FLAG}=AVX".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must follow the flags)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

NUM_DEVICES = 8


def make_mesh(num_devices: int = NUM_DEVICES, axis: str = "x") -> jax.sharding.Mesh:
  """A 1-D mesh over devices 1..num_devices (device 0 is kept free)."""
  devices = jax.devices()
  if len(devices) < num_devices + 1:
    raise RuntimeError(
        f"need {num_devices + 1} devices, have {len(devices)}: XLA_FLAGS was "
        "set after JAX initialised its backends")
  return jax.sharding.Mesh(np.array(devices[1:num_devices + 1]), (axis,))


@pytest.fixture
def mesh8():
  return make_mesh(8)


@pytest.fixture
def mesh1():
  return make_mesh(1)
