"""Property-based fuzzing of the sparse step against a float64 NumPy reference.

Hypothesis draws ids (padding, invalid, duplicate, in range), gradients and
their dtype; the synchronous API (`ShardedEmbedding.lookup/apply_gradients`,
SGD) runs them on 1 and 8 devices. Every example checks the embeddings, the
updated rows (to float32 rounding), that every other row kept its exact
bits, and the metrics. Shapes are drawn from a small fixed set, so that the
programs compile once per shape and mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pallas_emb as pe
from pallas_emb.norms import global_norm as _global_norm

ROWS, DIM, LR = {"t": 37, "u": 5}, 3, 0.5
# feature -> (table, combiner, bag size)
FEATURES = {
  "s": ("t", "sum", 3),
  "m": ("t", "mean", 2),
  "q": ("u", "sqrtn", 2),
  "seq": ("t", None, 2),
}
SETTINGS = settings(
  max_examples=6,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _emb(num_devices: int) -> pe.ShardedEmbedding:
  tables = [pe.TableSpec(name, rows, DIM, optimizer=pe.SGD(LR)) for name, rows in ROWS.items()]
  feats = [pe.FeatureSpec(f, t, c) for f, (t, c, _) in FEATURES.items()]
  # Unstacked: the reference steps each table alone (tests/test_stacking.py
  # compares stacked tables, one step counter per member, with this).
  return pe.ShardedEmbedding(tables, feats, make_mesh(num_devices), "x", "xla", stacking="off")


EMBS = {n: _emb(n) for n in (1, 8)}


def _reference(tables: dict, ids: dict, grads: dict):
  """float64 lookup and SGD update -> (acts, new tables, touched rows,
  invalid counts)."""
  acts, sums = {}, {t: np.zeros((r, DIM)) for t, r in ROWS.items()}
  touched = {t: np.zeros(r, bool) for t, r in ROWS.items()}
  invalid = {t: 0 for t in ROWS}
  for f, (t, combiner, _) in FEATURES.items():
    x, table = ids[f].astype(np.int64), tables[t].astype(np.float64)
    valid = (x >= 0) & (x < ROWS[t])
    invalid[t] += int(((x < -1) | (x >= ROWS[t])).sum())
    w = valid.astype(np.float64)
    count = np.maximum(w.sum(1, keepdims=True), 1)
    w = {"mean": w / count, "sqrtn": w / np.sqrt(count)}.get(combiner, w)
    rows = table[np.where(valid, x, 0)] * w[..., None]
    g = np.asarray(grads[f], np.float64)
    acts[f] = rows if combiner is None else rows.sum(1)
    token_grads = g * w[..., None] if combiner is None else g[:, None, :] * w[..., None]
    np.add.at(sums[t], x[valid], token_grads[valid])
    touched[t][x[valid]] = True
  new = {t: tables[t] - LR * sums[t] for t in ROWS}
  return acts, new, touched, invalid


@st.composite
def _batches(draw, batch: int):
  """ids of every feature (some padding, invalid and duplicate) and the
  gradient w.r.t. each output, in one dtype."""
  ids = {}
  for f, (t, _, bag) in FEATURES.items():
    ids[f] = draw(
      hnp.arrays(
        np.int32,
        (batch, bag),
        elements=st.one_of(
          st.integers(-1, ROWS[t] - 1),
          st.integers(-3, ROWS[t] + 3),
          st.sampled_from([0, ROWS[t] - 1, -(2**31), 2**31 - 1]),
        ),
      )
    )
  dtype = draw(st.sampled_from([np.float32, jnp.bfloat16]))
  grads = {}
  for f, (_, combiner, bag) in FEATURES.items():
    shape = (batch, bag, DIM) if combiner is None else (batch, DIM)
    values = draw(
      hnp.arrays(np.float32, shape, elements=st.floats(-8, 8, width=32, allow_subnormal=False))
    )
    grads[f] = values.astype(dtype)
  return ids, grads


def _check_step(num_devices: int, ids: dict, grads: dict):
  emb = EMBS[num_devices]
  state = emb.init(jax.random.key(3))
  before = {t: emb.logical_table(state, t) for t in ROWS}
  acts, res = emb.lookup(state, ids)
  state, metrics = emb.apply_gradients(state, res, grads)
  want_acts, want, touched, invalid = _reference(before, ids, grads)
  for f in FEATURES:
    np.testing.assert_allclose(np.asarray(acts[f]), want_acts[f], rtol=1e-5, atol=1e-6, err_msg=f)
  for t in ROWS:
    got = emb.logical_table(state, t)
    # Rows no valid id reached keep their exact bits.
    np.testing.assert_array_equal(got[~touched[t]], before[t][~touched[t]], err_msg=t)
    np.testing.assert_allclose(got, want[t], rtol=2e-5, atol=2e-5, err_msg=t)
    m = metrics[t]
    assert int(m.invalid_ids) == invalid[t]
    assert int(m.unique_ids) == int(touched[t].sum())
    # An update with no rows is nothing to apply; otherwise the gradient is
    # finite and it applies, and the step counts it.
    assert bool(m.applied) == bool(touched[t].any())
    assert int(state[t].step) == int(touched[t].any())


@pytest.mark.parametrize("num_devices", [1, 8])
@SETTINGS
@given(data=st.data())
def test_sgd_step_matches_float64_reference(num_devices, data):
  _check_step(num_devices, *data.draw(_batches(16)))


@settings(SETTINGS, max_examples=2)
@given(data=st.data())
def test_all_padding_is_nothing_to_apply(data):
  ids, grads = data.draw(_batches(16))
  ids = {f: np.full_like(x, -1) for f, x in ids.items()}
  _check_step(8, ids, grads)


@settings(SETTINGS, max_examples=2)
@given(data=st.data())
def test_another_batch_shape_matches_the_reference(data):
  _check_step(8, *data.draw(_batches(24)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_])
def test_ids_that_are_not_integers_are_refused(dtype):
  emb = EMBS[8]
  ids = {f: np.zeros((8, bag), dtype) for f, (_, _, bag) in FEATURES.items()}
  with pytest.raises(pe.InputError, match="must be integers"):
    emb.lookup(emb.init(jax.random.key(0)), ids)


@pytest.mark.parametrize("dtype", [np.int64, np.int16, np.uint32])
def test_other_integer_ids_are_refused_or_exact(dtype):
  # Whether other integer dtypes are accepted is validate.check_ids' call;
  # if they are, the lookup must equal the int32 one (never wrap an id).
  emb = EMBS[8]
  rng = np.random.default_rng(0)
  ids = {
    f: rng.integers(0, ROWS[t], (8, bag)).astype(np.int32) for f, (t, _, bag) in FEATURES.items()
  }
  state = emb.init(jax.random.key(0))
  want, _ = emb.lookup(state, ids)
  try:
    got, _ = emb.lookup(state, {f: x.astype(dtype) for f, x in ids.items()})
  except pe.InputError:
    return
  for f in FEATURES:
    np.testing.assert_array_equal(np.asarray(got[f]), np.asarray(want[f]))


def _norm_fn(num_devices: int):
  mesh = make_mesh(num_devices)
  return jax.jit(
    jax.shard_map(
      lambda x: _global_norm(x, "x"),
      mesh=mesh,
      in_specs=jax.sharding.PartitionSpec("x"),
      out_specs=jax.sharding.PartitionSpec(),
      check_vma=False,
    )
  )


NORMS = {n: _norm_fn(n) for n in (1, 8)}


def _floats(limit: float, **kwargs):
  limit = float(np.float32(limit))
  return st.floats(-limit, limit, width=32, **kwargs)


@pytest.mark.parametrize("num_devices", [1, 8])
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
  x=hnp.arrays(
    np.float32,
    (16, 3),
    elements=st.one_of(
      _floats(3e38), _floats(1e-37, allow_subnormal=False), st.just(0.0), _floats(1e20)
    ),
  )
)
def test_global_norm_does_not_overflow_for_finite_gradients(num_devices, x):
  got = float(NORMS[num_devices](x))
  want = np.linalg.norm(x.astype(np.float64))
  if want > np.finfo(np.float32).max * (1 - 1e-5):  # rounds to inf, or nearly
    assert got == np.inf or got == pytest.approx(want, rel=1e-5)
  else:
    assert np.isfinite(got)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_global_norm_of_a_non_finite_element_is_non_finite(bad):
  x = np.full((16, 3), 1e30, np.float32)
  x[5, 1] = bad
  for fn in NORMS.values():
    assert not np.isfinite(float(fn(x)))


def test_finite_gradient_with_an_overflowing_square_sum_is_applied():
  # Every element finite, the norm ~1e20: squaring first would overflow
  # float32 and drop the update as non-finite.
  emb = EMBS[8]
  ids = {f: np.zeros((8, bag), np.int32) for f, (_, _, bag) in FEATURES.items()}
  grads = {
    f: np.full((8, bag, DIM) if c is None else (8, DIM), 1e19, np.float32)
    for f, (_, c, bag) in FEATURES.items()
  }
  state = emb.init(jax.random.key(0))
  before = {t: emb.logical_table(state, t) for t in ROWS}
  _, res = emb.lookup(state, ids)
  state, metrics = emb.apply_gradients(state, res, grads)
  assert bool(metrics["t"].applied) and np.isfinite(float(metrics["t"].grad_norm))
  _, want, _, _ = _reference(before, ids, grads)
  np.testing.assert_allclose(emb.logical_table(state, "t")[0], want["t"][0], rtol=1e-5)
