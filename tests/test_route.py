"""Routing inside shard_map: buckets, all_to_all, owner merge and its reverse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

from sharding.dedup import dedup
from sharding.layout import RowLayout
from sharding.route import from_owners, plan_route, to_owners


def _plan(ids, layout, unique_cap, route_cap, owner_cap, method):
  """One device's dedup of its ids and their route (inside shard_map)."""
  return plan_route(
    dedup(ids.reshape(-1), layout, unique_cap, method),
    rows_per_shard=layout.rows_per_shard,
    num_shards=layout.num_shards,
    route_capacity=route_cap,
    owner_capacity=owner_cap,
    axis_name="x",
    method=method,
  )


def _route(mesh, layout, ids, values, unique_cap, route_cap, owner_cap, method="search"):
  """Per device: dedup its ids, route unit values to owners and rows back."""

  def fn(ids, values):
    plan = _plan(ids, layout, unique_cap, route_cap, owner_cap, method)
    owner_sums = to_owners(plan, values.reshape(-1), axis_name="x")
    # Owners answer each slot they received with its global physical row;
    # every id gets its answer back.
    shard = jax.lax.axis_index("x")
    answer = jnp.where(plan.recv_rows >= 0, plan.recv_rows + shard * layout.rows_per_shard, -1)
    back = from_owners(plan, answer, axis_name="x")
    return (
      plan.owner_rows,
      owner_sums,
      plan.token_slot,
      back,
      plan.num_overflow[None],
      plan.num_owner_unique[None],
    )

  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  return [np.asarray(x) for x in f(ids, values)]


@pytest.mark.parametrize("method", ["search", "sort"])
@pytest.mark.parametrize("shards,kind", [(8, "mod"), (6, "range"), (1, "mod")])
def test_gradients_reach_owners_summed_and_rows_come_back(shards, kind, method):
  mesh = make_mesh(shards)
  layout = RowLayout(200, shards, kind)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 200, (shards * 40,)).astype(np.int32)
  values = rng.integers(1, 5, ids.shape).astype(np.float32)
  cap = 48
  owner_rows, owner_sums, token_slot, back, overflow, n_owner = _route(
    mesh, layout, ids, values, cap, cap, min(shards * cap, layout.rows_per_shard), method
  )
  assert overflow.sum() == 0
  rps = layout.rows_per_shard
  # Every owner's rows are distinct, ascending, and the global sums are right.
  expected = {}
  for x, v in zip(ids, values):
    p = int(layout.physical_of(x))
    expected[p] = expected.get(p, 0.0) + v
  got = {}
  for s in range(shards):
    rows = owner_rows[s * len(owner_rows) // shards : (s + 1) * len(owner_rows) // shards]
    sums = owner_sums[s * len(owner_rows) // shards : (s + 1) * len(owner_rows) // shards]
    valid = rows >= 0
    assert (np.diff(rows[valid]) > 0).all()
    assert (rows[~valid] == -1).all() and (sums[~valid] == 0).all()
    for r, v in zip(rows[valid], sums[valid]):
      got[s * rps + int(r)] = float(v)
  assert got == expected
  assert n_owner.sum() == len(expected)
  # The reverse route returns every id its owner's answer.
  assert (token_slot >= 0).all()
  np.testing.assert_array_equal(back, layout.physical_of(ids))


def test_route_overflow_is_counted_and_dropped():
  shards = 4
  mesh = make_mesh(shards)
  layout = RowLayout(64, shards)
  # Every device asks for 8 ids all owned by shard 0 (ids multiple of 4).
  ids = np.tile(np.arange(0, 32, 4, dtype=np.int32), shards)
  values = np.ones_like(ids, np.float32)
  owner_rows, owner_sums, token_slot, back, overflow, _ = _route(
    mesh, layout, ids, values, 8, 5, 16
  )
  assert overflow.tolist() == [3] * shards
  # Only the 5 smallest ids reach the owner; each from all 4 sources.
  np.testing.assert_array_equal(owner_rows[:5], np.arange(5))
  np.testing.assert_array_equal(owner_sums[:5], [4.0] * 5)
  # The dropped ids have no slot and come back as zeros, never another row.
  assert (token_slot.reshape(shards, 8)[:, 5:] == -1).all()
  assert (back.reshape(shards, 8)[:, 5:] == 0).all()
  np.testing.assert_array_equal(
    back.reshape(shards, 8)[:, :5], np.tile(layout.physical_of(ids[:5]), (shards, 1))
  )


# -- summed in the sort's order ------------------------------------------------


def _sums(mesh, layout, ids, values, caps, method):
  """(owner rows, owner sums, the jaxpr, the traced plan) per device."""
  plans = []

  def fn(ids, values):
    plans.append(_plan(ids, layout, *caps, method))
    return plans[-1].owner_rows, to_owners(plans[-1], values, axis_name="x")

  f = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  rows, sums = jax.jit(f)(ids, values)
  return np.asarray(rows), np.asarray(sums), jax.make_jaxpr(f)(ids, values).jaxpr, plans[-1]


def _scatter_adds(jaxpr):
  """`indices_are_sorted` of every scatter-add in `jaxpr`, nested ones too."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scatter-add":
      found.append(eqn.params["indices_are_sorted"])
    for sub in jaxprs_in_params(eqn.params):
      found += _scatter_adds(sub)
  return found


@pytest.mark.parametrize("shards", [1, 8])
def test_routing_by_the_sort_sums_the_bits_of_the_search_without_sorting_again(shards):
  """The sort's plan sums in its sorted order (`sharding.sorted_sums`): ids
  over the route and the unique capacity, invalid ids and padding, with
  gradients whose sums depend on their order."""
  mesh = make_mesh(shards)
  layout = RowLayout(400, shards, "mod")
  rng = np.random.default_rng(1)
  ids = rng.integers(-1, 420, (shards * 64,)).astype(np.int32)
  # Magnitudes over many binades: a sum in another order has other bits.
  shape = (shards * 64, 5)
  values = (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, shape)).astype(np.float32)
  # Route capacity 6 cuts ids in the middle of the sorted order on 8
  # shards; unique capacity 40 the largest ids on one.
  caps = (40, 6 if shards > 1 else 40, min(shards * 6, layout.rows_per_shard))
  rows, sums, search, search_plan = _sums(mesh, layout, ids, values, caps, "search")
  sort_rows, sort_sums, sort, sort_plan = _sums(mesh, layout, ids, values, caps, "sort")
  np.testing.assert_array_equal(sort_rows, rows)
  np.testing.assert_array_equal(sort_sums, sums)
  assert (rows >= 0).sum() > 0 and np.isfinite(sums).all()
  # Every sum of the sort's plan is told its ids are sorted (no sort on a
  # TPU); the search's are not.
  assert _scatter_adds(sort) and all(_scatter_adds(sort))
  assert not any(_scatter_adds(search))
  # The sort's plan holds the owner's slots only in sorted order: nothing
  # scatters them back into received order.
  assert sort_plan.owner_inverse is None and sort_plan.owner_sums is not None
  assert search_plan.owner_sums is None and search_plan.token_sums is None
