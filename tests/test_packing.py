"""bfloat16 rows stored as 32-bit words: exact round trips and RNE rounding."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import packing


def test_pack_rounds_like_astype_bfloat16():
  rng = np.random.default_rng(0)
  x = np.concatenate(
    [
      rng.normal(size=(64, 8)) * 10.0 ** rng.integers(-30, 30, (64, 1)),
      np.array([[np.inf, -np.inf, 0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38, 1e-30]]),
    ]
  ).astype(np.float32)
  words = jax.jit(packing.pack_rows, static_argnums=1)(jnp.asarray(x), jnp.bfloat16)
  assert words.dtype == jnp.uint32 and words.shape == (65, 4)
  want = x.astype(jnp.bfloat16)
  np.testing.assert_array_equal(packing.from_storage(words, jnp.bfloat16), want)
  np.testing.assert_array_equal(packing.unpack_rows(words, jnp.bfloat16), want.astype(np.float32))


def test_nan_stays_nan():
  x = jnp.asarray([[np.nan, 1.0]], jnp.float32)
  assert np.isnan(packing.unpack_rows(packing.pack_rows(x, jnp.bfloat16), jnp.bfloat16)[0, 0])


def test_word_k_holds_columns_k_and_k_plus_half():
  x = np.arange(8, dtype=np.float32)[None]
  words = np.asarray(packing.to_storage(x, jnp.bfloat16))
  lo = (words & 0xFFFF).astype(np.uint16).view(jnp.bfloat16).astype(np.float32)
  hi = (words >> 16).astype(np.uint16).view(jnp.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(lo, [[0, 1, 2, 3]])
  np.testing.assert_array_equal(hi, [[4, 5, 6, 7]])


def test_host_and_device_packing_agree():
  x = np.random.default_rng(1).normal(size=(16, 6)).astype(np.float32)
  np.testing.assert_array_equal(
    packing.to_storage(x, jnp.bfloat16), packing.pack_rows(jnp.asarray(x), jnp.bfloat16)
  )
  np.testing.assert_array_equal(packing.to_storage(x, jnp.float32), x)
