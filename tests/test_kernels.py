"""The Pallas kernels: bit-exact against the XLA oracle in TPU interpret mode
(one device and under shard_map), race-free by the interpreter's detector,
lowerable for TPU, and refusing bad arguments with the right errors."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tpu_lowering
from conftest import make_mesh
from interpret_races import RACES, races_found
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_emb as pe
from pallas_emb import packing
from pallas_emb.kernels import chip as chip_lib
from pallas_emb.kernels import xla
from pallas_emb.kernels.pallas_gather import gather
from pallas_emb.kernels.pallas_gather import vmem_footprint_bytes as gather_vmem_footprint_bytes
from pallas_emb.kernels.pallas_update import fused_update, vmem_footprint_bytes

INTERPRET = pltpu.InterpretParams()

OPTIMIZERS = [
  pe.SGD(0.5),
  pe.Adagrad(0.25),
  pe.RowWiseAdagrad(0.1, half_life_steps=3, lazy_decay=True, weight_decay=0.01),
  pe.LazyAdam(0.05),
  pe.FTRL(0.1, learning_rate_power=-0.6, l1=0.5, l2=0.02, beta=0.1),
]
OPT_IDS = [type(o).__name__ for o in OPTIMIZERS]
DTYPES = [jnp.float32, jnp.bfloat16]
DTYPE_IDS = ["f32", "bf16"]

# 256 rows: two 128-row groups of the per-row scalar slots, each shared by
# many ids, whose runs cross chunk boundaries.
NUM_ROWS, DIM, CHUNK = 256, 16, 16
STEP = 7  # the step of the scalars; int32 slots (last_step, count) stay below


def _state(opt, dtype, rng, num_rows=NUM_ROWS, dim=DIM):
  """A stored table and random slots, as numpy arrays."""
  table = packing.to_storage(rng.normal(size=(num_rows, dim)), dtype)
  slots = {}
  for name, s in opt.slot_specs().items():
    shape = s.shape_for(num_rows, dim)  # per-row scalars in 128-row groups
    if np.dtype(s.dtype) == np.int32:
      slots[name] = rng.integers(0, STEP, shape).astype(np.int32)
    else:  # accumulators and second moments are positive
      slots[name] = rng.uniform(0.05, 2.0, shape).astype(np.float32)
  return table, slots


def _ascending(rng, num_rows, count):
  """`count` distinct ids in [0, num_rows), ascending, as routing makes them."""
  return np.sort(rng.choice(num_rows, count, replace=False)).astype(np.int32)


def _rows(case, rng, num_rows=NUM_ROWS):
  """(U,) int32 local row ids for a test case, and whether to apply."""
  if case == "full_chunks":  # U a multiple of chunk_rows
    return _ascending(rng, num_rows, 2 * CHUNK), True
  if case == "partial_last_chunk":  # 2 full chunks and one of 8 ids
    return _ascending(rng, num_rows, 2 * CHUNK + 8), True
  if case == "padding_last":  # -1 after the ids, mid-chunk, last chunk partial
    rows = np.full(2 * CHUNK + 8, -1, np.int32)
    rows[: CHUNK + 5] = _ascending(rng, num_rows, CHUNK + 5)
    return rows, True
  if case == "all_padding":
    return np.full(2 * CHUNK + 8, -1, np.int32), True
  if case == "apply_false":
    return _ascending(rng, num_rows, 2 * CHUNK), False
  raise ValueError(case)


# Two shapes (2 full chunks; 2 full and a partial one) for five cases: the
# cases of one shape share `_jitted_update`'s program.
CASES = ["full_chunks", "partial_last_chunk", "padding_last", "all_padding", "apply_false"]

# The quick loop's subset (conftest.pytest_collection_modifyitems): every
# optimizer on bf16 rows on the case that crosses full chunks into a partial
# one, full chunks and padding on f32 LazyAdam (the most DMAs per row),
# LazyAdam bf16 under shard_map, row-wise Adagrad in SMEM windows, the race
# the detector must find, and the TPU lowering of every optimizer and dtype
# for one generation at D=16 (bf16 rows of 8 words: unaligned halves).
QUICK = {
  "test_fused_update_equals_xla_bit_for_bit": lambda p: (
    (p["case"] == "partial_last_chunk" and p["dtype"] == jnp.bfloat16)
    or (
      isinstance(p["opt"], pe.LazyAdam)
      and p["dtype"] == jnp.float32
      and p["case"] in ("full_chunks", "padding_last")
    )
  ),
  "test_kernels_under_shard_map_equal_xla": lambda p: (
    isinstance(p["opt"], pe.LazyAdam) and p["dtype"] == jnp.bfloat16
  ),
  "test_ids_stream_through_smem_in_windows": lambda p: isinstance(p["opt"], pe.RowWiseAdagrad),
  "test_race_detector_sees_duplicate_ids_and_nothing_else": lambda p: p["duplicate"],
  "test_fused_update_lowers_for_tpu": lambda p: (
    p["kind"] == tpu_lowering.DEVICE_KINDS[0] and p["dim"] == 16
  ),
  "test_gather_lowers_for_tpu": lambda p: p["kind"] == tpu_lowering.DEVICE_KINDS[0],
}


def _assert_same(got, want, msg=""):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape, msg
  # Compare bits: NaNs equal, and -0.0 != 0.0.
  bits = np.dtype(f"u{got.dtype.itemsize}")
  np.testing.assert_array_equal(got.view(bits), want.view(bits), err_msg=msg)


def _update_fn(impl, opt, dtype, **kw):
  def fn(table, slots, rows, grads, scalars, apply):
    if impl == "xla":
      return xla.fused_update(table, slots, rows, grads, scalars, apply, optimizer=opt, dtype=dtype)
    return fused_update(table, slots, rows, grads, scalars, apply, optimizer=opt, dtype=dtype, **kw)

  return fn


@functools.cache
def _jitted_update(impl, opt, dtype, **kw):
  """`_update_fn` jitted once per configuration, so that the test cases of
  one shape trace and compile it once (an interpreted kernel's compile
  costs about as much as its run)."""
  return jax.jit(_update_fn(impl, opt, dtype, **kw))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_fused_update_equals_xla_bit_for_bit(opt, dtype, case):
  rng = np.random.default_rng(0)
  table, slots = _state(opt, dtype, rng)
  rows, apply = _rows(case, rng)
  grads = rng.normal(size=(rows.size, DIM)).astype(np.float32)
  args = (table, slots, rows, grads, opt.scalars(jnp.int32(STEP)), apply)
  want = _jitted_update("xla", opt, dtype)(*args)
  got = _jitted_update("pallas", opt, dtype, interpret=INTERPRET, chunk_rows=CHUNK)(*args)
  _assert_same(got[0], want[0], "table")
  assert set(got[1]) == set(slots)
  for k in slots:
    _assert_same(got[1][k], want[1][k], f"slot {k}")
  valid = rows[rows >= 0]
  untouched = np.setdiff1d(np.arange(NUM_ROWS), valid if apply else [])
  _assert_same(np.asarray(got[0])[untouched], table[untouched], "untouched rows")
  if apply and valid.size:
    assert not np.array_equal(np.asarray(got[0])[valid], table[valid])
  if not apply:
    _assert_same(got[0], table, "apply=False table")
    for k in slots:
      _assert_same(got[1][k], slots[k], f"apply=False slot {k}")


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather_equals_xla_bit_for_bit(dtype, case):
  rng = np.random.default_rng(1)
  table, _ = _state(pe.SGD(), dtype, rng)
  rows, _ = _rows(case, rng)
  want = jax.jit(lambda t, r: xla.gather(t, r, dtype=dtype))(table, rows)
  got = jax.jit(lambda t, r: gather(t, r, dtype=dtype, interpret=INTERPRET, chunk_rows=CHUNK))(
    table, rows
  )
  _assert_same(got, want)
  assert got.shape == (rows.size, DIM)
  assert (np.asarray(got)[rows < 0] == 0).all()


def test_default_chunk_covers_ids_in_one_step_and_interpret_true_works():
  # interpret=True (the "interpret" backend) means default InterpretParams.
  opt = pe.RowWiseAdagrad(0.1)
  rng = np.random.default_rng(2)
  table, slots = _state(opt, jnp.float32, rng)
  rows = _ascending(rng, NUM_ROWS, 20)
  grads = rng.normal(size=(20, DIM)).astype(np.float32)
  args = (table, slots, rows, grads, opt.scalars(jnp.int32(3)), True)
  want = jax.jit(_update_fn("xla", opt, jnp.float32))(*args)
  got = jax.jit(_update_fn("pallas", opt, jnp.float32, interpret=True))(*args)
  _assert_same(got[0], want[0])
  _assert_same(got[1]["acc"], want[1]["acc"])
  _assert_same(
    gather(table, rows, dtype=jnp.float32, interpret=True),
    xla.gather(table, rows, dtype=jnp.float32),
  )


@pytest.mark.parametrize("opt", OPTIMIZERS[2:], ids=OPT_IDS[2:])
def test_ids_stream_through_smem_in_windows(opt):
  # Windows of one chunk: 40 ids take 3 kernel calls, chained in place.
  rng = np.random.default_rng(4)
  table, slots = _state(opt, jnp.float32, rng)
  rows, _ = _rows("padding_last", rng)
  grads = rng.normal(size=(rows.size, DIM)).astype(np.float32)
  args = (table, slots, rows, grads, opt.scalars(jnp.int32(STEP)), True)
  want = jax.jit(_update_fn("xla", opt, jnp.float32))(*args)
  got = jax.jit(
    _update_fn("pallas", opt, jnp.float32, interpret=INTERPRET, chunk_rows=8, window_rows=CHUNK)
  )(*args)
  _assert_same(got[0], want[0], "table")
  for k in slots:
    _assert_same(got[1][k], want[1][k], f"slot {k}")
  rows = jnp.asarray(rows)
  _assert_same(
    gather(table, rows, dtype=jnp.float32, interpret=INTERPRET, chunk_rows=8, window_rows=CHUNK),
    xla.gather(table, rows, dtype=jnp.float32),
  )


def test_zero_ids_is_a_no_op():
  opt = pe.SGD()
  table, slots = _state(opt, jnp.float32, np.random.default_rng(3))
  empty = np.zeros((0,), np.int32)
  got, _ = fused_update(
    table,
    slots,
    empty,
    np.zeros((0, DIM), np.float32),
    opt.scalars(0),
    True,
    optimizer=opt,
    dtype=jnp.float32,
    interpret=True,
  )
  _assert_same(got, table)
  assert gather(table, empty, dtype=jnp.float32, interpret=True).shape == (0, DIM)


# -- under shard_map -----------------------------------------------------------

SHARD_ROWS, SHARD_IDS, SHARD_CHUNK = 128, 20, 8


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_kernels_under_shard_map_equal_xla(opt, dtype):
  # Four shards: every interpreted row costs milliseconds, and four already
  # hold a shard of each kind.
  mesh = make_mesh(4)
  n = mesh.shape["x"]
  rng = np.random.default_rng(4)
  table, slots = _state(opt, dtype, rng, num_rows=n * SHARD_ROWS)
  # Per shard: 20 ascending local ids, the last 5 of them -1 (3 chunks, the
  # last partial); shard 1 all padding, and shard 2's update not applied.
  rows = np.stack([_ascending(rng, SHARD_ROWS, SHARD_IDS) for _ in range(n)])
  rows[:, -5:] = -1
  rows[1] = -1
  apply = np.arange(n) != 2
  grads = rng.normal(size=(n * SHARD_IDS, DIM)).astype(np.float32)
  scalars = opt.scalars(jnp.int32(STEP))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  args = (
    put(table, P("x")),
    {k: put(v, P("x")) for k, v in slots.items()},
    put(rows.reshape(-1), P("x")),
    put(grads, P("x")),
    put(scalars, P()),
    put(apply, P("x")),
  )

  def run(impl):
    def shard_fn(table, slots, rows, grads, scalars, apply):
      kw = {} if impl == "xla" else dict(interpret=INTERPRET, chunk_rows=SHARD_CHUNK)
      new_table, new_slots = _update_fn(impl, opt, dtype, **kw)(
        table, slots, rows, grads, scalars, apply[0]
      )
      if impl == "xla":
        out = xla.gather(new_table, rows, dtype=dtype)
      else:
        out = gather(new_table, rows, dtype=dtype, chunk_rows=SHARD_CHUNK, interpret=INTERPRET)
      return new_table, new_slots, out

    return jax.jit(
      jax.shard_map(
        shard_fn,
        mesh=mesh,
        in_specs=(P("x"), P("x"), P("x"), P("x"), P(), P("x")),
        out_specs=P("x"),
        check_vma=False,
      )
    )(*args)

  want, got = run("xla"), run("pallas")
  _assert_same(got[0], want[0], "table")
  for k in slots:
    _assert_same(got[1][k], want[1][k], f"slot {k}")
  _assert_same(got[2], want[2], "gathered rows")
  # Shards 1 (all padding) and 2 (not applied) keep their rows bit for bit.
  for s in (1, 2):
    block = slice(s * SHARD_ROWS, (s + 1) * SHARD_ROWS)
    _assert_same(np.asarray(got[0])[block], table[block], f"shard {s}")


@pytest.mark.parametrize(
  "opt,dtype",
  [(OPTIMIZERS[2], jnp.float32), (OPTIMIZERS[3], jnp.bfloat16)],
  ids=["RowWiseAdagrad-f32", "LazyAdam-bf16"],
)
@pytest.mark.slow
def test_sharded_embedding_interpret_equals_xla(opt, dtype):
  def train(backend):
    # 128 rows per shard: the kernels, not the XLA fallback, update the
    # per-row scalar slots. Four shards and small route capacities keep the
    # interpreted rows few (each owner merges at most 4 x 8 rows) while ids
    # still travel between shards, collide and overflow.
    shards = 4
    table = pe.TableSpec(
      "t", shards * 128, DIM, optimizer=opt, dtype=dtype, unique_capacity=16, route_capacity=8
    )
    feats = [pe.FeatureSpec("bag", "t", "sum"), pe.FeatureSpec("seq", "t", None)]
    emb = pe.ShardedEmbedding([table], feats, make_mesh(shards), "x", backend)
    rng = np.random.default_rng(5)
    state = emb.init(jax.random.key(7))
    acts_log = []
    for _ in range(2):
      ids = {
        "bag": rng.integers(-1, shards * 128, (16, 3)).astype(np.int32),
        "seq": rng.integers(0, shards * 128 + 3, (16, 2)).astype(np.int32),
      }
      acts, res = emb.lookup(state, ids)
      acts_log.append(acts)
      grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in acts.items()}
      state, metrics = emb.apply_gradients(state, res, grads)
      assert bool(metrics["t"].applied)
    return emb.logical_table(state, "t"), emb.logical_slots(state, "t"), acts_log

  (t_x, s_x, a_x), (t_i, s_i, a_i) = train("xla"), train("interpret")
  _assert_same(t_i, t_x, "table")
  for k in s_x:
    _assert_same(s_i[k], s_x[k], f"slot {k}")
  for step_i, step_x in zip(a_i, a_x):
    for k in step_x:
      _assert_same(step_i[k], step_x[k], f"activations {k}")


# -- race detection --------------------------------------------------------------


@pytest.mark.parametrize("duplicate", [False, True], ids=["distinct", "duplicate"])
def test_race_detector_sees_duplicate_ids_and_nothing_else(duplicate):
  opt = pe.LazyAdam(0.05)  # three slots: four DMAs per row in flight
  rng = np.random.default_rng(6)
  # Four chunks: from the third on, a buffer is refilled after its previous
  # chunk's write-back, which the schedule must wait for. Chunks of 8 ids,
  # the smallest: the detector's cost grows faster than the DMAs it follows.
  chunk = 8
  table, slots = _state(opt, jnp.float32, rng, num_rows=128)
  rows = _ascending(rng, 128, 4 * chunk)
  if duplicate:  # the same row twice in one chunk: two write-backs race
    rows[5] = rows[4]
  grads = rng.normal(size=(rows.size, DIM)).astype(np.float32)
  found = races_found(
    lambda: fused_update(
      table,
      slots,
      rows,
      grads,
      opt.scalars(jnp.int32(STEP)),
      True,
      optimizer=opt,
      dtype=jnp.float32,
      interpret=RACES,
      chunk_rows=chunk,
    )
  )
  assert found == duplicate


def test_gather_has_no_races_even_with_duplicate_ids():
  # Reads never race with reads: the lookup may gather a row twice.
  rng = np.random.default_rng(7)
  table, _ = _state(pe.SGD(), jnp.bfloat16, rng)
  rows = rng.permutation(NUM_ROWS)[: 2 * CHUNK].astype(np.int32)
  rows[5] = rows[4]
  assert not races_found(
    lambda: gather(table, rows, dtype=jnp.bfloat16, interpret=RACES, chunk_rows=CHUNK)
  )


# -- lowering for TPU --------------------------------------------------------------


def _abstract_update_args(opt, dtype, num_rows, dim, num_ids):
  sds = jax.ShapeDtypeStruct
  table = sds((num_rows, packing.storage_width(dim, dtype)), packing.storage_dtype(dtype))
  slots = {k: sds(s.shape_for(num_rows, dim), s.dtype) for k, s in opt.slot_specs().items()}
  scalars = jax.tree.map(lambda _: sds((), jnp.float32), opt.scalars(jnp.int32(0)))
  return (
    table,
    slots,
    sds((num_ids,), jnp.int32),
    sds((num_ids, dim), jnp.float32),
    scalars,
    sds((), jnp.bool_),
  )


@pytest.mark.parametrize("dim", [16, 256])  # bf16 halves of 8 (unaligned) and 128 lanes
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
@pytest.mark.parametrize("kind", tpu_lowering.DEVICE_KINDS)
def test_fused_update_lowers_for_tpu(kind, opt, dtype, dim):
  args = _abstract_update_args(opt, dtype, 1024, dim, 200)
  exported = tpu_lowering.export_for_tpu(
    lambda *a: fused_update(*a, optimizer=opt, dtype=dtype), *args, device_kind=kind
  )
  [call] = tpu_lowering.mosaic_calls(exported)
  # In place: each of table and slots is an output aliased to its operand.
  assert call.count("output_operand_alias<") == 1 + len(opt.slot_specs())
  assert "update_kernel" in call


@pytest.mark.parametrize("dim", [16, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", tpu_lowering.DEVICE_KINDS)
def test_gather_lowers_for_tpu(kind, dtype, dim):
  sds = jax.ShapeDtypeStruct
  table = sds((1000, packing.storage_width(dim, dtype)), packing.storage_dtype(dtype))
  exported = tpu_lowering.export_for_tpu(
    lambda t, r: gather(t, r, dtype=dtype), table, sds((200,), jnp.int32), device_kind=kind
  )
  [call] = tpu_lowering.mosaic_calls(exported)
  assert "_gather_kernel" in call
  assert exported.out_avals[0].shape == (200, dim)


def test_export_sizes_vmem_for_the_abstract_chip():
  # A chunk between v5p's 64 MiB and v5e's 128 MiB of VMEM: v5e lowers it with
  # a VMEM limit above the default, v5p refuses it.
  opt, dim = pe.LazyAdam(), 2048
  widths = [dim, dim, 1]
  chunk = 768
  footprint = vmem_footprint_bytes(dim=dim, dtype=jnp.float32, slot_widths=widths, chunk_rows=chunk)
  assert 64 * 2**20 < footprint <= 128 * 2**20
  args = _abstract_update_args(opt, jnp.float32, 4096, dim, chunk)
  fn = lambda *a: fused_update(*a, optimizer=opt, dtype=jnp.float32, chunk_rows=chunk)
  [call] = tpu_lowering.mosaic_calls(
    tpu_lowering.export_for_tpu(fn, *args, device_kind="TPU v5 lite")
  )
  [limit] = map(int, re.findall(r"size\\22: (\d+)", call))
  assert footprint <= limit <= 128 * 2**20
  with pytest.raises(pe.VmemBudgetError, match="v5p"):
    tpu_lowering.export_for_tpu(fn, *args, device_kind="TPU v5")


# -- VMEM budget and argument checks -------------------------------------------------


def test_vmem_footprint_counts_padded_tiles():
  # f32 rows of 128: 2 row buffers, 2 gradient blocks and 3 + 1 live values of
  # C * 128 words; the per-row scalar slot adds two (C, 128) group buffers,
  # its old and new (C, 1) values padded to 128 lanes, and a carried group
  # padded to 8 sublanes.
  c = 128
  assert (
    vmem_footprint_bytes(dim=128, dtype=jnp.float32, slot_widths=[1], chunk_rows=c)
    == (12 * c * 128 + 8 * 128) * 4
  )
  # The gather: 2 row buffers, 2 output blocks and the unpacked rows.
  assert gather_vmem_footprint_bytes(dim=128, dtype=jnp.float32, chunk_rows=c) == 5 * c * 128 * 4
  # bf16 rows move as half as many words.
  assert vmem_footprint_bytes(
    dim=256, dtype=jnp.bfloat16, slot_widths=[], chunk_rows=8
  ) < vmem_footprint_bytes(dim=256, dtype=jnp.float32, slot_widths=[], chunk_rows=8)


def test_vmem_budget_error_names_footprint_vmem_chunk_and_a_chunk_that_fits():
  opt, dim, chunk = pe.Adagrad(), 8192, 512
  table, slots = (np.zeros((8, dim), np.float32), {"acc": np.zeros((8, dim), np.float32)})
  rows = np.full((chunk,), -1, np.int32)
  grads = np.zeros((chunk, dim), np.float32)
  footprint = vmem_footprint_bytes(dim=dim, dtype=jnp.float32, slot_widths=[dim], chunk_rows=chunk)
  with pytest.raises(pe.VmemBudgetError) as err:
    fused_update(
      table,
      slots,
      rows,
      grads,
      opt.scalars(0),
      True,
      optimizer=opt,
      dtype=jnp.float32,
      chunk_rows=chunk,
      target="v6e",
    )
  msg = str(err.value)
  vmem = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V6E, 1).vmem_capacity_bytes
  assert str(footprint) in msg and str(vmem) in msg and f"chunk_rows={chunk}" in msg
  [fits] = map(int, re.findall(r"use chunk_rows=(\d+)", msg))
  assert fits % 8 == 0
  assert (
    vmem_footprint_bytes(dim=dim, dtype=jnp.float32, slot_widths=[dim], chunk_rows=fits) <= vmem
  )
  assert (
    vmem_footprint_bytes(dim=dim, dtype=jnp.float32, slot_widths=[dim], chunk_rows=fits + 8) > vmem
  )
  with pytest.raises(pe.VmemBudgetError, match="v6e"):
    gather(
      table,
      np.full((4096,), -1, np.int32),
      dtype=jnp.float32,
      chunk_rows=4096,
      target="TPU v6 lite",
    )


def test_chip_targets_by_name_kind_or_version():
  v5e = chip_lib.resolve_chip(pltpu.ChipVersion.TPU_V5E)
  assert chip_lib.resolve_chip("v5e") == chip_lib.resolve_chip("TPU v5 lite") == v5e
  assert chip_lib.resolve_chip("TPU v5").name == "v5p"
  # Off TPU the kernels size for the smallest VMEM of v5e, v6e and v5p.
  assert chip_lib.resolve_chip().vmem_bytes == min(
    chip_lib.resolve_chip(v).vmem_bytes for v in ("v5e", "v6e", "v5p")
  )
  with tpu_lowering.tpu_target("TPU v6 lite"):
    assert chip_lib.resolve_chip().name == "v6e"
  with pytest.raises(pe.ConfigError, match="v9"):
    chip_lib.resolve_chip("v9")


def _call_update(**overrides):
  opt = overrides.pop("optimizer", pe.RowWiseAdagrad())
  table, slots = _state(opt, jnp.float32, np.random.default_rng(8))
  kw = dict(
    table=table,
    slots=slots,
    rows=np.arange(8, dtype=np.int32),
    grads=np.zeros((8, DIM), np.float32),
    scalars=opt.scalars(0),
    apply=True,
    optimizer=opt,
    dtype=jnp.float32,
    interpret=True,
  )
  kw.update(overrides)
  return fused_update(**kw)


@pytest.mark.parametrize(
  "overrides,error,match",
  [
    (
      dict(rows=np.arange(8, dtype=np.int64)),
      pe.InputError,
      r"int32.*pallas_emb.int32_ids\(rows\)",
    ),
    (dict(rows=np.zeros((2, 4), np.int32)), pe.InputError, r"1-D int32.*\[2, 4\]"),
    (dict(grads=np.zeros((8, DIM + 1), np.float32)), pe.InputError, r"float32\[8, 16\]"),
    (dict(grads=np.zeros((8, DIM), np.float16)), pe.InputError, "float16"),
    (dict(slots={}), pe.InputError, "acc"),
    (dict(slots={"acc": np.zeros((NUM_ROWS, DIM), np.float32)}), pe.InputError, r"\[2, 128\]"),
    (dict(dtype=jnp.bfloat16), pe.InputError, "uint32"),
    (dict(scalars=(0.1, 0.0)), pe.InputError, "NamedTuple"),
    (dict(chunk_rows=12), pe.ConfigError, "chunk_rows=16"),
    (dict(chunk_rows=0), pe.ConfigError, "multiple of 8"),
    (dict(chunk_rows=True), pe.ConfigError, "multiple of 8"),
    (dict(interpret="yes"), pe.ConfigError, "InterpretParams"),
    (dict(target="TPU v9"), pe.ConfigError, "TPU v9"),
  ],
  ids=[
    "rows-int64",
    "rows-2d",
    "grads-shape",
    "grads-dtype",
    "slots-missing",
    "slot-shape",
    "table-dtype",
    "scalars-tuple",
    "chunk-12",
    "chunk-0",
    "chunk-bool",
    "interpret-str",
    "target-unknown",
  ],
)
def test_fused_update_rejects_bad_arguments(overrides, error, match):
  with pytest.raises(error, match=match):
    _call_update(**overrides)


def test_gather_rejects_bad_arguments():
  table = np.zeros((NUM_ROWS, DIM // 2), np.uint32)
  with pytest.raises(pe.InputError, match="int32"):
    gather(table, np.arange(8, dtype=np.uint32), dtype=jnp.bfloat16)
  with pytest.raises(pe.InputError, match="float32"):
    gather(table, np.arange(8, dtype=np.int32), dtype=jnp.float32)
  with pytest.raises(pe.ConfigError, match="chunk_rows"):
    gather(table, np.arange(8, dtype=np.int32), dtype=jnp.bfloat16, chunk_rows=4)
