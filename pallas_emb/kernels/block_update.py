"""The fused update as a block sweep: the table blocks that hold ids stream
through VMEM, and each listed row is updated there, in place.

The schedule (`blocks.Plan`: one grid step per visit, a table block b and a
chunk k of G ids):

    Pallas pipeline:  fetch block b of the table and of every slot (once per
                      block: consecutive visits of b reuse it), and the
                      chunk's (G, dim) gradients (once per chunk); write
                      block b back when the visits move on
    first visit of b: copy the fetched block into the output block (one
                      VMEM-to-VMEM DMA per array): blocks are aliased in
                      place, so the output block must start as the table
    each visit:       gather: each id's row (and slot rows) from the output
                        block into a (G, 128) tile, its sub-row rotated to
                        lane 0 (a packed array's, a scalar slot's)
                      update: `update_rows` on the tile's 8-row groups that
                        hold the visit's ids
                      scatter: each id's new row back into the output
                        block (a packed row merged by a lane select, ids in
                        order, so ids sharing a physical row compose)

No row moves by its own DMA: per id the kernel does a few vector loads and
stores, and per block one DMA each way. It pays where the blocks holding
ids are few enough, or the ids per block many enough, that streaming them
beats copying rows one by one; the cost model (`forms`) decides, per table
and step shape. Blocks without ids are never read or written; a step that is
not applied visits block 0 alone and copies it unchanged.

Ids must be distinct and ascending, padding last (routing gives them so).
bfloat16 rows are unpacked from their words in the tile, per 8-row group,
and packed back (`xla.update_stored_rows`, which the XLA path runs too).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb import packing
from pallas_emb.kernels import blocks, checks, vmem_rows
from pallas_emb.kernels import chip as chip_lib
from pallas_emb.kernels.protocol import RowUpdate
from pallas_emb.kernels.xla import update_stored_rows

LANES = packing.LANES
DEFAULT_CHUNK = 512
DEFAULT_BLOCK_BYTES = 1 << 20


def _copy_block_in(ins, outs, sems) -> None:
  """The fetched blocks into the output blocks, one VMEM-to-VMEM DMA each:
  the output starts as the table (the blocks are aliased in place)."""
  copies = [
    pltpu.make_async_copy(src, dst, sems.at[a]) for a, (src, dst) in enumerate(zip(ins, outs))
  ]
  for c in copies:
    c.start()
  for c in copies:
    c.wait()


def _update_group(v: vmem_rows.Visit, m, grads_ref, keys_ref, scalars, *, optimizer, dtype) -> None:
  """`update_rows` on the tiles' 8-row group m, in place (the chunk's ids
  there; rows of other visits are recomputed and never written back)."""
  at = pl.ds(pl.multiple_of(m * 8, 8), 8)
  table, *slot_arrays = v.arrays
  words = lax.bitcast_convert_type(v.tiles[0][at, pl.ds(0, table.width)], v.outs[0].dtype)
  slots = {
    a.name: lax.bitcast_convert_type(tile[at, pl.ds(0, a.width)], out.dtype)
    for a, out, tile in zip(slot_arrays, v.outs[1:], v.tiles[1:])
  }
  noise = None if keys_ref is None else packing.rounding_noise(keys_ref[at, :], grads_ref.shape[1])
  words, slots = update_stored_rows(
    words, slots, grads_ref[at, :], scalars, optimizer=optimizer, dtype=dtype, noise=noise
  )
  v.tiles[0][at, pl.ds(0, table.width)] = vmem_rows.bits(words)
  for a, tile in zip(slot_arrays, v.tiles[1:]):
    tile[at, pl.ds(0, a.width)] = vmem_rows.bits(slots[a.name])


def _update_kernel(
  # Scalar prefetch (SMEM):
  rows_ref,  # (n,) int32 local row ids, ascending, padding last
  block_ref,  # (V,) int32 each visit's table block   (blocks.Plan)
  chunk_ref,  # (V,) int32 its chunk of ids
  lo_ref,  # (V,) int32 its first id
  hi_ref,  # (V,) int32 one past its last
  scalars_ref,  # (S,) float32 optimizer.scalars(step), flattened
  # Blocks:
  grads_ref,  # (G, dim) float32: the chunk's summed gradients
  *refs,  # [(G, 1) uint32 rounding keys], inputs, outputs, tiles, DMA semaphores
  arrays: tuple[blocks.Array, ...],
  optimizer,
  dtype,
  scalars_type,
  block: int,
  stochastic: bool,
):
  """One visit; see the module docstring."""
  keys_ref, refs = (refs[0], refs[1:]) if stochastic else (None, refs)
  n = len(arrays)
  ins, outs, tiles, sems = refs[:n], refs[n : 2 * n], refs[2 * n : 3 * n], refs[3 * n]
  i = pl.program_id(0)
  lo, hi = lo_ref[i], hi_ref[i]
  visit = vmem_rows.Visit(
    arrays, rows_ref, outs, tiles, block_ref[i] * block, chunk_ref[i] * grads_ref.shape[0]
  )
  scalars = scalars_type(*(scalars_ref[k] for k in range(len(scalars_type._fields))))

  @pl.when((i == 0) | (block_ref[jnp.maximum(i - 1, 0)] != block_ref[i]))
  def _():
    _copy_block_in(ins, outs, sems)

  def update(m, carry):
    _update_group(visit, m, grads_ref, keys_ref, scalars, optimizer=optimizer, dtype=dtype)
    return carry

  @pl.when(lo < hi)
  def _():
    blocks.for_each_id(lo, hi, blocks.load_then_store(visit.read, visit.to_tile))
    # Shifts, not //: the ids' offsets are not negative, and Mosaic lowers a
    # signed // with a sign correction.
    first, last = lo - visit.first_id, hi - 1 - visit.first_id
    lax.fori_loop(first >> 3, (last >> 3) + 1, update, 0)
    blocks.for_each_id(lo, hi, visit.scatter())


def vmem_bytes(arrays, operands, *, dim: int, block: int, chunk: int, stochastic: bool) -> int:
  """VMEM of one call: per array its input and output blocks, each double
  buffered by the pipeline, and its (G, 128) tile; the (G, dim) gradients,
  double buffered (and the (G, 1) rounding keys)."""
  pad = chip_lib.padded_words
  words = sum(
    4 * pad(*blocks.block_shape(a, x, block)) + pad(chunk, x.shape[1])
    for a, x in zip(arrays, operands)
  )
  words += 2 * pad(chunk, dim) + stochastic * 2 * pad(chunk, 1)
  return words * chip_lib.WORD_BYTES


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
  rounding_keys: jax.Array | None = None,
  dim: int | None = None,
  interpret=False,
  chunk_rows: int = DEFAULT_CHUNK,
  block_bytes: int = DEFAULT_BLOCK_BYTES,
  block_rows: int | None = None,
  target: chip_lib.Target = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Applies `optimizer` to the listed rows in place; see `xla.fused_update`.

  Args:
    table, slots, rows, grads, scalars, apply, optimizer, dtype, dim: as
      for `xla.fused_update`; rows distinct and ascending, padding last.
    rounding_keys: None, or (U,) uint32 per-row keys of stochastic
      rounding (`packing.row_rounding_keys`).
    interpret: False (compile for TPU), True or `pltpu.InterpretParams`.
    chunk_rows: ids per chunk G, a multiple of 8 (capped at the ids,
      rounded up to 8).
    block_bytes: the table block's target size (`blocks.block_rows`).
    block_rows: rows per block B, overriding `block_bytes` (a multiple of
      `blocks.BLOCK_ALIGNMENT`, or the shard's rows).
    target: the chip to size VMEM for.

  Returns:
    (table, slots) with only the listed rows changed; donate them to the
    enclosing jit for the update to happen in place. On a TPU the table
    and slots are constrained to HBM (else XLA may stage a small one in
    VMEM around the call, a copy every step); XLA then refuses to alias
    the kernel's outputs with a donated jit parameter passed straight in
    (a RET_CHECK on aliasing shapes), which the library's programs, whose
    tables reach the kernel through their own jitted calls, do not do.

  Raises:
    InputError: arrays of the wrong shape or dtype.
    ConfigError: a bad chunk_rows, block_rows, interpret or target.
    VmemBudgetError: a block and a chunk do not fit the chip's VMEM.
  """
  kw = dict(optimizer=optimizer, dtype=dtype, rounding_keys=rounding_keys, dim=dim)
  dim = checks.check_update(table, slots, rows, grads, scalars, **kw)
  params = checks.interpret_params(interpret)
  chunk = checks.chunk_size(chunk_rows, rows.shape[0])
  if rows.shape[0] == 0:
    return table, dict(slots)
  specs = optimizer.slot_specs()
  arrays = blocks.arrays(table, slots, specs, dim, dtype)
  num_rows = checks.table_rows(table, dim, dtype)
  if block_rows is None:
    row_bytes = max(a.width for a in arrays) * 4
    block_rows = blocks.block_rows(num_rows, row_bytes, block_bytes)
  blocks.check_block(block_rows, num_rows)
  n = rows.shape[0]
  ids = blocks.pad_ids(rows, chunk)
  grads = jnp.pad(grads, ((0, ids.shape[0] - n), (0, 0)))
  keys = None
  if rounding_keys is not None:
    keys = jnp.pad(rounding_keys, (0, ids.shape[0] - n)).reshape(-1, 1)
  plan = blocks.plan(
    ids, num_rows=num_rows, block=block_rows, chunk=chunk, visit_padding=False, apply=apply
  )
  chip = chip_lib.resolve_chip(target)
  names = tuple(slots)
  operands = (table,) + tuple(slots[k] for k in names)
  footprint = chip_lib.check_vmem(
    "block_update",
    lambda c: vmem_bytes(
      arrays, operands, dim=dim, block=block_rows, chunk=c, stochastic=keys is not None
    ),
    chunk,
    chip,
  )
  out = _block_update_call(
    table,
    tuple(slots[k] for k in names),
    ids,
    plan,
    grads,
    keys,
    jnp.stack([jnp.asarray(v, jnp.float32).reshape(()) for v in scalars] or [jnp.zeros(())]),
    arrays=arrays,
    optimizer=optimizer,
    dtype=np.dtype(dtype),
    scalars_type=type(scalars),
    block=block_rows,
    chunk=chunk,
    interpret=params,
    vmem_limit=chip_lib.vmem_limit_bytes(footprint, chip),
  )
  return out[0], dict(zip(names, out[1:]))


@functools.partial(
  jax.jit,
  static_argnames=[
    "arrays",
    "optimizer",
    "dtype",
    "scalars_type",
    "block",
    "chunk",
    "interpret",
    "vmem_limit",
  ],
)
def _block_update_call(
  table,
  slots,
  ids,
  plan,
  grads,
  keys,
  flat_scalars,
  *,
  arrays,
  optimizer,
  dtype,
  scalars_type,
  block,
  chunk,
  interpret,
  vmem_limit,
):
  """The pallas_call: the table and slots aliased in place."""
  everything = (table, *slots)
  sizes = [x.shape[0] for x in everything]
  if not interpret:
    # In HBM, stated: else XLA may stage a small enough table or slot in
    # VMEM around the call, copying all of it every step.
    everything = tuple(pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in everything)
  else:
    # A TPU masks the last, partial block's writes; Pallas' TPU interpreter
    # returns aliased outputs padded to whole blocks, so it is handed whole
    # blocks (rows past the shard are never ids: the same result).
    everything = tuple(
      blocks.padded_to_blocks(x, blocks.block_shape(a, x, block)[0])
      for a, x in zip(arrays, everything)
    )
  dim = grads.shape[1]
  num_prefetch = 6
  blocked = lambda a, x: pl.BlockSpec(
    blocks.block_shape(a, x, block), lambda i, rows, blk, chk, lo, hi, sc: (blk[i], 0)
  )
  by_chunk = lambda cols: pl.BlockSpec(
    (chunk, cols), lambda i, rows, blk, chk, lo, hi, sc: (chk[i], 0)
  )
  specs = [blocked(a, x) for a, x in zip(arrays, everything)]
  stochastic = keys is not None
  kernel = functools.partial(
    _update_kernel,
    arrays=arrays,
    optimizer=optimizer,
    dtype=dtype,
    scalars_type=scalars_type,
    block=block,
    stochastic=stochastic,
  )
  operands = (grads,) + ((keys,) if stochastic else ()) + everything
  out = pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=num_prefetch,
      grid=(plan.block.shape[0],),
      in_specs=[by_chunk(dim)] + [by_chunk(1)] * stochastic + specs,
      out_specs=specs,
      # A packed array's tile holds its 128-lane rows; a wide one's, its rows.
      scratch_shapes=[pltpu.VMEM((chunk, x.shape[1]), jnp.int32) for x in everything]
      + [pltpu.SemaphoreType.DMA((len(arrays),))],
    ),
    out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in everything],
    input_output_aliases={num_prefetch + 1 + stochastic + k: k for k in range(len(everything))},
    compiler_params=pltpu.CompilerParams(
      # Output blocks are revisited by consecutive visits.
      dimension_semantics=("arbitrary",),
      vmem_limit_bytes=vmem_limit,
    ),
    interpret=interpret,
  )(ids, *plan, flat_scalars, *operands)
  return [x[:n] for x, n in zip(out, sizes)]
