"""Gather of table rows into a dense block: a Pallas TPU kernel.

Why manual DMAs: the rows are scattered through a table far larger than VMEM,
so the table stays in HBM (`memory_space=pl.ANY`) and each listed row is its
own DMA into VMEM; the unpacked rows leave through an ordinary output
BlockSpec, which Pallas pipelines to HBM.

The schedule, for chunks of C row ids (grid step i handles chunk i; two VMEM
buffers, chunk i in buffer i % 2):

    step 0:     start the reads of chunk 0                  -> buffer 0
    every step: start the reads of chunk i+1                -> buffer (i+1) % 2
                wait the reads of chunk i
                unpack (zero rows for padding) into the output block

Buffer (i+1) % 2 is free to refill at step i: its chunk was unpacked at step
i-1 and nothing else reads it. So the reads of chunk i+1 overlap the unpack of
chunk i and the write-back of output block i-1; up to 2 * C row DMAs
(`row_dma.ChunkCopies`) are in flight.

Row ids are scalar-prefetched into SMEM to address the DMAs; padding ids are
never copied. Their output rows are zeroed with a mask built from the same
ids, also passed as a (C, 1) VMEM block (a vector mask cannot be read from
SMEM). bfloat16 rows travel as their uint32 storage
words and are unpacked in VMEM (see `pallas_emb.packing` and the note on lane
alignment in `fused_update`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb import packing
from pallas_emb.kernels import checks, row_dma
from pallas_emb.kernels import chip as chip_lib

DEFAULT_CHUNK_ROWS = 128


def vmem_footprint_bytes(*, dim: int, dtype,
                         chunk_rows: int = DEFAULT_CHUNK_ROWS) -> int:
  """VMEM the gather needs for one chunk size, in bytes.

  Counts, in (8, 128)-tiled 32-bit words: two row buffers (C, storage width)
  (the DMA double buffer), two (C, dim) output blocks and two (C, 1) id
  blocks (the Pallas pipeline's double buffers), and the unpacked rows.

  Args:
    dim: the row width D.
    dtype: the table's logical dtype (float32 or bfloat16).
    chunk_rows: rows per chunk C.
  """
  c = chunk_rows
  width = packing.storage_width(dim, dtype)
  pad = chip_lib.padded_words
  words = 2 * pad(c, width) + 3 * pad(c, dim) + 2 * pad(c, 1)
  return words * chip_lib.WORD_BYTES


def _gather_kernel(rows_ref, ids_ref, table_hbm, out_ref, buf, sems, *, dtype,
                   num_rows):
  """One grid step: one chunk of row ids; see the module docstring.

  Refs: rows (U,) int32 in SMEM; ids (C, 1) int32 block; the table in HBM;
  the (C, dim) float32 output block; a (2, C, width) VMEM buffer; (2,) DMA
  semaphores.
  """
  chunk = buf.shape[1]
  i = pl.program_id(0)
  cur = i % 2

  def copies(step, slot):
    return row_dma.ChunkCopies(rows_ref, step * chunk, [table_hbm],
                               [buf.at[slot]], [sems.at[slot]],
                               num_rows=num_rows)

  @pl.when(i == 0)
  def _():
    copies(0, 0).start()

  @pl.when(i < pl.num_programs(0) - 1)
  def _():
    copies(i + 1, 1 - cur).start()

  copies(i, cur).wait()
  # Broadcast the int32 ids and compare at full width, so that no boolean
  # mask needs broadcasting (Mosaic keeps masks in a layout of their own).
  ids = jnp.broadcast_to(ids_ref[...], out_ref.shape)
  valid = (ids >= 0) & (ids < num_rows)
  # Padding rows of the buffer hold stale data: select, never multiply.
  out_ref[...] = jnp.where(valid, packing.unpack_rows(buf[cur], dtype), 0.0)


def gather(table: jax.Array, rows: jax.Array, *, dtype, interpret=False,
           chunk_rows: int = DEFAULT_CHUNK_ROWS,
           target: chip_lib.Target = None) -> jax.Array:
  """Reads rows of a stored table; see `xla.gather`.

  Args:
    table: (R, W) stored rows: float32 (W = dim) or uint32 words of bfloat16
      (W = dim / 2).
    rows: (U,) int32 local row ids; -1 (any id outside [0, R)) is padding.
    dtype: the table's logical dtype.
    interpret: False (compile for TPU), True (TPU interpret mode) or a
      `pltpu.InterpretParams`.
    chunk_rows: rows per grid step, a positive multiple of 8 (capped at U
      rounded up to 8).
    target: the chip to size VMEM for; see `chip.resolve_chip`.

  Returns:
    (U, dim) float32, zero rows for padding.

  Raises:
    InputError: arrays of the wrong shape or dtype.
    ConfigError: a bad chunk_rows, interpret or target.
    VmemBudgetError: the chunk does not fit the target chip's VMEM.
  """
  dim = checks.check_gather(table, rows, dtype)
  num_ids = rows.shape[0]
  chunk = checks.chunk_size(chunk_rows, num_ids)
  params = checks.interpret_params(interpret)
  if num_ids == 0:
    return jnp.zeros((0, dim), jnp.float32)
  chip = chip_lib.resolve_chip(target)
  footprint = chip_lib.check_vmem(
      "gather",
      lambda c: vmem_footprint_bytes(dim=dim, dtype=dtype, chunk_rows=c),
      chunk, chip)
  chip_lib.check_smem("gather", chip_lib.round_up(num_ids, chunk), 0, chip)
  return _gather_call(table, rows, dtype=np.dtype(dtype), chunk=chunk,
                      interpret=params,
                      vmem_limit=chip_lib.vmem_limit_bytes(footprint, chip))


@functools.partial(
    jax.jit, static_argnames=["dtype", "chunk", "interpret", "vmem_limit"])
def _gather_call(table, rows, *, dtype, chunk, interpret, vmem_limit):
  num_ids = rows.shape[0]
  width = table.shape[1]
  dim = 2 * width if dtype == packing.SUPPORTED_DTYPES[1] else width
  padded = chip_lib.round_up(num_ids, chunk)
  rows = jnp.pad(rows, (0, padded - num_ids), constant_values=-1)
  cost = pl.estimate_cost(functools.partial(packing.unpack_rows, dtype=dtype),
                          jax.ShapeDtypeStruct((padded, width), table.dtype))
  cost = pl.CostEstimate(
      flops=cost.flops, transcendentals=cost.transcendentals,
      # Each id reads its row (twice over for the ids: SMEM and the mask);
      # the output is written once.
      bytes_accessed=num_ids * width * 4 + padded * (dim + 2) * 4)
  out = pl.pallas_call(
      functools.partial(_gather_kernel, dtype=dtype, num_rows=table.shape[0]),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(padded // chunk,),
          in_specs=[pl.BlockSpec((chunk, 1), lambda i, *_: (i, 0)),
                    pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec((chunk, dim), lambda i, *_: (i, 0)),
          scratch_shapes=[pltpu.VMEM((2, chunk, width), table.dtype),
                          pltpu.SemaphoreType.DMA((2,))]),
      out_shape=jax.ShapeDtypeStruct((padded, dim), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          # Buffers carry chunks across grid steps.
          dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit),
      cost_estimate=cost,
      interpret=interpret,
  )(rows, rows.reshape(padded, 1), table)
  return out[:num_ids]
