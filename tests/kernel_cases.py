"""Shared cases of the kernel tests: a random stored (packed, padded or
plain) table and slots over several blocks, ids that exercise the block
sweep, either form of the update and the gather, and bit-for-bit
comparison."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_emb import packing
from pallas_emb.kernels import block_gather, block_update, xla

INTERPRET = pltpu.InterpretParams()
# Three blocks of 1,024 rows, the last one partial; chunks of 16 ids.
NUM_ROWS, BLOCK, CHUNK, STEP = 2560, 1024, 16, 7


def random_state(opt, dtype, dim, rng, num_rows=NUM_ROWS):
  """A stored table and random slots of `opt` (NumPy), in their stored
  shapes: int32 slots below STEP, the others positive (accumulators and
  second moments)."""
  table = packing.table_stored(
    packing.to_storage(rng.normal(size=(num_rows, dim)), dtype), dim, dtype
  )
  slots = {}
  for name, s in opt.slot_specs().items():
    if np.dtype(s.dtype) == np.int32:
      values = rng.integers(0, STEP, (num_rows, s.width_for(dim))).astype(np.int32)
    else:
      values = rng.uniform(0.05, 2.0, (num_rows, s.width_for(dim))).astype(np.float32)
    slots[name] = s.as_stored(values, dim)
  return table, slots


def sweep_ids(rng, num_rows=NUM_ROWS):
  """Ascending distinct ids for a sweep of three blocks: at both edges of
  the first and last blocks, none in the middle block (an empty block), a
  dense run of 40 ids (runs in one packed physical row and in one scalar
  group, across chunks of 16), a few scattered ones; then padding: -1 and
  an id past the shard (invalid), as routing leaves them, last."""
  dense = np.arange(100, 140)
  scattered = rng.choice(np.arange(200, 1000), 9, replace=False)
  edges = [0, 1, 1022, 1023, 2048, 2049, num_rows - 2, num_rows - 1]
  rows = np.unique(np.concatenate([dense, scattered, edges])).astype(np.int32)
  return np.concatenate([rows, np.array([-1, num_rows + 3, -1, -1, -1], np.int32)])


def bits(x):
  """An array's bit patterns (unsigned integers of its width)."""
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def assert_same(got, want, msg=""):
  """Same shape, dtype and bits."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, msg
  np.testing.assert_array_equal(bits(got), bits(want), err_msg=msg)


def run_update(form, opt, dtype, *args, rounding_keys=None, interpret=INTERPRET, **kw):
  """The jitted fused update on "xla" or the interpreted block kernel."""
  if form == "xla":
    fn = lambda *a: xla.fused_update(*a, optimizer=opt, dtype=dtype, rounding_keys=rounding_keys)
  else:
    kw = dict(interpret=interpret, chunk_rows=CHUNK, block_rows=BLOCK) | kw
    fn = lambda *a: block_update.fused_update(
      *a, optimizer=opt, dtype=dtype, rounding_keys=rounding_keys, **kw
    )
  return jax.jit(fn)(*args)


def run_gather(form, table, rows, dtype, dim, **kw):
  """The gather on "xla" or the interpreted block kernel."""
  if form == "xla":
    return xla.gather(table, rows, dtype=dtype, dim=dim)
  kw = dict(interpret=INTERPRET, chunk_rows=CHUNK, block_rows=BLOCK) | kw
  return block_gather.gather(table, rows, dtype=dtype, dim=dim, **kw)


def assert_kernels_equal_xla(opt, dtype, dim, seed=2, rounding=False):
  """A random case (`random_state`, `sweep_ids`) updated and gathered by the
  interpreted block kernels and by XLA: the same table, slots and gathered
  rows, bit for bit, and the table changed. Returns (table before, slots
  before, the ids, the kernels' (table, slots))."""
  rng = np.random.default_rng(seed)
  table, slots = random_state(opt, dtype, dim, rng)
  rows = sweep_ids(rng)
  grads = rng.normal(size=(rows.size, dim)).astype(np.float32)
  keys = None
  if rounding:
    keys = packing.row_rounding_keys(packing.rounding_key(5, jnp.int32(STEP), 9), jnp.asarray(rows))
  args = (table, slots, rows, grads, opt.scalars(jnp.int32(STEP)), True)
  want = run_update("xla", opt, dtype, *args, rounding_keys=keys)
  got = run_update("block", opt, dtype, *args, rounding_keys=keys)
  assert_same(got[0], want[0], "table")
  assert not np.array_equal(bits(got[0]), bits(table))
  for k in slots:
    assert_same(got[1][k], want[1][k], f"slot {k}")
  r = jnp.asarray(rows)
  assert_same(run_gather("block", got[0], r, dtype, dim), run_gather("xla", want[0], r, dtype, dim))
  return table, slots, rows, got
