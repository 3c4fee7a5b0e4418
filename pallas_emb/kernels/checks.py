"""Argument checks shared by the Pallas kernels and the XLA path.

`check_gather` and `check_update` are the validators of the two operations;
each backend calls the same one before it traces anything, so a bad argument
gets the same error whichever backend runs. Everything here reads static
shapes and dtypes only.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_emb import packing
from pallas_emb.errors import ConfigError, InputError
from pallas_emb.kernels.chip import SUBLANES, round_up
from pallas_emb.kernels.protocol import RowUpdate


def interpret_params(interpret) -> pltpu.InterpretParams | bool:
  """`interpret=` of `pl.pallas_call`: False, or TPU interpret parameters.

  True means default `InterpretParams()`: the TPU interpreter, which runs
  DMAs asynchronously against simulated HBM, VMEM and semaphores (and can
  detect races), not pallas_call's generic interpreter, which completes
  every copy at its start and so cannot exercise the schedule.
  """
  if isinstance(interpret, pltpu.InterpretParams):
    return interpret
  if isinstance(interpret, (bool, np.bool_)):
    return pltpu.InterpretParams() if interpret else False
  raise ConfigError(
    f"interpret must be a bool or a pltpu.InterpretParams, got "
    f"{interpret!r} of type {type(interpret).__name__}."
  )


def chunk_size(chunk_rows, num_ids: int) -> int:
  """The rows per grid step: `chunk_rows`, capped at `num_ids` rounded to 8.

  Raises:
    ConfigError: `chunk_rows` is not a positive multiple of 8.
  """
  is_int = isinstance(chunk_rows, (int, np.integer)) and not isinstance(chunk_rows, bool)
  if not is_int or chunk_rows < SUBLANES or chunk_rows % SUBLANES:
    fix = round_up(max(int(chunk_rows), SUBLANES), SUBLANES) if is_int else 128
    raise ConfigError(
      f"chunk_rows must be a positive multiple of {SUBLANES} (the TPU "
      f"sublane count, so every VMEM buffer is whole (8, 128) tiles), got "
      f"{chunk_rows!r}; use e.g. chunk_rows={fix}."
    )
  return min(int(chunk_rows), round_up(max(num_ids, 1), SUBLANES))


def check_rows(rows, name: str = "rows") -> int:
  """Validates (U,) int32 local row ids; returns U."""
  if np.dtype(rows.dtype) != np.int32 or rows.ndim != 1:
    raise InputError(
      f"{name} must be a 1-D int32 array of local row ids (-1 = padding), "
      f"got {rows.dtype}{list(rows.shape)}; flatten it and convert it with "
      "pallas_emb.int32_ids(rows), which makes ids outside int32 invalid "
      "instead of wrapping them onto a row as .astype(jnp.int32) would."
    )
  return rows.shape[0]


def check_stored_table(table, dtype) -> int:
  """Validates a stored table for logical `dtype`; returns the row dim."""
  dtype = np.dtype(dtype)
  if dtype not in packing.SUPPORTED_DTYPES:
    raise InputError(f"dtype must be float32 or bfloat16, got {dtype}.")
  want = packing.storage_dtype(dtype)
  if table.ndim != 2 or np.dtype(table.dtype) != want:
    raise InputError(
      f"a {dtype} table is stored as a 2-D {want} array (see "
      f"pallas_emb.packing), got {table.dtype}{list(table.shape)}; build it "
      "with packing.to_storage / ShardedEmbedding.init."
    )
  width = table.shape[1]
  return 2 * width if dtype == packing.SUPPORTED_DTYPES[1] else width


def check_slots(
  slots: Mapping,
  specs: Mapping[str, packing.SlotSpec],
  num_rows: int,
  dim: int,
  *,
  owner: str,
  fix: str,
  table: str | None = None,
  rows_per_shard: int | None = None,
) -> None:
  """Validates slots against an optimizer's `slot_specs()`: the same names,
  and each slot stored as `SlotSpec.shape_for` says, of its dtype.

  Args:
    rows_per_shard: rows of each shard of the `num_rows` (default: one
      shard).
    owner: the optimizer's name, for the message.
    fix: what to pass instead, for the message.
    table: the table's name, for the message.
  """
  of = "" if table is None else f" of table {table!r}"
  if set(slots) != set(specs):
    raise InputError(f"the slots{of} are {sorted(slots)}, but {owner} keeps {sorted(specs)}; {fix}")
  for name, spec in specs.items():
    x = slots[name]
    want = spec.shape_for(num_rows, dim, rows_per_shard)
    if tuple(x.shape) != want or np.dtype(x.dtype) != np.dtype(spec.dtype):
      raise InputError(
        f"slot {name!r}{of} is {x.dtype}{list(x.shape)}, but {owner} keeps "
        f"{np.dtype(spec.dtype)}{list(want)} (see pallas_emb.packing); {fix}"
      )


def check_scalars(scalars) -> None:
  """`optimizer.scalars(step)`: a NamedTuple of single numbers (SMEM)."""
  if not (isinstance(scalars, tuple) and hasattr(type(scalars), "_fields")):
    raise InputError(
      f"scalars must be the NamedTuple of optimizer.scalars(step), got {type(scalars).__name__}."
    )
  for name, v in zip(scalars._fields, scalars):
    if np.size(v) != 1:
      raise InputError(
        f"scalar {name!r} must be a single number (it is prefetched into "
        f"SMEM), got shape {np.shape(v)}."
      )


def check_gather(table, rows, dtype) -> int:
  """The validator of `gather` on every backend; returns the row dim."""
  dim = check_stored_table(table, dtype)
  check_rows(rows)
  return dim


def check_grads(grads, num: int, dim: int, *, name: str = "grads", per: str = "row id") -> None:
  """Validates float32[num, dim] gradients, one per `per`."""
  if tuple(grads.shape) != (num, dim) or np.dtype(grads.dtype) != np.float32:
    raise InputError(
      f"{name} must be float32[{num}, {dim}] (one summed gradient per "
      f"{per}, dim {dim}), got {grads.dtype}{list(grads.shape)}."
    )


def check_optimizer_state(table, slots, scalars, optimizer: RowUpdate, dim: int) -> None:
  """Validates an update's slots and step scalars against `optimizer`."""
  check_slots(
    slots,
    optimizer.slot_specs(),
    table.shape[0],
    dim,
    owner=type(optimizer).__name__,
    fix="pass the TableState's slots.",
  )
  check_scalars(scalars)


def check_update(table, slots, rows, grads, scalars, *, optimizer: RowUpdate, dtype) -> int:
  """The validator of `fused_update` on every backend; returns the row dim."""
  dim = check_stored_table(table, dtype)
  check_grads(grads, check_rows(rows), dim)
  check_optimizer_state(table, slots, scalars, optimizer, dim)
  return dim
