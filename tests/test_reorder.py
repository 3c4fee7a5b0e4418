"""`sharding.reorder`: each reordering's sort form (a TPU's) gives its
scatter form's bits, on random inputs with ties, empty and full selections."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding import reorder


def _same(f, g, *args):
  want = jax.jit(f)(*args)
  got = jax.jit(g)(*args)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  return np.asarray(want)


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("size", [5, 64, 100])
def test_compact_by_sort_equals_by_scatter(size, p):
  rng = np.random.default_rng(size)
  keep = jnp.asarray(rng.random(64) < p)
  values = jnp.asarray(rng.integers(-5, 1000, 64, dtype=np.int32))
  kw = dict(size=size, fill=-7)
  got = _same(
    lambda k, v: reorder.compact_by_scatter(k, v, **kw),
    lambda k, v: reorder.compact_by_sort(k, v, **kw),
    keep,
    values,
  )
  kept = np.asarray(values)[np.asarray(keep)][:size]
  np.testing.assert_array_equal(got[: kept.size], kept)
  assert (got[kept.size :] == -7).all()


def test_compact_takes_the_scatter_form_for_rows():
  keep = jnp.asarray([True, False, True])
  rows = jnp.arange(6.0).reshape(3, 2)
  got = jax.jit(lambda k, v: reorder.compact(k, v, 4, 0.5))(keep, rows)
  np.testing.assert_array_equal(got, [[0, 1], [4, 5], [0.5, 0.5], [0.5, 0.5]])


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.float32, np.bool_])
def test_invert_by_sort_equals_by_scatter(dtype):
  rng = np.random.default_rng(1)
  perm = jnp.asarray(rng.permutation(300).astype(np.int32))
  values = jnp.asarray(rng.integers(0, 2, 300).astype(dtype))
  got = _same(reorder.invert_by_scatter, reorder.invert_by_sort, perm, values)
  np.testing.assert_array_equal(got[np.asarray(perm)], values)


@pytest.mark.parametrize("capacity", [4, 50, 1000])
def test_first_claims_by_sort_equals_by_scatter(capacity):
  rng = np.random.default_rng(capacity)
  slot = rng.integers(0, capacity, 300).astype(np.int32)
  want = rng.random(300) < 0.6
  slot[~want & (rng.random(300) < 0.5)] = -1  # a key that wants nothing may have no slot
  kw = dict(capacity=capacity)
  got = _same(
    lambda s, w: reorder.first_claims_by_scatter(s, w, **kw),
    lambda s, w: reorder.first_claims_by_sort(s, w, **kw),
    jnp.asarray(slot),
    jnp.asarray(want),
  )
  first = {}
  for i in np.flatnonzero(want):
    first.setdefault(slot[i], i)
  np.testing.assert_array_equal(np.flatnonzero(got), sorted(first.values()))


@pytest.mark.parametrize("platform,form", [("tpu", "sort"), ("cpu", "scatter")])
def test_each_platform_compiles_one_form(platform, form):
  keep, perm = jnp.asarray([False, True, True, False]), jnp.asarray([2, 0, 3, 1])
  for f, args in [
    (lambda k: reorder.compact(k, jnp.arange(4), 4, -1), (keep,)),
    (reorder.invert, (perm, perm)),
    (lambda s, w: reorder.first_claims(s, w, 8), (perm, keep)),
  ]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    ops = {op for op in ("sort", "scatter") if f"stablehlo.{op}" in text}
    assert ops == {form}, (platform, ops)
