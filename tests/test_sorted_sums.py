"""Segment sums in the dedup's sorted order: the same bits as unsorted sums.

On a TPU the dedup sorts ("sort") and routing sums in the order that sort
found (`sharding.sorted_sums`), so that XLA:TPU does not sort the ids of
each sum again. On this CPU the dedup searches, so these tests run the
sorted form by asking for it: alone, and through the async pipeline (whose
first step routes the empty plan of `empty_plan`); test_route.py routes by
it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

import pallas_emb as pe
from pallas_emb.sharded_table import ShardedTable
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
