"""pallas_emb.threefry.IMPL draws the bits of JAX's default threefry keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.random import threefry_2x32

from pallas_emb import threefry

DRAWS = {
  "normal": lambda k: jax.random.normal(k, (5, 16)),
  "uniform": lambda k: jax.random.uniform(k, (33,), minval=-2.0, maxval=3.0),
  "truncated_normal": lambda k: jax.random.truncated_normal(k, -2.0, 2.0, (7, 3)),
  "bits8": lambda k: jax.random.bits(k, (9,), jnp.uint8),
  "bits16": lambda k: jax.random.bits(k, (4, 4), jnp.uint16),
  "bits32": lambda k: jax.random.bits(k, (3, 5)),
  "randint": lambda k: jax.random.randint(k, (11,), -50, 50),
  "glorot_uniform": lambda k: jax.nn.initializers.glorot_uniform()(k, (8, 6)),
  "bfloat16_normal": lambda k: jax.random.normal(k, (16,), jnp.bfloat16),
  "scalar": lambda k: jax.random.normal(k, ()),
  "split_then_draw": lambda k: jax.random.normal(jax.random.split(k)[1], (4,)),
  "fold_in_then_draw": lambda k: jax.random.uniform(jax.random.fold_in(k, 7), (4,)),
}


@pytest.mark.parametrize("draw", sorted(DRAWS))
def test_same_bits_as_a_default_threefry_key(draw):
  data = jnp.array([[0, 0], [1, 2], [0xDEADBEEF, 0xFFFFFFFF]], jnp.uint32)
  fn = DRAWS[draw]
  want = jax.jit(jax.vmap(lambda d: fn(jax.random.wrap_key_data(d))))(data)
  got = jax.jit(jax.vmap(lambda d: fn(jax.random.wrap_key_data(d, impl=threefry.IMPL))))(data)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_hash_matches_the_threefry_primitive():
  rng = np.random.default_rng(0)
  words = rng.integers(0, 2**32, (4, 64), dtype=np.uint64).astype(np.uint32)
  k1, k2, x1, x2 = (jnp.asarray(w) for w in words)
  key = jnp.stack([k1[0], k2[0]])
  want = threefry_2x32(key, jnp.concatenate([x1, x2]))
  got = jnp.concatenate(threefry.hash2x32(k1[0], k2[0], x1, x2))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_draws_of_2_to_32_values_are_refused():
  key = jax.random.wrap_key_data(jnp.array([1, 2], jnp.uint32), impl=threefry.IMPL)
  with pytest.raises(ValueError, match="fewer than 2\\*\\*32"):
    jax.jit(lambda k: jax.random.bits(k, (2**16, 2**16))).lower(key)
