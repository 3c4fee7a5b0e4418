"""The DMAs that move one chunk of scattered rows between HBM and VMEM.

Both kernels read (and the update writes back) rows that are scattered
through tables far larger than VMEM: each listed row of each array is its own
DMA, written once here, as `paged_attention`'s copy descriptor is. A chunk's
copies of one array share one DMA semaphore, and every copy is waited with
the same row-sized descriptor that started it, so one semaphore counts many
copies in flight.

Row ids outside [0, num_rows) -- -1 padding -- never address the table: no
DMA may leave it. A skipped row's (stale) buffer row is never written back.
A gather's reads (`pad_reads`) copy row 0 for them instead and zero them
after the wait: then every row of the chunk is in flight, and the chunk is
waited with one chunk-sized wait rather than a loop of row-sized ones.

The loops over a chunk's rows issue one DMA per row from the scalar core,
which bounds the kernels on a TPU; they are unrolled by 8. On one v5e chip,
a gather of 107,776 rows (a fifth of them padding) of a 1M x 128 float32
table took 5.36 ms as plain loops, 4.46 ms unrolled, and 3.69 ms unrolled
with the single wait (the kernel alone, median of 20 calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb.kernels import scalar_slots


class ChunkCopies:
  """The row copies of one chunk, between HBM arrays and VMEM buffers.

  Args:
    ids: the SMEM ref of local row ids.
    offset: index in `ids` of the chunk's first id.
    hbm: the HBM refs (table, then slots), each (R, width).
    vmem: one (C, width) VMEM ref per HBM ref: where the chunk's rows land.
    sems: one DMA semaphore per HBM ref.
    num_rows: R; ids outside [0, R) are skipped.
    to_hbm: write the chunk back (VMEM -> HBM) instead of reading it.
    pad_reads: reads copy row 0 for padding ids, so that `wait` is one wait
      of the whole chunk; `zero_padding` then zeroes those buffer rows (a
      gather's padding rows must read zero). Only for an array that no DMA
      writes meanwhile, and of at least C rows.
    shift: copy HBM row `id >> shift` (a lane-dense group of 2**shift rows;
      see `scalar_slots`) instead of row `id`.
    per_run: copy such a physical row once per run of consecutive ids in
      it, into the run's first buffer row (`scalar_slots.run_starts`).
  """

  def __init__(
    self,
    ids,
    offset,
    hbm: Sequence,
    vmem: Sequence,
    sems: Sequence,
    *,
    num_rows: int,
    to_hbm: bool = False,
    pad_reads: bool = False,
    shift: int = 0,
    per_run: bool = False,
  ):
    self._ids, self._offset = ids, offset
    self._arrays = tuple(zip(hbm, vmem, sems))
    self._num_rows, self._to_hbm = num_rows, to_hbm
    self._chunk = self._arrays[0][1].shape[0]
    self._pad_reads = pad_reads and not to_hbm
    if self._pad_reads and any(hbm.shape[0] < self._chunk for hbm, _, _ in self._arrays):
      raise ValueError(f"pad_reads needs arrays of at least {self._chunk} rows")
    if per_run and (self._pad_reads or to_hbm or not shift):
      raise ValueError("per_run is for the reads of physical rows (shift > 0) without pad_reads")
    self._shift, self._per_run = shift, per_run

  def start(self) -> None:
    """Starts every copy of the chunk."""
    if not self._pad_reads:
      self._each(lambda copy: copy.start())
      return

    def body(row, valid, j):
      for hbm, vmem, sem in self._arrays:
        src = hbm.at[pl.ds(jnp.where(valid, row >> self._shift, 0), 1)]
        pltpu.make_async_copy(src, vmem.at[pl.ds(j, 1)], sem).start()

    self._loop(body)

  def wait(self) -> None:
    """Waits for every copy of the chunk."""
    if not self._pad_reads:
      self._each(lambda copy: copy.wait())
      return
    for hbm, vmem, sem in self._arrays:
      # A DMA semaphore counts bytes: one wait of the chunk's size covers
      # its C row copies.
      pltpu.make_async_copy(hbm.at[pl.ds(0, self._chunk)], vmem, sem).wait()

  def zero_padding(self) -> None:
    """After `wait`: zeroes the buffer rows of padding ids."""

    def body(row, valid, j):
      @pl.when(jnp.logical_not(valid))
      def _():
        for _, vmem, _ in self._arrays:
          vmem[pl.ds(j, 1), :] = jnp.zeros((1, vmem.shape[1]), vmem.dtype)

    self._loop(body)

  def _each(self, action: Callable) -> None:
    """`action(copy)` on the copy of each valid id's row."""

    def body(row, valid, j):
      if self._per_run:
        valid &= scalar_slots.starts_run(
          self._ids, self._offset + j, self._offset, num_rows=self._num_rows, shift=self._shift
        )

      @pl.when(valid)
      def _():
        for hbm, vmem, sem in self._arrays:
          src, dst = hbm.at[pl.ds(row >> self._shift, 1)], vmem.at[pl.ds(j, 1)]
          if self._to_hbm:
            src, dst = dst, src
          action(pltpu.make_async_copy(src, dst, sem))

    self._loop(body)

  def _loop(self, body: Callable) -> None:
    """`body(row, valid, j)` for each id j of the chunk, unrolled by 8."""

    def step(j, carry):
      row = self._ids[self._offset + j]
      body(row, (row >= 0) & (row < self._num_rows), j)
      return carry

    lax.fori_loop(0, self._chunk, step, 0, unroll=min(8, self._chunk))


class _Copies:
  """Several `ChunkCopies` (or `scalar_slots.GroupWrites`) started or
  waited together."""

  def __init__(self, parts: Sequence):
    self._parts = tuple(parts)

  def start(self) -> None:
    for p in self._parts:
      p.start()

  def wait(self) -> None:
    for p in self._parts:
      p.wait()


class ChunkTransfers:
  """The reads and write-backs of one chunk of every array of an update,
  written once: rows of arrays stored as rows, whole physical rows of
  packed arrays (`sub_rows`) and the 128-row groups of the scalar slots
  (`scalar_slots`), each array with its own semaphore of the buffer's pair.

  Args:
    ids: the SMEM ref of the call's local row ids (ascending, -1 last).
    hbm: the HBM refs, table first.
    bufs: their (2, C, width) VMEM double buffers.
    read_sems, write_sems: (2, arrays) DMA semaphores.
    shifts: per array, log2 of its logical rows per physical row: 0 for
      rows stored as they are, 7 for a scalar slot's groups.
    num_rows: the shard's rows; other ids are padding.
  """

  def __init__(
    self,
    ids,
    hbm: Sequence,
    bufs: Sequence,
    read_sems,
    write_sems,
    *,
    shifts: Sequence[int],
    num_rows: int,
  ):
    self._ids, self._hbm, self._bufs = ids, tuple(hbm), tuple(bufs)
    self._read_sems, self._write_sems = read_sems, write_sems
    self._groups = {}
    for k, shift in enumerate(shifts):
      self._groups.setdefault(shift, []).append(k)
    self._num_rows = num_rows

  def _args(self, step, buf, sems, arrays):
    chunk = self._bufs[0].shape[1]
    return (
      self._ids,
      step * chunk,
      [self._hbm[k] for k in arrays],
      [self._bufs[k].at[buf] for k in arrays],
      [sems.at[buf, k] for k in arrays],
    )

  def reads(self, step, buf) -> _Copies:
    """Chunk `step`'s reads into buffer `buf` (a physical row of several
    rows once per run)."""
    return _Copies(
      ChunkCopies(
        *self._args(step, buf, self._read_sems, arrays),
        num_rows=self._num_rows,
        shift=shift,
        per_run=shift > 0,
      )
      for shift, arrays in self._groups.items()
    )

  def writes(self, step, buf) -> _Copies:
    """Chunk `step`'s write-backs from buffer `buf` (a packed array's
    physical row once, by its run's last id)."""
    parts = []
    for shift, arrays in self._groups.items():
      args = self._args(step, buf, self._write_sems, arrays)
      if shift == 0:
        parts.append(ChunkCopies(*args, num_rows=self._num_rows, to_hbm=True))
      else:
        parts.append(
          scalar_slots.GroupWrites(
            *args, num_rows=self._num_rows, num_ids_in_call=self._ids.shape[0], shift=shift
          )
        )
    return _Copies(parts)
