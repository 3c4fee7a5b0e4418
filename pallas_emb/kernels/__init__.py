"""Row gather and fused optimizer update over one device's row shard.

`gather` and `fused_update` dispatch on a backend name ("pallas",
"interpret", "xla", "native"); see `backend.py`. The Pallas kernels are
`pallas_gather` and `pallas_update`, the XLA path (their oracle) is `xla`.
The native CPU backend adds two operations: `unique_impl`, the dedup core
that `sharding.dedup` takes, and `segment_sum_update`, one device's whole
update in one pass. A leaf of the package: kernels import only `errors` and
`packing`, take any optimizer with `update_rows` (see `protocol.RowUpdate`)
and know nothing of training.
"""

from __future__ import annotations

from pallas_emb.kernels import (
  checks,
  chip,
  native,
  native_id_map,
  pallas_gather,
  pallas_update,
  staged_update,
  xla,
)
from pallas_emb.kernels.backend import BACKENDS, check_name, default_backend, resolve_backend


def _kernel_mode(backend: str) -> bool:
  """interpret= for a Pallas backend; refuses names that are no backend."""
  return check_name(backend) == "interpret"


def uses_kernel(backend: str, table, slots=None, optimizer=None) -> bool:
  """Whether `backend` runs the Pallas kernels on this stored table shard.

  On a TPU a Mosaic operand is (8, 128)-tiled, but XLA keeps an array whose
  stored rows are not a multiple of 128 lanes wide transposed in HBM, so a
  kernel there would relayout the whole table every step: such tables (and
  tables with such slots) take the XLA path on "pallas". Every table and
  slot is stored lane-dense (`pallas_emb.packing`): rows of a width that
  divides 128 packed 128 / width to a physical row, other widths padded to
  one that divides 128 or is a multiple of it; only a shard too small to
  hold whole physical rows stays narrow. The interpreter ("interpret") runs
  the kernels at any width: that is how they are tested. The update kernel
  also needs whole 128-row groups of a shard with per-row scalar slots.
  """
  if check_name(backend) in ("xla", "native"):
    return False
  if slots is not None and not pallas_update.supports(table, slots, optimizer.slot_specs()):
    return False
  arrays = [table] + list((slots or {}).values())
  return backend == "interpret" or all(a.shape[1] % chip.LANES == 0 for a in arrays)


def gather(table, rows, *, dtype, backend: str, dim: int | None = None, in_hbm: bool = True):
  """(C,) local rows (-1 padding) of a stored table -> (C, dim) float32.

  `dim`: the row width, for a table that may be stored packed
  (`pallas_emb.packing`); None for rows stored as they are. `in_hbm`: see
  `pallas_gather.gather` (False for rows the step computed)."""
  if not uses_kernel(backend, table):
    return xla.gather(table, rows, dtype=dtype, dim=dim)
  return pallas_gather.gather(
    table, rows, dtype=dtype, dim=dim, interpret=_kernel_mode(backend), in_hbm=in_hbm
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
  rounding_key=None,
  dim: int | None = None,
):
  """In-place optimizer update of distinct rows; see `xla.fused_update`
  (`rounding_key`: stochastic rounding of bfloat16 rows; the native
  backend runs float32 tables only; `dim`: the table's row width, checked
  against the gradients', see `checks.check_update`). An optimizer whose
  math cannot run in a kernel (`runs_in_kernel` False) has it run in XLA on
  the rows the kernels move (`staged_update`)."""
  checks.check_update(
    table, slots, rows, grads, scalars, optimizer=optimizer, dtype=dtype,
    rounding_key=rounding_key, dim=dim,
  )
  if backend == "native" and rounding_key is None and native.supports(optimizer, dtype):
    return native.fused_update(
      table, slots, rows, grads, scalars, apply, optimizer=optimizer, dtype=dtype, dim=dim
    )
  args = (table, slots, rows, grads, scalars, apply)
  kw = dict(optimizer=optimizer, dtype=dtype, rounding_key=rounding_key)
  if not uses_kernel(backend, table, slots, optimizer):
    return xla.fused_update(*args, **kw)
  if not getattr(optimizer, "runs_in_kernel", True):
    return staged_update.fused_update(*args, **kw, interpret=_kernel_mode(backend))
  return pallas_update.fused_update(*args, **kw, interpret=_kernel_mode(backend))


def unique_impl(backend: str):
  """The dedup core of `backend` for `sharding.dedup` (None: its own)."""
  return native.unique_keys if backend == "native" else None


def id_map_impl(backend: str):
  """(plan, owner step, one-shard step) of `backend` for
  `sharding.id_map.translate` (None: its own XLA code)."""
  if backend != "native":
    return None
  return (native_id_map.plan, native_id_map.owner_step, native_id_map.one_shard_step)


def fuses_segment_sum(backend: str, optimizer, dtype) -> bool:
  """True if `segment_sum_update` runs this optimizer and dtype."""
  return backend == "native" and native.supports(optimizer, dtype)


def segment_sum_update(
  table, slots, rows, inverse, token_grads, scalars, gate, *, optimizer, dtype, dim=None
):
  """Sum per row, norm, gate and update in one pass (when
  `fuses_segment_sum`); see `native.segment_sum_update`."""
  return native.segment_sum_update(
    table, slots, rows, inverse, token_grads, scalars, gate, optimizer=optimizer, dtype=dtype,
    dim=dim,
  )


__all__ = [
  "BACKENDS",
  "default_backend",
  "fused_update",
  "fuses_segment_sum",
  "gather",
  "resolve_backend",
  "segment_sum_update",
  "unique_impl",
]
