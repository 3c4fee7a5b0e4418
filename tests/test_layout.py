"""RowLayout: placement, conversions and resharding for any shard count."""

import numpy as np
import pytest

from sharding.layout import ROW_ALIGNMENT, LayoutError, RowLayout

SHARDS = [1, 2, 3, 6, 7, 8]


@pytest.mark.parametrize("kind", ["mod", "range"])
@pytest.mark.parametrize("shards", SHARDS)
@pytest.mark.parametrize("rows", [1, 13, 100, 1000])
def test_every_row_has_one_distinct_home(kind, shards, rows):
  layout = RowLayout(rows, shards, kind)
  assert layout.rows_per_shard % ROW_ALIGNMENT == 0
  r = np.arange(rows)
  phys = layout.physical_of(r)
  assert len(np.unique(phys)) == rows
  assert phys.min() >= 0 and phys.max() < layout.num_physical_rows
  np.testing.assert_array_equal(phys // layout.rows_per_shard, layout.shard_of(r))
  np.testing.assert_array_equal(phys % layout.rows_per_shard, layout.local_of(r))
  assert (layout.local_of(r) < layout.rows_per_shard).all()
  # logical_of inverts physical_of, and marks every other slot as padding.
  logical = layout.logical_of(np.arange(layout.num_physical_rows))
  np.testing.assert_array_equal(logical[phys], r)
  assert (logical >= 0).sum() == rows


def test_mod_layout_stripes_rows_and_range_layout_is_contiguous():
  mod = RowLayout(20, 4, "mod")
  np.testing.assert_array_equal(mod.shard_of(np.arange(8)), [0, 1, 2, 3] * 2)
  rng = RowLayout(20, 4, "range")
  np.testing.assert_array_equal(rng.physical_of(np.arange(20)), np.arange(20))


@pytest.mark.parametrize("kind", ["mod", "range"])
@pytest.mark.parametrize("shards", SHARDS)
def test_physical_logical_round_trip(kind, shards):
  layout = RowLayout(50, shards, kind)
  logical = np.random.default_rng(0).normal(size=(50, 3)).astype(np.float32)
  physical = layout.to_physical(logical)
  assert physical.shape == (layout.num_physical_rows, 3)
  pad = layout.logical_of(np.arange(layout.num_physical_rows)) < 0
  assert (physical[pad] == 0).all()
  np.testing.assert_array_equal(layout.to_logical(physical), logical)


@pytest.mark.parametrize("src", [(8, "mod"), (3, "range"), (1, "mod")])
@pytest.mark.parametrize("dst", [(4, "mod"), (6, "range"), (7, "mod"), (1, "range")])
def test_reshard_preserves_the_logical_table(src, dst):
  a, b = RowLayout(77, *src), RowLayout(77, *dst)
  logical = np.arange(77 * 2, dtype=np.float32).reshape(77, 2)
  moved = a.reshard(a.to_physical(logical), b)
  np.testing.assert_array_equal(moved, b.to_physical(logical))


def test_layout_works_on_jax_arrays():
  import jax.numpy as jnp

  layout = RowLayout(30, 4)
  logical = jnp.arange(30.0).reshape(30, 1)
  np.testing.assert_array_equal(layout.to_logical(layout.to_physical(logical)), logical)


def test_bad_layouts_name_the_value():
  with pytest.raises(LayoutError, match="num_shards must be a positive int, got 0"):
    RowLayout(10, 0)
  with pytest.raises(LayoutError, match="num_rows"):
    RowLayout(0, 2)
  with pytest.raises(LayoutError, match="'hash'"):
    RowLayout(10, 2, "hash")
  with pytest.raises(LayoutError, match="split the table"):
    RowLayout(2**31 - 2, 3)
  with pytest.raises(LayoutError, match="expects 16"):
    RowLayout(10, 2).to_logical(np.zeros((10, 1)))
  with pytest.raises(LayoutError, match="vocabulary must match"):
    RowLayout(10, 2).reshard(np.zeros((16, 1)), RowLayout(11, 2))
