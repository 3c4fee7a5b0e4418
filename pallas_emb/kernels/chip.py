"""The TPU chip a kernel is sized for: VMEM and SMEM budgets, tile padding.

Nothing here touches arrays; it runs while tracing, on static shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax.experimental.pallas import tpu as pltpu

from pallas_emb.errors import ConfigError, VmemBudgetError

# TPU vregs are (8, 128) 32-bit words: VMEM buffers round rows up to 8
# sublanes and columns up to 128 lanes, so a (C, 1) slot buffer costs as much
# as a (C, 128) one.
SUBLANES = 8
LANES = 128
WORD_BYTES = 4

# Off TPU (interpret mode on CPU) there is no chip to ask. v5p has the least
# VMEM per core of v5e, v6e and v5p, so a chunk size accepted here fits all
# three.
OFF_TPU_CHIP = pltpu.ChipVersion.TPU_V5P

# The smallest default scoped VMEM limit (v5e's): asking for less would only
# make a small kernel harder to compile.
_MIN_VMEM_LIMIT = 16 * 1024 * 1024

# Device kinds (jax.Device.device_kind) whose spelling differs from the
# ChipVersion value.
_KIND_ALIASES = {"v4 lite": "v4i", "v5 lite": "v5e", "v5": "v5p", "v6 lite": "v6e"}

Target = None | str | pltpu.ChipVersion | pltpu.TpuInfo


def round_up(x: int, m: int) -> int:
  """The least multiple of m that is >= x."""
  return -(-x // m) * m


def padded_words(rows: int, cols: int) -> int:
  """32-bit words a (rows, cols) VMEM buffer occupies after (8, 128) tiling."""
  return round_up(rows, SUBLANES) * round_up(cols, LANES)


@dataclasses.dataclass(frozen=True)
class Chip:
  """The part of `pltpu.TpuInfo` the kernels size themselves by."""

  name: str
  vmem_bytes: int
  smem_bytes: int


def _chip_version(name: str) -> pltpu.ChipVersion:
  key = name.strip().lower()
  if key.startswith("tpu"):
    key = key[3:].strip()
  key = _KIND_ALIASES.get(key, key)
  try:
    return pltpu.ChipVersion(key)
  except ValueError:
    known = sorted({v.value for v in pltpu.ChipVersion})
    raise ConfigError(
      f"target {name!r} names no TPU chip; use a ChipVersion, one of "
      f"{known}, or a device kind such as 'TPU v5 lite'."
    ) from None


def resolve_chip(target: Target = None) -> Chip:
  """The chip a kernel is sized for.

  Args:
    target: None for the chip JAX runs on (or, under
      `jax.sharding.use_abstract_mesh`, the abstract device's chip, which is
      how an export for TPU names it); off TPU, `OFF_TPU_CHIP`. Else a
      `pltpu.ChipVersion`, its value ("v5e"), a device kind ("TPU v5 lite"),
      or a `pltpu.TpuInfo`.
  """
  if isinstance(target, pltpu.TpuInfo):
    info = target
  elif target is None:
    try:
      info = pltpu.get_tpu_info()
    except ValueError:  # not a TPU device kind: interpret mode on CPU
      info = pltpu.get_tpu_info_for_chip(OFF_TPU_CHIP, 1)
  else:
    if not isinstance(target, pltpu.ChipVersion):
      target = _chip_version(str(target))
    info = pltpu.get_tpu_info_for_chip(target, 1)
  return Chip(str(info.chip_version), info.vmem_capacity_bytes, info.smem_capacity_bytes)


def vmem_limit_bytes(footprint: int, chip: Chip) -> int:
  """The scoped VMEM limit to compile with: the footprint plus headroom for
  Mosaic's own scratch and spills, never above the chip."""
  return min(chip.vmem_bytes, max(_MIN_VMEM_LIMIT, footprint + footprint // 2))


def check_vmem(kernel: str, footprint_of: Callable[[int], int], chunk_rows: int, chip: Chip) -> int:
  """Raises VmemBudgetError unless `footprint_of(chunk_rows)` fits the chip.

  Returns the footprint in bytes.
  """
  footprint = footprint_of(chunk_rows)
  if footprint <= chip.vmem_bytes:
    return footprint
  fits = chunk_rows - SUBLANES
  while fits >= SUBLANES and footprint_of(fits) > chip.vmem_bytes:
    fits -= SUBLANES
  hint = (
    f"use chunk_rows={fits} (or less)"
    if fits >= SUBLANES
    else f"even chunk_rows={SUBLANES} needs {footprint_of(SUBLANES)} bytes; "
    "split the table's rows into narrower tables"
  )
  raise VmemBudgetError(
    f"{kernel}: chunk_rows={chunk_rows} needs {footprint} bytes of VMEM, but "
    f"TPU {chip.name} has {chip.vmem_bytes} bytes per core; {hint}."
  )


# Ids are scalar-prefetched into SMEM a window at a time; a window may fill
# at most this much of SMEM (the rest holds other scalars and Mosaic's own).
_SMEM_FRACTION_FOR_IDS = 0.5


def window_ids(chip: Chip, chunk_rows: int, window_rows: int | None = None) -> int:
  """Ids per kernel call: a multiple of `chunk_rows` that fits SMEM.

  The kernels stream any number of ids: the caller splits them into windows
  of this many ids, one kernel call each, so SMEM never limits a step.

  Args:
    window_rows: a smaller window asked for (tests exercise several windows
      on few ids); rounded down to a multiple of `chunk_rows`.
  """
  fits = int(chip.smem_bytes * _SMEM_FRACTION_FOR_IDS) // WORD_BYTES
  if window_rows is not None:
    fits = min(fits, window_rows)
  return max(chunk_rows, fits // chunk_rows * chunk_rows)
