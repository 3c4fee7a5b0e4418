"""Lowering a function for a TPU that is not there.

`jax.export` lowers for any platform, but Pallas' TPU lowering asks which chip
it targets (VMEM size, tiling) of the current mesh's device. An abstract mesh
whose abstract device is a TPU of the given kind answers that question, for
Pallas and for the kernels' own chip lookup (`pltpu.get_tpu_info()`), so the
Mosaic lowering runs on CPU. What is checked: every kernel lowers to a Mosaic
custom call; what is not: Mosaic's own compilation, which runs on the TPU.
"""

from __future__ import annotations

import contextlib

import jax

# jax.Device.device_kind of the chips the kernels must lower for.
DEVICE_KINDS = ("TPU v5 lite", "TPU v6 lite", "TPU v5")


@contextlib.contextmanager
def tpu_target(device_kind: str):
  """Makes `device_kind` (one TPU core) the device code is lowered for."""
  mesh = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(
      device_kind=device_kind, num_cores=1, platform="tpu"
    ),
  )
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def export_for_tpu(fn, *args, device_kind: str) -> jax.export.Exported:
  """`jax.export` of `jax.jit(fn)` for TPU `device_kind` on abstract args."""
  with tpu_target(device_kind):
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)


def mosaic_calls(exported: jax.export.Exported) -> list[str]:
  """The StableHLO lines that call a Mosaic (Pallas TPU) kernel."""
  return [line for line in exported.mlir_module().splitlines() if "tpu_custom_call" in line]
