"""Fused sparse optimizer update of table rows, in place: a Pallas TPU kernel.

One kernel template serves every optimizer: it moves rows and slot rows
between HBM and VMEM and calls the optimizer's pure `update_rows` on them.

Why manual DMAs: the rows to update are scattered through a table far larger
than VMEM, so neither a BlockSpec (contiguous blocks) nor XLA (gather, update,
scatter: three passes over the rows and temporaries in HBM) fits. The table
and every slot stay in HBM (`memory_space=pltpu.HBM`: XLA may not move
them into VMEM around the call, a whole-table copy) and are aliased
to the outputs, so only the listed rows are read and written, in place.

The kernel itself, one grid step per chunk of row ids, is `update_kernel`
(its DMA schedule, and how per-row scalar slots move as lane-dense groups);
this module sizes and calls it: validation, the chunk that fits VMEM, one
call per window of ids, the cost estimate.

Any number of ids: the ids are scalar-prefetched into SMEM one window at a
time (`chip.window_ids`), one kernel call per window, the table and slots
aliased from each call to the next.

bfloat16 rows travel as the uint32 words they are stored as (a lone bf16 row
is not a legal DMA; see `pallas_emb.packing`) and are unpacked in VMEM. The
unpacking concatenates two (C, D/2) halves along lanes: lane-aligned, hence
cheapest, when D % 256 == 0; other widths rely on Mosaic's unaligned
concatenation (a lane shift and a select per vreg).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb import packing
from pallas_emb.errors import InputError
from pallas_emb.kernels import checks, scalar_slots, sub_rows, update_kernel
from pallas_emb.kernels import chip as chip_lib
from pallas_emb.kernels.protocol import RowUpdate

DEFAULT_CHUNK_ROWS = 128


def is_narrow(spec: packing.SlotSpec) -> bool:
  """Whether a slot holds one scalar per row (moved as lane-dense groups)."""
  return spec.width == 1


def supports(table, slots, specs) -> bool:
  """Whether the kernel can update this shard: per-row scalar slots must be
  stored in lane-dense groups, which needs whole 128-row groups."""
  del table
  return all(slots[n].shape[1] == packing.LANES for n in slots if is_narrow(specs[n]))


def vmem_footprint_bytes(
  *,
  dim: int,
  dtype,
  slot_widths: Sequence[int],
  chunk_rows: int = DEFAULT_CHUNK_ROWS,
  num_packed: int = 0,
  stochastic: bool = False,
) -> int:
  """VMEM the fused update needs for one chunk size, in bytes.

  Counts, in (8, 128)-tiled 32-bit words: two row buffers (C, storage width)
  and two buffers per slot (C, width; a scalar slot's are (C, 128) groups)
  -- the double buffer of the DMA schedule --; two (C, dim) gradient blocks
  (the Pallas pipeline's double buffer); the values live during the update:
  unpacked and updated rows, a temporary, the packed words, old and new slot
  rows; per scalar slot its (C, 1) old and new values and a carried group;
  per packed row array (`sub_rows`) its (C, 128) rotated sub-rows and a
  carried physical row (its double buffer is counted at 128 lanes by the
  caller's `slot_widths`, or here for the table); with stochastic rounding,
  the (C, dim) random bits and the (C, 1) row ids' double buffer.

  Args:
    dim: the row width D.
    dtype: the table's logical dtype (float32 or bfloat16).
    slot_widths: stored columns of each optimizer slot (dim, 128 packed,
      or 1 for per-row state).
    chunk_rows: rows per chunk C.
    num_packed: how many of the table and row-shaped slots are packed.
    stochastic: bfloat16 rows are rounded stochastically.
  """
  c = chunk_rows
  width = packing.storage_width(dim, dtype)
  pad = chip_lib.padded_words
  wide = sum(pad(c, w) for w in slot_widths if w != 1)
  narrow = sum(1 for w in slot_widths if w == 1)
  words = (
    2 * pad(c, width)
    + 2 * wide
    + 2 * pad(c, dim)
    + 3 * pad(c, dim)
    + pad(c, width)
    + 2 * wide
    + narrow * (2 * pad(c, scalar_slots.GROUP) + 2 * pad(c, 1) + pad(1, scalar_slots.GROUP))
    + num_packed * (pad(c, packing.LANES) + pad(1, packing.LANES))
    + stochastic * (pad(c, dim) + 2 * pad(c, 1))
  )
  return words * chip_lib.WORD_BYTES


def _flat_scalars(scalars) -> jax.Array:
  values = [jnp.asarray(v, jnp.float32).reshape(()) for v in scalars]
  # SMEM operands cannot be empty.
  return jnp.stack(values) if values else jnp.zeros((1,), jnp.float32)


def fused_update(
  table: jax.Array,
  slots: Mapping[str, jax.Array],
  rows: jax.Array,
  grads: jax.Array,
  scalars: NamedTuple,
  apply: jax.Array,
  *,
  optimizer: RowUpdate,
  dtype,
  rounding_key: jax.Array | None = None,
  interpret=False,
  chunk_rows: int = DEFAULT_CHUNK_ROWS,
  window_rows: int | None = None,
  target: chip_lib.Target = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Applies `optimizer` to the listed rows, in place; see `xla.fused_update`.

  Args:
    table: (R, W) stored rows: float32 (W = dim) or uint32 words of bfloat16
      (W = dim / 2).
    slots: name -> (R, width) float32 | int32 optimizer state, width = dim or
      1, exactly the optimizer's `slot_specs()`.
    rows: (U,) int32 distinct local row ids, ascending; -1 (any id outside
      [0, R)) is padding, after all ids (routing produces them so: the
      writes of per-row scalar slots rely on it).
    grads: (U, dim) float32 summed gradient per row.
    scalars: `optimizer.scalars(step)`, a NamedTuple of float32 scalars.
    apply: bool scalar; when False nothing is written.
    optimizer: supplies `update_rows`.
    dtype: the table's logical dtype.
    rounding_key: None, or a uint32 scalar: bfloat16 rows are rounded
      stochastically with it (`packing.rounding_key`).
    interpret, chunk_rows, window_rows, target: as for
      `pallas_gather.gather`.

  Returns:
    (table, slots) with only the listed rows changed. Donate `table` and
    `slots` to the enclosing jit for the update to happen in place.

  Raises:
    InputError: arrays of the wrong shape or dtype, or per-row scalar slots
      with a number of rows that is not a multiple of 128.
    ConfigError: a bad chunk_rows, interpret or target.
    VmemBudgetError: the chunk does not fit the target chip's VMEM.
  """
  kw = dict(optimizer=optimizer, dtype=dtype, rounding_key=rounding_key)
  dim = checks.check_update(table, slots, rows, grads, scalars, **kw)
  num_ids = rows.shape[0]
  chunk = checks.chunk_size(chunk_rows, num_ids)
  params = checks.interpret_params(interpret)
  if num_ids == 0:
    return table, dict(slots)
  specs = optimizer.slot_specs()
  if not supports(table, slots, specs):
    raise InputError(
      f"fused_update: per-row scalar slots are stored in groups of "
      f"{scalar_slots.GROUP} rows only for shards of a multiple of "
      f"{scalar_slots.GROUP} rows, and this shard has {table.shape[0]}; use "
      "the XLA path (kernels.uses_kernel decides)."
    )
  wide = tuple(n for n in slots if not is_narrow(specs[n]))
  widths = (packing.storage_width(dim, dtype),) + tuple(specs[n].stored_width(dim) for n in wide)
  layout = update_kernel.Layout(
    wide,
    tuple(n for n in slots if is_narrow(specs[n])),
    widths,
    tuple(
      sub_rows.shift_of(w, a.shape[1]) for w, a in zip(widths, [table] + [slots[n] for n in wide])
    ),
  )
  chip = chip_lib.resolve_chip(target)
  footprint = chip_lib.check_vmem(
    "fused_update",
    lambda c: vmem_footprint_bytes(
      dim=dim,
      dtype=dtype,
      slot_widths=[s.shape[1] for s in slots.values()],
      chunk_rows=c,
      num_packed=len(layout.packed),
      stochastic=rounding_key is not None,
    ),
    chunk,
    chip,
  )
  window = chip_lib.window_ids(chip, chunk, window_rows)
  out = _fused_update_call(
    table,
    tuple(slots[n] for n in layout.wide),
    tuple(slots[n] for n in layout.narrow),
    jnp.pad(rows, (0, chip_lib.round_up(num_ids, window) - num_ids), constant_values=-1),
    grads,
    _flat_scalars(scalars),
    jnp.asarray(apply).astype(jnp.int32).reshape(1),
    jax.lax.bitcast_convert_type(
      jnp.zeros((), jnp.uint32) if rounding_key is None else rounding_key, jnp.int32
    ).reshape(1),
    optimizer=optimizer,
    stochastic=rounding_key is not None,
    dtype=np.dtype(dtype),
    layout=layout,
    scalars_type=type(scalars),
    chunk=chunk,
    window=window,
    interpret=params,
    vmem_limit=chip_lib.vmem_limit_bytes(footprint, chip),
  )
  new = dict(zip(layout.wide + layout.narrow, out[1:]))
  return out[0], {n: new[n] for n in slots}


@functools.partial(
  jax.jit,
  static_argnames=[
    "optimizer",
    "dtype",
    "stochastic",
    "layout",
    "scalars_type",
    "chunk",
    "window",
    "interpret",
    "vmem_limit",
  ],
)
def _fused_update_call(
  table,
  wide,
  narrow,
  rows,
  grads,
  flat_scalars,
  apply,
  key,
  *,
  optimizer,
  dtype,
  stochastic,
  layout,
  scalars_type,
  chunk,
  window,
  interpret,
  vmem_limit,
):
  """The kernel, once per window of ids; table and slots chain in place."""
  num_ids = grads.shape[0]
  arrays = (table, *wide, *narrow)
  for start in range(0, num_ids, window):
    call = _window_call(
      arrays,
      grads,
      size=min(window, num_ids - start),
      num_narrow=len(narrow),
      optimizer=optimizer,
      dtype=dtype,
      stochastic=stochastic,
      layout=layout,
      scalars_type=scalars_type,
      chunk=chunk,
      interpret=interpret,
      vmem_limit=vmem_limit,
    )
    arrays = tuple(
      call(
        rows[start : start + window],
        apply,
        flat_scalars,
        jnp.full((1,), start // chunk, jnp.int32),
        key,
        grads,
        *([rows.reshape(-1, 1)] if stochastic else []),
        *arrays,
      )
    )
  return arrays


def _window_call(
  arrays,
  grads,
  *,
  size,
  num_narrow,
  optimizer,
  dtype,
  stochastic,
  layout,
  scalars_type,
  chunk,
  interpret,
  vmem_limit,
):
  """The pallas_call of one window of `size` ids."""
  dim = grads.shape[1]
  table = arrays[0]
  num_rows = packing.num_rows_of(table, layout.widths[0])
  steps = pl.cdiv(size, chunk)
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  wide = arrays[1 : len(arrays) - num_narrow]
  narrow = arrays[len(arrays) - num_narrow :]
  noise = sds((steps * chunk, dim), jnp.uint32) if stochastic else None
  cost = pl.estimate_cost(
    lambda words, slots, grads, scalars, noise: update_kernel.update_chunk(
      words, slots, grads, scalars, optimizer=optimizer, dtype=dtype, noise=noise
    ),
    sds((steps * chunk, layout.widths[0]), table.dtype),
    {n: sds((steps * chunk, w), a.dtype) for n, a, w in zip(layout.wide, wide, layout.widths[1:])}
    | {n: sds((steps * chunk, 1), a.dtype) for n, a in zip(layout.narrow, narrow)},
    sds((steps * chunk, dim), jnp.float32),
    scalars_type(*(sds((), jnp.float32) for _ in scalars_type._fields)),
    noise,
  )
  shifts = layout.shifts + (scalar_slots.GROUP_SHIFT,) * num_narrow
  moved = 0
  for a, shift in zip(arrays, shifts):
    # Each id reads and writes its row; a physical row of several rows (a
    # packed array's, a scalar slot's group) moves once per run of ids:
    # at most once per physical row, plus a re-read where a run crosses
    # chunks.
    reads, writes = (
      (min(size, a.shape[0] + steps), min(size, a.shape[0])) if shift else (size, size)
    )
    moved += (reads + writes) * a.shape[1] * a.dtype.itemsize
  cost = pl.CostEstimate(
    flops=cost.flops,
    transcendentals=cost.transcendentals,
    bytes_accessed=moved + size * (dim * 4 + 4),  # and the grads and ids, once
  )

  hbm = pl.BlockSpec(memory_space=pltpu.HBM)
  num_scalar_prefetch = 5
  kernel = functools.partial(
    update_kernel.update_kernel,
    optimizer=optimizer,
    dtype=dtype,
    layout=layout,
    scalars_type=scalars_type,
    num_rows=num_rows,
    stochastic=stochastic,
  )
  packed = [arrays[k] for k in layout.packed]
  chunk_of = lambda i, rows, apply, scalars, off, key: (i + off[0], 0)
  return pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=num_scalar_prefetch,
      grid=(steps,),
      # Grads (and ids, for the rounding) span all ids: blocks from the
      # window's first.
      in_specs=[pl.BlockSpec((chunk, dim), chunk_of)]
      + [pl.BlockSpec((chunk, 1), chunk_of)] * stochastic
      + [hbm] * len(arrays),
      out_specs=[hbm] * len(arrays),
      scratch_shapes=[pltpu.VMEM((2, chunk, a.shape[1]), a.dtype) for a in arrays]
      + [pltpu.VMEM((chunk, 1), a.dtype) for a in narrow] * 2
      + [pltpu.VMEM((1, a.shape[1]), a.dtype) for a in narrow]
      + [pltpu.VMEM((chunk, packing.LANES), jnp.int32) for _ in packed]
      + [pltpu.VMEM((1, packing.LANES), a.dtype) for a in packed]
      + [pltpu.SMEM((1,), jnp.int32), pltpu.SMEM((max(len(packed), 1),), jnp.int32)]
      + [pltpu.SemaphoreType.DMA((2, len(arrays)))] * 2,
    ),
    # In HBM, stated: else XLA may stage a small enough slot (or table)
    # in VMEM around the call, copying all of it every step.
    out_shape=[pltpu.HBM(a.shape, a.dtype) for a in arrays],
    # Alias indices count the scalar-prefetch operands too: the operands
    # are rows, apply, scalars, offset, key, grads, the ids if stochastic,
    # then the table and slots.
    input_output_aliases={num_scalar_prefetch + 1 + stochastic + k: k for k in range(len(arrays))},
    compiler_params=pltpu.CompilerParams(
      # Buffers carry chunks (and scalar-slot groups) across grid steps.
      dimension_semantics=("arbitrary",),
      vmem_limit_bytes=vmem_limit,
    ),
    cost_estimate=cost,
    interpret=interpret,
  )
