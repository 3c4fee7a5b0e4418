"""A dynamic table's map slots on uneven shards (`sharding.map_slots`): a
permutation of each shard's rows that spreads the rows without a logical row,
so that an empty table never refuses an id for lack of a free slot; and the
configurations whose windows could still miss every row, refused."""

import jax
import numpy as np
import pytest
from conftest import make_mesh

import pallas_emb as pe
from pallas_emb.errors import SpecError
from pallas_emb.vocabulary import DynamicVocabulary
from sharding import map_slots
from sharding.layout import RowLayout

LAYOUTS = [
  (512, 3, "mod"),  # 171 of 256 rows used per shard
  (1000, 6, "mod"),
  (40, 8, "mod"),  # 5 of 8
  (9, 8, "mod"),  # 1 or 2 of 8: the used rows are the minority
  (1024, 8, "mod"),  # even: the identity
  (700, 3, "range"),  # the last shard holds 188 of 256
]


@pytest.mark.parametrize("num_rows,shards,kind", LAYOUTS)
def test_slots_are_a_permutation_of_each_shards_rows(num_rows, shards, kind):
  layout = RowLayout(num_rows, shards, kind)
  c = layout.rows_per_shard
  slots = np.arange(c)
  for s in range(shards):
    rows = map_slots.slot_rows(layout, s, slots)
    np.testing.assert_array_equal(np.sort(rows), slots)
    holds = layout.logical_of(s * c + rows) >= 0
    np.testing.assert_array_equal(map_slots.usable(layout, s, slots), holds)
    assert holds.sum() == map_slots.used_rows(layout, s)
    # The same on a traced shard number (as inside shard_map).
    traced = jax.jit(lambda sh: map_slots.slot_rows(layout, sh, slots))(np.int32(s))
    np.testing.assert_array_equal(traced, rows)
  if layout.num_physical_rows == num_rows:
    np.testing.assert_array_equal(map_slots.slot_rows(layout, 0, slots), slots)


@pytest.mark.parametrize("num_rows,shards,kind", LAYOUTS)
def test_every_window_longer_than_the_gap_holds_a_row(num_rows, shards, kind):
  layout = RowLayout(num_rows, shards, kind)
  c, gap = layout.rows_per_shard, map_slots.max_gap(layout)
  for s in range(shards):
    ok = np.asarray(map_slots.usable(layout, s, np.arange(c)))
    windows = np.stack([np.roll(ok, -r) for r in range(gap + 1)])
    assert windows.any(axis=0).all(), (s, gap)
  # Tail at most half a shard: no two slots without a row are adjacent.
  if layout.num_physical_rows < 2 * num_rows and kind == "mod":
    assert gap <= 1


@pytest.mark.parametrize("shards,num_rows", [(3, 512), (6, 1000)])
def test_an_empty_table_gives_every_admitted_id_a_row(shards, num_rows):
  vocab = DynamicVocabulary(probe_limit=8)
  spec = pe.TableSpec("t", num_rows, 8, vocabulary=vocab)
  emb = pe.ShardedEmbedding([spec], [pe.FeatureSpec("f", "t")], make_mesh(shards), backend="xla")
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  raw = (np.arange(96 * 2, dtype=np.int64).reshape(96, 2) * 7919 + 2**40)[:, :1]
  raw = np.concatenate([raw, np.full((96, 1), -1, np.int64)], axis=1)
  rows, tables, vocabs, metrics = emb.admit(tables, vocabs, {"f": raw})
  got = np.asarray(rows["f"])[:, 0]
  assert int(metrics["t"].failed) == 0 and int(metrics["t"].misses) == 0
  assert (got >= 0).all() and (got < num_rows).all() and np.unique(got).size == 96


def test_windows_that_could_miss_every_row_are_refused():
  # 1,000 rows over 6 shards, "range": shards 4 and 5 hold none.
  spec = pe.TableSpec("t", 1000, 8, layout="range", vocabulary=DynamicVocabulary())
  with pytest.raises(SpecError, match=r"shards \[4, 5\] hold none.*layout='mod'"):
    pe.ShardedEmbedding([spec], [pe.FeatureSpec("f", "t")], make_mesh(6), backend="xla")
  # 9 rows over 8 shards: runs of 7 slots without a row; windows of 4 miss.
  spec = pe.TableSpec("t", 9, 8, vocabulary=DynamicVocabulary(probe_limit=4))
  with pytest.raises(SpecError, match="probe_limit >= 8"):
    pe.ShardedEmbedding([spec], [pe.FeatureSpec("f", "t")], make_mesh(8), backend="xla")
