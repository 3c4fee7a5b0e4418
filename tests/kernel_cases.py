"""Shared cases of the kernel tests on stored (packed or padded) rows: a
random stored table and slots, ids with runs in one physical row, the
update on either path, and bit-for-bit comparison."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_emb import packing
from pallas_emb.kernels import xla
from pallas_emb.kernels.pallas_gather import gather
from pallas_emb.kernels.pallas_update import fused_update

INTERPRET = pltpu.InterpretParams()
NUM_ROWS, CHUNK, WINDOW, STEP = 256, 16, 32, 7


def random_state(opt, dtype, dim, rng, num_rows=NUM_ROWS):
  """A stored table and random slots of `opt` (NumPy), in their stored
  shapes: int32 slots below STEP, the others positive (accumulators and
  second moments)."""
  table = packing.table_stored(
    packing.to_storage(rng.normal(size=(num_rows, dim)), dtype), dim, dtype
  )
  slots = {}
  for name, s in opt.slot_specs().items():
    shape = s.shape_for(num_rows, dim)
    if np.dtype(s.dtype) == np.int32:
      slots[name] = rng.integers(0, STEP, shape).astype(np.int32)
    else:
      values = rng.uniform(0.05, 2.0, (num_rows, s.width_for(dim))).astype(np.float32)
      slots[name] = s.as_stored(values, dim) if s.width != 1 else values.reshape(shape)
  return table, slots


def dense_ids(rng):
  """48 ascending distinct ids among the first 96 rows, then 5 padding ids:
  runs of ids in one physical row inside chunks, across chunk boundaries
  and across kernel calls (windows of 32 ids)."""
  rows = np.sort(rng.choice(96, 48, replace=False)).astype(np.int32)
  return np.concatenate([rows, np.full(5, -1, np.int32)])


def bits(x):
  """An array's bit patterns (unsigned integers of its width)."""
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def assert_same(got, want, msg=""):
  """Same shape, dtype and bits."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, msg
  np.testing.assert_array_equal(bits(got), bits(want), err_msg=msg)


def run_update(impl, opt, dtype, *args):
  """The jitted fused update on "xla" or the interpreted Pallas kernel
  (chunks of CHUNK ids, windows of WINDOW)."""
  if impl == "xla":
    fn = lambda *a: xla.fused_update(*a, optimizer=opt, dtype=dtype)
  else:
    fn = lambda *a: fused_update(
      *a, optimizer=opt, dtype=dtype, interpret=INTERPRET, chunk_rows=CHUNK, window_rows=WINDOW
    )
  return jax.jit(fn)(*args)


def assert_kernels_equal_xla(opt, dtype, dim, seed=2):
  """A random case (`random_state`, `dense_ids`) updated and gathered by
  the interpreted kernels and by XLA: the same table, slots and gathered
  rows, bit for bit, and the table changed. Returns (table before,
  slots before, the kernels' (table, slots))."""
  rng = np.random.default_rng(seed)
  table, slots = random_state(opt, dtype, dim, rng)
  rows = dense_ids(rng)
  grads = rng.normal(size=(rows.size, dim)).astype(np.float32)
  args = (table, slots, rows, grads, opt.scalars(jnp.int32(STEP)), True)
  want = run_update("xla", opt, dtype, *args)
  got = run_update("pallas", opt, dtype, *args)
  assert_same(got[0], want[0], "table")
  assert not np.array_equal(bits(got[0]), bits(table))
  for k in slots:
    assert_same(got[1][k], want[1][k], f"slot {k}")
  r = jnp.asarray(rows)
  assert_same(
    gather(
      got[0], r, dtype=dtype, dim=dim, interpret=INTERPRET, chunk_rows=CHUNK, window_rows=WINDOW
    ),
    xla.gather(want[0], r, dtype=dtype, dim=dim),
    "gather",
  )
  return table, slots, got
