"""Row gather and fused optimizer update over one device's row shard.

`gather` and `fused_update` dispatch on a backend name ("pallas",
"interpret", "xla", "native"; see `backend.py`) and, on a TPU, on a cost
model (`forms`): the block sweep kernels (`block_gather`, `block_update`)
where they are cheaper for the table and step shape, XLA's own gather and
scatter (`xla`, also the oracle) where they are not. The native CPU backend
adds two operations: `unique_impl`, the dedup core that `sharding.dedup`
takes, and `segment_sum_update`, one device's whole update in one pass. A
leaf of the package: kernels import only `errors` and `packing`, take any
optimizer with `update_rows` (see `protocol.RowUpdate`) and know nothing of
training.
"""

from __future__ import annotations

from pallas_emb.kernels import (
  block_gather,
  block_update,
  blocks,
  checks,
  chip,
  forms,
  native,
  native_id_map,
  staged_update,
  xla,
)
from pallas_emb.kernels.backend import BACKENDS, check_name, default_backend, resolve_backend


def _kernel_mode(backend: str) -> bool:
  """interpret= for a Pallas backend; refuses names that are no backend."""
  return check_name(backend) == "interpret"


def uses_kernel(backend: str, table, slots=None) -> bool:
  """Whether `backend` may run the Pallas kernels on this stored table shard.

  On a TPU a Mosaic operand is (8, 128)-tiled, but XLA keeps an array whose
  stored rows are not a multiple of 128 lanes wide transposed in HBM, so a
  kernel there would relayout the whole table every step: such tables (and
  tables with such slots) take the XLA path on "pallas". Every table and
  slot is stored lane-dense (`pallas_emb.packing`): rows of a width that
  divides 128 packed 128 / width to a physical row, other widths padded to
  one that divides 128 or is a multiple of it; only a shard too small to
  hold whole physical rows stays narrow (a per-row scalar slot of a shard
  that is not whole 128-row groups, too). The interpreter ("interpret") runs
  the kernels at any width: that is how they are tested.
  """
  if check_name(backend) in ("xla", "native"):
    return False
  arrays = [table] + list((slots or {}).values())
  return backend == "interpret" or all(a.shape[1] % chip.LANES == 0 for a in arrays)


def _block_rows(arrays, num_rows: int, dim: int, dtype) -> int:
  """The block of a sweep of these arrays (`blocks.block_rows`)."""
  row_bytes = max(a.size * a.dtype.itemsize // max(num_rows, 1) for a in arrays)
  return blocks.block_rows(num_rows, row_bytes, block_update.DEFAULT_BLOCK_BYTES)


def gather_form(backend: str, table, num_ids: int, *, dim: int, dtype, ascending: bool) -> str:
  """ "block" or "xla": the form of a gather of `num_ids` rows on `backend`
  (the block form needs ascending ids)."""
  check_name(backend)
  if not ascending or not uses_kernel(backend, table):
    return "xla"
  if backend == "interpret":
    return "block"
  rows = checks.table_rows(table, dim, dtype)
  block = _block_rows([table], rows, dim, dtype)
  return forms.pick(
    forms.gather_costs(
      table_bytes=table.size * table.dtype.itemsize,
      num_rows=rows,
      num_ids=num_ids,
      block_rows=block,
      packed=table.shape[1] != checks.row_width(table, dim, dtype),
    )
  )


def gather(table, rows, *, dtype, backend: str, dim: int | None = None, ascending: bool = False):
  """(C,) local rows (-1 padding) of a stored table -> (C, dim) float32.

  `dim`: the row width, for a table that may be stored packed
  (`pallas_emb.packing`); None for rows stored as they are. `ascending`:
  the rows are ascending, padding last (an owner's unique rows on one
  shard), which the block form needs and the XLA form is told."""
  dim = checks.check_gather(table, rows, dtype, dim)
  form = gather_form(backend, table, rows.shape[0], dim=dim, dtype=dtype, ascending=ascending)
  if form == "xla":
    return xla.gather(table, rows, dtype=dtype, dim=dim, ascending=ascending)
  return block_gather.gather(table, rows, dtype=dtype, dim=dim, interpret=_kernel_mode(backend))


def update_form(backend: str, table, slots, num_ids: int, *, dim: int, dtype) -> str:
  """ "block" or "xla": the form of an update of `num_ids` rows on `backend`
  (a kernel backend; "native" and "xla" run their own)."""
  if not uses_kernel(backend, table, slots):
    return "xla"
  if backend == "interpret":
    return "block"
  rows = checks.table_rows(table, dim, dtype)
  arrays = [table] + list(slots.values())
  return forms.pick(
    forms.update_costs(
      array_bytes=[a.size * a.dtype.itemsize for a in arrays],
      num_rows=rows,
      num_ids=num_ids,
      block_rows=_block_rows(arrays, rows, dim, dtype),
      packed=table.shape[1] != checks.row_width(table, dim, dtype),
    )
  )


def fused_update(
  table,
  slots,
  rows,
  grads,
  scalars,
  apply,
  *,
  optimizer,
  dtype,
  backend: str,
  rounding_keys=None,
  dim: int | None = None,
):
  """In-place optimizer update of distinct rows, ascending, padding last;
  see `xla.fused_update` (`rounding_keys`: (U,) uint32 per-row keys of
  stochastic rounding of bfloat16 rows; the native backend runs float32
  tables only; `dim`: the table's row width, checked against the
  gradients', see `checks.check_update`). An optimizer whose math cannot run
  in a kernel (`runs_in_kernel` False) has it run in XLA on the rows the
  block kernels move (`staged_update`)."""
  kw = dict(optimizer=optimizer, dtype=dtype, rounding_keys=rounding_keys, dim=dim)
  kw["dim"] = dim = checks.check_update(table, slots, rows, grads, scalars, **kw)
  args = (table, slots, rows, grads, scalars, apply)
  if backend == "native" and rounding_keys is None and native.supports(optimizer, dtype):
    return native.fused_update(*args, optimizer=optimizer, dtype=dtype, dim=dim)
  if update_form(backend, table, slots, rows.shape[0], dim=dim, dtype=dtype) == "xla":
    return xla.fused_update(*args, **kw)
  if not getattr(optimizer, "runs_in_kernel", True):
    return staged_update.fused_update(*args, **kw, interpret=_kernel_mode(backend))
  return block_update.fused_update(*args, **kw, interpret=_kernel_mode(backend))


def unique_impl(backend: str):
  """The dedup core of `backend` for `sharding.dedup` (None: its own)."""
  return native.unique_keys if backend == "native" else None


def id_map_impl(backend: str) -> dict | None:
  """`backend`'s steps of the id map, by `sharding.id_map.MapImpl`'s field
  names (None: the map's own XLA code)."""
  if backend != "native":
    return None
  return dict(
    plan=native_id_map.plan,
    owner_step=native_id_map.owner_step,
    one_shard=native_id_map.one_shard_step,
  )


def fuses_segment_sum(backend: str, optimizer, dtype) -> bool:
  """True if `segment_sum_update` runs this optimizer and dtype."""
  return backend == "native" and native.supports(optimizer, dtype)


def segment_sum_update(
  table, slots, rows, inverse, token_grads, scalars, gate, *, optimizer, dtype, dim=None
):
  """Sum per row, norm, gate and update in one pass (when
  `fuses_segment_sum`); see `native.segment_sum_update`."""
  return native.segment_sum_update(
    table,
    slots,
    rows,
    inverse,
    token_grads,
    scalars,
    gate,
    optimizer=optimizer,
    dtype=dtype,
    dim=dim,
  )


__all__ = [
  "BACKENDS",
  "default_backend",
  "fused_update",
  "fuses_segment_sum",
  "gather",
  "gather_form",
  "update_form",
  "resolve_backend",
  "segment_sum_update",
  "unique_impl",
]
