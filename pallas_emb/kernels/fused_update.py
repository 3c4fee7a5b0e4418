"""Fused sparse optimizer update of table rows, in place: a Pallas TPU kernel.

One kernel template serves every optimizer: it moves rows and slot rows
between HBM and VMEM and calls the optimizer's pure `update_rows` on them.

Why manual DMAs: the rows to update are scattered through a table far larger
than VMEM, so neither a BlockSpec (contiguous blocks) nor XLA (gather, update,
scatter: three passes over the rows and temporaries in HBM) fits. The table
and every slot stay in HBM (`memory_space=pltpu.HBM`: XLA may not move
them into VMEM around the call, a whole-table copy) and are aliased
to the outputs, so only the listed rows are read and written, in place.

The schedule, for chunks of C row ids (grid step i handles chunk i; two VMEM
buffers per array, chunk i in buffer i % 2):

    step 0:     start the reads of chunk 0                  -> buffer 0
    every step: wait the writes of chunk i-1 (they read buffer (i+1) % 2,
                  which is refilled next)
                start the reads of chunk i+1                -> buffer (i+1) % 2
                wait the reads of chunk i
                unpack, update_rows, pack, store           in buffer i % 2
                start the writes of chunk i                 <- buffer i % 2
    last step:  wait the writes of chunks i-1 and i

So the reads of chunk i+1 overlap the update of chunk i, and the writes of
chunk i overlap the reads of chunk i+1. Every row and slot row is its own DMA
(`row_dma.ChunkCopies`): up to 2 * C * (1 + number of row-shaped slots) in
flight. The ids must be distinct: two DMAs writing the same row race (the
interpreter's race detector reports it). When `apply` is false the kernel
issues no DMA at all, so the table and slots stay bit-identical.

Per-row scalar slots (width 1: row-wise Adagrad's accumulator, Adam's
count) move as lane-dense groups of 128 rows (`scalar_slots`): passed as
they are, (R, 1), they would be relaid out and padded 128x on every step.
That needs R to be a multiple of 128, which `RowLayout` gives every shard of
128 rows or more; a smaller table takes the XLA path (`uses_kernel`). The
group writes need the ids ascending (routing produces them so); padding ids
(-1) come last.

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
from typing import Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb import packing
from pallas_emb.errors import InputError
from pallas_emb.kernels import checks, row_dma, scalar_slots
from pallas_emb.kernels import chip as chip_lib
from pallas_emb.kernels.protocol import RowUpdate

DEFAULT_CHUNK_ROWS = 128


def is_narrow(spec: packing.SlotSpec) -> bool:
  """Whether a slot holds one scalar per row (moved as lane-dense groups)."""
  return spec.width == 1


def supports(table, slots, specs) -> bool:
  """Whether the kernel can update this shard: per-row scalar slots must be
  stored in lane-dense groups, which needs whole 128-row groups."""
  return all(specs[n].grouped(table.shape[0]) for n in slots
             if is_narrow(specs[n]))


def vmem_footprint_bytes(*, dim: int, dtype, slot_widths: Sequence[int],
                         chunk_rows: int = DEFAULT_CHUNK_ROWS) -> int:
  """VMEM the fused update needs for one chunk size, in bytes.

  Counts, in (8, 128)-tiled 32-bit words: two row buffers (C, storage width)
  and two buffers per slot (C, width; a scalar slot's are (C, 128) groups)
  -- the double buffer of the DMA schedule --; two (C, dim) gradient blocks
  (the Pallas pipeline's double buffer); the values live during the update:
  unpacked and updated rows, a temporary, the packed words, old and new slot
  rows; per scalar slot its (C, 1) old and new values and a carried group.

  Args:
    dim: the row width D.
    dtype: the table's logical dtype (float32 or bfloat16).
    slot_widths: columns of each optimizer slot (dim, or 1 for per-row state).
    chunk_rows: rows per chunk C.
  """
  c = chunk_rows
  width = packing.storage_width(dim, dtype)
  pad = chip_lib.padded_words
  wide = sum(pad(c, w) for w in slot_widths if w != 1)
  narrow = sum(1 for w in slot_widths if w == 1)
  words = (2 * pad(c, width) + 2 * wide + 2 * pad(c, dim)
           + 3 * pad(c, dim) + pad(c, width) + 2 * wide
           + narrow * (2 * pad(c, scalar_slots.GROUP) + 2 * pad(c, 1)
                       + pad(1, scalar_slots.GROUP)))
  return words * chip_lib.WORD_BYTES


def _update_chunk(words, slots, grads, scalars, *, optimizer, dtype):
  """Stored rows -> updated stored rows: what the kernel runs per chunk."""
  new_rows, new_slots = optimizer.update_rows(
      packing.unpack_rows(words, dtype), slots, grads, scalars)
  packed = packing.pack_rows(new_rows, dtype).astype(words.dtype)
  return packed, {k: new_slots[k].astype(v.dtype) for k, v in slots.items()}


class _Layout(NamedTuple):
  """The static structure of one call: which slots move how."""

  wide: tuple[str, ...]    # row-shaped slots, DMA'd with the rows
  narrow: tuple[str, ...]  # per-row scalars, DMA'd as (1, 128) groups


def _update_kernel(rows_ref, apply_ref, scalars_ref, offset_ref, grads_ref,
                   *refs, optimizer, dtype, layout, scalars_type, num_rows):
  """One grid step: one chunk of row ids; see the module docstring.

  Refs: rows (W,) int32, apply (1,) int32, scalars (S,) float32 and the
  window's first block (1,) int32 (for the grads' index map) in SMEM;
  the grads (C, dim) float32 block; the table, row-shaped slots and scalar
  slots (viewed (R / 128, 128)) twice (the aliased inputs, unused, and the
  outputs, in HBM); one (2, C, width) VMEM buffer per array; per scalar
  slot (C, 1) old and new values and a (1, 128) carried group; the carried
  group's id (1,) in SMEM; read and write DMA semaphores, (2, arrays).
  """
  del offset_ref  # used by the index map only
  num_rows_dma, num_narrow = 1 + len(layout.wide), len(layout.narrow)
  num_arrays = num_rows_dma + num_narrow
  refs = refs[num_arrays:]  # the aliased inputs
  hbm, refs = refs[:num_arrays], refs[num_arrays:]
  bufs, refs = refs[:num_arrays], refs[num_arrays:]
  old_cols, new_cols = refs[:num_narrow], refs[num_narrow:2 * num_narrow]
  carries = refs[2 * num_narrow:3 * num_narrow]
  carry_group, read_sems, write_sems = refs[3 * num_narrow:]
  chunk = bufs[0].shape[1]
  i = pl.program_id(0)
  last = pl.num_programs(0) - 1
  cur, nxt = i % 2, 1 - i % 2
  num_ids = rows_ref.shape[0]

  def reads(step, buf):
    sems = [read_sems.at[buf, k] for k in range(num_arrays)]
    row_copies = row_dma.ChunkCopies(
        rows_ref, step * chunk, hbm[:num_rows_dma],
        [b.at[buf] for b in bufs[:num_rows_dma]], sems[:num_rows_dma],
        num_rows=num_rows)
    group_copies = row_dma.ChunkCopies(
        rows_ref, step * chunk, hbm[num_rows_dma:],
        [b.at[buf] for b in bufs[num_rows_dma:]], sems[num_rows_dma:],
        num_rows=num_rows, shift=scalar_slots.GROUP_SHIFT)
    return [row_copies] + ([group_copies] if num_narrow else [])

  def writes(step, buf):
    sems = [write_sems.at[buf, k] for k in range(num_arrays)]
    out = [row_dma.ChunkCopies(
        rows_ref, step * chunk, hbm[:num_rows_dma],
        [b.at[buf] for b in bufs[:num_rows_dma]], sems[:num_rows_dma],
        num_rows=num_rows, to_hbm=True)]
    if num_narrow:
      out.append(scalar_slots.GroupWrites(
          rows_ref, step * chunk, hbm[num_rows_dma:],
          [b.at[buf] for b in bufs[num_rows_dma:]], sems[num_rows_dma:],
          num_rows=num_rows, num_ids_in_call=num_ids))
    return out

  each = lambda copies, action: [getattr(c, action)() for c in copies]

  # Not applying issues no DMA at all: nothing can be written.
  @pl.when(apply_ref[0] != 0)
  def _():
    @pl.when(i == 0)
    def _():
      carry_group[0] = -1
      each(reads(0, 0), "start")

    @pl.when(i < last)
    def _():
      # Chunk i-1's write-back still reads the buffer chunk i+1 fills.
      @pl.when(i > 0)
      def _():
        each(writes(i - 1, nxt), "wait")

      each(reads(i + 1, nxt), "start")

    each(reads(i, cur), "wait")
    narrow_bufs = [b.at[cur] for b in bufs[num_rows_dma:]]
    if num_narrow:
      scalar_slots.extract(rows_ref, i * chunk, narrow_bufs, old_cols,
                           num_rows=num_rows)
    scalars = scalars_type(*(scalars_ref[k]
                             for k in range(len(scalars_type._fields))))
    slots = {n: b[cur] for n, b in zip(layout.wide, bufs[1:])}
    slots.update({n: c[...] for n, c in zip(layout.narrow, old_cols)})
    words, slots = _update_chunk(bufs[0][cur], slots, grads_ref[...], scalars,
                                 optimizer=optimizer, dtype=dtype)
    bufs[0][cur] = words
    for name, buf in zip(layout.wide, bufs[1:]):
      buf[cur] = slots[name]
    for name, col in zip(layout.narrow, new_cols):
      col[...] = slots[name]
    if num_narrow:
      scalar_slots.merge(rows_ref, i * chunk, narrow_bufs, new_cols, carries,
                         carry_group, num_rows=num_rows, num_ids_in_call=num_ids)
    each(writes(i, cur), "start")

    # The kernel may not end with DMAs in flight.
    @pl.when(i == last)
    def _():
      @pl.when(i > 0)
      def _():
        each(writes(i - 1, nxt), "wait")

      each(writes(i, cur), "wait")


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
    interpret: False (compile for TPU), True (TPU interpret mode) or a
      `pltpu.InterpretParams`.
    chunk_rows: rows per grid step, a positive multiple of 8 (capped at U
      rounded up to 8).
    window_rows: ids per kernel call (default: what fits SMEM).
    target: the chip to size VMEM for; see `chip.resolve_chip`.

  Returns:
    (table, slots) with only the listed rows changed. Donate `table` and
    `slots` to the enclosing jit for the update to happen in place.

  Raises:
    InputError: arrays of the wrong shape or dtype, or per-row scalar slots
      with a number of rows that is not a multiple of 128.
    ConfigError: a bad chunk_rows, interpret or target.
    VmemBudgetError: the chunk does not fit the target chip's VMEM.
  """
  dim = checks.check_update(table, slots, rows, grads, scalars,
                            optimizer=optimizer, dtype=dtype)
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
        "the XLA path (kernels.uses_kernel decides).")
  layout = _Layout(tuple(n for n in slots if not is_narrow(specs[n])),
                   tuple(n for n in slots if is_narrow(specs[n])))
  chip = chip_lib.resolve_chip(target)
  footprint = chip_lib.check_vmem(
      "fused_update",
      lambda c: vmem_footprint_bytes(
          dim=dim, dtype=dtype, slot_widths=[s.shape[1] for s in slots.values()],
          chunk_rows=c), chunk, chip)
  window = chip_lib.window_ids(chip, chunk, window_rows)
  out = _fused_update_call(
      table, tuple(slots[n] for n in layout.wide),
      tuple(slots[n] for n in layout.narrow),
      jnp.pad(rows, (0, chip_lib.round_up(num_ids, window) - num_ids),
              constant_values=-1),
      grads, _flat_scalars(scalars),
      jnp.asarray(apply).astype(jnp.int32).reshape(1), optimizer=optimizer,
      dtype=np.dtype(dtype), layout=layout, scalars_type=type(scalars),
      chunk=chunk, window=window, interpret=params,
      vmem_limit=chip_lib.vmem_limit_bytes(footprint, chip))
  new = dict(zip(layout.wide + layout.narrow, out[1:]))
  return out[0], {n: new[n] for n in slots}


@functools.partial(
    jax.jit,
    static_argnames=["optimizer", "dtype", "layout", "scalars_type", "chunk",
                     "window", "interpret", "vmem_limit"])
def _fused_update_call(table, wide, narrow, rows, grads, flat_scalars, apply, *,
                       optimizer, dtype, layout, scalars_type, chunk, window,
                       interpret, vmem_limit):
  """The kernel, once per window of ids; table and slots chain in place."""
  num_ids = grads.shape[0]
  arrays = (table, *wide, *narrow)
  for start in range(0, num_ids, window):
    call = _window_call(arrays, grads, size=min(window, num_ids - start),
                        num_narrow=len(narrow), optimizer=optimizer,
                        dtype=dtype, layout=layout, scalars_type=scalars_type,
                        chunk=chunk, interpret=interpret,
                        vmem_limit=vmem_limit)
    arrays = tuple(call(rows[start:start + window], apply, flat_scalars,
                        jnp.full((1,), start // chunk, jnp.int32), grads,
                        *arrays))
  return arrays


def _window_call(arrays, grads, *, size, num_narrow, optimizer, dtype, layout,
                 scalars_type, chunk, interpret, vmem_limit):
  """The pallas_call of one window of `size` ids."""
  dim = grads.shape[1]
  table = arrays[0]
  steps = pl.cdiv(size, chunk)
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  wide = arrays[1:len(arrays) - num_narrow]
  narrow = arrays[len(arrays) - num_narrow:]
  cost = pl.estimate_cost(
      functools.partial(_update_chunk, optimizer=optimizer, dtype=dtype),
      sds((steps * chunk, table.shape[1]), table.dtype),
      {n: sds((steps * chunk, a.shape[1]), a.dtype)
       for n, a in zip(layout.wide, wide)}
      | {n: sds((steps * chunk, 1), a.dtype)
         for n, a in zip(layout.narrow, narrow)},
      sds((steps * chunk, dim), jnp.float32),
      scalars_type(*(sds((), jnp.float32) for _ in scalars_type._fields)))
  row_bytes = sum(a.shape[1] * a.dtype.itemsize for a in arrays)
  cost = pl.CostEstimate(
      flops=cost.flops, transcendentals=cost.transcendentals,
      # Each id reads and writes its row of every array (a scalar slot's
      # 128-row group, written once per group); grads and ids are read once.
      bytes_accessed=size * (2 * row_bytes + dim * 4 + 4))

  hbm = pl.BlockSpec(memory_space=pltpu.HBM)
  num_scalar_prefetch = 4
  kernel = functools.partial(
      _update_kernel, optimizer=optimizer, dtype=dtype, layout=layout,
      scalars_type=scalars_type, num_rows=table.shape[0])
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=num_scalar_prefetch,
          grid=(steps,),
          # Grads span all ids: blocks from the window's first.
          in_specs=[pl.BlockSpec((chunk, dim),
                                 lambda i, rows, apply, scalars, off: (i + off[0], 0))]
          + [hbm] * len(arrays),
          out_specs=[hbm] * len(arrays),
          scratch_shapes=[pltpu.VMEM((2, chunk, a.shape[1]), a.dtype)
                          for a in arrays]
          + [pltpu.VMEM((chunk, 1), a.dtype) for a in narrow] * 2
          + [pltpu.VMEM((1, a.shape[1]), a.dtype) for a in narrow]
          + [pltpu.SMEM((1,), jnp.int32)]
          + [pltpu.SemaphoreType.DMA((2, len(arrays)))] * 2),
      # In HBM, stated: else XLA may stage a small enough slot (or table)
      # in VMEM around the call, copying all of it every step.
      out_shape=[pltpu.HBM(a.shape, a.dtype) for a in arrays],
      # Alias indices count the scalar-prefetch operands too: the operands
      # are rows, apply, scalars, offset, grads, then the table and slots.
      input_output_aliases={num_scalar_prefetch + 1 + k: k
                            for k in range(len(arrays))},
      compiler_params=pltpu.CompilerParams(
          # Buffers carry chunks (and scalar-slot groups) across grid steps.
          dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit),
      cost_estimate=cost,
      interpret=interpret,
  )
