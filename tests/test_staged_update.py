"""An optimizer whose math cannot run in Mosaic (`OptaxRows`) on the kernel
backends: its rows move through the gather and update kernels and its math
runs in XLA (`kernels.staged_update`), bit-exact against the XLA path, in
TPU interpret mode."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from jax.experimental.pallas import tpu as pltpu

import pallas_emb as pe
from pallas_emb import kernels, packing
from pallas_emb.kernels import staged_update, xla

NUM_ROWS, CHUNK = 256, 16
OPT = pe.OptaxRows(optax.adam(0.05))


def _bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _state(dtype, dim, rng):
  table = packing.table_stored(
    jnp.asarray(packing.to_storage(rng.normal(size=(NUM_ROWS, dim)), dtype)), dim, dtype
  )
  slots = {}
  for name, s in OPT.slot_specs().items():
    if np.dtype(s.dtype) == np.int32:  # Adam's per-row step count
      rows = rng.integers(0, 7, (NUM_ROWS, s.width_for(dim))).astype(np.int32)
    else:
      rows = rng.uniform(0.05, 2.0, (NUM_ROWS, s.width_for(dim))).astype(np.float32)
    slots[name] = jnp.asarray(s.as_stored(rows, dim))
  return table, slots


@functools.cache
def _update(impl, dtype, stochastic):
  def fn(table, slots, rows, grads, apply):
    keys = None
    if stochastic:
      keys = packing.row_rounding_keys(packing.rounding_key(3, jnp.int32(5)), rows)
    kw = dict(optimizer=OPT, dtype=dtype, rounding_keys=keys)
    args = (table, slots, rows, grads, OPT.scalars(5), apply)
    if impl == "xla":
      return xla.fused_update(*args, **kw)
    return staged_update.fused_update(*args, **kw, interpret=pltpu.InterpretParams())

  return jax.jit(fn)


@pytest.mark.parametrize(
  "dtype, dim, stochastic",
  [
    (jnp.float32, 16, False),  # packed rows, 8 to a 128-lane row
    (jnp.float32, 128, False),
    (jnp.bfloat16, 64, True),  # packed words, rounded stochastically
  ],
  ids=["f32-d16", "f32-d128", "bf16-d64-sr"],
)
@pytest.mark.parametrize("apply", [True, False])
def test_optax_rows_through_the_kernels_equals_the_xla_path(dtype, dim, stochastic, apply):
  rng = np.random.default_rng(dim)
  table, slots = _state(dtype, dim, rng)
  # 2 full chunks and a partial one, then padding: ids dense enough that
  # several share a packed row and a scalar slot's group, runs crossing
  # chunks.
  rows = np.full(3 * CHUNK + 8, -1, np.int32)
  rows[: 2 * CHUNK + 5] = np.sort(rng.choice(NUM_ROWS // 2, 2 * CHUNK + 5, replace=False))
  grads = rng.normal(size=(rows.size, dim)).astype(np.float32)
  args = (rows, grads, jnp.asarray(apply))
  want = _update("xla", dtype, stochastic)(table, slots, *args)
  got = _update("staged", dtype, stochastic)(table, slots, *args)
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    assert w.dtype == g.dtype and w.shape == g.shape
    np.testing.assert_array_equal(_bits(g), _bits(w))
  changed = np.any(_bits(want[0]) != _bits(table))
  assert changed == apply  # the case is not vacuous


def test_the_kernel_backends_route_optax_rows_through_the_kernels(monkeypatch):
  calls = []
  real = staged_update.fused_update
  monkeypatch.setattr(
    staged_update, "fused_update", lambda *a, **k: calls.append(1) or real(*a, **k)
  )
  rng = np.random.default_rng(0)
  table, slots = _state(jnp.float32, 16, rng)
  rows = np.arange(8, dtype=np.int32)
  grads = rng.normal(size=(8, 16)).astype(np.float32)
  args = (table, slots, rows, grads, OPT.scalars(1), True)
  kernels.fused_update(*args, optimizer=OPT, dtype=jnp.float32, backend="interpret")
  assert calls, "OptaxRows on the interpret backend did not take the kernels"
  calls.clear()
  kernels.fused_update(*args, optimizer=OPT, dtype=jnp.float32, backend="xla")
  assert not calls


def test_a_sync_step_with_optax_rows_in_kernels_equals_the_xla_backend():
  mesh = make_mesh(2)
  features = [pe.FeatureSpec("f", "t", "sum")]
  batch = {"f": np.random.default_rng(1).integers(0, 512, (16, 3)).astype(np.int32)}
  out = {}
  for backend in ("xla", "interpret"):
    spec = pe.TableSpec("t", 512, 16, optimizer=OPT)
    emb = pe.ShardedEmbedding([spec], features, mesh, "x", backend)
    state = emb.init(jax.random.key(0))
    acts, res = emb.lookup(state, batch)
    grads = jax.tree.map(lambda a: jnp.ones_like(a) * 0.5, acts)
    state, metrics = emb.apply_gradients(state, res, grads)
    assert bool(metrics["t"].applied)
    out[backend] = (emb.logical_table(state, "t"), state)
  np.testing.assert_array_equal(_bits(out["interpret"][0]), _bits(out["xla"][0]))
  for w, g in zip(jax.tree.leaves(out["xla"][1]), jax.tree.leaves(out["interpret"][1])):
    np.testing.assert_array_equal(_bits(g), _bits(w))
