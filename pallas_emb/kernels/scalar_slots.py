"""Per-row scalar slots inside the fused update: lane-dense groups of rows.

A slot with one value per row (row-wise Adagrad's accumulator, Adam's count)
is an (R, 1) array that XLA keeps lane-dense in HBM. As an operand of a
Mosaic kernel it would be (8, 128)-tiled, i.e. relaid out and padded 128x on
every step, so the kernel reads it as the same bytes viewed (R / 128, 128)
(a free reshape when R is a multiple of 128): row r lives in *group* r >> 7
at lane r & 127, and the kernel moves whole groups.

Reads: the ids of one group are consecutive (ascending ids), a *run*; the
run's first id of the chunk DMAs the group into its buffer row
(`row_dma.ChunkCopies(per_run=True)`) and `extract` takes each id's lane
from there (`run_starts`). One read per run, not per id: with row-wise
Adagrad these group reads were half of the update's reads.

Writes: ids of one group must not each write the group back: the later DMA
would undo the earlier one's lane. So `merge` folds the run's new values
into one copy, and `ends` marks the run's last id, the only
one that writes. A run that continues into the next chunk is not written:
its merged group is *carried* to the next grid step, whose own read of that
group is stale (it was prefetched before this chunk's update) and replaced by
the carry. Runs never continue across kernel calls: each call ends with its
writes done, and the next call reads afresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

GROUP_SHIFT = 7  # log2 of the 128 lanes of a group
GROUP = 1 << GROUP_SHIFT


def _lane_mask(lane) -> jax.Array:
  return lax.broadcasted_iota(jnp.int32, (1, GROUP), 1) == lane


def _bits(x):
  return lax.bitcast_convert_type(x, jnp.int32)


def starts_run(ids, pos, first, *, num_rows: int, shift: int = GROUP_SHIFT):
  """Whether id `pos` is the first of its run among ids[first:]: the first
  id there, or in another physical row `id >> shift` than the id before it
  (which may be padding). Padding ids themselves start runs."""
  row, prev = ids[pos], ids[jnp.maximum(pos - 1, first)]
  prev_valid = (prev >= 0) & (prev < num_rows)
  return (pos == first) | jnp.logical_not(prev_valid) | ((prev >> shift) != (row >> shift))


def run_starts(ids, offset, j, starts: Sequence, *, num_rows: int, shifts: Sequence[int]) -> tuple:
  """Per shift, the buffer row of the run of chunk id j: where the run's
  single read landed (`row_dma.ChunkCopies(per_run=True)`). `starts`: the
  same for id j - 1 (anything for j = 0)."""
  return tuple(
    jnp.where(starts_run(ids, offset + j, offset, num_rows=num_rows, shift=shift), j, start)
    for start, shift in zip(starts, shifts)
  )


def extract(ids, offset: int | jax.Array, bufs: Sequence, cols: Sequence, *, num_rows: int) -> None:
  """cols[k][j] = the value of id j in its group row: bufs[k] at the run's
  first id of the chunk, the only one read.

  Args:
    ids: the SMEM ref of local row ids; the chunk starts at `offset`.
    bufs: per slot, the (C, 128) group rows of the chunk.
    cols: per slot, a (C, 1) ref for the values.
  """
  chunk = bufs[0].shape[0]

  def body(j, start):
    row = ids[offset + j]
    (start,) = run_starts(ids, offset, j, (start,), num_rows=num_rows, shifts=(GROUP_SHIFT,))

    @pl.when((row >= 0) & (row < num_rows))
    def _():
      mask = _lane_mask(row & (GROUP - 1))
      for buf, col in zip(bufs, cols):
        # Sum the bits as int32: exact for every value (-0.0, NaN payloads).
        picked = jnp.where(mask, _bits(buf[pl.ds(start, 1), :]), 0)
        col[pl.ds(j, 1), :] = lax.bitcast_convert_type(
          jnp.sum(picked, axis=1, keepdims=True), col.dtype
        )

    return start

  lax.fori_loop(0, chunk, body, jnp.int32(0))


def is_end(ids, pos, num_ids_in_call, *, num_rows, shift: int = GROUP_SHIFT):
  """Whether id `pos` is the last of its run among the ids of the call: the
  ids of one physical row `id >> shift`."""
  row = ids[pos]
  nxt = ids[jnp.minimum(pos + 1, num_ids_in_call - 1)]
  last = pos + 1 >= num_ids_in_call
  return (
    (row >= 0)
    & (row < num_rows)
    & (last | (nxt < 0) | (nxt >= num_rows) | ((nxt >> shift) != (row >> shift)))
  )


def merge(
  ids,
  offset,
  bufs: Sequence,
  new_cols: Sequence,
  carry_bufs: Sequence,
  carry_group,
  *,
  num_rows: int,
  num_ids_in_call,
) -> None:
  """Folds each run's new values into the run's last group row.

  Args:
    ids, offset: the chunk's ids, as for `extract`.
    bufs: per slot, the (C, 128) group rows; updated in place, the run's
      last id's row holding the whole run's values.
    new_cols: per slot, the (C, 1) new values.
    carry_bufs: per slot, a (1, 128) ref: the group a run of the previous
      chunk left unwritten (see the module docstring).
    carry_group: a (1,) SMEM ref with that group, -1 for none; updated for
      the next chunk.
    num_ids_in_call: ids of this kernel call (the id past the chunk's end
      decides whether its last run continues).
  """
  chunk = bufs[0].shape[0]

  def body(j, prev_group):
    row = ids[offset + j]
    group = row >> GROUP_SHIFT

    @pl.when((row >= 0) & (row < num_rows))
    def _():
      mask = _lane_mask(row & (GROUP - 1))
      for buf, col, carry in zip(bufs, new_cols, carry_bufs):
        if_carried = jnp.logical_and(j == 0, carry_group[0] == group)
        continues = jnp.logical_and(j > 0, prev_group == group)
        base = jnp.where(
          continues,
          _bits(buf[pl.ds(jnp.maximum(j - 1, 0), 1), :]),
          jnp.where(if_carried, _bits(carry[...]), _bits(buf[pl.ds(j, 1), :])),
        )
        value = jnp.broadcast_to(_bits(col[pl.ds(j, 1), :]), (1, GROUP))
        buf[pl.ds(j, 1), :] = lax.bitcast_convert_type(jnp.where(mask, value, base), buf.dtype)

    return jnp.where((row >= 0) & (row < num_rows), group, -1)

  last_group = lax.fori_loop(0, chunk, body, jnp.int32(-1))
  # The chunk's last run goes on into the next chunk: carry it there.
  last = offset + chunk - 1
  carries = jnp.logical_and(
    last_group >= 0, jnp.logical_not(is_end(ids, last, num_ids_in_call, num_rows=num_rows))
  )

  @pl.when(carries)
  def _():
    for buf, carry in zip(bufs, carry_bufs):
      carry[...] = buf[pl.ds(chunk - 1, 1), :]

  carry_group[0] = jnp.where(carries, last_group, -1)


class GroupWrites:
  """The write-backs of a chunk's merged groups: one DMA per run end.

  Waits recompute the same run ends from the ids, so each wait matches the
  DMA that was started. `shift`: the group of id r is physical row r >>
  shift (packed rows of any width, `sub_rows`, are written the same way).
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
    num_ids_in_call,
    shift: int = GROUP_SHIFT,
  ):
    self._ids, self._offset, self._shift = ids, offset, shift
    self._arrays = tuple(zip(hbm, vmem, sems))
    self._num_rows, self._num_ids = num_rows, num_ids_in_call

  def start(self) -> None:
    self._each(lambda copy: copy.start())

  def wait(self) -> None:
    self._each(lambda copy: copy.wait())

  def _each(self, action) -> None:
    chunk = self._arrays[0][1].shape[0]

    def body(j, carry):
      pos = self._offset + j

      @pl.when(is_end(self._ids, pos, self._num_ids, num_rows=self._num_rows, shift=self._shift))
      def _():
        group = self._ids[pos] >> self._shift
        for hbm, vmem, sem in self._arrays:
          action(pltpu.make_async_copy(vmem.at[pl.ds(j, 1)], hbm.at[pl.ds(group, 1)], sem))

      return carry

    lax.fori_loop(0, chunk, body, 0)
