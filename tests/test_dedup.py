"""Static-capacity dedup: deterministic, invalid ids masked, overflow counted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding.dedup import PAD_ID, dedup, set_at, unique_keys
from sharding.layout import SENTINEL, RowLayout

# Both ways of finding each id's slot must give the same result.
METHODS = pytest.mark.parametrize("method", ["search", "sort"])


def _check_unique(ids, layout, capacity, method="search"):
  u = jax.jit(dedup, static_argnums=(1, 2, 3))(
    jnp.asarray(ids, jnp.int32), layout, capacity, method
  )
  keys, inverse = np.asarray(u.keys), np.asarray(u.inverse)
  valid = (ids >= 0) & (ids < layout.num_rows)
  distinct = np.unique(layout.physical_of(ids[valid]))
  kept = distinct[:capacity]
  np.testing.assert_array_equal(keys[: len(kept)], kept)
  assert (keys[len(kept) :] == SENTINEL).all()
  assert int(u.num_unique) == len(distinct)
  assert int(u.num_overflow) == len(distinct) - len(kept)
  assert int(u.num_invalid) == int(np.sum(~valid & (ids != PAD_ID)))
  for i, x in enumerate(ids):
    if valid[i] and layout.physical_of(x) in kept:
      assert keys[inverse[i]] == layout.physical_of(x)
    else:
      assert inverse[i] == -1, (i, x)
  return u


@METHODS
@pytest.mark.parametrize(
  "layout", [RowLayout(100, 1), RowLayout(100, 8), RowLayout(100, 3, "range")]
)
def test_dedup_matches_numpy(layout, method):
  ids = np.random.default_rng(1).integers(0, 100, 300).astype(np.int32)
  _check_unique(ids, layout, 128, method)


@METHODS
def test_invalid_ids_are_masked_and_counted(method):
  layout = RowLayout(50, 4)
  ids = np.array([3, -1, 50, 3, 2**31 - 1, -7, 49, 0, -1], np.int32)
  u = _check_unique(ids, layout, 16, method)
  assert int(u.num_invalid) == 3  # 50, 2**31-1, -7; the -1 are padding
  assert int(u.num_unique) == 3


@METHODS
def test_overflow_drops_whole_ids_never_clamps(method):
  layout = RowLayout(1000, 1)
  ids = np.arange(40, dtype=np.int32)[::-1].copy()
  u = _check_unique(ids, layout, 16, method)
  assert int(u.num_overflow) == 24
  inverse = np.asarray(u.inverse)
  # The kept ids are the 16 smallest keys; every other token has no slot.
  assert set(ids[inverse >= 0]) == set(range(16))


@METHODS
def test_result_does_not_depend_on_input_order(method):
  layout = RowLayout(64, 4)
  ids = np.random.default_rng(2).integers(0, 64, 200).astype(np.int32)
  a = dedup(jnp.asarray(ids), layout, 24, method)
  perm = np.random.default_rng(3).permutation(200)
  b = dedup(jnp.asarray(ids[perm]), layout, 24, method)
  np.testing.assert_array_equal(a.keys, b.keys)
  np.testing.assert_array_equal(np.asarray(a.inverse)[perm], b.inverse)


def test_unique_keys_validates():
  with pytest.raises(TypeError, match="int32"):
    unique_keys(jnp.zeros((4,), jnp.float32), 4)
  with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
    unique_keys(jnp.zeros((4,), jnp.int32), 0)
  with pytest.raises(ValueError, match="method must be one of"):
    unique_keys(jnp.zeros((4,), jnp.int32), 4, "hash")


def test_set_at_is_one_scatter_per_target():
  # Several arrays of different 32-bit dtypes set at the same indices, a
  # scalar broadcast, and indices past the end dropped: what a scatter per
  # array gives.
  rng = np.random.default_rng(0)
  m, n = 50, 20
  targets = (
    jnp.asarray(rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.uint32)),
    jnp.asarray(rng.standard_normal(m).astype(np.float32)),
    jnp.asarray(rng.integers(-5, 5, m).astype(np.int32)),
  )
  # The last element is never set: a clipped index would land there.
  at = jnp.asarray(np.where(rng.random(n) < 0.7, rng.permutation(m - 1)[:n], m + 3), jnp.int32)
  values = (
    jnp.asarray(rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)),
    jnp.asarray(rng.integers(0, 100, n).astype(np.int32)),  # cast to float32
    jnp.int32(7),
  )
  got = jax.jit(set_at)(targets, at, values)
  for g, x, v in zip(got, targets, values):
    want = x.at[at].set(jnp.broadcast_to(v, at.shape).astype(x.dtype), mode="drop")
    assert g.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
