"""The synchronous sharded API on the XLA path: lookup, sparse update, metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

import pallas_emb as pe

V, D = 61, 16


def _emb(
  num_devices,
  optimizer,
  *,
  layout="mod",
  dtype=jnp.float32,
  combiner="sum",
  unique_capacity=None,
  route_capacity=None,
  backend="xla",
  rows=V,
  dim=D,
  kind="auto",
):
  table = pe.TableSpec(
    "t",
    rows,
    dim,
    optimizer=optimizer,
    dtype=dtype,
    layout=layout,
    unique_capacity=unique_capacity,
    route_capacity=route_capacity,
  )
  feats = [pe.FeatureSpec("bag", "t", combiner), pe.FeatureSpec("seq", "t", None)]
  return pe.ShardedEmbedding([table], feats, make_mesh(num_devices, kind=kind), "x", backend)


def _batch(rng, batch=24, bag=3, seq=2, rows=V, invalid=True):
  lo = -1 if invalid else 0
  ids = {
    "bag": rng.integers(lo, rows, (batch, bag)).astype(np.int32),
    "seq": rng.integers(0, rows + (3 if invalid else 0), (batch, seq)).astype(np.int32),
  }
  return ids


def _dyadic(rng, shape):
  # Multiples of 1/8 in [-1, 1]: sums of a few of them are exact in float32,
  # so the result cannot depend on summation order.
  return (rng.integers(-8, 9, shape) / 8).astype(np.float32)


def _train(emb, steps, seed=0, dyadic=True):
  rng = np.random.default_rng(seed)
  state = emb.init(jax.random.key(7))
  acts_log = []
  for _ in range(steps):
    ids = _batch(rng)
    acts, res = emb.lookup(state, ids)
    acts_log.append({k: np.asarray(v) for k, v in acts.items()})
    make = _dyadic if dyadic else (lambda r, s: r.normal(size=s).astype(np.float32))
    grads = {k: make(rng, v.shape) for k, v in acts.items()}
    state, metrics = emb.apply_gradients(state, res, grads)
    assert bool(metrics["t"].applied)
  return state, acts_log


OPTIMIZERS = [
  pe.SGD(0.5),
  pe.Adagrad(0.25),
  pe.RowWiseAdagrad(0.1, half_life_steps=3.0, lazy_decay=True, weight_decay=0.01),
  pe.LazyAdam(0.05),
]

# The quick loop's subset (conftest): SGD and LazyAdam (three slots, a per-row
# step) on the "mod" layout; against optax, SGD on an Auto mesh and Adagrad on
# an Explicit one, both on 8 devices.
QUICK = {
  "test_sparse_update_equals_dense_optax_on_every_row": lambda p: (
    p["num_devices"] == 8 and (p["kind"] == "auto") == isinstance(p["opt"], pe.SGD)
  ),
  "test_one_eight_and_six_devices_give_identical_tables": lambda p: (
    p["layout"] == "mod" and isinstance(p["opt"], (pe.SGD, pe.LazyAdam))
  ),
}


@pytest.mark.parametrize("layout", ["mod", "range"])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_one_eight_and_six_devices_give_identical_tables(opt, layout):
  results = {}
  for n in (1, 8, 6):
    emb = _emb(n, opt, layout=layout)
    state, acts = _train(emb, steps=3)
    results[n] = (emb.logical_table(state, "t"), emb.logical_slots(state, "t"), acts)
  table1, slots1, acts1 = results[1]
  for n in (8, 6):
    table, slots, acts = results[n]
    # Exact: every per-row gradient sum is exact (dyadic values), so nothing
    # depends on the order in which shards add their contributions.
    np.testing.assert_array_equal(table, table1, err_msg=f"{n} devices")
    for k in slots1:
      np.testing.assert_array_equal(slots[k], slots1[k], err_msg=f"slot {k}, {n} devices")
    for a, b in zip(acts, acts1):
      for k in a:
        np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize(
  "opt", [pe.RowWiseAdagrad(0.1), pe.LazyAdam(0.05)], ids=lambda o: type(o).__name__
)
def test_device_counts_agree_within_tolerance_for_arbitrary_gradients(opt):
  # With arbitrary float gradients the per-row sums are added in a different
  # order on 1 and 8 devices: agreement is to float32 rounding (1e-5).
  tables = [
    _emb(n, opt).logical_table(_train(_emb(n, opt), 3, dyadic=False)[0], "t") for n in (1, 8)
  ]
  np.testing.assert_allclose(tables[0], tables[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "opt,tx",
  [
    (pe.SGD(0.5), optax.sgd(0.5)),
    (
      pe.Adagrad(0.25, initial_accumulator_value=0.1, eps=1e-7),
      optax.adagrad(0.25, initial_accumulator_value=0.1, eps=1e-7),
    ),
  ],
  ids=["sgd", "adagrad"],
)
@pytest.mark.parametrize("num_devices,kind", [(1, "auto"), (8, "auto"), (8, "explicit")])
def test_sparse_update_equals_dense_optax_on_every_row(opt, tx, num_devices, kind):
  emb = _emb(num_devices, opt, kind=kind)
  state = emb.init(jax.random.key(0))
  dense = jnp.asarray(emb.logical_table(state, "t"))
  opt_state = tx.init(dense)
  rng = np.random.default_rng(3)
  for _ in range(3):
    ids = _batch(rng)
    w = {"bag": _dyadic(rng, (24, D)), "seq": _dyadic(rng, (24, 2, D))}

    def loss(table):  # the same model written densely: gather, sum, dot
      out = 0.0
      for name, x in ids.items():
        valid = (x >= 0) & (x < V)
        rows = jnp.where(valid[..., None], table[np.clip(x, 0, V - 1)], 0.0)
        act = rows.sum(1) if name == "bag" else rows
        out += jnp.sum(act * w[name])
      return out

    g = jax.grad(loss)(dense)
    upd, opt_state = tx.update(g, opt_state, dense)
    dense = optax.apply_updates(dense, upd)
    _, res = emb.lookup(state, ids)
    state, _ = emb.apply_gradients(state, res, w)
  np.testing.assert_array_equal(emb.logical_table(state, "t"), dense)
  if isinstance(opt, pe.Adagrad):
    np.testing.assert_array_equal(emb.logical_slots(state, "t")["acc"], opt_state[0].sum_of_squares)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_lookup_combiners_match_numpy(combiner, dtype):
  emb = _emb(8, pe.SGD(), combiner=combiner, dtype=dtype)
  state = emb.init(jax.random.key(1))
  table = emb.logical_table(state, "t").astype(np.float32)
  assert emb.logical_table(state, "t").dtype == np.dtype(dtype)
  ids = _batch(np.random.default_rng(4))
  acts, _ = emb.lookup(state, ids)
  x = ids["bag"]
  valid = (x >= 0) & (x < V)
  rows = np.where(valid[..., None], table[np.clip(x, 0, V - 1)], 0.0)
  count = np.maximum(valid.sum(1, keepdims=True), 1)
  want = rows.sum(1) / {"sum": 1, "mean": count, "sqrtn": np.sqrt(count)}[combiner]
  np.testing.assert_allclose(acts["bag"], want, rtol=1e-6, atol=1e-6)
  s = ids["seq"]
  sv = (s >= 0) & (s < V)
  np.testing.assert_array_equal(
    acts["seq"], np.where(sv[..., None], table[np.clip(s, 0, V - 1)], 0)
  )
  assert acts["seq"].shape == (24, 2, D) and acts["bag"].dtype == jnp.float32


def test_bf16_table_update_rounds_once_per_step():
  emb = _emb(8, pe.SGD(0.5), dtype=jnp.bfloat16)
  state = emb.init(jax.random.key(1))
  before = emb.logical_table(state, "t").astype(np.float32)
  ids = {"bag": np.full((8, 1), 5, np.int32), "seq": np.full((8, 1), -1, np.int32)}
  _, res = emb.lookup(state, ids)
  g = {"bag": np.full((8, D), 0.125, np.float32), "seq": np.zeros((8, 1, D), np.float32)}
  state, _ = emb.apply_gradients(state, res, g)
  after = emb.logical_table(state, "t").astype(np.float32)
  want = (before[5] - 0.5 * 8 * 0.125).astype(jnp.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(after[5], want)
  np.testing.assert_array_equal(np.delete(after, 5, 0), np.delete(before, 5, 0))


def test_invalid_ids_read_zero_write_nothing_and_are_counted():
  emb = _emb(8, pe.Adagrad(0.5))
  state = emb.init(jax.random.key(2))
  before, slots_before = emb.logical_table(state, "t"), emb.logical_slots(state, "t")
  bad = np.array([-5, V, 2**31 - 1, -1], np.int32)
  ids = {
    "bag": np.tile(np.array([[3, -5, V], [2**31 - 1, -1, 3]], np.int32), (4, 1)),
    "seq": np.tile(np.array([[-1, 9]], np.int32), (8, 1)),
  }
  acts, res = emb.lookup(state, ids)
  np.testing.assert_allclose(acts["bag"][0], before[3], rtol=1e-6)
  np.testing.assert_allclose(acts["bag"][1], before[3], rtol=1e-6)
  assert (np.asarray(acts["seq"])[:, 0] == 0).all()
  grads = {k: jnp.ones_like(v) for k, v in acts.items()}
  state, m = emb.apply_gradients(state, res, grads)
  assert int(m["t"].invalid_ids) == 4 * 3  # -5, V, 2**31-1 in 4 row pairs; -1 is padding
  assert int(m["t"].unique_ids) == 2 and int(m["t"].overflow_ids) == 0
  after, slots_after = emb.logical_table(state, "t"), emb.logical_slots(state, "t")
  untouched = np.setdiff1d(np.arange(V), [3, 9])
  np.testing.assert_array_equal(after[untouched], before[untouched])
  np.testing.assert_array_equal(slots_after["acc"][untouched], slots_before["acc"][untouched])
  assert not np.array_equal(after[3], before[3]) and not np.array_equal(after[9], before[9])
  del bad


@pytest.mark.parametrize("caps", [dict(unique_capacity=8), dict(route_capacity=8)])
def test_capacity_overflow_drops_ids_and_never_touches_other_rows(caps):
  emb = _emb(2, pe.SGD(1.0), **caps)
  state = emb.init(jax.random.key(3))
  before = emb.logical_table(state, "t")
  # 20 distinct ids per data shard, all owned by shard 0 (even ids), for a
  # capacity of 8: 12 ids per shard overflow.
  ids = {
    "bag": np.tile(np.arange(0, 40, 2, dtype=np.int32), (2, 1)),
    "seq": np.full((2, 1), -1, np.int32),
  }
  acts, res = emb.lookup(state, ids)
  state, m = emb.apply_gradients(
    state, res, {"bag": np.ones((2, D), np.float32), "seq": np.zeros((2, 1, D), np.float32)}
  )
  assert int(m["t"].overflow_ids) == 2 * 12
  assert int(m["t"].unique_ids) == 8
  after = emb.logical_table(state, "t")
  changed = np.nonzero((after != before).any(1))[0]
  np.testing.assert_array_equal(changed, np.arange(0, 16, 2))  # the 8 smallest
  # The looked-up sum holds only the kept rows: dropped ids read zero.
  np.testing.assert_allclose(acts["bag"][0], before[0:16:2].sum(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_writes_nothing(bad):
  emb = _emb(8, pe.RowWiseAdagrad(0.1, lazy_decay=True))
  state = emb.init(jax.random.key(4))
  rng = np.random.default_rng(5)
  # One normal step first so that the slots are not at their initial values.
  ids = _batch(rng)
  _, res = emb.lookup(state, ids)
  state, _ = emb.apply_gradients(
    state, res, {"bag": _dyadic(rng, (24, D)), "seq": _dyadic(rng, (24, 2, D))}
  )
  table = np.asarray(state["t"].table).copy()
  slots = {k: np.asarray(v).copy() for k, v in state["t"].slots.items()}
  step = int(state["t"].step)
  ids = _batch(rng)
  _, res = emb.lookup(state, ids)
  g = {"bag": _dyadic(rng, (24, D)), "seq": _dyadic(rng, (24, 2, D))}
  g["bag"][3, 2] = bad
  state, m = emb.apply_gradients(state, res, g)
  assert not bool(m["t"].applied) and not np.isfinite(float(m["t"].grad_norm))
  np.testing.assert_array_equal(np.asarray(state["t"].table), table)
  for k in slots:
    np.testing.assert_array_equal(np.asarray(state["t"].slots[k]), slots[k])
  assert int(state["t"].step) == step


def test_gate_false_skips_the_update():
  emb = _emb(8, pe.SGD(1.0))
  state = emb.init(jax.random.key(4))
  table = np.asarray(state["t"].table).copy()
  acts, res = emb.lookup(state, _batch(np.random.default_rng(0)))
  state, m = emb.apply_gradients(
    state, res, {k: jnp.ones_like(v) for k, v in acts.items()}, gate=False
  )
  assert not bool(m["t"].applied) and np.isfinite(float(m["t"].grad_norm))
  np.testing.assert_array_equal(np.asarray(state["t"].table), table)


def test_update_is_in_place_with_donated_buffers():
  emb = _emb(8, pe.RowWiseAdagrad(), rows=8 * 4096, dim=128)
  state = emb.init(jax.random.key(0))
  acts, res = emb.lookup(state, _batch(np.random.default_rng(0), rows=8 * 4096))
  grads = {k: jnp.ones_like(v) for k, v in acts.items()}
  old = state["t"]
  new, _ = emb.apply_gradients(state, res, grads)
  assert old.table.is_deleted() and all(v.is_deleted() for v in old.slots.values())
  assert not new["t"].table.is_deleted()
  # No table-sized temporary: the compiled update's scratch is far below one
  # shard of the table (4096 x 128 float32 = 2 MiB per device).
  from pallas_emb import programs

  t = emb.sharded_table("t", res["t"].plan.token_slot.shape[0] // 8)
  compiled = programs.apply_gradients.lower(
    t, new["t"], res["t"], (grads["bag"], grads["seq"]), jnp.bool_(True)
  ).compile()
  shard_bytes = new["t"].table.nbytes // 8
  assert compiled.memory_analysis().temp_size_in_bytes < shard_bytes / 4


def test_init_does_not_depend_on_shard_count_or_layout():
  a = _emb(1, pe.SGD())
  b = _emb(6, pe.SGD(), layout="range")
  key = jax.random.key(11)
  np.testing.assert_array_equal(
    a.logical_table(a.init(key), "t"), b.logical_table(b.init(key), "t")
  )
  table = a.logical_table(a.init(key), "t")
  assert 0.1 < table.std() * np.sqrt(D) < 1.5  # default: stddev ~ 1/sqrt(dim)


def test_init_places_every_shard_on_its_device():
  emb = _emb(8, pe.Adagrad(), rows=1000)
  state = emb.init(jax.random.key(0))
  # Rows of 16 floats are stored packed, 8 to a 128-lane row (pe.packing).
  rps = emb.layout("t").rows_per_shard
  for x in (state["t"].table, state["t"].slots["acc"]):
    assert x.sharding.spec[0] == "x"
    assert {s.data.shape for s in x.addressable_shards} == {(rps * D // 128, 128)}


def test_state_from_logical_round_trips(mesh_kind):
  emb = _emb(6, pe.LazyAdam(), kind=mesh_kind)
  table = np.random.default_rng(0).normal(size=(V, D)).astype(np.float32)
  m = np.ones((V, D), np.float32)
  state = {"t": emb.state_from_logical("t", table, {"m": m}, step=3)}
  np.testing.assert_array_equal(emb.logical_table(state, "t"), table)
  np.testing.assert_array_equal(emb.logical_slots(state, "t")["m"], m)
  assert int(state["t"].step) == 3


def test_lookup_and_update_work_inside_jit(mesh_kind):
  emb = _emb(8, pe.SGD(0.01), kind=mesh_kind)
  state = emb.init(jax.random.key(0))
  ids = _batch(np.random.default_rng(0))

  @jax.jit
  def step(state, ids):
    acts, res = emb.lookup(state, ids)
    loss, g = jax.value_and_grad(lambda a: sum(jnp.sum(v**2) for v in a.values()))(acts)
    state, m = emb.apply_gradients(state, res, g)
    return state, loss, m

  s1, loss1, _ = step(state, ids)
  s2, loss2, _ = step(s1, ids)
  assert float(loss2) < float(loss1)


# -- bad arguments ------------------------------------------------------------


def test_bad_arguments_raise_specific_errors():
  emb = _emb(8, pe.SGD())
  state = emb.init(jax.random.key(0))
  ids = _batch(np.random.default_rng(0))
  with pytest.raises(
    pe.InputError,
    match=r"ids of feature 'bag' must be integers \(int32 or int64\), got float32; .*hash_ids",
  ):
    emb.lookup(state, {**ids, "bag": ids["bag"].astype(np.float32)})
  with pytest.raises(pe.InputError, match=r"must have shape \(batch, bag_size\), got \(24,\)"):
    emb.lookup(state, {**ids, "bag": ids["bag"][:, 0]})
  with pytest.raises(
    pe.InputError, match=r"batch size 20 of feature 'bag' is not divisible by the 8"
  ):
    emb.lookup(state, {**ids, "bag": ids["bag"][:20]})
  with pytest.raises(pe.InputError, match=r"unknown features \['nope'\]"):
    emb.lookup(state, {**ids, "nope": ids["bag"]})
  with pytest.raises(pe.InputError, match=r"missing feature 'seq'"):
    emb.lookup(state, {"bag": ids["bag"]})
  acts, res = emb.lookup(state, ids)
  with pytest.raises(
    pe.InputError,
    match=r"gradient of feature .bag. is float32\[24, 8\]; "
    r"expected a float array of shape \(24, 16\)",
  ):
    emb.apply_gradients(state, res, {"bag": jnp.ones((24, 8)), "seq": acts["seq"]})
  other = _emb(8, pe.SGD(), dim=8)
  with pytest.raises(
    # Rows of 16 floats are stored packed (8 to a 128-lane row), of 8 floats
    # in shards of 8 rows as they are (16 would share a row).
    pe.InputError,
    match=r"table 't' has float32\[8, 128\].*stores float32\[64, 8\]",
  ):
    other.lookup(state, ids)
  with pytest.raises(pe.InputError, match=r"unknown table 'u'"):
    emb.table_spec("u")


def test_bad_specs_raise_specific_errors():
  mesh = make_mesh(8)
  t = pe.TableSpec("t", 10, 4)
  with pytest.raises(
    pe.SpecError, match=r"feature 'f' reads table 'u', which is not among the tables \['t'\]"
  ):
    pe.ShardedEmbedding([t], [pe.FeatureSpec("f", "u")], mesh)
  with pytest.raises(
    pe.SpecError, match=r"axis 'y' is not an axis of the mesh, whose axes are \('x',\)"
  ):
    pe.ShardedEmbedding([t], [pe.FeatureSpec("f", "t")], mesh, axis="y")
  with pytest.raises(pe.SpecError, match=r"table names must be unique"):
    pe.ShardedEmbedding([t, t], [], mesh)
  with pytest.raises(pe.SpecError, match=r"dtype float16 is not supported"):
    pe.TableSpec("t", 10, 4, dtype=jnp.float16)
  with pytest.raises(pe.SpecError, match=r"bfloat16 table needs an even dim.*dim=5"):
    pe.TableSpec("t", 10, 5, dtype=jnp.bfloat16)
  with pytest.raises(pe.SpecError, match=r"num_rows must be a positive int, got 0"):
    pe.TableSpec("t", 0, 4)
  with pytest.raises(pe.SpecError, match=r"does not implement EmbeddingOptimizer"):
    pe.TableSpec("t", 10, 4, optimizer=optax.adam(1e-3))
  with pytest.raises(pe.SpecError, match=r"combiner must be one of"):
    pe.FeatureSpec("f", "t", combiner="max")
  with pytest.raises(pe.SpecError, match=r"unique_capacity must be a positive int or None"):
    pe.TableSpec("t", 10, 4, unique_capacity=0)
  with pytest.raises(pe.BackendError, match=r"backend must be one of"):
    pe.ShardedEmbedding([t], [], mesh, backend="cuda")
  with pytest.raises(pe.BackendError, match=r"needs a TPU.*use 'interpret'"):
    pe.ShardedEmbedding([t], [], mesh, backend="pallas")


def test_metrics_count_unique_ids_globally():
  emb = _emb(8, pe.SGD())
  state = emb.init(jax.random.key(0))
  ids = _batch(np.random.default_rng(9), invalid=False)
  acts, res = emb.lookup(state, ids)
  _, m = emb.apply_gradients(state, res, {k: jnp.ones_like(v) for k, v in acts.items()})
  distinct = len(np.unique(np.concatenate([ids["bag"].ravel(), ids["seq"].ravel()])))
  assert int(m["t"].unique_ids) == distinct
  assert int(m["t"].invalid_ids) == 0


def test_plan_gives_the_lookups_residuals_without_reading_rows():
  emb = _emb(8, pe.SGD(0.5))
  state = emb.init(jax.random.key(0))
  ids = _batch(np.random.default_rng(1))
  acts, res = emb.lookup(state, ids)
  planned = emb.plan(ids)
  for a, b in zip(jax.tree.leaves(res), jax.tree.leaves(planned)):
    np.testing.assert_array_equal(a, b)
  grads = {k: jnp.ones_like(v) for k, v in acts.items()}
  s1, _ = emb.apply_gradients(jax.tree.map(jnp.copy, state), res, grads)
  s2, _ = emb.apply_gradients(state, planned, grads)
  np.testing.assert_array_equal(emb.logical_table(s1, "t"), emb.logical_table(s2, "t"))


def test_mean_counts_only_ids_that_got_a_row():
  # unique_capacity 8 keeps the 8 smallest physical rows of each data shard;
  # the others are dropped like invalid ids, also from the mean's count.
  emb = _emb(1, pe.SGD(), combiner="mean", unique_capacity=8)
  state = emb.init(jax.random.key(3))
  table = emb.logical_table(state, "t")
  ids = {
    "bag": np.arange(16, dtype=np.int32).reshape(1, 16).repeat(8, 0),
    "seq": np.full((8, 1), -1, np.int32),
  }
  acts, _ = emb.lookup(state, ids)
  np.testing.assert_allclose(acts["bag"][0], table[:8].mean(0), rtol=1e-6, atol=1e-7)


def test_slots_are_checked_on_every_backend():
  emb = _emb(8, pe.RowWiseAdagrad())
  state = emb.init(jax.random.key(0))
  acts, res = emb.lookup(state, _batch(np.random.default_rng(0)))
  rows = emb.layout("t").num_physical_rows
  wrong = {"t": state["t"]._replace(slots={"acc": jnp.zeros((rows, D), jnp.float32)})}
  with pytest.raises(
    pe.InputError,
    match=r"slot 'acc' of table 't' is float32\[64, 16\], "
    r"but RowWiseAdagrad keeps float32\[64, 1\]",
  ):
    emb.apply_gradients(wrong, res, {k: jnp.ones_like(v) for k, v in acts.items()})
  with pytest.raises(
    pe.InputError, match=r"slot 'acc' of table 't' must have shape \(61, 1\), got \(1, 61\)"
  ):
    emb.state_from_logical("t", np.zeros((V, D)), {"acc": np.zeros((1, V))})


def test_kernel_dispatch_refuses_unknown_backends():
  from pallas_emb import kernels

  with pytest.raises(pe.BackendError, match=r"backend must be one of .* got 'interp'"):
    kernels.gather(
      jnp.zeros((8, 4)), jnp.zeros((8,), jnp.int32), dtype=jnp.float32, backend="interp"
    )
