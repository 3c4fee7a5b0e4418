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
"""

from __future__ import annotations

from typing import NamedTuple

from jax.experimental import pallas as pl

from pallas_emb import packing
from pallas_emb.kernels import row_dma, scalar_slots


def update_chunk(words, slots, grads, scalars, *, optimizer, dtype):
  """Stored rows -> updated stored rows: what the kernel runs per chunk."""
  new_rows, new_slots = optimizer.update_rows(
    packing.unpack_rows(words, dtype), slots, grads, scalars
  )
  packed = packing.pack_rows(new_rows, dtype).astype(words.dtype)
  return packed, {k: new_slots[k].astype(v.dtype) for k, v in slots.items()}


class Layout(NamedTuple):
  """The static structure of one call: which slots move how."""

  wide: tuple[str, ...]  # row-shaped slots, DMA'd with the rows
  narrow: tuple[str, ...]  # per-row scalars, DMA'd as (1, 128) groups


def update_kernel(
  # Scalar prefetch (SMEM):
  rows_ref,  # (W,) int32: the window's local row ids, ascending, -1 padding last
  apply_ref,  # (1,) int32: 0 writes nothing
  scalars_ref,  # (S,) float32: optimizer.scalars(step), flattened
  offset_ref,  # (1,) int32: the window's first chunk (the grads' index map reads it)
  # Inputs:
  grads_ref,  # (C, dim) float32 VMEM block: the chunk's summed row gradients
  *refs,  # per array (table, row-shaped slots, scalar slots), see _ArrayRefs
  optimizer,
  dtype,
  layout,
  scalars_type,
  num_rows,
):
  """One grid step: one chunk of row ids; see the module docstring."""
  del offset_ref
  arrays = _ArrayRefs.split(refs, layout)
  chunk = arrays.bufs[0].shape[1]
  i = pl.program_id(0)
  last = pl.num_programs(0) - 1
  cur, nxt = i % 2, 1 - i % 2
  copies = row_dma.ChunkTransfers(
    rows_ref,
    arrays.hbm,
    arrays.bufs,
    arrays.read_sems,
    arrays.write_sems,
    num_grouped=len(layout.narrow),
    num_rows=num_rows,
  )

  # Not applying issues no DMA at all: nothing can be written.
  @pl.when(apply_ref[0] != 0)
  def _():
    @pl.when(i == 0)
    def _():
      arrays.carry_group[0] = -1
      copies.reads(0, 0).start()

    @pl.when(i < last)
    def _():
      # Chunk i-1's write-back still reads the buffer chunk i+1 fills.
      @pl.when(i > 0)
      def _():
        copies.writes(i - 1, nxt).wait()

      copies.reads(i + 1, nxt).start()

    copies.reads(i, cur).wait()
    num_rows_dma = 1 + len(layout.wide)
    narrow_bufs = [b.at[cur] for b in arrays.bufs[num_rows_dma:]]
    if layout.narrow:
      scalar_slots.extract(rows_ref, i * chunk, narrow_bufs, arrays.old_cols, num_rows=num_rows)
    scalars = scalars_type(*(scalars_ref[k] for k in range(len(scalars_type._fields))))
    slots = {n: b[cur] for n, b in zip(layout.wide, arrays.bufs[1:])}
    slots.update({n: c[...] for n, c in zip(layout.narrow, arrays.old_cols)})
    words, slots = update_chunk(
      arrays.bufs[0][cur], slots, grads_ref[...], scalars, optimizer=optimizer, dtype=dtype
    )
    arrays.bufs[0][cur] = words
    for name, buf in zip(layout.wide, arrays.bufs[1:]):
      buf[cur] = slots[name]
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
  the row-shaped slots, then the g scalar slots)."""

  hbm: tuple  # n: (R, w) table and row slots, (R / 128, 128) scalar slots; aliased outputs
  bufs: tuple  # n: (2, C, w) VMEM double buffers (a scalar slot's w: 128)
  old_cols: tuple  # g: (C, 1) VMEM, each id's value before the update
  new_cols: tuple  # g: (C, 1) VMEM, after it
  carries: tuple  # g: (1, 128) VMEM, the group a run carries into the next chunk
  carry_group: object  # (1,) int32 SMEM: that group's index, -1 for none
  read_sems: object  # (2, n) DMA semaphores of the reads, per buffer and array
  write_sems: object  # (2, n) DMA semaphores of the writes

  @classmethod
  def split(cls, refs, layout: Layout) -> _ArrayRefs:
    n, g = 1 + len(layout.wide) + len(layout.narrow), len(layout.narrow)
    sizes = (n, n, n, g, g, g, 1, 1, 1)  # the aliased inputs (unused) come first
    parts, start = [], 0
    for size in sizes:
      parts.append(tuple(refs[start : start + size]))
      start += size
    _, hbm, bufs, old, new, carries, (carry_group,), (reads,), (writes,) = parts
    return cls(hbm, bufs, old, new, carries, carry_group, reads, writes)
