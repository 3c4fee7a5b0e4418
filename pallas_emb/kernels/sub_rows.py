"""Packed rows inside the kernels: logical sub-rows of 128-lane physical rows.

A table or row-shaped slot whose rows are w < 128 words wide, w dividing
128, is stored packed (`pallas_emb.packing`): k = 128 / w logical rows per
physical row, logical row r at physical row r >> s (s = log2 k), lanes
(r & (k - 1)) * w ... + w - 1. Passed to Mosaic as (R, w), XLA would keep
such an array transposed in HBM and relayout all of it around every call;
packed, it is (8, 128)-tiled as it lies, and the kernels DMA whole physical
rows (`row_dma.ChunkCopies` with `shift=s`).

In VMEM each id's physical row is rotated so that its sub-row starts at
lane 0 (`extract`, one lane rotation per id into a (C, 128) scratch), and
the chunk's (C, w) rows are the scratch's first w lanes: the optimizer's
row math (`update_rows`) sees plain rows. New rows go back the other way
(`merge`): each id's new sub-row is rotated to its lanes and selected into
its physical row.

Merging: several ids of a chunk may share a physical row (consecutive ids,
since ids are ascending). Each would write the whole physical row, and the
later DMA would undo the earlier one's sub-row, so the ids of one physical
row form a *run* whose sub-rows are folded, in order, into the run's last
id's buffer row, the only one written back (`scalar_slots.GroupWrites` with
the shift). A run that continues into the next chunk is carried there, as a
per-row scalar slot's group is (`scalar_slots`, the case w = 1, which keeps
its own lane-select code): its next-chunk copy was read before this chunk's
update and is stale. Rotations and selects move 32-bit words, so every
value (NaN payloads, -0.0) passes bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb.kernels import scalar_slots

LANES = 128


def shift_of(width: int, cols: int) -> int:
  """log2 of the logical rows per physical row of an array of rows `width`
  words wide stored with `cols` columns (0: stored as rows)."""
  if cols == width:
    return 0
  return (LANES // width).bit_length() - 1


def _bits(x):
  return lax.bitcast_convert_type(x, jnp.int32)


def _lane_offset(row, shift: int, width: int):
  return (row & ((1 << shift) - 1)) * width


def extract(ids, offset, bufs: Sequence, subs: Sequence, *, shifts, widths, num_rows: int) -> None:
  """subs[a][j, :w] = id j's sub-row of its physical row: bufs[a] at the
  first id of the run (`scalar_slots.run_starts`; an update reads a
  physical row once per run, a gather per id).

  Every id is rotated, padding too (its buffer row is zero in a gather,
  stale in an update, whose padding rows are never written).

  Args:
    ids, offset: the SMEM ref of local row ids; the chunk starts at `offset`.
    bufs: per packed array, the chunk's (C, 128) physical rows.
    subs: per packed array, a (C, 128) int32 scratch.
    shifts, widths: per packed array, its shift and row width w.
    num_rows: the table's logical rows; other ids are padding.
  """
  chunk = bufs[0].shape[0]

  def body(j, starts):
    row = ids[offset + j]
    starts = scalar_slots.run_starts(ids, offset, j, starts, num_rows=num_rows, shifts=shifts)
    for buf, sub, shift, width, start in zip(bufs, subs, shifts, widths, starts):
      back = (LANES - _lane_offset(row, shift, width)) % LANES
      sub[pl.ds(j, 1), :] = pltpu.roll(_bits(buf[pl.ds(start, 1), :]), back, 1)
    return starts

  lax.fori_loop(0, chunk, body, (jnp.int32(0),) * len(bufs))


def rows_of(sub, width: int, dtype) -> jax.Array:
  """The (C, width) rows `extract` left in `sub`, as `dtype`."""
  return lax.bitcast_convert_type(sub[:, pl.ds(0, width)], dtype)


def set_rows(sub, values: jax.Array) -> None:
  """Puts (C, width) new rows into the first lanes of `sub` for `merge`."""
  sub[:, pl.ds(0, values.shape[1])] = _bits(values)


def merge(
  ids,
  offset,
  bufs: Sequence,
  subs: Sequence,
  carries: Sequence,
  carry_rows,
  *,
  shifts,
  widths,
  num_rows: int,
  num_ids_in_call,
) -> None:
  """Folds each run's new sub-rows into the run's last physical row.

  Args:
    ids, offset: as for `extract`.
    bufs: per packed array, the chunk's (C, 128) physical rows; updated in
      place, a run's last id's row holding all of the run's sub-rows.
    subs: per packed array, the (C, 128) scratch with the new rows in its
      first w lanes (`set_rows`).
    carries: per packed array, a (1, 128) ref: the physical row a run of the
      previous chunk left unwritten.
    carry_rows: an SMEM int32 ref, one entry per packed array: that physical
      row, -1 for none; updated for the next chunk.
    shifts, widths: per packed array.
    num_ids_in_call: ids of this kernel call (the id past the chunk's end
      decides whether its last run continues).
  """
  chunk = bufs[0].shape[0]
  lane = lax.broadcasted_iota(jnp.int32, (1, LANES), 1)

  def body(j, carry):
    row = ids[offset + j]
    prev = ids[offset + jnp.maximum(j - 1, 0)]

    @pl.when((row >= 0) & (row < num_rows))
    def _():
      for a, (buf, sub, kept, shift, width) in enumerate(zip(bufs, subs, carries, shifts, widths)):
        phys = row >> shift
        start = _lane_offset(row, shift, width)
        continues = (j > 0) & ((prev >> shift) == phys)
        carried = (j == 0) & (carry_rows[a] == phys)
        base = jnp.where(
          continues,
          _bits(buf[pl.ds(jnp.maximum(j - 1, 0), 1), :]),
          jnp.where(carried, _bits(kept[...]), _bits(buf[pl.ds(j, 1), :])),
        )
        new = pltpu.roll(sub[pl.ds(j, 1), :], start, 1)
        mine = (lane >= start) & (lane < start + width)
        buf[pl.ds(j, 1), :] = lax.bitcast_convert_type(jnp.where(mine, new, base), buf.dtype)

    return carry

  lax.fori_loop(0, chunk, body, 0)
  last = offset + chunk - 1
  row = ids[last]
  for a, (buf, kept, shift) in enumerate(zip(bufs, carries, shifts)):
    # The chunk's last run goes on into the next chunk: carry it there.
    carries_on = (
      (row >= 0)
      & (row < num_rows)
      & jnp.logical_not(
        scalar_slots.is_end(ids, last, num_ids_in_call, num_rows=num_rows, shift=shift)
      )
    )

    @pl.when(carries_on)
    def _(kept=kept, buf=buf):
      kept[...] = buf[pl.ds(chunk - 1, 1), :]

    carry_rows[a] = jnp.where(carries_on, row >> shift, -1)
