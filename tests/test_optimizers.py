"""Optimizer math against float64 NumPy oracles, and hyperparameter checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallas_emb as pe


def _run(opt, rows, grads_per_step, steps_touched, dim):
  """Applies update_rows to a block of rows for the given (step, grads)."""
  slots = {
    k: jnp.full((rows.shape[0], dim if s.width is None else s.width), s.init, s.dtype)
    for k, s in opt.slot_specs().items()
  }
  rows = jnp.asarray(rows)
  for step, g in zip(steps_touched, grads_per_step):
    rows, slots = jax.jit(opt.update_rows)(
      rows, slots, jnp.asarray(g), opt.scalars(jnp.int32(step))
    )
  return np.asarray(rows), {k: np.asarray(v) for k, v in slots.items()}


def _rowwise_adagrad_numpy(rows, grads_per_step, steps, *, lr, eps, half_life, lazy, wd):
  rows = rows.astype(np.float64)
  acc = np.zeros((rows.shape[0], 1))
  last = np.zeros((rows.shape[0], 1))
  decay = 1.0 if half_life is None else math.exp(-math.log(2) / half_life)
  for step, g in zip(steps, grads_per_step):
    g = g.astype(np.float64)
    factor = decay ** (step - last) if lazy else decay
    acc = acc * factor + np.mean(g * g, axis=1, keepdims=True)
    last[:] = step
    rows = rows - lr * (g / (np.sqrt(acc) + eps) + wd * rows)
  return rows, acc


@pytest.mark.parametrize(
  "half_life,lazy,wd",
  [
    (None, False, 0.0),
    (5000, False, 0.0),
    (3.0, False, 0.0),
    (3.0, True, 0.0),
    (2.0, True, 0.01),
    (None, False, 0.05),
  ],
)
def test_rowwise_adagrad_matches_the_reference_formula(half_life, lazy, wd):
  rng = np.random.default_rng(0)
  rows = rng.normal(size=(8, 16)).astype(np.float32)
  grads = [rng.normal(size=(8, 16)).astype(np.float32) for _ in range(4)]
  steps = [0, 1, 5, 6]  # gaps: lazy decay must account for steps 2-4
  opt = pe.RowWiseAdagrad(
    learning_rate=0.1, eps=1e-10, half_life_steps=half_life, lazy_decay=lazy, weight_decay=wd
  )
  got_rows, got_slots = _run(opt, rows, grads, steps, 16)
  want_rows, want_acc = _rowwise_adagrad_numpy(
    rows, grads, steps, lr=0.1, eps=1e-10, half_life=half_life, lazy=lazy, wd=wd
  )
  np.testing.assert_allclose(got_rows, want_rows, rtol=2e-6, atol=2e-6)
  np.testing.assert_allclose(got_slots["acc"], want_acc, rtol=2e-6)
  if lazy:
    assert (got_slots["last_step"] == 6).all()


def test_rowwise_adagrad_defaults_are_the_references():
  opt = pe.RowWiseAdagrad()
  assert (opt.learning_rate, opt.eps, opt.half_life_steps, opt.initial_accumulator_value) == (
    0.1,
    1e-10,
    5000,
    0.0,
  )
  assert opt.decay == pytest.approx(math.exp(-math.log(2) / 5000))
  assert pe.RowWiseAdagrad(half_life_steps=None).decay == 1.0


def _lazy_adam_numpy(rows, grads_per_step, masks, *, lr, b1, b2, eps):
  rows = rows.astype(np.float64)
  m = np.zeros_like(rows)
  v = np.zeros_like(rows)
  t = np.zeros((rows.shape[0], 1))
  for g, mask in zip(grads_per_step, masks):
    g = g.astype(np.float64)
    mk = mask[:, None]
    t = np.where(mk, t + 1, t)
    m = np.where(mk, b1 * m + (1 - b1) * g, m)
    v = np.where(mk, b2 * v + (1 - b2) * g * g, v)
    upd = (m / (1 - b1 ** np.maximum(t, 1))) / (np.sqrt(v / (1 - b2 ** np.maximum(t, 1))) + eps)
    rows = np.where(mk, rows - lr * upd, rows)
  return rows, m, v, t


def test_lazy_adam_matches_numpy_with_per_row_counts():
  rng = np.random.default_rng(1)
  rows = rng.normal(size=(6, 8)).astype(np.float32)
  opt = pe.LazyAdam(learning_rate=0.01)
  masks = [
    np.array([1, 1, 0, 0, 1, 1], bool),
    np.array([1, 0, 1, 0, 1, 0], bool),
    np.array([1, 1, 1, 1, 0, 0], bool),
  ]
  grads = [rng.normal(size=(6, 8)).astype(np.float32) for _ in masks]
  slots = {
    k: jnp.full((6, 8 if s.width is None else s.width), s.init, s.dtype)
    for k, s in opt.slot_specs().items()
  }
  r = jnp.asarray(rows)
  for g, mask in zip(grads, masks):
    # Lazy: only touched rows go through update_rows (as the sparse path does).
    idx = np.nonzero(mask)[0]
    new_r, new_s = opt.update_rows(
      r[idx], {k: v[idx] for k, v in slots.items()}, jnp.asarray(g[idx]), opt.scalars(jnp.int32(0))
    )
    r = r.at[idx].set(new_r)
    slots = {k: v.at[idx].set(new_s[k]) for k, v in slots.items()}
  # The kernel computes in float32, so the oracle takes float32-rounded
  # hyperparameters (1 - b2 differs by 1.3e-5 relative otherwise).
  f32 = lambda x: float(np.float32(x))
  want_rows, m, v, t = _lazy_adam_numpy(
    rows, grads, masks, lr=f32(0.01), b1=f32(0.9), b2=f32(0.999), eps=f32(1e-8)
  )
  np.testing.assert_allclose(r, want_rows, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(slots["m"], m, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(slots["v"], v, rtol=1e-5, atol=1e-9)
  np.testing.assert_array_equal(slots["count"], t)


@pytest.mark.parametrize("b1,b2", [(0.9, 0.999), (0.9, 1 - 1e-7), (0.0, 0.99999)])
def test_lazy_adam_bias_correction_matches_float64_at_any_count(b1, b2):
  # Per-row counts from 1 to 10**5 (a rare row stays at small t for ever; b
  # near 1 keeps b ** t near 1 for long runs). 1 - exp(t log b) in float32
  # was off by up to 1e-3 relative here; now it is float32 rounding.
  t = np.array([1, 2, 3, 10, 999, 12345, 10**5 - 1], np.int32)
  rng = np.random.default_rng(0)
  m = rng.normal(size=(len(t), 4)).astype(np.float32)
  v = rng.random((len(t), 4)).astype(np.float32) + 0.5
  g = rng.normal(size=(len(t), 4)).astype(np.float32)
  rows = np.zeros((len(t), 4), np.float32)
  opt = pe.LazyAdam(learning_rate=1.0, b1=b1, b2=b2, eps=1e-8)
  got, slots = opt.update_rows(
    jnp.asarray(rows),
    {"m": m, "v": v, "count": t[:, None]},
    jnp.asarray(g),
    opt.scalars(jnp.int32(0)),
  )
  f64 = lambda x: np.asarray(x, np.float64)
  n = f64(t + 1)[:, None]
  m64 = f64(np.float32(b1)) * f64(m) + f64(np.float32(1 - b1)) * f64(g)
  v64 = f64(np.float32(b2)) * f64(v) + f64(np.float32(1 - b2)) * f64(g) ** 2
  corr = lambda b: -np.expm1(n * np.log(b)) if b else 1.0
  want = -(m64 / corr(b1)) / (np.sqrt(v64 / corr(b2)) + 1e-8)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6)
  np.testing.assert_array_equal(np.asarray(slots["count"]), t[:, None] + 1)


@pytest.mark.parametrize(
  "opt,tx",
  [
    (pe.SGD(0.25), optax.sgd(0.25)),
    (
      pe.Adagrad(0.5, initial_accumulator_value=0.1, eps=1e-7),
      optax.adagrad(0.5, initial_accumulator_value=0.1, eps=1e-7),
    ),
  ],
)
def test_sgd_and_adagrad_are_optax_on_a_block(opt, tx):
  rng = np.random.default_rng(2)
  rows = jnp.asarray(rng.normal(size=(4, 8)).astype(np.float32))
  state = tx.init(rows)
  slots = {k: jnp.full((4, 8), s.init) for k, s in opt.slot_specs().items()}
  ours = rows
  for _ in range(3):
    g = jnp.asarray(rng.normal(size=(4, 8)).astype(np.float32))
    upd, state = tx.update(g, state, rows)
    rows = optax.apply_updates(rows, upd)
    ours, slots = opt.update_rows(ours, slots, g, opt.scalars(jnp.int32(0)))
  np.testing.assert_array_equal(ours, rows)


def test_learning_rate_may_be_an_optax_schedule():
  sched = optax.linear_schedule(1.0, 0.0, 10)
  opt = pe.SGD(sched)
  assert float(opt.scalars(jnp.int32(5)).learning_rate) == pytest.approx(0.5)
  rows, _ = opt.update_rows(jnp.ones((1, 2)), {}, jnp.ones((1, 2)), opt.scalars(jnp.int32(5)))
  np.testing.assert_allclose(rows, 0.5)


@pytest.mark.parametrize(
  "make,match",
  [
    (lambda: pe.SGD(float("nan")), r"SGD: learning_rate must be finite and >= 0, got nan"),
    (lambda: pe.SGD(-1.0), r"got -1.0"),
    (lambda: pe.SGD("fast"), r"must be a float or an optax schedule"),
    (lambda: pe.Adagrad(eps=0.0), r"Adagrad: eps must be in \(0.0"),
    (lambda: pe.Adagrad(initial_accumulator_value=-1.0), r"initial_accumulator_value"),
    (lambda: pe.RowWiseAdagrad(half_life_steps=0), r"half_life_steps must be in \(0.0"),
    (lambda: pe.RowWiseAdagrad(weight_decay=-0.1), r"weight_decay"),
    (lambda: pe.RowWiseAdagrad(eps=float("inf")), r"eps"),
    (lambda: pe.RowWiseAdagrad(lazy_decay=1), r"lazy_decay must be a bool"),
    (lambda: pe.LazyAdam(b1=1.0), r"LazyAdam: b1 must be in \[0.0, 1.0\), got 1.0"),
    (lambda: pe.LazyAdam(b2=-0.5), r"b2"),
  ],
)
def test_hyperparameters_are_validated_at_construction(make, match):
  with pytest.raises(pe.SpecError, match=match):
    make()


def test_optimizers_are_hashable_static_config():
  assert hash(pe.RowWiseAdagrad()) == hash(pe.RowWiseAdagrad())
  assert pe.LazyAdam(0.1) == pe.LazyAdam(0.1)
