"""The block kernels: bit-exact against the XLA oracle in TPU interpret mode
(one device and under shard_map) over several blocks, an empty block, ids at
block edges, a partial last block, padding and invalid ids; race-free by the
interpreter's detector; lowerable for TPU; refusing bad arguments with the
right errors. And the plan of a sweep and the cost model that picks a form."""

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
from kernel_cases import (
  NUM_ROWS,
  STEP,
  assert_kernels_equal_xla,
  assert_same,
  random_state,
  run_gather,
  run_update,
  sweep_ids,
)

import pallas_emb as pe
from pallas_emb import kernels, packing
from pallas_emb.kernels import block_gather, block_update, blocks, forms
from pallas_emb.kernels import chip as chip_lib

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
DIM = 16  # packed: 8 float32 rows (16 bfloat16 rows) to a 128-lane row

# The quick loop's subset (conftest.pytest_collection_modifyitems): every
# optimizer on bf16 rows (packed words), LazyAdam (four arrays, two of them
# packed, one a scalar) on f32, the TPU lowering of every optimizer for one
# generation.
QUICK = {
  "test_fused_update_equals_xla_bit_for_bit": lambda p: (
    p["dtype"] == jnp.bfloat16 or isinstance(p["opt"], pe.LazyAdam)
  ),
  "test_fused_update_lowers_for_tpu": lambda p: (
    p["kind"] == tpu_lowering.DEVICE_KINDS[0] and p["dim"] == 16
  ),
  "test_gather_lowers_for_tpu": lambda p: p["kind"] == tpu_lowering.DEVICE_KINDS[0],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_fused_update_equals_xla_bit_for_bit(opt, dtype):
  table, _, rows, (got, _) = assert_kernels_equal_xla(opt, dtype, DIM)
  valid = rows[(rows >= 0) & (rows < NUM_ROWS)]
  logical = lambda x: packing.table_rows(np.asarray(x), DIM, dtype)
  untouched = np.setdiff1d(np.arange(NUM_ROWS), valid)
  assert_same(logical(got)[untouched], logical(table)[untouched], "untouched rows")


@pytest.mark.parametrize("case", ["all_padding", "apply_false"])
def test_an_update_that_writes_nothing_leaves_every_bit(case):
  opt = pe.LazyAdam(0.05)
  rng = np.random.default_rng(3)
  table, slots = random_state(opt, jnp.float32, DIM, rng)
  rows = sweep_ids(rng) if case == "apply_false" else np.full((24,), -1, np.int32)
  grads = rng.normal(size=(rows.size, DIM)).astype(np.float32)
  got = run_update(
    "block",
    opt,
    jnp.float32,
    table,
    slots,
    rows,
    grads,
    opt.scalars(jnp.int32(STEP)),
    case != "apply_false",
  )
  assert_same(got[0], table)
  for k in slots:
    assert_same(got[1][k], slots[k], k)


def test_a_shard_of_one_block_and_the_default_sizes():
  # 384 rows: the block is the whole shard; default chunk and block sizes,
  # and interpret=True (the "interpret" backend).
  opt = pe.RowWiseAdagrad(0.1)
  rng = np.random.default_rng(4)
  table, slots = random_state(opt, jnp.float32, 128, rng, num_rows=384)
  rows = np.concatenate([np.sort(rng.choice(384, 50, replace=False)), [-1] * 6]).astype(np.int32)
  grads = rng.normal(size=(rows.size, 128)).astype(np.float32)
  args = (table, slots, rows, grads, opt.scalars(jnp.int32(3)), True)
  want = run_update("xla", opt, jnp.float32, *args)
  got = jax.jit(
    lambda *a: block_update.fused_update(*a, optimizer=opt, dtype=jnp.float32, interpret=True)
  )(*args)
  assert_same(got[0], want[0])
  assert_same(got[1]["acc"], want[1]["acc"])
  r = jnp.asarray(rows)
  assert_same(
    block_gather.gather(table, r, dtype=jnp.float32, interpret=True),
    run_gather("xla", table, r, jnp.float32, 128),
  )


def test_zero_ids_is_a_no_op():
  opt = pe.SGD()
  table, slots = random_state(opt, jnp.float32, DIM, np.random.default_rng(5))
  empty = np.zeros((0,), np.int32)
  got, _ = block_update.fused_update(
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
  assert_same(got, table)
  gathered = block_gather.gather(table, empty, dtype=jnp.float32, dim=DIM, interpret=True)
  assert gathered.shape == (0, DIM)


# -- the plan of a sweep ----------------------------------------------------------


def test_the_plan_visits_each_block_holding_ids_once_per_chunk():
  ids = [0, 5, 6, 7, 8, 9, 1030, 1031, 1032, 1033, 3000, 3001, 3002, -1, 9999, -1]
  rows = jnp.asarray(ids + [-1] * 8, jnp.int32)
  plan = blocks.plan(rows, num_rows=4096, block=1024, chunk=8, visit_padding=False)
  used = int(np.sum(np.asarray(plan.hi) > np.asarray(plan.lo)))
  got = [tuple(int(x[v]) for x in plan) for v in range(used)]
  # (block, chunk, lo, hi): block 1 (ids 1030..1033) spans chunks 0 and 1;
  # block 3 holds no id; padding and the id past the rows make no visit.
  assert got == [(0, 0, 0, 6), (1, 0, 6, 8), (1, 1, 8, 10), (2, 1, 10, 13)]
  assert len(plan.block) == blocks.num_visits(24, 4, 8)
  # The unused tail repeats the last visit's block and chunk, empty.
  tail = slice(used, None)
  assert set(np.asarray(plan.block)[tail]) == {2} and set(np.asarray(plan.chunk)[tail]) == {1}
  assert (np.asarray(plan.lo)[tail] == np.asarray(plan.hi)[tail]).all()
  padded = blocks.plan(rows, num_rows=4096, block=1024, chunk=8, visit_padding=True)
  assert set(np.asarray(padded.chunk)) == {0, 1, 2}  # the padding-only chunk too
  off = blocks.plan(rows, num_rows=4096, block=1024, chunk=8, visit_padding=False, apply=False)
  assert not np.asarray(off.block).any() and not np.asarray(off.hi).any()


def test_a_block_is_the_shard_or_whole_1024_rows():
  assert blocks.block_rows(100_000, 512, 1 << 20) == 2048
  assert blocks.block_rows(500, 512, 1 << 20) == 500
  assert blocks.block_rows(10**7, 8192, 1 << 20) == 1024
  with pytest.raises(pe.ConfigError, match="block_rows=1024"):
    blocks.check_block(1000, 5000)


# -- under shard_map -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kernels_under_shard_map_equal_xla(dtype):
  # Three shards over devices 1..3, each its own rows and ids.
  opt = pe.LazyAdam(0.05)
  mesh = make_mesh(3)
  rng = np.random.default_rng(6)
  n, rows_per = 3, 2048
  table, slots = random_state(opt, dtype, DIM, rng, num_rows=n * rows_per)
  rows = np.stack([sweep_ids(rng, rows_per)[:40] for _ in range(n)]).reshape(-1)
  grads = rng.normal(size=(rows.size, DIM)).astype(np.float32)
  spec = P("x")
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  args = tuple(map(put, (table, rows, grads)))
  slots_in = {k: put(v) for k, v in slots.items()}

  def shard(form):
    def one(table, slots, rows, grads):
      sc = opt.scalars(jnp.int32(STEP))
      t, s = run_update(form, opt, dtype, table, slots, rows, grads, sc, True)
      return t, s, run_gather(form, t, rows, dtype, DIM)

    # As the library's programs: pallas_call results carry no varying-axes type.
    return jax.jit(jax.shard_map(one, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

  want = shard("xla")(args[0], slots_in, *args[1:])
  got = shard("block")(args[0], slots_in, *args[1:])
  for g, w, what in [(got[0], want[0], "table"), (got[2], want[2], "gather")] + [
    (got[1][k], want[1][k], k) for k in slots
  ]:
    assert_same(g, w, what)


# -- race detection --------------------------------------------------------------


def test_race_detector_finds_no_race_in_the_sweeps():
  # The update's in-place copy of each block (a VMEM-to-VMEM DMA) against the
  # pipeline's own, and the gather's: nothing races.
  opt = pe.RowWiseAdagrad(0.1)
  rng = np.random.default_rng(7)
  table, slots = random_state(opt, jnp.float32, DIM, rng)
  rows = sweep_ids(rng)
  grads = rng.normal(size=(rows.size, DIM)).astype(np.float32)
  args = (table, slots, rows, grads, opt.scalars(jnp.int32(STEP)), True)
  assert not races_found(lambda: run_update("block", opt, jnp.float32, *args, interpret=RACES))
  assert not races_found(
    lambda: run_gather("block", table, jnp.asarray(rows), jnp.float32, DIM, interpret=RACES)
  )


# -- lowering for TPU --------------------------------------------------------------


def _abstract_update_args(opt, dtype, num_rows, dim, num_ids):
  sds = jax.ShapeDtypeStruct
  table = sds(packing.table_shape(num_rows, dim, dtype), packing.storage_dtype(dtype))
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


@pytest.mark.parametrize("dim", [16, 256])  # packed bf16 words of 8 lanes, and 128-lane halves
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
@pytest.mark.parametrize("kind", tpu_lowering.DEVICE_KINDS)
def test_fused_update_lowers_for_tpu(kind, opt, dtype, dim):
  # 5,000 rows: a partial last block.
  args = _abstract_update_args(opt, dtype, 5000, dim, 200)
  exported = tpu_lowering.export_for_tpu(
    lambda *a: block_update.fused_update(*a, optimizer=opt, dtype=dtype, dim=dim),
    *args,
    device_kind=kind,
  )
  [call] = tpu_lowering.mosaic_calls(exported)
  # In place: each of table and slots is an output aliased to its operand.
  assert call.count("output_operand_alias<") == 1 + len(opt.slot_specs())
  assert "_update_kernel" in call


@pytest.mark.parametrize("dim", [16, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", tpu_lowering.DEVICE_KINDS)
def test_gather_lowers_for_tpu(kind, dtype, dim):
  sds = jax.ShapeDtypeStruct
  table = sds(packing.table_shape(5000, dim, dtype), packing.storage_dtype(dtype))
  exported = tpu_lowering.export_for_tpu(
    lambda t, r: block_gather.gather(t, r, dtype=dtype, dim=dim),
    table,
    sds((200,), jnp.int32),
    device_kind=kind,
  )
  [call] = tpu_lowering.mosaic_calls(exported)
  assert "_gather_kernel" in call
  assert exported.out_avals[0].shape == (200, dim)


def test_vmem_is_sized_for_the_abstract_chip_and_refused_past_it():
  # LazyAdam at D=2048: three blocks of 1,024 wide rows, twice each way,
  # fit v5e's 128 MiB of VMEM (lowered with a limit above the default) and
  # not v5p's 64 MiB.
  opt, dim = pe.LazyAdam(), 2048
  args = _abstract_update_args(opt, jnp.float32, 4096, dim, 256)
  fn = lambda *a: block_update.fused_update(*a, optimizer=opt, dtype=jnp.float32, chunk_rows=64)
  [call] = tpu_lowering.mosaic_calls(
    tpu_lowering.export_for_tpu(fn, *args, device_kind="TPU v5 lite")
  )
  [limit] = map(int, re.findall(r"size\\22: (\d+)", call))
  assert 64 * 2**20 < limit <= 128 * 2**20
  with pytest.raises(pe.VmemBudgetError, match="v5p"):
    tpu_lowering.export_for_tpu(fn, *args, device_kind="TPU v5")


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


# -- argument checks ---------------------------------------------------------------


def _call_update(**overrides):
  opt = overrides.pop("optimizer", pe.RowWiseAdagrad())
  table, slots = random_state(opt, jnp.float32, DIM, np.random.default_rng(8), num_rows=256)
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
  return block_update.fused_update(**kw)


@pytest.mark.parametrize(
  "overrides,error,match",
  [
    (
      dict(rows=np.arange(8, dtype=np.int64)),
      pe.InputError,
      r"int32.*pallas_emb.int32_ids\(rows\)",
    ),
    (dict(rows=np.zeros((2, 4), np.int32)), pe.InputError, r"1-D int32.*\[2, 4\]"),
    (dict(grads=np.zeros((8, DIM), np.float16)), pe.InputError, "float16"),
    (dict(grads=np.zeros((8, DIM + 16), np.float32), dim=DIM), pe.InputError, "16 wide"),
    (dict(slots={}), pe.InputError, "acc"),
    (dict(slots={"acc": np.zeros((256, DIM), np.float32)}), pe.InputError, r"\[2, 128\]"),
    (dict(dtype=jnp.bfloat16), pe.InputError, "uint32"),
    (dict(scalars=(0.1, 0.0)), pe.InputError, "NamedTuple"),
    (dict(rounding_keys=np.zeros((8,), np.uint32)), pe.InputError, "bfloat16 rows only"),
    (dict(chunk_rows=12), pe.ConfigError, "chunk_rows=16"),
    (dict(chunk_rows=True), pe.ConfigError, "multiple of 8"),
    (dict(block_rows=100), pe.ConfigError, "block_rows=1024"),
    (dict(interpret="yes"), pe.ConfigError, "InterpretParams"),
    (dict(target="TPU v9"), pe.ConfigError, "TPU v9"),
  ],
  ids=[
    "rows-int64",
    "rows-2d",
    "grads-dtype",
    "grads-width",
    "slots-missing",
    "slot-shape",
    "table-dtype",
    "scalars-tuple",
    "rounding-f32",
    "chunk-12",
    "chunk-bool",
    "block-100",
    "interpret-str",
    "target-unknown",
  ],
)
def test_fused_update_rejects_bad_arguments(overrides, error, match):
  with pytest.raises(error, match=match):
    _call_update(**overrides)


def test_gather_rejects_bad_arguments():
  table = np.zeros((256, DIM // 2), np.uint32)
  with pytest.raises(pe.InputError, match="int32"):
    block_gather.gather(table, np.arange(8, dtype=np.uint32), dtype=jnp.bfloat16)
  with pytest.raises(pe.InputError, match="float32"):
    block_gather.gather(table, np.arange(8, dtype=np.int32), dtype=jnp.float32)
  with pytest.raises(pe.ConfigError, match="chunk_rows"):
    block_gather.gather(table, np.arange(8, dtype=np.int32), dtype=jnp.bfloat16, chunk_rows=4)


# -- which form runs -----------------------------------------------------------------

MB = 10**6


def _update_choice(table_mb, rows, ids, packed=False):
  costs = forms.update_costs(
    array_bytes=[int(table_mb * MB), rows * 4],
    num_rows=rows,
    num_ids=ids,
    block_rows=2048,
    packed=packed,
  )
  return forms.pick(costs)


def test_the_cost_model_picks_what_the_chip_measured():
  # One v5e chip, W-TPU's batch (86,016 ids): the block update won at 1M
  # rows (float32 D=128, and packed D=16), XLA's at 100k and 4M rows; XLA's
  # gather won everywhere (docs/benchmarks/forms_v5e.json).
  assert _update_choice(512, 1_000_064, 86016) == "block"
  assert _update_choice(64, 1_000_064, 86016, packed=True) == "block"
  assert _update_choice(51, 100_096, 86016) == "xla"
  assert _update_choice(2048, 4_000_000, 86016) == "xla"
  gather = forms.gather_costs(
    table_bytes=512 * MB, num_rows=1_000_064, num_ids=86016, block_rows=2048, packed=False
  )
  assert forms.pick(gather) == "xla"
  with forms.forcing("block"):
    assert forms.pick(gather) == "block"


def test_forms_are_forced_by_context_or_environment(monkeypatch):
  monkeypatch.setenv(forms.ENV_VAR, "xla")
  assert forms.forced() == "xla"
  with forms.forcing("block"):
    assert forms.forced() == "block"
  monkeypatch.setenv(forms.ENV_VAR, "fast")
  with pytest.raises(pe.ConfigError, match="PALLAS_EMB_FORMS"):
    forms.forced()
  with pytest.raises(pe.ConfigError, match="block"):
    with forms.forcing("fastest"):
      pass


def test_the_backends_choose_their_forms():
  sds = jax.ShapeDtypeStruct
  table = sds((4096, 128), jnp.float32)
  narrow = sds((4096, 16), jnp.float32)
  slots = {"acc": sds((32, 128), jnp.float32)}
  kw = dict(dim=128, dtype=jnp.float32)
  assert kernels.update_form("interpret", table, slots, 512, **kw) == "block"
  assert kernels.update_form("xla", table, slots, 512, **kw) == "xla"
  # A narrow stored array (a shard too small to pack) runs XLA on a TPU.
  assert kernels.update_form("pallas", narrow, {}, 512, dim=16, dtype=jnp.float32) == "xla"
  # The block gather needs ascending ids.
  assert kernels.gather_form("interpret", table, 512, ascending=False, **kw) == "xla"
  assert kernels.gather_form("interpret", table, 512, ascending=True, **kw) == "block"
