"""The row gather as a block sweep: the table blocks that hold ids stream
through VMEM, and each listed row is copied out of its block there.

The schedule (`blocks.Plan`, every chunk visited, padding-only chunks too):

    Pallas pipeline:     fetch block b of the table (once per block); write
                         the chunk's (G, dim) output block when the visits
                         move on to the next chunk
    first visit of k:    zero the chunk's (G, 128) tile of words
    each visit:          copy each id's row (a packed row's sub-row rotated
                         to lane 0) from the block into the tile
    last visit of k:     unpack the tile into the output block (bfloat16
                         words to float32; padding rows stay zero)

No row moves by its own DMA. The sweep reads every block that holds ids,
whole: it beats a gather of rows where the blocks holding ids are few or
dense enough (a small table, or a hot range of a big one); the cost model
(`forms`) decides. Ids must be ascending, padding last (an owner's unique
rows on one shard are).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb import packing
from pallas_emb.kernels import blocks, checks, vmem_rows
from pallas_emb.kernels import chip as chip_lib

LANES = packing.LANES
DEFAULT_CHUNK = 512
DEFAULT_BLOCK_BYTES = 1 << 20


def _gather_kernel(
  rows_ref,  # (n,) int32 SMEM: local row ids, ascending, padding last
  block_ref,  # (V,) int32 SMEM: each visit's table block (blocks.Plan)
  chunk_ref,  # (V,) int32 SMEM: its chunk of ids
  lo_ref,  # (V,) int32 SMEM: its first id
  hi_ref,  # (V,) int32 SMEM: one past its last
  table_ref,  # the visit's block of the table
  out_ref,  # (G, dim) float32: the chunk's rows
  tile,  # (G, stored width) int32 VMEM: the chunk's row words
  *,
  dtype,
  dim: int,
  width: int,
  shift: int,
  block: int,
):
  """One visit; see the module docstring."""
  chunk = out_ref.shape[0]
  i, last = pl.program_id(0), pl.num_programs(0) - 1
  k, lo, hi = chunk_ref[i], lo_ref[i], hi_ref[i]
  array = blocks.Array("", width, shift)
  visit = vmem_rows.Visit(
    (array,), rows_ref, (table_ref,), (tile,), block_ref[i] * block, k * chunk
  )

  @pl.when((i == 0) | (chunk_ref[jnp.maximum(i - 1, 0)] != k))
  def _():
    tile[...] = jnp.zeros(tile.shape, tile.dtype)

  blocks.for_each_id(lo, hi, blocks.load_then_store(visit.read, visit.to_tile))

  @pl.when((i == last) | (chunk_ref[jnp.minimum(i + 1, last)] != k))
  def _():
    words = lax.bitcast_convert_type(tile[:, pl.ds(0, width)], table_ref.dtype)
    out_ref[...] = packing.unpack_rows(words, dtype, dim)


def gather(
  table: jax.Array,
  rows: jax.Array,
  *,
  dtype,
  dim: int | None = None,
  interpret=False,
  chunk_rows: int = DEFAULT_CHUNK,
  block_bytes: int = DEFAULT_BLOCK_BYTES,
  block_rows: int | None = None,
  target: chip_lib.Target = None,
) -> jax.Array:
  """Reads rows of a stored table; see `xla.gather`.

  Args:
    table, dtype, dim: as for `xla.gather`.
    rows: (U,) int32 local row ids, ascending, padding (-1, or any id
      outside [0, R)) last.
    interpret, chunk_rows, block_bytes, block_rows, target: as for
      `block_update.fused_update`.

  Returns:
    (U, dim) float32, zero rows for padding.

  Raises:
    InputError: arrays of the wrong shape or dtype.
    ConfigError: a bad chunk_rows, block_rows, interpret or target.
    VmemBudgetError: a block and a chunk do not fit the chip's VMEM.
  """
  dim = checks.check_gather(table, rows, dtype, dim)
  params = checks.interpret_params(interpret)
  num_ids = rows.shape[0]
  if num_ids == 0:
    return jnp.zeros((0, dim), jnp.float32)
  chunk = checks.chunk_size(chunk_rows, num_ids)
  width = checks.row_width(table, dim, dtype)
  num_rows = packing.num_rows_of(table, width)
  if block_rows is None:
    block_rows = blocks.block_rows(num_rows, width * 4, block_bytes)
  blocks.check_block(block_rows, num_rows)
  ids = blocks.pad_ids(rows, chunk)
  plan = blocks.plan(ids, num_rows=num_rows, block=block_rows, chunk=chunk, visit_padding=True)
  shift = blocks.shift_of(width, table.shape[1])
  pad = chip_lib.padded_words
  block_shape = (min(block_rows >> shift, table.shape[0]), table.shape[1])
  footprint = chip_lib.check_vmem(
    "block_gather",
    lambda c: (
      chip_lib.WORD_BYTES * (2 * pad(*block_shape) + 2 * pad(c, dim) + pad(c, table.shape[1]))
    ),
    chunk,
    chip_lib.resolve_chip(target),
  )
  out = _block_gather_call(
    table,
    ids,
    plan,
    dtype=np.dtype(dtype),
    dim=dim,
    width=width,
    shift=shift,
    block=block_rows,
    chunk=chunk,
    interpret=params,
    vmem_limit=chip_lib.vmem_limit_bytes(footprint, chip_lib.resolve_chip(target)),
  )
  return out[:num_ids]


@functools.partial(
  jax.jit,
  static_argnames=["dtype", "dim", "width", "shift", "block", "chunk", "interpret", "vmem_limit"],
)
def _block_gather_call(
  table, ids, plan, *, dtype, dim, width, shift, block, chunk, interpret, vmem_limit
):
  rows = min(block >> shift, table.shape[0])
  if interpret:  # see block_update._block_update_call
    table = blocks.padded_to_blocks(table, rows)
  else:  # in HBM, stated (see block_update._block_update_call)
    table = pltpu.with_memory_space_constraint(table, pltpu.HBM)
  kernel = functools.partial(
    _gather_kernel, dtype=dtype, dim=dim, width=width, shift=shift, block=block
  )
  return pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5,
      grid=(plan.block.shape[0],),
      in_specs=[pl.BlockSpec((rows, table.shape[1]), lambda i, r, blk, chk, lo, hi: (blk[i], 0))],
      out_specs=pl.BlockSpec((chunk, dim), lambda i, r, blk, chk, lo, hi: (chk[i], 0)),
      scratch_shapes=[pltpu.VMEM((chunk, table.shape[1]), jnp.int32)],
    ),
    out_shape=jax.ShapeDtypeStruct((ids.shape[0], dim), jnp.float32),
    compiler_params=pltpu.CompilerParams(
      # The tile and the output block carry a chunk across visits.
      dimension_semantics=("arbitrary",),
      vmem_limit_bytes=vmem_limit,
    ),
    interpret=interpret,
  )(ids, *plan, table)
