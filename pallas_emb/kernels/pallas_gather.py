"""Gather of table rows into a dense block: a Pallas TPU kernel.

Why manual DMAs: the rows are scattered through a table far larger than VMEM,
so the table stays in HBM (`memory_space=pltpu.HBM`; an array the step
computed may stay wherever XLA put it, `in_hbm=False`) and each listed row is
its own DMA into VMEM; the unpacked rows leave through an ordinary output
BlockSpec, which Pallas pipelines to HBM.

The schedule, for chunks of C row ids (grid step i handles chunk i; two VMEM
buffers, chunk i in buffer i % 2):

    step 0:     start the reads of chunk 0                  -> buffer 0
    every step: start the reads of chunk i+1                -> buffer (i+1) % 2
                wait the reads of chunk i, zero its padding rows
                unpack into the output block

Buffer (i+1) % 2 is free to refill at step i: its chunk was unpacked at step
i-1 and nothing else reads it. So the reads of chunk i+1 overlap the unpack of
chunk i and the write-back of output block i-1; up to 2 * C row DMAs
(`row_dma.ChunkCopies`) are in flight.

Row ids are scalar-prefetched into SMEM to address the DMAs, one window of
ids per kernel call (`chip.window_ids`), so any number of ids fits. Padding
ids copy row 0 (`row_dma`'s `pad_reads`: the chunk is then waited at once)
and their buffer rows are zeroed after the wait, so the output needs no mask
(a (C, 1) mask block would be padded to 128 lanes). bfloat16 rows travel as
their uint32 storage words and are unpacked in VMEM (see `pallas_emb.packing`
and the note on lane alignment in `pallas_update`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb import packing
from pallas_emb.kernels import checks, row_dma, sub_rows
from pallas_emb.kernels import chip as chip_lib

DEFAULT_CHUNK_ROWS = 128


def vmem_footprint_bytes(
  *, dim: int, dtype, chunk_rows: int = DEFAULT_CHUNK_ROWS, packed: bool = False
) -> int:
  """VMEM the gather needs for one chunk size, in bytes.

  Counts, in (8, 128)-tiled 32-bit words: two row buffers (C, storage width)
  (the DMA double buffer), two (C, dim) output blocks (the Pallas pipeline's
  double buffer), and the unpacked rows.

  Args:
    dim: the row width D.
    dtype: the table's logical dtype (float32 or bfloat16).
    chunk_rows: rows per chunk C.
    packed: the table is stored packed; its rotated sub-rows (`sub_rows`)
      take a (C, 128) scratch.
  """
  c = chunk_rows
  width = packing.storage_width(dim, dtype)
  pad = chip_lib.padded_words
  words = 2 * pad(c, width) + 3 * pad(c, dim) + packed * pad(c, packing.LANES)
  return words * chip_lib.WORD_BYTES


def _gather_kernel(rows_ref, table_hbm, out_ref, buf, *scratch, dtype, dim, num_rows, width, shift):
  """One grid step: one chunk of row ids; see the module docstring.

  Refs: rows (W,) int32 in SMEM; the table in HBM; the (C, dim) float32
  output block; a (2, C, stored width) VMEM buffer; for a packed table
  (`shift` > 0) a (C, 128) int32 scratch of rotated sub-rows; (2,) DMA
  semaphores.
  """
  *sub, sems = scratch
  chunk = buf.shape[1]
  i = pl.program_id(0)
  cur = i % 2
  # A table of fewer rows than a chunk cannot be waited chunk-sized.
  pad_reads = table_hbm.shape[0] >= chunk

  def copies(step, slot):
    return row_dma.ChunkCopies(
      rows_ref,
      step * chunk,
      [table_hbm],
      [buf.at[slot]],
      [sems.at[slot]],
      num_rows=num_rows,
      pad_reads=pad_reads,
      shift=shift,
    )

  @pl.when(i == 0)
  def _():
    copies(0, 0).start()

  @pl.when(i < pl.num_programs(0) - 1)
  def _():
    copies(i + 1, 1 - cur).start()

  current = copies(i, cur)
  current.wait()
  current.zero_padding()
  if not shift:
    out_ref[...] = packing.unpack_rows(buf[cur], dtype, dim)
    return
  sub_rows.extract(
    rows_ref, i * chunk, [buf.at[cur]], sub, shifts=[shift], widths=[width], num_rows=num_rows
  )
  out_ref[...] = packing.unpack_rows(sub_rows.rows_of(sub[0], width, buf.dtype), dtype, dim)


def gather(
  table: jax.Array,
  rows: jax.Array,
  *,
  dtype,
  dim: int | None = None,
  interpret=False,
  chunk_rows: int = DEFAULT_CHUNK_ROWS,
  window_rows: int | None = None,
  target: chip_lib.Target = None,
  in_hbm: bool = True,
) -> jax.Array:
  """Reads rows of a stored table; see `xla.gather`.

  Args:
    table: (R, W) stored rows: float32 (W = dim) or uint32 words of bfloat16
      (W = dim / 2); given `dim`, also packed (R * W / 128, 128), whose
      physical rows are DMA'd whole (`sub_rows`).
    rows: (U,) int32 local row ids; -1 (any id outside [0, R)) is padding.
    dtype: the table's logical dtype.
    dim: the row width (None: rows stored as they are).
    interpret: False (compile for TPU), True (TPU interpret mode) or a
      `pltpu.InterpretParams`.
    chunk_rows: rows per grid step, a positive multiple of 8 (capped at U
      rounded up to 8).
    window_rows: ids per kernel call (default: what fits SMEM).
    target: the chip to size VMEM for; see `chip.resolve_chip`.
    in_hbm: keep `table` in HBM for the call (a stored table: else XLA may
      stage a small enough one in VMEM, copying all of it every step).
      False for an array the step computes (the rows an all_to_all
      returned), which XLA may then leave in VMEM rather than copy to HBM.

  Returns:
    (U, dim) float32, zero rows for padding.

  Raises:
    InputError: arrays of the wrong shape or dtype.
    ConfigError: a bad chunk_rows, interpret or target.
    VmemBudgetError: the chunk does not fit the target chip's VMEM.
  """
  dim = checks.check_gather(table, rows, dtype, dim)
  num_ids = rows.shape[0]
  chunk = checks.chunk_size(chunk_rows, num_ids)
  params = checks.interpret_params(interpret)
  if num_ids == 0:
    return jnp.zeros((0, dim), jnp.float32)
  chip = chip_lib.resolve_chip(target)
  footprint = chip_lib.check_vmem(
    "gather",
    lambda c: vmem_footprint_bytes(
      dim=dim,
      dtype=dtype,
      chunk_rows=c,
      packed=table.shape[1] != checks.row_width(table, dim, dtype),
    ),
    chunk,
    chip,
  )
  window = chip_lib.window_ids(chip, chunk, window_rows)
  rows = jnp.pad(rows, (0, chip_lib.round_up(num_ids, window) - num_ids), constant_values=-1)
  return _gather_call(
    table,
    rows,
    num_ids=num_ids,
    dim=dim,
    dtype=np.dtype(dtype),
    chunk=chunk,
    window=window,
    interpret=params,
    vmem_limit=chip_lib.vmem_limit_bytes(footprint, chip),
    in_hbm=in_hbm,
  )


@functools.partial(
  jax.jit,
  static_argnames=[
    "num_ids",
    "dim",
    "dtype",
    "chunk",
    "window",
    "interpret",
    "vmem_limit",
    "in_hbm",
  ],
)
def _gather_call(table, rows, *, num_ids, dim, dtype, chunk, window, interpret, vmem_limit, in_hbm):
  """The kernel, once per window of ids."""
  width = checks.row_width(table, dim, dtype)
  shift = sub_rows.shift_of(width, table.shape[1])
  num_rows = packing.num_rows_of(table, width)
  space = pltpu.HBM if in_hbm else pl.ANY
  if in_hbm:
    table = pltpu.with_memory_space_constraint(table, pltpu.HBM)
  outs = []
  for start in range(0, num_ids, window):
    size = min(window, num_ids - start)
    steps = pl.cdiv(size, chunk)
    cost = pl.estimate_cost(
      functools.partial(packing.unpack_rows, dtype=dtype, dim=dim),
      jax.ShapeDtypeStruct((steps * chunk, width), table.dtype),
    )
    cost = pl.CostEstimate(
      flops=cost.flops,
      transcendentals=cost.transcendentals,
      # Each id reads its (physical) row and its id; the output is
      # written once.
      bytes_accessed=size * (table.shape[1] * 4 + 4 + dim * 4),
    )
    outs.append(
      pl.pallas_call(
        functools.partial(
          _gather_kernel, dtype=dtype, dim=dim, num_rows=num_rows, width=width, shift=shift
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(steps,),
          in_specs=[pl.BlockSpec(memory_space=space)],
          out_specs=pl.BlockSpec((chunk, dim), lambda i, rows: (i, 0)),
          scratch_shapes=[pltpu.VMEM((2, chunk, table.shape[1]), table.dtype)]
          + [pltpu.VMEM((chunk, packing.LANES), jnp.int32)] * (shift > 0)
          + [pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=jax.ShapeDtypeStruct((size, dim), jnp.float32),
        compiler_params=pltpu.CompilerParams(
          # Buffers carry chunks across grid steps.
          dimension_semantics=("arbitrary",),
          vmem_limit_bytes=vmem_limit,
        ),
        cost_estimate=cost,
        interpret=interpret,
      )(rows[start : start + window], table)
    )
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs)
