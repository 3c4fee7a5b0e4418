"""Weighted ids and ragged bags: pooled outputs and gradients.

Weighted bags are checked against NumPy (weights 0, negative, a bag whose
weights sum to 0). Ragged bags are checked against the same bags padded:
with dyadic table values, weights and gradients every sum is exact, so the
two must agree bit for bit whatever order each adds in.
"""

import jax
import numpy as np
import pytest
from conftest import make_mesh

import pallas_emb as pe
from pallas_emb import async_emb

V, D, B = 48, 8, 16

# The quick loop's subset (conftest): stacked features with clipping on.
QUICK = {"test_stacked_weighted_and_ragged_features_equal_unstacked": lambda p: p["max_norm"]}


def _emb(num_devices, combiner, opt=None):
  table = pe.TableSpec("t", V, D, optimizer=opt or pe.SGD(1.0))
  return pe.ShardedEmbedding(
    [table], [pe.FeatureSpec("f", "t", combiner)], make_mesh(num_devices), "x", "xla"
  )


def _dyadic_table(rng):
  return (rng.integers(-8, 8, (V, D)) / 8).astype(np.float32)


def _weighted_bags(rng, L=4):
  ids = rng.integers(0, V, (B, L))
  ids[1, 2:] = -1  # padding
  ids[2, 0] = V + 3  # invalid: weighs nothing
  w = (rng.integers(-4, 5, (B, L)) / 4).astype(np.float32)
  w[3] = [0.5, -0.5, 0.0, 0.0]  # sums to 0
  w[4] = 0.0  # all zero
  return ids.astype(np.int32), w


def _numpy_pool(table, ids, w, combiner):
  has = (ids >= 0) & (ids < V)
  w = np.where(has, w, 0.0).astype(np.float64)
  if combiner == "mean":
    s = w.sum(1, keepdims=True)
    w = np.where(s != 0, w / np.where(s != 0, s, 1), 0)
  elif combiner == "sqrtn":
    s = (w * w).sum(1, keepdims=True)
    w = np.where(s > 0, w / np.sqrt(np.where(s > 0, s, 1)), 0)
  rows = table[np.where(has, ids, 0)].astype(np.float64)
  return (rows * w[..., None]).sum(1), w


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weighted_lookup_and_gradient_match_numpy(combiner):
  rng = np.random.default_rng(0)
  emb = _emb(8, combiner)
  table = _dyadic_table(rng)
  state = {"t": emb.state_from_logical("t", table)}
  ids, w = _weighted_bags(rng)
  acts, res = emb.lookup(state, {"f": pe.Weighted(ids, w)})
  want, wn = _numpy_pool(table, ids, w, combiner)
  out = np.asarray(acts["f"])
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(out[4], 0.0)  # all weights 0
  if combiner == "mean":
    np.testing.assert_array_equal(out[3], 0.0)  # weights sum to 0
  g = (rng.integers(-4, 5, (B, D)) / 4).astype(np.float32)
  state, m = emb.apply_gradients(state, res, {"f": g})
  # SGD(1): each row moves by minus its summed weighted gradient.
  expect = table.astype(np.float64).copy()
  has = (ids >= 0) & (ids < V)
  for b, l in zip(*np.nonzero(has)):
    expect[ids[b, l]] -= wn[b, l] * g[b]
  got = emb.logical_table(state, "t")
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-6)
  assert int(m["t"].invalid_ids) == 1 and bool(m["t"].applied)


def test_unit_weights_equal_plain_ids_bit_for_bit():
  rng = np.random.default_rng(1)
  ids, _ = _weighted_bags(rng)
  for combiner in ("sum", "mean", "sqrtn"):
    emb = _emb(8, combiner)
    state = emb.init(jax.random.key(0))
    a, _ = emb.lookup(state, {"f": ids})
    b, _ = emb.lookup(state, {"f": pe.Weighted(ids, np.ones(ids.shape, np.float32))})
    np.testing.assert_array_equal(a["f"], b["f"])


def _bags(rng):
  lengths = rng.integers(0, 6, B)
  lengths[5] = 0
  bags = [rng.integers(0, V, n) for n in lengths]
  bags[6][:1] = -1  # padding inside a bag
  if len(bags[7]):
    bags[7][0] = V  # invalid
  weights = [(rng.integers(-4, 5, len(b)) / 4).astype(np.float32) for b in bags]
  return bags, weights


def _padded(bags, weights):
  L = max(len(b) for b in bags)
  ids = np.full((len(bags), L), -1, np.int32)
  w = np.zeros((len(bags), L), np.float32)
  for i, (b, wb) in enumerate(zip(bags, weights)):
    ids[i, : len(b)], w[i, : len(b)] = b, wb
  return ids, w


def _sync(emb, table, feature, g):
  state = {"t": emb.state_from_logical("t", table)}
  acts, res = emb.lookup(state, {"f": feature})
  state, m = emb.apply_gradients(state, res, {"f": g})
  return np.asarray(acts["f"]), emb.logical_table(state, "t"), m["t"]


def _async(emb, table, feature, g):
  ids = {"f": feature}
  ctx = async_emb.context_handles(emb, ids)["t"]
  state = {"t": emb.state_from_logical("t", table)}
  lk = async_emb.lookup_start(ctx, state["t"].table, ids)
  acts = async_emb.lookup_done(ctx, lk)
  update = async_emb.make_gradient_update(ctx, lk, {"f": g})
  opt = async_emb.EmbOptState(state["t"].slots, state["t"].step)
  _, tbl, opt, m = async_emb.gradient_update_start(ctx, update, state["t"].table, opt)
  async_emb.gradient_update_done(ctx)
  new = pe.TableState(tbl, opt.slots, opt.step)
  return np.asarray(acts["f"]), emb.logical_table({"t": new}, "t"), m


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("run", [_sync, _async], ids=["sync", "async"])
def test_ragged_equals_padded_bit_for_bit(num_devices, run):
  rng = np.random.default_rng(2)
  table = _dyadic_table(rng)
  bags, weights = _bags(rng)
  g = (rng.integers(-4, 5, (B, D)) / 4).astype(np.float32)
  for combiner, w in (("sum", None), ("mean", weights)):
    emb = _emb(num_devices, combiner)
    ids, wp = _padded(
      bags, weights if w is not None else [np.ones(len(b), np.float32) for b in bags]
    )
    padded = ids if w is None else pe.Weighted(ids, wp)
    rag = pe.ragged(bags, num_shards=num_devices, capacity=32, weights=w)
    want_acts, want_table, want_m = run(emb, table, padded, g)
    acts, got_table, m = run(emb, table, rag, g)
    np.testing.assert_array_equal(acts, want_acts)
    np.testing.assert_array_equal(got_table, want_table)
    get = lambda x, k: x[k] if isinstance(x, dict) else getattr(x, k)
    for k in ("unique_ids", "invalid_ids", "overflow_ids", "applied"):
      np.testing.assert_array_equal(get(m, k), get(want_m, k))
    # The norm adds the same squares in another order (the token order
    # differs); "mean" weights w / sum(w) are not dyadic, so only "sum" is exact.
    np.testing.assert_allclose(
      get(m, "grad_norm"), get(want_m, "grad_norm"), rtol=0 if combiner == "sum" else 1e-6
    )


def test_ragged_over_capacity_drops_and_counts():
  rng = np.random.default_rng(3)
  emb = _emb(2, "sum")
  table = _dyadic_table(rng)
  bags = [np.arange(5) + i for i in range(B)]  # 40 ids per shard of 2
  rag = pe.ragged(bags, num_shards=2, capacity=24)
  acts, _, m = _sync(emb, table, rag, np.zeros((B, D), np.float32))
  assert int(m.overflow_ids) == 2 * (40 - 24)
  # Shard 0 keeps bags 0..3 whole and bag 4's first 4 ids.
  np.testing.assert_array_equal(acts[4], table[np.arange(4, 8)].sum(0))
  np.testing.assert_array_equal(acts[5], 0.0)


def test_ragged_from_csr_and_lists_agree():
  bags = [[1, 2], [], [3], [4, 5, 6]]
  a = pe.ragged(bags, num_shards=2, capacity=4)
  b = pe.ragged_from_csr([1, 2, 3, 4, 5, 6], [2, 0, 1, 3], num_shards=2, capacity=4)
  for x, y in zip(a[:2], b[:2]):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(a.ids, [1, 2, -1, -1, 3, 4, 5, 6])
  np.testing.assert_array_equal(a.lengths, [2, 0, 1, 3])


def test_bad_inputs_name_the_problem():
  emb = _emb(2, "sum")
  state = emb.init(jax.random.key(0))
  ids = np.zeros((4, 2), np.int32)
  with pytest.raises(pe.InputError, match="weights of feature 'f'.*expected floats"):
    emb.lookup(state, {"f": pe.Weighted(ids, np.ones((4, 3), np.float32))})
  with pytest.raises(pe.InputError, match="weights of feature 'f'"):
    emb.lookup(state, {"f": pe.Weighted(ids, ids)})
  with pytest.raises(pe.InputError, match="not a positive multiple of the 2 shards"):
    emb.lookup(state, {"f": pe.Ragged(np.zeros(5, np.int32), np.zeros(4, np.int32))})
  with pytest.raises(pe.InputError, match="lengths of feature 'f' must be >= 0"):
    emb.lookup(state, {"f": pe.Ragged(np.zeros(4, np.int32), np.array([1, -1], np.int32))})
  with pytest.raises(pe.InputError, match="sum to the 3 values"):
    pe.ragged_from_csr([1, 2, 3], [1, 1], num_shards=1, capacity=4)
  with pytest.raises(pe.InputError, match="positive multiple of num_shards=2"):
    pe.ragged([[1], [2], [3]], num_shards=2, capacity=4)
  seq = pe.ShardedEmbedding(
    [pe.TableSpec("t", V, D)], [pe.FeatureSpec("f", "t", None)], make_mesh(2), "x", "xla"
  )
  with pytest.raises(pe.InputError, match="sequence.*Weighted"):
    seq.lookup(state, {"f": pe.Weighted(ids, np.ones((4, 2), np.float32))})


def test_ragged_int64_ids_beyond_int32_are_invalid():
  emb = _emb(1, "sum")
  table = _dyadic_table(np.random.default_rng(4))
  rag = pe.ragged([[2**32 + 5, 1], [5]], num_shards=1, capacity=4)
  assert rag.ids.dtype == np.int64
  acts, _, m = _sync(emb, table, rag, np.zeros((2, D), np.float32))
  np.testing.assert_array_equal(acts[0], table[1])
  assert int(m.invalid_ids) == 1


def _sgd_delta(emb, table, ids, g, **kw):
  state = {"t": emb.state_from_logical("t", table)}
  _, res = emb.lookup(state, {"f": ids})
  state, m = emb.apply_gradients(state, res, {"f": g}, **kw)
  return emb.logical_table(state, "t") - table, m["t"]


def test_clipping_scales_the_update_by_max_norm_over_norm():
  rng = np.random.default_rng(5)
  table = _dyadic_table(rng)
  ids = rng.integers(0, V, (B, 3)).astype(np.int32)
  g = rng.normal(size=(B, D)).astype(np.float32)
  base = _emb(8, "sum")
  delta, m = _sgd_delta(base, table, ids, g)
  norm = float(m.grad_norm)
  clipped = pe.ShardedEmbedding(
    [pe.TableSpec("t", V, D, optimizer=pe.SGD(1.0), max_grad_norm=norm / 4)],
    base.features,
    base.mesh,
    "x",
    "xla",
  )
  got, mc = _sgd_delta(clipped, table, ids, g)
  np.testing.assert_allclose(got, delta * 0.25, rtol=1e-5, atol=1e-6)
  assert float(mc.grad_norm) == norm  # the metric stays the unclipped norm
  # Below the limit nothing changes, bit for bit.
  loose = pe.ShardedEmbedding(
    [pe.TableSpec("t", V, D, optimizer=pe.SGD(1.0), max_grad_norm=norm * 2)],
    base.features,
    base.mesh,
    "x",
    "xla",
  )
  np.testing.assert_array_equal(_sgd_delta(loose, table, ids, g)[0], delta)
  # One norm over all tables (here one table): the same scaling.
  got, _ = _sgd_delta(base, table, ids, g, max_global_norm=norm / 4)
  np.testing.assert_allclose(got, delta * 0.25, rtol=1e-5, atol=1e-6)
  # A non-finite gradient is still skipped, clipping or not.
  g[0, 0] = np.nan
  got, mc = _sgd_delta(clipped, table, ids, g)
  assert not bool(mc.applied) and not got.any()
  with pytest.raises(pe.SpecError, match="max_grad_norm must be None or a finite number > 0"):
    pe.TableSpec("t", V, D, max_grad_norm=0.0)


def test_global_clipping_uses_one_norm_over_all_tables():
  rng = np.random.default_rng(6)
  tables = [pe.TableSpec(n, V, D, optimizer=pe.SGD(1.0)) for n in ("a", "b")]
  feats = [pe.FeatureSpec("fa", "a"), pe.FeatureSpec("fb", "b")]
  # Stored apart: state_from_logical builds each table (stacking them would
  # clip by the same one norm).
  emb = pe.ShardedEmbedding(tables, feats, make_mesh(2), "x", "xla", stacking="off")
  start = {n: _dyadic_table(rng) for n in ("a", "b")}
  ids = {f: rng.integers(0, V, (B, 2)).astype(np.int32) for f in ("fa", "fb")}
  g = {f: rng.normal(size=(B, D)).astype(np.float32) for f in ("fa", "fb")}

  def deltas(**kw):
    state = {n: emb.state_from_logical(n, t) for n, t in start.items()}
    _, res = emb.lookup(state, ids)
    state, m = emb.apply_gradients(state, res, g, **kw)
    return {n: emb.logical_table(state, n) - start[n] for n in start}, m

  full, m = deltas()
  total = np.hypot(float(m["a"].grad_norm), float(m["b"].grad_norm))
  clipped, _ = deltas(max_global_norm=total / 2)
  for n in start:
    np.testing.assert_allclose(clipped[n], full[n] / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_async_trainer_takes_ragged_bags_like_padded_ones():
  # The async pipeline: contexts sized from a ragged batch, pending updates
  # of ragged tokens (the sync one is the embedding API tested above).
  import optax

  from pallas_emb import data as data_lib
  from pallas_emb.data.feed import GlobalBatches
  from pallas_emb.job.model import build_ranking

  dataset = data_lib.SyntheticClickLog(num_users=300, num_items=200, eval_examples=64)
  emb, model = build_ranking(
    dataset, make_mesh(4), emb_dim=8, backend="xla", optimizer=pe.RowWiseAdagrad(0.05)
  )
  feed = GlobalBatches(dataset, 32, emb.sharding())
  config = pe.TrainConfig(use_async_emb=True)

  def batches(ragged):
    out = []
    for i in range(3):
      host = dataset.train_batch(i, 32)
      if ragged:
        h = host["ids"]["history"]
        host["ids"]["history"] = pe.ragged([r[r >= 0] for r in h], num_shards=4, capacity=8 * 8)
      out.append(feed.put(host))
    return out

  losses = {}
  for ragged in (False, True):
    bs = batches(ragged)
    tr = pe.make_trainer(emb, model.loss, optax.adam(1e-3), config, bs[0])
    state = tr.init(model.init(jax.random.key(1)), emb.init(jax.random.key(0)), bs[0])
    losses[ragged] = []
    for i in range(2):
      state, m = tr.step(state, bs[i], bs[i + 1])
      losses[ragged].append(float(m["loss"]))
  np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_stacked_weighted_and_ragged_features_equal_unstacked(max_norm):
  rng = np.random.default_rng(7)
  tables = [
    pe.TableSpec(n, V, D, optimizer=pe.Adagrad(0.25), max_grad_norm=max_norm) for n in ("a", "c")
  ]
  feats = [pe.FeatureSpec("fa", "a", "mean"), pe.FeatureSpec("fc", "c", "sqrtn")]
  bags, weights = _bags(rng)
  ids, w = _padded(bags, weights)
  inputs = {
    "fa": pe.Weighted(ids, w),
    "fc": pe.ragged(bags, num_shards=8, capacity=32, weights=weights),
  }
  g = {f: (rng.integers(-4, 5, (B, D)) / 4).astype(np.float32) for f in ("fa", "fc")}
  out = {}
  for mode in ("off", "auto"):
    emb = pe.ShardedEmbedding(tables, feats, make_mesh(8), "x", "xla", stacking=mode)
    state = emb.init(jax.random.key(0))
    acts, res = emb.lookup(state, inputs)
    state, m = emb.apply_gradients(state, res, g)
    out[mode] = (acts, {n: emb.logical_table(state, n) for n in ("a", "c")}, m)
  (a0, t0, m0), (a1, t1, m1) = out["off"], out["auto"]
  for k in a0:
    np.testing.assert_array_equal(a0[k], a1[k])
  # Clipped, a stack's member norm is computed in another order than the
  # table's alone: equal to rounding.
  tol = dict(rtol=0) if max_norm is None else dict(rtol=1e-6, atol=1e-7)
  for n in ("a", "c"):
    np.testing.assert_allclose(t0[n], t1[n], **tol)
    assert bool(m0[n].applied) and bool(m1[n].applied)
    np.testing.assert_allclose(m0[n].grad_norm, m1[n].grad_norm, rtol=1e-6)
    if max_norm is not None:
      assert float(m0[n].grad_norm) > max_norm  # the clip was active
