"""Segment sums in the dedup's sorted order: the same bits as unsorted sums.

On a TPU the dedup sorts ("sort") and routing sums in the order that sort
found (`sharding.sorted_sums`), so that XLA:TPU does not sort the ids of
each sum again. On this CPU the dedup searches, so these tests run the
sorted form by asking for it: alone, through routing, and through the async
pipeline (whose first step routes the empty plan of `empty_plan`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

import pallas_emb as pe
from pallas_emb.sharded_table import ShardedTable
from sharding.dedup import dedup
from sharding.layout import RowLayout
from sharding.route import plan_route, to_owners
from sharding.sorted_sums import SortedSlots, segment_sum


def _values(rng, shape):
  # Magnitudes over many binades: a sum in another order has other bits.
  return (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, shape)).astype(np.float32)


def _sorted(rng, slot, num_slots):
  """`slot`'s ids in ascending stable slot order, each -1 at a random place."""
  key = np.where(slot >= 0, slot, rng.integers(0, num_slots, slot.shape))
  order = np.argsort(key, kind="stable").astype(np.int32)
  return SortedSlots(jnp.asarray(order), jnp.asarray(slot[order]))


@pytest.mark.parametrize("width", [None, 3])
def test_the_sorted_sum_adds_each_slot_in_input_order(width):
  rng = np.random.default_rng(0)
  n, num_slots = 500, 40
  slot = rng.integers(-1, num_slots, n).astype(np.int32)
  slot[:7] = -1  # ids without a slot before every slot's first
  values = _values(rng, (n,) if width is None else (n, width))
  # What an id without a slot carries goes nowhere, even NaN.
  values[slot < 0] = np.nan
  expected = np.zeros((num_slots,) + values.shape[1:], np.float32)
  np.add.at(expected, slot[slot >= 0], values[slot >= 0])  # in input order
  sum_of = jax.jit(segment_sum, static_argnums=2)
  in_order = _sorted(rng, slot, num_slots)
  np.testing.assert_array_equal(sum_of(values, slot, num_slots, in_order), expected)
  np.testing.assert_array_equal(sum_of(values, slot, num_slots), expected)


def test_a_sum_of_ids_none_of_which_has_a_slot_is_zero():
  values = jnp.full((6, 2), -0.0, jnp.float32)
  slot = jnp.full((6,), -1, jnp.int32)
  got = segment_sum(values, slot, 4, SortedSlots(jnp.arange(6, dtype=jnp.int32), slot))
  np.testing.assert_array_equal(np.signbit(got), False)
  np.testing.assert_array_equal(got, 0.0)


def _route_sums(mesh, layout, ids, values, caps, method):
  """(owner rows, owner sums, the jaxpr, the traced plan) per device."""
  unique_cap, route_cap, owner_cap = caps
  plans = []

  def fn(ids, values):
    u = dedup(ids, layout, unique_cap, method)
    plan = plan_route(
      u,
      rows_per_shard=layout.rows_per_shard,
      num_shards=layout.num_shards,
      route_capacity=route_cap,
      owner_capacity=owner_cap,
      axis_name="x",
      method=method,
    )
    plans.append(plan)
    return plan.owner_rows, to_owners(plan, values, axis_name="x")

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
  """Ids over the route and the unique capacity, invalid ids and padding,
  with gradients whose sums depend on their order."""
  mesh = make_mesh(shards)
  layout = RowLayout(400, shards, "mod")
  rng = np.random.default_rng(1)
  ids = rng.integers(-1, 420, (shards * 64,)).astype(np.int32)
  values = _values(rng, (shards * 64, 5))
  # Route capacity 6 cuts ids in the middle of the sorted order on 8
  # shards; unique capacity 40 the largest ids on one.
  caps = (40, 6 if shards > 1 else 40, min(shards * 6, layout.rows_per_shard))
  rows, sums, search, search_plan = _route_sums(mesh, layout, ids, values, caps, "search")
  sort_rows, sort_sums, sort, sort_plan = _route_sums(mesh, layout, ids, values, caps, "sort")
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


# -- through the async pipeline ------------------------------------------------

V, D, B = 53, 8, 16


def _loss_fn(params, acts, batch):
  logit = jnp.sum((acts["f"] + acts["g"]) * batch["w"], axis=1) * params["scale"]
  return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, batch["y"])), {}


def _batches(n):
  rng = np.random.default_rng(2)
  return [
    {
      "ids": {
        "f": rng.integers(-1, V, (B, 3)).astype(np.int32),
        "g": rng.integers(-1, 11, (B, 2)).astype(np.int32),
      },
      "w": _values(rng, (B, D)),
      "y": (rng.random(B) < 0.5).astype(np.float32),
    }
    for _ in range(n)
  ]


def _train(batches, mesh):
  tables = [
    pe.TableSpec("t", V, D, optimizer=pe.RowWiseAdagrad(0.2, half_life_steps=None)),
    pe.TableSpec("r", 11, D, optimizer=pe.SGD(0.3), placement="replicated"),
  ]
  features = [pe.FeatureSpec("f", "t", "sum"), pe.FeatureSpec("g", "r", "sum")]
  emb = pe.ShardedEmbedding(tables, features, mesh, "x", "xla")
  tr = pe.make_trainer(
    emb, _loss_fn, optax.sgd(0.1), pe.TrainConfig(use_async_emb=True), batches[0]
  )
  state = tr.init({"scale": jnp.float32(1.0)}, emb.init(jax.random.key(0)), batches[0])
  for t in range(len(batches)):
    state, _ = tr.step(state, batches[t], batches[min(t + 1, len(batches) - 1)])
  state, _ = tr.flush(state)
  # Whether the run routed by sorted sums: its plan says.
  sorted_sums = emb.plan(batches[0]["ids"])["t"].plan.token_sums is not None
  return [np.asarray(emb.logical_table(state.tables, n)) for n in ("t", "r")], sorted_sums


def test_the_async_pipeline_trains_the_same_bits_with_the_sorts_plans(monkeypatch):
  batches = _batches(4)
  mesh = make_mesh(8)
  search, sorted_search = _train(batches, mesh)
  # The programs are cached by their static table, which does not say how
  # it dedups: the sort's run gets a mesh of its own (the same devices in
  # reverse order, which no other test builds), so that it compiles afresh
  # and no other test finds its programs.
  monkeypatch.setattr(ShardedTable, "dedup_method", property(lambda self: "sort"))
  reversed_mesh = jax.sharding.Mesh(mesh.devices[::-1], mesh.axis_names)
  sort, sorted_sort = _train(batches, reversed_mesh)
  assert sorted_sort and not sorted_search
  for a, b in zip(search, sort):
    np.testing.assert_array_equal(b, a)
