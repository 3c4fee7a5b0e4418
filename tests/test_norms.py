"""The gradient norms (`pallas_emb.norms`): one pass of three square sums
gives the float64 norm across the whole float32 range, for a table's
(over devices), a stack's members and a replicated table's, and a
non-finite element gives a non-finite norm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import PartitionSpec as P

from pallas_emb import norms

# Each scale takes another of the three sums: squares that underflow
# (1e-25), the plain sum (1), squares that overflow (1e25), and near the
# top of float32 (1e36, the norm still finite).
SCALES = [1e-25, 1.0, 1e25, 1e36]


def _data(scale, shape=(64, 8)):
  rng = np.random.default_rng(0)
  return (rng.normal(size=shape) * scale).astype(np.float32)


def _norm64(x):
  return float(np.linalg.norm(np.asarray(x, np.float64)))


def _sharded(fn, num_args=1):
  """`fn` under shard_map over 4 devices, its arguments split by rows."""
  specs = (P("x"),) * num_args
  return jax.jit(
    jax.shard_map(fn, mesh=make_mesh(4), in_specs=specs, out_specs=P(), check_vma=False)
  )


@pytest.mark.parametrize("scale", SCALES)
def test_global_and_local_norms_equal_float64(scale):
  x = _data(scale)
  want = _norm64(x)
  got_global = float(_sharded(lambda b: norms.global_norm(b, "x"))(x))
  got_local = float(jax.jit(norms.local_norm)(x))
  np.testing.assert_allclose([got_global, got_local], [want, want], rtol=2e-6)


@pytest.mark.parametrize("scale", SCALES)
def test_member_norms_equal_float64_per_member(scale):
  x = _data(scale)
  member = np.arange(64, dtype=np.int32) % 4  # 3: rows of no member
  fn = _sharded(lambda b, m: norms.member_norms(b, m, 3, "x"), num_args=2)
  got = np.asarray(fn(x, member))
  want = [_norm64(x[member == k]) for k in range(3)]
  np.testing.assert_allclose(got, want, rtol=2e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("scale", [1e-25, 1.0])
def test_a_non_finite_element_gives_a_non_finite_norm(bad, scale):
  x = _data(scale)
  x[7, 3] = bad
  assert not np.isfinite(float(jax.jit(norms.local_norm)(x)))
  assert not np.isfinite(float(_sharded(lambda b: norms.global_norm(b, "x"))(x)))


def test_zero_gradients_have_norm_zero():
  x = jnp.zeros((64, 8), jnp.float32)
  assert float(jax.jit(norms.local_norm)(x)) == 0.0
  assert float(_sharded(lambda b: norms.global_norm(b, "x"))(x)) == 0.0
