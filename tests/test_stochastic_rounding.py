"""Stochastic rounding of bfloat16 rows (`TableSpec.stochastic_rounding`):
unbiased between the two bfloat16 neighbours, special values kept, the
block kernel bit for bit equal to the XLA path (plain and packed rows), a
step deterministic for a seed and the same on every mesh, stacking and
backend (the noise is keyed by table, logical row, column, step and seed),
and a bfloat16 table that tracks the float32 trajectory where
round-to-nearest-even stalls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tpu_lowering
from conftest import make_mesh
from jax.experimental.pallas import tpu as pltpu

import pallas_emb as pe
from pallas_emb import packing
from pallas_emb.errors import InputError, SpecError
from pallas_emb.kernels import xla
from pallas_emb.kernels.block_update import fused_update

ULP = 2.0**-7  # of a bfloat16 in [1, 2)


def _to_f32(words):
  return packing.from_storage(np.asarray(words), jnp.bfloat16).astype(np.float32)


def test_rounding_picks_a_neighbour_with_probability_by_nearness():
  # One value per row, at fractions of an ulp above 1.0, in both word halves.
  fractions = np.array([0.01, 0.25, 0.5, 0.75, 0.99], np.float32)
  x = jnp.asarray(np.tile(1.0 + fractions * ULP, (2, 2)))  # (2, 10): two rows
  rows = jnp.asarray([3, 4], jnp.int32)

  def at(step):
    keys = packing.row_rounding_keys(packing.rounding_key(7, step), rows)
    return packing.pack_rows(x, jnp.bfloat16, packing.rounding_noise(keys, x.shape[1]))

  words = jax.vmap(at)(jnp.arange(2000, dtype=jnp.int32))  # (2000, 2, 5)
  got = _to_f32(np.asarray(words).reshape(-1, 5)).reshape(2000, 2, 10)
  assert set(np.unique(got)) <= {1.0, 1.0 + ULP}
  up = (got > 1.0).reshape(4000, 2, 5)  # both halves of a row: 4,000 draws per fraction
  # The binomial's standard deviation is at most 0.008.
  np.testing.assert_allclose(up.mean(axis=(0, 1)), fractions, atol=0.03)
  # Rows, steps and columns draw independently: the two rows agree about as
  # often as independent draws would (p^2 + (1-p)^2 at p = 0.5: one half).
  assert abs((got[:, 0, 2] == got[:, 1, 2]).mean() - 0.5) < 0.05


def test_exact_and_special_values_are_kept():
  special = [1.0, 1.0 + ULP, -3.5, 0.0, -0.0, np.inf, -np.inf, np.nan]
  x = jnp.asarray(np.array([special * 2], np.float32))
  for step in range(4):
    keys = packing.row_rounding_keys(
      packing.rounding_key(1, jnp.int32(step)), jnp.zeros((1,), jnp.int32)
    )
    words = packing.pack_rows(x, jnp.bfloat16, packing.rounding_noise(keys, x.shape[1]))
    got = packing.from_storage(np.asarray(words), jnp.bfloat16)
    want = packing.from_storage(packing.to_storage(np.asarray(x), jnp.bfloat16), jnp.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def _state(opt, dim, rng, num_rows=256):
  table = packing.table_stored(
    packing.to_storage(rng.normal(size=(num_rows, dim)), jnp.bfloat16), dim, jnp.bfloat16
  )
  slots = {}
  for name, s in opt.slot_specs().items():
    shape = s.shape_for(num_rows, dim)
    if np.dtype(s.dtype) == np.int32:
      slots[name] = rng.integers(0, 5, shape).astype(np.int32)
    else:
      slots[name] = rng.uniform(0.05, 2.0, shape).astype(np.float32)
  return table, slots


# The quick loop's subset (conftest): both optimizers on packed rows.
QUICK = {"test_kernel_equals_xla_path_bit_for_bit": lambda p: p["dim"] == 16}


@pytest.mark.parametrize("dim", [16, 256], ids=["d16_packed", "d256"])
@pytest.mark.parametrize(
  "opt", [pe.RowWiseAdagrad(0.1), pe.LazyAdam(0.05)], ids=["RowWiseAdagrad", "LazyAdam"]
)
def test_kernel_equals_xla_path_bit_for_bit(opt, dim):
  rng = np.random.default_rng(0)
  table, slots = _state(opt, dim, rng)
  # Two chunks and a partial one; several ids of one packed physical row.
  rows = np.concatenate([np.sort(rng.choice(96, 40, replace=False)), [-1] * 4]).astype(np.int32)
  grads = (1e-3 * rng.normal(size=(rows.size, dim))).astype(np.float32)
  keys = packing.row_rounding_keys(packing.rounding_key(11, jnp.int32(5), 3), jnp.asarray(rows))
  args = (table, slots, rows, grads, opt.scalars(jnp.int32(5)), True)
  kw = dict(optimizer=opt, dtype=jnp.bfloat16, rounding_keys=keys)
  want = jax.jit(lambda *a: xla.fused_update(*a, **kw))(*args)
  got = jax.jit(
    lambda *a: fused_update(*a, **kw, interpret=pltpu.InterpretParams(), chunk_rows=16)
  )(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  nearest = jax.jit(lambda *a: xla.fused_update(*a, optimizer=opt, dtype=jnp.bfloat16))(*args)
  # The rounding is in effect: some words differ from round-to-nearest.
  assert (np.asarray(got[0]) != np.asarray(nearest[0])).any()


def test_the_kernel_lowers_for_tpu_with_stochastic_rounding():
  opt = pe.RowWiseAdagrad(0.1)
  table = jax.ShapeDtypeStruct((512, 64), jnp.uint32)  # 512 rows of D=128 bf16
  slots = {"acc": jax.ShapeDtypeStruct((4, 128), jnp.float32)}
  rows = jax.ShapeDtypeStruct((256,), jnp.int32)
  grads = jax.ShapeDtypeStruct((256, 128), jnp.float32)

  def fn(table, slots, rows, grads, step):
    return fused_update(
      table,
      slots,
      rows,
      grads,
      opt.scalars(step),
      True,
      optimizer=opt,
      dtype=jnp.bfloat16,
      rounding_keys=packing.row_rounding_keys(packing.rounding_key(3, step), rows),
    )

  step = jax.ShapeDtypeStruct((), jnp.int32)
  exported = tpu_lowering.export_for_tpu(
    fn, table, slots, rows, grads, step, device_kind="TPU v5 lite"
  )
  assert len(tpu_lowering.mosaic_calls(exported)) == 1


def _emb(*tables, devices=4, backend="xla", stacking="auto"):
  feats = [pe.FeatureSpec(t.name, t.name, "sum") for t in tables]
  return pe.ShardedEmbedding(
    list(tables), feats, make_mesh(devices), "x", backend, stacking=stacking
  )


def _two_tables(devices, backend, stacking):
  """Two bfloat16 tables of one seed (so they stack), each id once a step,
  three steps; their logical tables as uint16 words."""
  kw = dict(dim=16, dtype=jnp.bfloat16, optimizer=pe.SGD(0.003), stochastic_rounding=True)
  emb = _emb(
    pe.TableSpec("a", 96, **kw),
    pe.TableSpec("b", 120, **kw),
    devices=devices,
    backend=backend,
    stacking=stacking,
  )
  state = emb.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  for _ in range(3):
    ids = {"a": rng.permutation(96)[:64, None], "b": rng.permutation(120)[:64, None]}
    ids = {k: v.astype(np.int32) for k, v in ids.items()}
    acts, res = emb.lookup(state, ids)
    grads = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in acts.items()}
    state = emb.apply_gradients(state, res, grads)[0]
  return {k: np.asarray(emb.logical_table(state, k)).view(np.uint16) for k in ("a", "b")}


# (devices, backend, stacking): every mesh, stacking and backend rounds the
# same values alike (each row keyed by its table and logical row, not by its
# shard or its place in a stack).
SETUPS = [(4, "xla", "off"), (8, "xla", "auto"), (2, "interpret", "auto")]


@pytest.mark.parametrize("setup", SETUPS, ids=["4-xla-unstacked", "8-xla-stacked", "2-interpret"])
def test_rounding_is_the_same_on_every_mesh_stacking_and_backend(setup):
  want = _two_tables(4, "xla", "auto")
  got = _two_tables(*setup)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], k)


def test_bf16_tracks_f32_where_round_to_nearest_stalls():
  # Every step adds 0.02 bfloat16 ulps to each value of 64 rows that start
  # on bfloat16 values in [1, 1.5): nearest-even rounds every update away,
  # stochastic rounding moves the rows as float32 does, in expectation.
  start = lambda key, shape, dtype: 1.0 + ULP * jax.random.randint(key, shape, 0, 64).astype(dtype)
  kw = dict(num_rows=64, dim=16, optimizer=pe.SGD(1.0), initializer=start)
  names = ("f32", "nearest", "stochastic")
  emb = _emb(
    pe.TableSpec("f32", **kw),
    pe.TableSpec("nearest", dtype=jnp.bfloat16, **kw),
    pe.TableSpec("stochastic", dtype=jnp.bfloat16, stochastic_rounding=True, **kw),
  )
  ids = jnp.arange(64, dtype=jnp.int32)[:, None]
  steps, step_size = 1000, 0.02 * ULP

  @jax.jit
  def train(state):
    def body(state, _):
      acts, res = emb.lookup(state, {k: ids for k in names})
      grads = {k: jnp.full_like(v, -step_size) for k, v in acts.items()}  # SGD: w -= lr * g
      return emb.apply_gradients(state, res, grads)[0], None

    return jax.lax.scan(body, state, None, length=steps)[0]

  state = emb.init(jax.random.key(0))
  before = {k: emb.logical_table(state, k).astype(np.float32) for k in names}
  state = train(state)
  moved = {k: emb.logical_table(state, k).astype(np.float32) - before[k] for k in names}
  np.testing.assert_allclose(moved["f32"], steps * step_size, rtol=1e-3)  # 20 ulps
  np.testing.assert_array_equal(moved["nearest"], 0.0)  # stalled
  # Each value's drift is 20 ulps give or take 4.4 (the sum of 1,000
  # roundings, each off by at most one ulp); the mean of 1,024 values is
  # within 0.14 ulps (0.7%) of float32's, one standard deviation.
  ratio = moved["stochastic"].mean() / moved["f32"].mean()
  assert abs(ratio - 1) < 0.05, ratio
  assert (moved["stochastic"] > 0).mean() > 0.95


def test_a_step_is_deterministic_for_a_seed():
  def run(seed):
    spec = pe.TableSpec(
      "t",
      64,
      16,
      optimizer=pe.SGD(0.01),
      dtype=jnp.bfloat16,
      stochastic_rounding=True,
      rounding_seed=seed,
    )
    emb = _emb(spec)
    state = emb.init(jax.random.key(0))
    acts, res = emb.lookup(state, {"t": jnp.arange(32, dtype=jnp.int32)[:, None]})
    grads = {"t": jnp.asarray(np.random.default_rng(0).normal(size=acts["t"].shape), jnp.float32)}
    return np.asarray(emb.logical_table(emb.apply_gradients(state, res, grads)[0], "t"))

  a, b, c = run(1), run(1), run(2)
  np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
  assert (a.view(np.uint16) != c.view(np.uint16)).any()


def test_bad_settings_are_refused_with_the_fix():
  with pytest.raises(SpecError, match=r"bfloat16 tables.*float32.*stochastic_rounding=False"):
    pe.TableSpec("t", 8, 16, stochastic_rounding=True)
  with pytest.raises(SpecError, match="stochastic_rounding must be True or False"):
    pe.TableSpec("t", 8, 16, dtype=jnp.bfloat16, stochastic_rounding=1)
  with pytest.raises(SpecError, match="rounding_seed must be below 2"):
    pe.TableSpec("t", 8, 16, dtype=jnp.bfloat16, rounding_seed=2**32)
  with pytest.raises(SpecError, match="rounding_seed"):
    pe.TableSpec("t", 8, 16, dtype=jnp.bfloat16, rounding_seed=-1)
  opt = pe.SGD()
  table, slots = np.zeros((8, 16), np.float32), {}
  args = (table, slots, np.arange(8, dtype=np.int32), np.zeros((8, 16), np.float32))
  keys = packing.row_rounding_keys(packing.rounding_key(0, 0), jnp.arange(8))
  with pytest.raises(InputError, match="bfloat16 rows only.*rounding_keys=None"):
    xla.fused_update(
      *args, opt.scalars(0), True, optimizer=opt, dtype=jnp.float32, rounding_keys=keys
    )
  with pytest.raises(InputError, match=r"uint32\[8\], one per row id"):
    xla.fused_update(
      *args, opt.scalars(0), True, optimizer=opt, dtype=jnp.bfloat16, rounding_keys=keys[:4]
    )


def test_tables_that_round_differently_do_not_stack():
  kw = dict(num_rows=64, dim=16, dtype=jnp.bfloat16)
  a = pe.TableSpec("a", **kw)
  b = pe.TableSpec("b", stochastic_rounding=True, **kw)
  feats = [pe.FeatureSpec("a", "a"), pe.FeatureSpec("b", "b")]
  with pytest.raises(SpecError, match="rounding"):
    pe.ShardedEmbedding([a, b], feats, make_mesh(4), "x", "xla", stacking={"ab": ["a", "b"]})
