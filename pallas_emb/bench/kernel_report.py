"""`python -m pallas_emb.bench.kernel_report`: what one fused-update call moves.

For one call on U rows of width D with row-wise Adagrad (one (R, 1) slot):
the bytes the DMA schedule moves per row against the minimum (row read and
write, slot read and write), the DMAs in flight, the VMEM footprint against
each chip generation's VMEM, and the wall time in TPU interpret mode.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_emb import packing
from pallas_emb.kernels import chip as chip_lib
from pallas_emb.kernels.pallas_update import DEFAULT_CHUNK_ROWS, fused_update, vmem_footprint_bytes
from pallas_emb.optimizers import RowWiseAdagrad

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined only when run, so importing this module adds no absl flags."""
  flags.DEFINE_integer("rows", 256, "Row ids U in the call.")
  flags.DEFINE_integer("dim", 128, "Row width D.")
  flags.DEFINE_integer("repeats", 5, "Timed interpret-mode calls.")


def report(num_ids: int, dim: int, repeats: int) -> None:
  opt = RowWiseAdagrad()
  chunk = min(DEFAULT_CHUNK_ROWS, chip_lib.round_up(num_ids, chip_lib.SUBLANES))
  rng = np.random.default_rng(0)
  table_rows = 16 * num_ids
  for dtype in (jnp.float32, jnp.bfloat16):
    width = packing.storage_width(dim, dtype)
    values = packing.to_storage(rng.normal(size=(table_rows, dim)), dtype)
    table = jnp.asarray(packing.table_stored(values, dim, dtype))
    slots = {"acc": jnp.zeros((table_rows, 1), jnp.float32)}
    ids = jnp.asarray(rng.permutation(table_rows)[:num_ids].astype(np.int32))
    grads = jnp.asarray(rng.normal(size=(num_ids, dim)).astype(np.float32))
    call = jax.jit(
      lambda t, s, r, g, sc, dtype=dtype: fused_update(
        t, s, r, g, sc, True, optimizer=opt, dtype=dtype, interpret=True
      )
    )
    scalars = opt.scalars(jnp.int32(1))
    jax.block_until_ready(call(table, slots, ids, grads, scalars))
    times = []
    for _ in range(repeats):
      tic = time.perf_counter()
      jax.block_until_ready(call(table, slots, ids, grads, scalars))
      times.append(time.perf_counter() - tic)
    moved = 2 * (width * 4 + 4)  # each id: its stored row and slot row, in and out
    minimum = 2 * (dim * np.dtype(dtype).itemsize + 4)
    in_flight = 2 * chunk * (1 + len(slots))  # next chunk's reads + this chunk's writes
    print(
      f"{np.dtype(dtype)} U={num_ids} D={dim}: DMA bytes per row {moved} (minimum "
      f"{minimum}); plus {dim * 4} B of gradient (BlockSpec) and a 4 B id (SMEM); "
      f"chunk {chunk}, up to {in_flight} DMAs in flight"
    )
    footprint = vmem_footprint_bytes(dim=dim, dtype=dtype, slot_widths=[1], chunk_rows=chunk)
    for chip in ("v5e", "v6e", "v5p"):
      c = chip_lib.resolve_chip(chip)
      print(
        f"  TPU {chip}: VMEM footprint {footprint / 2**10:.0f} KiB of "
        f"{c.vmem_bytes / 2**20:.0f} MiB ({100 * footprint / c.vmem_bytes:.2f}%)"
      )
    print(
      f"  interpret mode: median {statistics.median(times) * 1e3:.0f} ms "
      f"over {repeats} calls ({[round(t * 1e3) for t in times]} ms)"
    )


def main(argv):
  del argv
  report(FLAGS.rows, FLAGS.dim, FLAGS.repeats)


if __name__ == "__main__":
  define_flags()
  app.run(main)
