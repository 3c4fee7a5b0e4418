"""FTRL against a float64 NumPy oracle of TensorFlow's equations, on a block of
rows and through the sharded API on 1 and 8 devices; its guarded corners."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

import pallas_emb as pe

# (lr, hyperparameters): lr_power != -0.5 exercises exp(-k log n); both
# settings of multiply_linear_by_learning_rate.
CONFIGS = [
  (0.1, dict()),
  (
    0.1,
    dict(
      learning_rate_power=-0.6,
      l1=1.0,
      l2=0.02,
      beta=0.5,
      initial_accumulator_value=0.2,
      initial_linear_value=0.05,
    ),
  ),
  (
    0.1,
    dict(
      learning_rate_power=-0.6, l1=1.0, l2=0.02, beta=0.5, multiply_linear_by_learning_rate=True
    ),
  ),
  (0.3, dict(learning_rate_power=0.0, l1=0.05, l2=0.1, multiply_linear_by_learning_rate=True)),
]
CONFIG_IDS = ["defaults", "l1-l2-beta-power", "l1-l2-beta-power-mlr", "constant-rate-mlr"]


def _ftrl_numpy(
  w,
  n,
  z,
  g,
  *,
  lr,
  learning_rate_power=-0.5,
  l1=0.0,
  l2=0.0,
  beta=0.0,
  multiply_linear_by_learning_rate=False,
  **_,
):
  """One step of TF's ApplyFtrl (training_ops.cc) in float64, with beta
  folded into l2 as TF's TPU FTRL and Keras do: l2 + beta / (2 lr)."""
  w, n, z, g = (np.asarray(x, np.float64) for x in (w, n, z, g))
  k, l2 = learning_rate_power, l2 + (beta / (2 * lr) if beta else 0.0)
  n_new = n + g * g
  sigma = n_new**-k - n**-k
  if multiply_linear_by_learning_rate:
    z = z + lr * g - sigma * w
    w = (np.clip(z, -l1 * lr, l1 * lr) - z) / (n_new**-k + 2 * l2 * lr)
  else:
    z = z + g - sigma / lr * w
    w = (np.clip(z, -l1, l1) - z) / (n_new**-k / lr + 2 * l2)
  return w, n_new, z


def _oracle_init(opt, shape):
  return (np.full(shape, opt.initial_accumulator_value), np.full(shape, opt.initial_linear_value))


@pytest.mark.parametrize("lr,hp", CONFIGS, ids=CONFIG_IDS)
def test_update_rows_matches_the_float64_oracle(lr, hp):
  opt = pe.FTRL(lr, **hp)
  rng = np.random.default_rng(0)
  rows = rng.normal(size=(8, 16)).astype(np.float32)
  slots = {k: jnp.full(rows.shape, s.init, jnp.float32) for k, s in opt.slot_specs().items()}
  w, (n, z) = rows.astype(np.float64), _oracle_init(opt, rows.shape)
  got, update = jnp.asarray(rows), jax.jit(opt.update_rows)
  for step in range(5):
    g = rng.normal(size=rows.shape).astype(np.float32)
    got, slots = update(got, slots, jnp.asarray(g), opt.scalars(jnp.int32(step)))
    w, n, z = _ftrl_numpy(w, n, z, g, lr=lr, **hp)
  np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(slots["accumulator"], n, rtol=1e-6)
  np.testing.assert_allclose(slots["linear"], z, rtol=1e-5, atol=1e-5 * np.abs(z).max())
  if hp.get("l1"):  # l1 sparsifies: some weights are exactly 0
    zero = np.asarray(got) == 0
    assert zero.any() and not zero.all()
    np.testing.assert_array_equal(zero, w == 0)


# Both linear-slot conventions, each on a device count: the routing is
# optimizer-agnostic (tests/test_embedding.py checks 1 == 8 == 6 devices
# for every other optimizer).
@pytest.mark.parametrize(
  "lr,hp,num_devices",
  [(*CONFIGS[1], 1), (*CONFIGS[2], 8)],
  ids=[f"{CONFIG_IDS[1]}-1", f"{CONFIG_IDS[2]}-8"],
)
def test_sharded_api_matches_the_oracle(lr, hp, num_devices):
  opt = pe.FTRL(lr, **hp)
  V, D, B, L = 40, 8, 16, 3
  emb = pe.ShardedEmbedding(
    [pe.TableSpec("t", V, D, optimizer=opt)],
    [pe.FeatureSpec("f", "t", "sum")],
    make_mesh(num_devices),
    "x",
    "xla",
  )
  state = emb.init(jax.random.key(0))
  w = emb.logical_table(state, "t").astype(np.float64)
  n, z = _oracle_init(opt, w.shape)
  rng = np.random.default_rng(1)
  for _ in range(4):
    ids = rng.integers(-1, V, (B, L)).astype(np.int32)
    g_out = rng.normal(size=(B, D)).astype(np.float32)
    acts, res = emb.lookup(state, {"f": ids})
    state, m = emb.apply_gradients(state, res, {"f": g_out})
    assert bool(m["t"].applied)
    # The update sees each touched row once, with its summed gradient.
    g = np.zeros((V, D))
    for b, l in zip(*np.nonzero(ids >= 0)):
      g[ids[b, l]] += g_out[b]
    touched = np.unique(ids[ids >= 0])
    w[touched], n[touched], z[touched] = _ftrl_numpy(
      w[touched], n[touched], z[touched], g[touched], lr=lr, **hp
    )
  slots = emb.logical_slots(state, "t")
  np.testing.assert_allclose(emb.logical_table(state, "t"), w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(slots["accumulator"], n, rtol=1e-6)
  np.testing.assert_allclose(slots["linear"], z, rtol=1e-5, atol=1e-5 * np.abs(z).max())


def _step(opt, rows, slots, g, lr_step=0):
  return jax.jit(opt.update_rows)(rows, slots, g, opt.scalars(jnp.int32(lr_step)))


def test_zero_accumulator_and_zero_gradient_keep_the_weight():
  # n stays 0 where g == 0: the denominator is 0 with l2 == beta == 0.
  opt = pe.FTRL(0.1, initial_accumulator_value=0.0)
  rows = jnp.asarray([[0.5, -0.25, 1.0]], jnp.float32)
  slots = {"accumulator": jnp.zeros((1, 3)), "linear": jnp.zeros((1, 3))}
  new, slots = _step(opt, rows, slots, jnp.asarray([[0.0, 2.0, 0.0]]))
  new = np.asarray(new)
  assert np.isfinite(new).all()
  np.testing.assert_array_equal(new[0, [0, 2]], [0.5, 1.0])
  w, _, _ = _ftrl_numpy(-0.25, 0.0, 0.0, 2.0, lr=0.1)
  np.testing.assert_allclose(new[0, 1], w, rtol=1e-6)


def test_a_schedule_at_zero_skips_the_step_unless_linear_is_scaled_by_lr():
  sched = optax.linear_schedule(0.0, 0.1, 10)  # lr == 0 at step 0
  rows = jnp.asarray([[0.5, -0.25]], jnp.float32)
  g = jnp.asarray([[1.0, -2.0]])
  opt = pe.FTRL(sched)
  slots = {k: jnp.full((1, 2), s.init) for k, s in opt.slot_specs().items()}
  new, new_slots = _step(opt, rows, slots, g)
  np.testing.assert_array_equal(new, rows)
  for k in slots:
    np.testing.assert_array_equal(new_slots[k], slots[k])
  # multiply_linear_by_learning_rate=True is defined at lr == 0.
  opt = pe.FTRL(sched, multiply_linear_by_learning_rate=True)
  new, new_slots = _step(opt, rows, slots, g)
  w, n, z = _ftrl_numpy(rows, 0.1, 0.0, g, lr=0.0, multiply_linear_by_learning_rate=True)
  np.testing.assert_allclose(new, w, rtol=1e-6)
  np.testing.assert_allclose(new_slots["linear"], z, rtol=1e-6)
  # At step 5 the schedule's lr (0.05) is used.
  opt = pe.FTRL(sched)
  new, _ = _step(opt, rows, slots, g, lr_step=5)
  w, _, _ = _ftrl_numpy(rows, 0.1, 0.0, g, lr=0.05)
  np.testing.assert_allclose(new, w, rtol=1e-5)


def test_defaults_slots_and_registration():
  opt = pe.FTRL()
  # jax-tpu-embedding's FTRLOptimizerSpec defaults.
  assert (
    opt.learning_rate,
    opt.learning_rate_power,
    opt.l1,
    opt.l2,
    opt.beta,
    opt.initial_accumulator_value,
    opt.initial_linear_value,
    opt.multiply_linear_by_learning_rate,
  ) == (0.01, -0.5, 0.0, 0.0, 0.0, 0.1, 0.0, False)
  specs = opt.slot_specs()
  assert set(specs) == {"accumulator", "linear"}
  assert specs["accumulator"].width is None and specs["accumulator"].init == 0.1
  assert pe.supports_async_emb(opt)
  pe.validate_config(pe.TrainConfig(use_async_emb=True), opt)
  from pallas_emb.optimizers import FTRL

  assert FTRL is pe.FTRL and hash(opt) == hash(pe.FTRL())


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (
      dict(learning_rate=0.0),
      r"FTRL: learning_rate=0 divides by zero.*multiply_linear_by_learning_rate=True",
    ),
    (dict(learning_rate=-0.1), r"FTRL: learning_rate must be finite and >= 0, got -0.1"),
    (dict(learning_rate_power=0.5), r"FTRL: learning_rate_power must be in \[-inf, 0.0\], got 0.5"),
    (dict(l1=-1.0), r"FTRL: l1 must be in \[0.0, inf\], got -1.0"),
    (dict(l2=float("nan")), r"FTRL: l2 must be in"),
    (dict(beta=-0.5), r"FTRL: beta must be in"),
    (dict(initial_accumulator_value=-0.1), r"initial_accumulator_value must be in \[0.0"),
    (dict(initial_linear_value=float("inf")), r"initial_linear_value"),
    (
      dict(multiply_linear_by_learning_rate=1),
      r"multiply_linear_by_learning_rate must be a bool, got 1",
    ),
  ],
)
def test_hyperparameters_are_validated(kwargs, match):
  with pytest.raises(pe.SpecError, match=match):
    pe.FTRL(**kwargs)
  pe.FTRL(0.0, multiply_linear_by_learning_rate=True)  # defined at lr == 0
