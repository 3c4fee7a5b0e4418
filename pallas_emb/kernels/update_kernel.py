"""The fused update's kernel body: one grid step, one chunk of row ids.

`pallas_update` sizes and calls it (see there for why manual DMAs).

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
flight. A physical row that holds several rows (below) is read once per run
of the chunk's ids in it and written once per run. The ids must be distinct:
two DMAs writing the same row race (the interpreter's race detector reports
it). When `apply` is false the kernel
issues no DMA at all, so the table and slots stay bit-identical.

Per-row scalar slots (width 1: row-wise Adagrad's accumulator, Adam's
count) move as lane-dense groups of 128 rows (`scalar_slots`): passed as
they are, (R, 1), they would be relaid out and padded 128x on every step.
That needs R to be a multiple of 128, which `RowLayout` gives every shard of
128 rows or more; a smaller table takes the XLA path (`uses_kernel`). The
group writes need the ids ascending (routing produces them so); padding ids
(-1) come last.

A table or row-shaped slot whose rows are narrower than 128 lanes is stored
packed (`pallas_emb.packing`) and moves the same way: whole 128-lane
physical rows, each id's sub-row rotated out for `update_rows` and merged
back, one write per run of ids in a physical row (`sub_rows`). Each array
has its own shift (a bfloat16 table's words pack twice as many rows as its
float32 slots).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_emb import packing
from pallas_emb.kernels import row_dma, scalar_slots, sub_rows


def update_chunk(words, slots, grads, scalars, *, optimizer, dtype, noise=None):
  """Stored rows -> updated stored rows: what the kernel runs per chunk
  (`noise`: bfloat16 rows rounded stochastically, `packing.pack_rows`).
  The math sees rows of their logical width; pad words are written zero."""
  dim = grads.shape[1]
  specs = optimizer.slot_specs()
  new_rows, new_slots = optimizer.update_rows(
    packing.unpack_rows(words, dtype, dim),
    {k: packing.unpadded(v, specs[k].width_for(dim)) for k, v in slots.items()},
    grads,
    scalars,
  )
  packed = packing.padded(
    packing.pack_rows(new_rows, dtype, noise).astype(words.dtype), words.shape[1]
  )
  return packed, {
    k: packing.padded(new_slots[k].astype(v.dtype), v.shape[1]) for k, v in slots.items()
  }


class Layout(NamedTuple):
  """The static structure of one call: which slots move how."""

  wide: tuple[str, ...]  # row-shaped slots, DMA'd with the rows
  narrow: tuple[str, ...]  # per-row scalars, DMA'd as (1, 128) groups
  # Per row array (the table, then `wide`): its row width w in words and
  # shift (log2 of logical rows per physical row; 0: stored as rows).
  widths: tuple[int, ...] = ()
  shifts: tuple[int, ...] = ()

  @property
  def packed(self) -> tuple[int, ...]:
    """The row arrays stored packed (`sub_rows`), by index."""
    return tuple(k for k, s in enumerate(self.shifts) if s)


def update_kernel(
  # Scalar prefetch (SMEM):
  rows_ref,  # (W,) int32: the window's local row ids, ascending, -1 padding last
  apply_ref,  # (1,) int32: 0 writes nothing
  scalars_ref,  # (S,) float32: optimizer.scalars(step), flattened
  offset_ref,  # (1,) int32: the window's first chunk (the grads' index map reads it)
  key_ref,  # (1,) int32: the stochastic rounding key's bits (read if `stochastic`)
  # Inputs:
  grads_ref,  # (C, dim) float32 VMEM block: the chunk's summed row gradients
  *refs,  # if `stochastic`, (C, 1) int32 VMEM block: the chunk's row ids;
  # then per array (table, row-shaped slots, scalar slots), see _ArrayRefs
  optimizer,
  dtype,
  layout,
  scalars_type,
  num_rows,
  stochastic,
):
  """One grid step: one chunk of row ids; see the module docstring."""
  del offset_ref
  ids_ref, refs = (refs[0], refs[1:]) if stochastic else (None, refs)
  arrays = _ArrayRefs.split(refs, layout)
  chunk = arrays.bufs[0].shape[1]
  i = pl.program_id(0)
  last = pl.num_programs(0) - 1
  cur, nxt = i % 2, 1 - i % 2
  num_rows_dma = 1 + len(layout.wide)
  copies = row_dma.ChunkTransfers(
    rows_ref,
    arrays.hbm,
    arrays.bufs,
    arrays.read_sems,
    arrays.write_sems,
    shifts=layout.shifts + (scalar_slots.GROUP_SHIFT,) * len(layout.narrow),
    num_rows=num_rows,
  )
  packed = layout.packed
  packed_args = dict(
    shifts=[layout.shifts[k] for k in packed], widths=[layout.widths[k] for k in packed]
  )

  # Not applying issues no DMA at all: nothing can be written.
  @pl.when(apply_ref[0] != 0)
  def _():
    @pl.when(i == 0)
    def _():
      arrays.carry_group[0] = -1
      for a in range(len(packed)):
        arrays.carry_rows[a] = -1
      copies.reads(0, 0).start()

    @pl.when(i < last)
    def _():
      # Chunk i-1's write-back still reads the buffer chunk i+1 fills.
      @pl.when(i > 0)
      def _():
        copies.writes(i - 1, nxt).wait()

      copies.reads(i + 1, nxt).start()

    copies.reads(i, cur).wait()
    row_bufs = [b.at[cur] for b in arrays.bufs[:num_rows_dma]]
    narrow_bufs = [b.at[cur] for b in arrays.bufs[num_rows_dma:]]
    if layout.narrow:
      scalar_slots.extract(rows_ref, i * chunk, narrow_bufs, arrays.old_cols, num_rows=num_rows)
    if packed:
      sub_rows.extract(
        rows_ref,
        i * chunk,
        [row_bufs[k] for k in packed],
        arrays.subs,
        num_rows=num_rows,
        **packed_args,
      )
    values = [b[...] for b in row_bufs]
    for a, k in enumerate(packed):
      values[k] = sub_rows.rows_of(arrays.subs[a], layout.widths[k], row_bufs[k].dtype)
    scalars = scalars_type(*(scalars_ref[k] for k in range(len(scalars_type._fields))))
    slots = dict(zip(layout.wide, values[1:]))
    slots.update({n: c[...] for n, c in zip(layout.narrow, arrays.old_cols)})
    noise = None
    if stochastic:
      key = lax.bitcast_convert_type(key_ref[0], jnp.uint32)
      noise = packing.rounding_noise(key, ids_ref[...], grads_ref.shape[1])
    words, slots = update_chunk(
      values[0], slots, grads_ref[...], scalars, optimizer=optimizer, dtype=dtype, noise=noise
    )
    new = [words] + [slots[n] for n in layout.wide]
    for k, buf in enumerate(row_bufs):
      if k not in packed:
        buf[...] = new[k]
    for a, k in enumerate(packed):
      sub_rows.set_rows(arrays.subs[a], new[k])
    if packed:
      sub_rows.merge(
        rows_ref,
        i * chunk,
        [row_bufs[k] for k in packed],
        arrays.subs,
        arrays.packed_carries,
        arrays.carry_rows,
        num_rows=num_rows,
        num_ids_in_call=rows_ref.shape[0],
        **packed_args,
      )
    for name, col in zip(layout.narrow, arrays.new_cols):
      col[...] = slots[name]
    if layout.narrow:
      scalar_slots.merge(
        rows_ref,
        i * chunk,
        narrow_bufs,
        arrays.new_cols,
        arrays.carries,
        arrays.carry_group,
        num_rows=num_rows,
        num_ids_in_call=rows_ref.shape[0],
      )
    copies.writes(i, cur).start()

    # The kernel may not end with DMAs in flight.
    @pl.when(i == last)
    def _():
      @pl.when(i > 0)
      def _():
        copies.writes(i - 1, nxt).wait()

      copies.writes(i, cur).wait()


class _ArrayRefs(NamedTuple):
  """The kernel's refs after the gradients, by role (n arrays: the table,
  the row-shaped slots, then the g scalar slots; p of the row arrays
  packed)."""

  hbm: tuple  # n: (R, w) rows, (R * w / 128, 128) packed, (R / 128, 128) scalar slots; aliased
  bufs: tuple  # n: (2, C, w) VMEM double buffers (packed and scalar slots: w = 128)
  old_cols: tuple  # g: (C, 1) VMEM, each id's value before the update
  new_cols: tuple  # g: (C, 1) VMEM, after it
  carries: tuple  # g: (1, 128) VMEM, the group a run carries into the next chunk
  subs: tuple  # p: (C, 128) int32 VMEM, each id's sub-row rotated to lane 0
  packed_carries: tuple  # p: (1, 128) VMEM, the physical row a run carries on
  carry_group: object  # (1,) int32 SMEM: that group's index, -1 for none
  carry_rows: object  # (max(p, 1),) int32 SMEM: those physical rows, -1 for none
  read_sems: object  # (2, n) DMA semaphores of the reads, per buffer and array
  write_sems: object  # (2, n) DMA semaphores of the writes

  @classmethod
  def split(cls, refs, layout: Layout) -> _ArrayRefs:
    n, g, p = 1 + len(layout.wide) + len(layout.narrow), len(layout.narrow), len(layout.packed)
    sizes = (n, n, n, g, g, g, p, p, 1, 1, 1, 1)  # the aliased inputs (unused) come first
    parts, start = [], 0
    for size in sizes:
      parts.append(tuple(refs[start : start + size]))
      start += size
    _, hbm, bufs, old, new, carries, subs, pcarries, (cg,), (cr,), (reads,), (writes,) = parts
    return cls(hbm, bufs, old, new, carries, subs, pcarries, cg, cr, reads, writes)
