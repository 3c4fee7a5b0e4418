"""Rows narrower than 128 lanes stored packed (pallas_emb.packing): the stored
shapes, the XLA path against the logical (unpacked) update, the block kernels
in TPU interpret mode bit for bit against the XLA path (several blocks and
chunks, runs of ids in one physical row within and across chunks), lowering
for TPU, and host conversions across layouts that pack differently."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import tpu_lowering
from kernel_cases import (
  NUM_ROWS,
  STEP,
  assert_kernels_equal_xla,
  assert_same,
  random_state,
  run_update,
  sweep_ids,
)

import pallas_emb as pe
from pallas_emb import kernels, packing, stored_rows
from pallas_emb import state as state_lib
from pallas_emb.kernels.block_gather import gather
from pallas_emb.kernels.block_update import fused_update
from sharding.layout import RowLayout

# Every optimizer that runs in the kernels.
OPTIMIZERS = [
  pe.SGD(0.5),
  pe.Adagrad(0.25),
  pe.RowWiseAdagrad(0.1, half_life_steps=3, lazy_decay=True, weight_decay=0.01),
  pe.LazyAdam(0.05),
  pe.FTRL(0.1, learning_rate_power=-0.6, l1=0.5, l2=0.02, beta=0.1),
]
OPT_IDS = [type(o).__name__ for o in OPTIMIZERS]

# The quick loop's subset (conftest): D=16 on LazyAdam, the most arrays.
QUICK = {"test_packed_kernels_equal_xla_d16": lambda p: isinstance(p["opt"], pe.LazyAdam)}


def test_stored_shapes_pack_widths_that_divide_128():
  assert packing.table_shape(256, 16, jnp.float32) == (32, 128)
  assert packing.table_shape(256, 64, jnp.bfloat16) == (64, 128)  # 32 words a row
  assert packing.table_shape(256, 128, jnp.float32) == (256, 128)
  assert packing.table_shape(256, 48, jnp.float32) == (128, 128)  # padded to 64, 2 to a row
  # Shards of 8 rows cannot hold whole physical rows of 16 rows of width 8.
  assert packing.table_shape(64, 8, jnp.float32, rows_per_shard=8) == (64, 8)
  assert packing.table_shape(64, 8, jnp.float32, rows_per_shard=16) == (4, 128)
  m = pe.LazyAdam().slot_specs()
  assert m["m"].shape_for(256, 32) == (64, 128) and m["count"].shape_for(256, 32) == (2, 128)
  # Packing is the row-major reshape: logical row r at [r // k, (r % k) * w].
  x = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
  stored = packing.table_stored(x, 16, jnp.float32)
  np.testing.assert_array_equal(stored[5 // 8, (5 % 8) * 16 : (5 % 8) * 16 + 16], x[5])
  np.testing.assert_array_equal(packing.table_rows(stored, 16, jnp.float32), x)


def test_take_and_put_rows_of_packed_arrays_touch_only_their_sub_rows():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 16)).astype(np.float32)
  stored = jnp.asarray(x.reshape(8, 128))
  idx = jnp.asarray([3, 4, 63, 64], jnp.int32)  # 64: past the end
  got = stored_rows.take_rows(stored, idx, 16)
  np.testing.assert_array_equal(got[:3], x[[3, 4, 63]])
  np.testing.assert_array_equal(got[3], 0)
  new = rng.normal(size=(4, 16)).astype(np.float32)
  put = np.asarray(stored_rows.put_rows(stored, idx, new, 16)).reshape(64, 16)
  want = x.copy()
  want[[3, 4, 63]] = new[:3]
  np.testing.assert_array_equal(put, want)


@pytest.mark.parametrize("dtype", [np.float32, np.uint32, np.int32])
@pytest.mark.parametrize("width", [1, 16, 64])
def test_put_rows_tpu_form_equals_the_row_view(width, dtype):
  """A TPU's `put_rows` on a packed array (a scatter-add of each physical
  row's word differences) against the CPU's (a scatter into the (N * k,
  width) view): the same bits, with indices sharing physical rows, one past
  the end, and NaN and -0.0 words."""
  rng = np.random.default_rng(width)
  k = 128 // width
  stored = rng.integers(0, 2**32, (16, 128), dtype=np.uint64).astype(np.uint32).view(dtype)
  shared = np.arange(k // 2 + 1) + 3 * k  # rows of one physical row
  rest = rng.permutation(np.setdiff1d(np.arange(16 * k), shared))[: 5 * k]
  idx = np.concatenate([shared, rest, [16 * k]]).astype(np.int32)  # the last: past the end
  values = rng.integers(0, 2**32, (idx.size, width), dtype=np.uint64).astype(np.uint32)
  values[0, 0], values[-2, 0] = 0x7FC00001, 0x80000000  # a NaN and -0.0 as float32
  args = (jnp.asarray(stored), jnp.asarray(idx), jnp.asarray(values.view(dtype)))
  got = jax.jit(stored_rows._put_packed_rows)(*args)
  want = jax.jit(stored_rows._put_row_view)(*args)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
  rows = stored.reshape(-1, width).copy()
  rows[idx[:-1]] = values.view(dtype)[:-1]
  np.testing.assert_array_equal(
    np.asarray(got).view(np.uint32), rows.reshape(16, 128).view(np.uint32)
  )


def test_put_rows_on_a_tpu_keeps_the_packed_layout():
  """Lowered for a TPU, writing packed rows never reshapes the array to its
  (N * k, width) view (a relayout of the whole array in (8, 128) tiles)."""
  stored = jax.ShapeDtypeStruct((2048, 128), jnp.float32)
  idx, values = jax.ShapeDtypeStruct((64,), jnp.int32), jax.ShapeDtypeStruct((64, 16), jnp.float32)
  put = lambda s, i, v: stored_rows.put_rows(s, i, v, 16)
  text = jax.jit(put).trace(stored, idx, values).lower(lowering_platforms=("tpu",)).as_text()
  assert "16384x16" not in text
  assert (
    "16384x16"
    in jax.jit(put).trace(stored, idx, values).lower(lowering_platforms=("cpu",)).as_text()
  )


@pytest.mark.parametrize("width", [16, 128], ids=["packed", "plain"])
def test_the_xla_update_tells_its_gathers_the_rows_are_sorted_not_its_scatters(width):
  """A fused update's rows are ascending, padding last (every form's
  contract): its XLA form tells XLA's gathers so. Not its scatters: a TPU's
  sorted scatter holds 8 bytes per table row in temp (`kernels.xla`),
  and pod_check's bound on per-chip temp would no longer hold."""
  opt = pe.RowWiseAdagrad(0.1)
  num_rows = 2048 * 128 // width  # stored (2048, 128) either way
  stored = jax.ShapeDtypeStruct((2048, 128), jnp.float32)
  slots = {
    k: jax.ShapeDtypeStruct(v.shape_for(num_rows, width), v.dtype)
    for k, v in opt.slot_specs().items()
  }
  rows = jax.ShapeDtypeStruct((64,), jnp.int32)
  grads = jax.ShapeDtypeStruct((64, width), jnp.float32)

  def update(t, s, r, g):
    scalars = opt.scalars(jnp.int32(1))
    return kernels.xla.fused_update(
      t, s, r, g, scalars, jnp.bool_(True), optimizer=opt, dtype=jnp.float32, dim=width
    )

  ops = _indexing_ops(jax.make_jaxpr(update)(stored, slots, rows, grads).jaxpr)
  # Each stored array's rows are read by a gather told; no scatter is told
  # (nor the TPU write's own read of the physical rows it adds to).
  for shape in {stored.shape, *(v.shape for v in slots.values())}:
    assert ("gather", shape, True) in ops, (shape, ops)
  assert not [op for op in ops if op[0] == "scatter" and op[2]], ops


def _indexing_ops(jaxpr) -> list[tuple[str, tuple, bool]]:
  """(primitive, operand shape, indices_are_sorted) of every gather and
  scatter of `jaxpr`, in the branches of platform-dependent code too."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("gather", "scatter", "scatter-add"):
      name = "gather" if eqn.primitive.name == "gather" else "scatter"
      out.append((name, tuple(eqn.invars[0].aval.shape), eqn.params["indices_are_sorted"]))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out += _indexing_ops(sub)
  return out


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_xla_path_on_packed_state_equals_the_logical_update(opt):
  rng = np.random.default_rng(1)
  dim, dtype = 16, jnp.float32
  table, slots = random_state(opt, dtype, dim, rng)
  rows = sweep_ids(rng)
  grads = rng.normal(size=(rows.size, dim)).astype(np.float32)
  scalars = opt.scalars(jnp.int32(STEP))
  packed = run_update("xla", opt, dtype, table, slots, rows, grads, scalars, True)
  specs = opt.slot_specs()
  unpacked_slots = {
    k: v if specs[k].width == 1 else v.reshape(NUM_ROWS, -1) for k, v in slots.items()
  }
  plain = run_update(
    "xla", opt, dtype, table.reshape(NUM_ROWS, -1), unpacked_slots, rows, grads, scalars, True
  )
  assert_same(np.asarray(packed[0]).reshape(NUM_ROWS, -1), plain[0], "table")
  for k in slots:
    assert_same(np.asarray(packed[1][k]).reshape(plain[1][k].shape), plain[1][k], k)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_packed_kernels_equal_xla_d16(opt):
  assert_kernels_equal_xla(opt, jnp.float32, 16)


@pytest.mark.grid
@pytest.mark.parametrize("dim", [32, 64])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_packed_kernels_equal_xla_d32_d64(opt, dim):
  assert_kernels_equal_xla(opt, jnp.float32, dim)


@pytest.mark.grid
@pytest.mark.parametrize(
  "dtype,dim,seed",
  [(jnp.bfloat16, 8, 2), (jnp.bfloat16, 32, 2), (jnp.float32, 8, 3)],
  ids=["bf16-8", "bf16-32", "f32-8"],
)
@pytest.mark.parametrize("opt", OPTIMIZERS[2:4], ids=OPT_IDS[2:4])
def test_packed_kernels_equal_xla_bf16_and_d8(opt, dtype, dim, seed):
  # bf16 rows of 32 (16 words, 8 to a physical row) beside f32 slots (4 to
  # a physical row): each array has its own shift; f32 rows of 8: 16 to a row.
  assert_kernels_equal_xla(opt, dtype, dim, seed)


def test_uses_kernel_on_tpu_for_packed_state_only():
  opt = pe.LazyAdam()
  table, slots = random_state(opt, jnp.float32, 16, np.random.default_rng(5))
  assert kernels.uses_kernel("pallas", table, slots)
  assert kernels.uses_kernel("pallas", table)
  plain = {k: specs.as_rows(v, 16) for k, v, specs in _with_specs(opt, slots)}
  assert not kernels.uses_kernel("pallas", table.reshape(NUM_ROWS, 16), plain)
  assert not kernels.uses_kernel("pallas", table, plain)


def _with_specs(opt, slots):
  specs = opt.slot_specs()
  return [(k, v, specs[k]) for k, v in slots.items()]


@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("opt", OPTIMIZERS[2:4], ids=OPT_IDS[2:4])
def test_packed_kernels_lower_for_tpu(opt, dim):
  sds = jax.ShapeDtypeStruct
  dtype = jnp.float32
  table = sds(packing.table_shape(1024, dim, dtype), jnp.float32)
  slots = {k: sds(s.shape_for(1024, dim), s.dtype) for k, s in opt.slot_specs().items()}
  scalars = jax.tree.map(lambda _: sds((), jnp.float32), opt.scalars(jnp.int32(0)))
  args = (table, slots, sds((200,), jnp.int32), sds((200, dim), jnp.float32), scalars)
  exported = tpu_lowering.export_for_tpu(
    lambda t, s, r, g, sc: fused_update(t, s, r, g, sc, True, optimizer=opt, dtype=dtype, dim=dim),
    *args,
    device_kind="TPU v5 lite",
  )
  [call] = tpu_lowering.mosaic_calls(exported)
  assert call.count("output_operand_alias<") == 1 + len(opt.slot_specs())
  exported = tpu_lowering.export_for_tpu(
    lambda t, r: gather(t, r, dtype=dtype, dim=dim),
    table,
    sds((200,), jnp.int32),
    device_kind="TPU v5 lite",
  )
  [call] = tpu_lowering.mosaic_calls(exported)
  assert exported.out_avals[0].shape == (200, dim)


def test_host_state_moves_between_layouts_that_pack_differently():
  # Rows of 8 floats pack 16 to a physical row: shards of 8 rows (8 shards)
  # store them as rows, shards of 16 (4 shards) packed.
  spec = pe.TableSpec("t", 64, 8, optimizer=pe.LazyAdam())
  rng = np.random.default_rng(6)
  logical = rng.normal(size=(64, 8)).astype(np.float32)
  m = rng.normal(size=(64, 8)).astype(np.float32)
  plain, packed = RowLayout(64, 8), RowLayout(64, 4)
  assert plain.rows_per_shard == 8 and packed.rows_per_shard == 16
  specs = spec.optimizer.slot_specs()
  stored = packing.table_stored(plain.to_physical(logical), 8, jnp.float32, 8)
  assert stored.shape == (64, 8)
  moved = state_lib.reshard_table(spec, plain, packed, stored)
  assert moved.shape == (4, 128)
  back = state_lib.reshard_table(spec, packed, plain, moved)
  assert_same(back, stored)
  np.testing.assert_array_equal(
    packed.to_logical(packing.table_rows(moved, 8, jnp.float32)), logical
  )
  slots = {"m": specs["m"].as_stored(plain.to_physical(m), 8, 8)}
  slots["v"], slots["count"] = slots["m"], np.zeros((64, 1), np.int32)
  moved = state_lib.reshard_slots(spec, plain, packed, slots)
  assert moved["m"].shape == (4, 128)
  np.testing.assert_array_equal(packed.to_logical(specs["m"].as_rows(moved["m"], 8)), m)
