"""Capacities: defaults that follow the ids per chip, measured maxima, the
planner."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh

import pallas_emb as pe
from pallas_emb.capacity import Capacities
from pallas_emb.capacity_planner import plan_capacities, with_capacities
from sharding.layout import RowLayout

V, D = 4000, 8


def _emb(num_devices, **caps):
  table = pe.TableSpec("t", V, D, optimizer=pe.SGD(0.1), **caps)
  return pe.ShardedEmbedding(
    [table],
    [pe.FeatureSpec("f", "t", "sum"), pe.FeatureSpec("g", "t", None)],
    make_mesh(num_devices),
    "x",
    "xla",
  )


def _batch(seed, batch=64, hi=V):
  rng = np.random.default_rng(seed)
  return {
    "f": rng.integers(0, hi, (batch, 3)).astype(np.int32),
    "g": rng.integers(-1, hi, (batch, 2)).astype(np.int32),
  }


def test_default_exchange_follows_the_ids_per_chip_not_the_chip_count():
  spec = pe.TableSpec("t", 100_000_000, 128)
  tokens = 86016
  sizes = {}
  for shards in (4, 16, 64, 256):
    caps = Capacities.for_table(spec, RowLayout(spec.num_rows, shards), tokens)
    sizes[shards] = shards * caps.route
  # The exchange buffer stays about 1.25x the ids per chip at any chip count.
  for shards, slots in sizes.items():
    assert tokens <= slots <= 1.25 * tokens + 64 * shards + 8 * shards, (shards, slots)
  # One shard and the "range" layout (hot ids all on one shard) stay exact.
  assert Capacities.for_table(spec, RowLayout(spec.num_rows, 1), tokens).route >= tokens
  assert Capacities.for_table(spec, RowLayout(spec.num_rows, 16, "range"), tokens).route >= tokens


def test_metrics_report_the_observed_maxima():
  emb = _emb(8)
  state = emb.init(jax.random.key(0))
  ids = _batch(1)
  acts, res = emb.lookup(state, ids)
  _, m = emb.apply_gradients(state, res, {k: jnp.ones_like(v) for k, v in acts.items()})
  layout = emb.layout("t")
  per_shard = [
    np.concatenate([ids["f"][s * 8 : (s + 1) * 8].ravel(), ids["g"][s * 8 : (s + 1) * 8].ravel()])
    for s in range(8)
  ]
  uniques = [np.unique(x[(x >= 0) & (x < V)]) for x in per_shard]
  assert int(m["t"].max_unique_per_shard) == max(len(u) for u in uniques)
  assert int(m["t"].max_ids_per_route) == max(
    np.bincount(layout.shard_of(u), minlength=8).max() for u in uniques
  )
  owners = [np.unique(np.concatenate(uniques))]
  rows_per_owner = np.bincount(layout.shard_of(owners[0]), minlength=8)
  assert int(m["t"].max_rows_per_owner) == rows_per_owner.max()


def test_planned_capacities_never_overflow_on_what_they_measured():
  emb = _emb(8)
  sample = [_batch(s) for s in range(4)]
  planned = plan_capacities(emb, sample)["t"]
  assert planned.batches == 4
  tuned = with_capacities(emb, {"t": planned})
  exact = Capacities.for_table(emb.tables[0], emb.layout("t"), 8 * 5)
  caps = tuned.sharded_table("t", 8 * 5).capacities
  assert caps.unique <= exact.unique and caps.route <= exact.route
  for ids in sample:
    res = tuned.plan(ids)["t"]
    assert int(np.sum(res.num_overflow)) + int(np.sum(res.plan.num_overflow)) == 0


def test_overflow_past_planned_capacities_is_counted_not_clamped():
  emb = _emb(8)
  # Plan on batches of a narrow id range, then feed one that uses the whole
  # vocabulary: more distinct ids than planned.
  planned = plan_capacities(emb, [_batch(s, hi=40) for s in range(2)], headroom=1.0, slack=0)
  tuned = with_capacities(emb, planned)
  state = tuned.init(jax.random.key(0))
  before = tuned.logical_table(state, "t")
  ids = _batch(9)
  acts, res = tuned.lookup(state, ids)
  state, m = tuned.apply_gradients(state, res, {k: jnp.ones_like(v) for k, v in acts.items()})
  assert int(m["t"].overflow_ids) > 0
  assert int(m["t"].max_unique_per_shard) > planned["t"].unique_capacity
  # Dropped ids wrote nothing: rows no kept id touches are unchanged.
  after = tuned.logical_table(state, "t")
  changed = np.flatnonzero((after != before).any(axis=1))
  assert set(changed) <= set(np.concatenate([ids["f"].ravel(), ids["g"].ravel()]))


def test_planner_refuses_bad_arguments():
  emb = _emb(1)
  with pytest.raises(pe.InputError, match="at least one batch"):
    plan_capacities(emb, [])
  with pytest.raises(pe.InputError, match="headroom must be"):
    plan_capacities(emb, [_batch(0)], headroom=0.5)
  with pytest.raises(pe.InputError, match="unknown tables"):
    with_capacities(emb, {"u": None})
