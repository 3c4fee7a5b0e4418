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


def check_stored_table(table, dtype, dim: int | None = None) -> int:
  """Validates a stored table for logical `dtype`; returns the row dim.

  Args:
    dim: None for rows stored as they are, (R, storage width); else the
      table's row width, and the table may also be stored packed,
      (R * storage width / 128, 128) (see `pallas_emb.packing`).
  """
  dtype = np.dtype(dtype)
  if dtype not in packing.SUPPORTED_DTYPES + packing.WORD_DTYPES:
    raise InputError(f"dtype must be float32 or bfloat16 (or an int32 slot's words), got {dtype}.")
  want = packing.storage_dtype(dtype)
  if table.ndim != 2 or np.dtype(table.dtype) != want:
    raise InputError(
      f"a {dtype} table is stored as a 2-D {want} array (see "
      f"pallas_emb.packing), got {table.dtype}{list(table.shape)}; build it "
      "with packing.to_storage / ShardedEmbedding.init."
    )
  if dim is None:
    width = table.shape[1]
    return 2 * width if dtype == packing.SUPPORTED_DTYPES[1] else width
  width = packing.storage_width(dim, dtype)
  if packing.num_rows_of(table, width) is None:
    raise InputError(
      f"a {dtype} table of dim {dim} is stored {want}[rows, {width}] or, "
      f"packed, {want}[rows * {width} / {packing.LANES}, {packing.LANES}], "
      f"got {table.dtype}{list(table.shape)}; store it with "
      "packing.table_stored."
    )
  return dim


def row_width(table, dim: int, dtype) -> int:
  """Words per row of a table that `check_stored_table` accepted: its
  `packing.storage_width`, or, for rows kept unpadded (rows a step
  computed, gathered again), their own `packing.row_words`."""
  words = packing.row_words(dim, dtype)
  return words if table.shape[1] == words else packing.storage_width(dim, dtype)


def table_rows(table, dim: int, dtype) -> int:
  """Logical rows of a table that `check_stored_table` accepted."""
  return packing.num_rows_of(table, packing.storage_width(dim, dtype))


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
  lenient: bool = False,
) -> None:
  """Validates slots against an optimizer's `slot_specs()`: the same names,
  and each slot stored as `SlotSpec.shape_for` says, of its dtype.

  Args:
    rows_per_shard: rows of each shard of the `num_rows` (default: one
      shard).
    owner: the optimizer's name, for the message.
    fix: what to pass instead, for the message.
    table: the table's name, for the message.
    lenient: also accept a row-shaped slot stored unpacked, (num_rows,
      width), where `packing.packs` would pack it.
  """
  of = "" if table is None else f" of table {table!r}"
  if set(slots) != set(specs):
    raise InputError(f"the slots{of} are {sorted(slots)}, but {owner} keeps {sorted(specs)}; {fix}")
  for name, spec in specs.items():
    x = slots[name]
    want = spec.shape_for(num_rows, dim, rows_per_shard)
    # A kernel's caller may keep a wide slot as rows (unpacked); a scalar
    # slot's stored shape is fixed (the kernels rely on its groups).
    ok = tuple(x.shape) == want or (
      lenient and spec.width != 1 and tuple(x.shape) == (num_rows, spec.stored_width(dim))
    )
    if not ok or np.dtype(x.dtype) != np.dtype(spec.dtype):
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


def check_gather(table, rows, dtype, dim: int | None = None) -> int:
  """The validator of `gather` on every backend; returns the row dim."""
  dim = check_stored_table(table, dtype, dim)
  check_rows(rows)
  return dim


def check_grads(grads, num: int, dim: int, *, name: str = "grads", per: str = "row id") -> None:
  """Validates float32[num, dim] gradients, one per `per`."""
  if tuple(grads.shape) != (num, dim) or np.dtype(grads.dtype) != np.float32:
    raise InputError(
      f"{name} must be float32[{num}, {dim}] (one summed gradient per "
      f"{per}, dim {dim}), got {grads.dtype}{list(grads.shape)}."
    )


def check_optimizer_state(table, slots, scalars, optimizer: RowUpdate, dim: int, dtype) -> None:
  """Validates an update's slots and step scalars against `optimizer`."""
  check_slots(
    slots,
    optimizer.slot_specs(),
    table_rows(table, dim, dtype),
    dim,
    owner=type(optimizer).__name__,
    fix="pass the TableState's slots.",
    lenient=True,
  )
  check_scalars(scalars)


def check_rounding_keys(rounding_keys, num_ids: int, dtype) -> None:
  """None (round to nearest even), or (U,) uint32 per-row keys of
  stochastic rounding (`packing.row_rounding_keys`), which only a bfloat16
  table has."""
  if rounding_keys is None:
    return
  if np.dtype(rounding_keys.dtype) != np.uint32 or tuple(rounding_keys.shape) != (num_ids,):
    raise InputError(
      f"rounding_keys must be uint32[{num_ids}], one per row id "
      f"(packing.row_rounding_keys(packing.rounding_key(seed, step, tag), logical_rows)), got "
      f"{rounding_keys.dtype}{list(np.shape(rounding_keys))}."
    )
  if np.dtype(dtype) != packing.SUPPORTED_DTYPES[1]:
    raise InputError(
      f"rounding_keys: stochastic rounding applies to bfloat16 rows only, and this table is "
      f"{np.dtype(dtype)} (stored exactly); pass rounding_keys=None."
    )


def check_update(
  table, slots, rows, grads, scalars, *, optimizer: RowUpdate, dtype, rounding_keys=None, dim=None
) -> int:
  """The validator of `fused_update` on every backend; returns the row dim.

  Args:
    dim: the table's logical row width. Given, the table must store rows of
      that width (as they are, padded or packed) and `grads` must be as
      wide: a stored (R, 128) table holds R rows of 96 (padded) or 128, or
      2R of 64 (packed), so the gradients' width alone cannot say which.
      None: the width is taken from `grads` where the table can hold it
      (the kernels' direct callers, whose tables are what they pass).
  """
  check_rounding_keys(rounding_keys, check_rows(rows), dtype)
  if dim is not None:
    check_stored_table(table, dtype, dim)
    if grads.ndim != 2 or grads.shape[1] != dim:
      raise InputError(
        f"grads are {list(grads.shape)}, but the table's rows are {dim} wide (stored "
        f"{table.dtype}{list(table.shape)}); pass one summed gradient of width {dim} per row "
        "(strip routing padding with packing.unpadded)."
      )
  else:
    dim = check_stored_table(table, dtype)
    if grads.ndim == 2 and grads.shape[1] != dim and grads.shape[1] > 0:
      # A packed or padded table's row width is the gradients'.
      width = packing.storage_width(grads.shape[1], dtype)
      if width > 0 and packing.num_rows_of(table, width) is not None:
        dim = grads.shape[1]
  check_grads(grads, check_rows(rows), dim)
  check_optimizer_state(table, slots, scalars, optimizer, dim, dtype)
  return dim
