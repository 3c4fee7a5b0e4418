"""Fused sparse optimizer update of table rows, in place: a Pallas TPU kernel.

One kernel template serves every optimizer: it moves rows and slot rows
between HBM and VMEM and calls the optimizer's pure `update_rows` on them.

Why manual DMAs: the rows to update are scattered through a table far larger
than VMEM, so neither a BlockSpec (contiguous blocks) nor XLA (gather, update,
scatter: three passes over the rows and temporaries in HBM) fits. The table
and every slot stay in HBM (`memory_space=pl.ANY`) and are aliased to the
outputs, so only the listed rows are read and written, in place.

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
(`row_dma.ChunkCopies`): up to 2 * C * (1 + number of slots) in flight.

Row ids are scalar-prefetched into SMEM (the scalar core computes DMA
addresses from them); padding ids are never copied. The ids must be
distinct: two DMAs writing the same row race (the interpreter's race
detector reports it). When `apply` is false the kernel issues no DMA at all,
so the table and slots stay bit-identical.

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
from pallas_emb.kernels import checks, row_dma
from pallas_emb.kernels import chip as chip_lib
from pallas_emb.kernels.protocol import RowUpdate

DEFAULT_CHUNK_ROWS = 128


def vmem_footprint_bytes(*, dim: int, dtype, slot_widths: Sequence[int],
                         chunk_rows: int = DEFAULT_CHUNK_ROWS) -> int:
  """VMEM the fused update needs for one chunk size, in bytes.

  Counts, in (8, 128)-tiled 32-bit words: two row buffers (C, storage width)
  and two buffers per slot (C, width) -- the double buffer of the DMA
  schedule --, two (C, dim) gradient blocks (the Pallas pipeline's double
  buffer), and the values live during the update: unpacked and updated rows,
  a temporary, the packed words, and old and new slot rows.

  Args:
    dim: the row width D.
    dtype: the table's logical dtype (float32 or bfloat16).
    slot_widths: columns of each optimizer slot (dim, or 1 for per-row state).
    chunk_rows: rows per chunk C.
  """
  c = chunk_rows
  width = packing.storage_width(dim, dtype)
  pad = chip_lib.padded_words
  slots = sum(pad(c, w) for w in slot_widths)
  words = (2 * pad(c, width) + 2 * slots + 2 * pad(c, dim)
           + 3 * pad(c, dim) + pad(c, width) + 2 * slots)
  return words * chip_lib.WORD_BYTES


def _update_chunk(words, slots, grads, scalars, *, optimizer, dtype):
  """Stored rows -> updated stored rows: what the kernel runs per chunk."""
  new_rows, new_slots = optimizer.update_rows(
      packing.unpack_rows(words, dtype), slots, grads, scalars)
  packed = packing.pack_rows(new_rows, dtype).astype(words.dtype)
  return packed, {k: new_slots[k].astype(v.dtype) for k, v in slots.items()}


def _update_kernel(rows_ref, apply_ref, scalars_ref, grads_ref, *refs,
                   optimizer, dtype, slot_names, scalars_type, num_rows):
  """One grid step: one chunk of row ids; see the module docstring.

  Refs: rows (U,) int32, apply (1,) int32 and scalars (S,) float32 in SMEM;
  grads (C, dim) float32 block in VMEM; then the table and slots twice (the
  aliased inputs, unused, and the outputs, in HBM); then one (2, C, width)
  VMEM buffer per array; then the read and write DMA semaphores, (2, arrays).
  """
  num_arrays = 1 + len(slot_names)
  hbm = refs[num_arrays:2 * num_arrays]
  bufs = refs[2 * num_arrays:3 * num_arrays]
  read_sems, write_sems = refs[3 * num_arrays:]
  chunk = bufs[0].shape[1]
  i = pl.program_id(0)
  last = pl.num_programs(0) - 1
  cur, nxt = i % 2, 1 - i % 2

  def copies(step, buf, to_hbm):
    sems = write_sems if to_hbm else read_sems
    return row_dma.ChunkCopies(
        rows_ref, step * chunk, hbm, [b.at[buf] for b in bufs],
        [sems.at[buf, k] for k in range(num_arrays)], num_rows=num_rows,
        to_hbm=to_hbm)

  # Not applying issues no DMA at all: nothing can be written.
  @pl.when(apply_ref[0] != 0)
  def _():
    @pl.when(i == 0)
    def _():
      copies(0, 0, False).start()

    @pl.when(i < last)
    def _():
      # Chunk i-1's write-back still reads the buffer chunk i+1 fills.
      @pl.when(i > 0)
      def _():
        copies(i - 1, nxt, True).wait()

      copies(i + 1, nxt, False).start()

    copies(i, cur, False).wait()
    scalars = scalars_type(*(scalars_ref[k]
                             for k in range(len(scalars_type._fields))))
    words, slots = _update_chunk(
        bufs[0][cur], {n: b[cur] for n, b in zip(slot_names, bufs[1:])},
        grads_ref[...], scalars, optimizer=optimizer, dtype=dtype)
    bufs[0][cur] = words
    for name, buf in zip(slot_names, bufs[1:]):
      buf[cur] = slots[name]
    copies(i, cur, True).start()

    # The kernel may not end with DMAs in flight.
    @pl.when(i == last)
    def _():
      @pl.when(i > 0)
      def _():
        copies(i - 1, nxt, True).wait()

      copies(i, cur, True).wait()


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
    target: chip_lib.Target = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Applies `optimizer` to the listed rows, in place; see `xla.fused_update`.

  Args:
    table: (R, W) stored rows: float32 (W = dim) or uint32 words of bfloat16
      (W = dim / 2).
    slots: name -> (R, width) float32 | int32 optimizer state, width = dim or
      1, exactly the optimizer's `slot_specs()`.
    rows: (U,) int32 distinct local row ids; -1 (any id outside [0, R)) is
      padding.
    grads: (U, dim) float32 summed gradient per row.
    scalars: `optimizer.scalars(step)`, a NamedTuple of float32 scalars.
    apply: bool scalar; when False nothing is written.
    optimizer: supplies `update_rows`.
    dtype: the table's logical dtype.
    interpret: False (compile for TPU), True (TPU interpret mode) or a
      `pltpu.InterpretParams`.
    chunk_rows: rows per grid step, a positive multiple of 8 (capped at U
      rounded up to 8).
    target: the chip to size VMEM for; see `chip.resolve_chip`.

  Returns:
    (table, slots) with only the listed rows changed. Donate `table` and
    `slots` to the enclosing jit for the update to happen in place.

  Raises:
    InputError: arrays of the wrong shape or dtype.
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
  flat_scalars = _flat_scalars(scalars)
  slot_names = tuple(slots)
  widths = [slots[n].shape[1] for n in slot_names]
  chip = chip_lib.resolve_chip(target)
  footprint = chip_lib.check_vmem(
      "fused_update",
      lambda c: vmem_footprint_bytes(dim=dim, dtype=dtype, slot_widths=widths,
                                     chunk_rows=c),
      chunk, chip)
  chip_lib.check_smem("fused_update", chip_lib.round_up(num_ids, chunk),
                      1 + flat_scalars.shape[0], chip)
  table, new_slots = _fused_update_call(
      table, tuple(slots[n] for n in slot_names), rows, grads, flat_scalars,
      jnp.asarray(apply).astype(jnp.int32).reshape(1), optimizer=optimizer,
      dtype=np.dtype(dtype), slot_names=slot_names, scalars_type=type(scalars),
      chunk=chunk, interpret=params,
      vmem_limit=chip_lib.vmem_limit_bytes(footprint, chip))
  return table, dict(zip(slot_names, new_slots))


@functools.partial(
    jax.jit,
    static_argnames=["optimizer", "dtype", "slot_names", "scalars_type",
                     "chunk", "interpret", "vmem_limit"])
def _fused_update_call(table, slots, rows, grads, flat_scalars, apply, *,
                       optimizer, dtype, slot_names, scalars_type, chunk,
                       interpret, vmem_limit):
  num_ids, dim = grads.shape
  padded = chip_lib.round_up(num_ids, chunk)
  rows = jnp.pad(rows, (0, padded - num_ids), constant_values=-1)
  grads = jnp.pad(grads, ((0, padded - num_ids), (0, 0)))
  arrays = (table, *slots)

  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  cost = pl.estimate_cost(
      functools.partial(_update_chunk, optimizer=optimizer, dtype=dtype),
      sds((padded, table.shape[1]), table.dtype),
      {n: sds((padded, s.shape[1]), s.dtype)
       for n, s in zip(slot_names, slots)},
      sds((padded, dim), jnp.float32),
      scalars_type(*(sds((), jnp.float32) for _ in scalars_type._fields)))
  row_bytes = sum(a.shape[1] * a.dtype.itemsize for a in arrays)
  cost = pl.CostEstimate(
      flops=cost.flops, transcendentals=cost.transcendentals,
      # Each id reads and writes its row of every array; grads are read once.
      bytes_accessed=2 * num_ids * row_bytes + padded * dim * 4 + padded * 4)

  hbm = pl.BlockSpec(memory_space=pl.ANY)
  num_scalar_prefetch = 3
  kernel = functools.partial(
      _update_kernel, optimizer=optimizer, dtype=dtype, slot_names=slot_names,
      scalars_type=scalars_type, num_rows=table.shape[0])
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=num_scalar_prefetch,
          grid=(padded // chunk,),
          in_specs=[pl.BlockSpec((chunk, dim), lambda i, *_: (i, 0))]
          + [hbm] * len(arrays),
          out_specs=[hbm] * len(arrays),
          scratch_shapes=[pltpu.VMEM((2, chunk, a.shape[1]), a.dtype)
                          for a in arrays]
          + [pltpu.SemaphoreType.DMA((2, len(arrays)))] * 2),
      out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
      # Alias indices count the scalar-prefetch operands too: the call's
      # operands are rows, apply, scalars, grads, then table and slots.
      input_output_aliases={num_scalar_prefetch + 1 + k: k
                            for k in range(len(arrays))},
      compiler_params=pltpu.CompilerParams(
          # Buffers carry chunks across grid steps.
          dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit),
      cost_estimate=cost,
      interpret=interpret,
  )(rows, apply, flat_scalars, grads, *arrays)
  return out[0], tuple(out[1:])
