"""Dynamic vocabularies: the id maps against a pure-Python reference, and
what training with them guarantees (rows never shared, admission, eviction,
read-only evaluation, static shapes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vocab_reference import PAD_KEY, ReferenceVocab

import pallas_emb as pe
from pallas_emb import dynamic
from pallas_emb.errors import InputError, SpecError
from pallas_emb.kernels import native_lib
from pallas_emb.vocabulary import DynamicVocabulary, raw_ids, vocab_keys
from sharding.sketch import sketch_slots

B, L = 8, 2

POLICIES = {
  "lfu": DynamicVocabulary(policy="lfu", probe_limit=3, evict_every=3, decay=0.5, ttl=4),
  # A narrow sketch: it fills, and ages (halves), within a few steps.
  "lru": DynamicVocabulary(policy="lru", probe_limit=2, admit_after=2, sketch_width=128),
  "ttl": DynamicVocabulary(policy="ttl", probe_limit=4, ttl=2, evict_every=2),
}


def _emb(num_devices, vocab, num_rows=40, optimizer=None, backend="xla"):
  spec = pe.TableSpec("t", num_rows, 8, vocabulary=vocab, optimizer=optimizer or pe.Adagrad(0.1))
  return pe.ShardedEmbedding(
    [spec], [pe.FeatureSpec("f", "t")], make_mesh(num_devices), backend=backend
  )


# The native CPU kernels' map (csrc/id_map.cc) against the same reference.
BACKENDS = [
  "xla",
  pytest.param(
    "native",
    marks=pytest.mark.skipif(
      not native_lib.available(), reason=f"native library: {native_lib.status().reason}"
    ),
  ),
]


def _as_int(words):
  w = np.asarray(words, np.uint64).reshape(-1, 2)
  return [int(k) for k in (w[:, 0] << np.uint64(32)) | w[:, 1]]


def _train(emb, tables, vocabs, raw):
  """One training step: admit, lookup, a gradient of ones, update."""
  rows, tables, vocabs, vm = emb.admit(tables, vocabs, {"f": raw})
  acts, res = emb.lookup(tables, rows)
  tables, _ = emb.apply_gradients(tables, res, {"f": jnp.ones_like(acts["f"])})
  return rows["f"], tables, vocabs, vm["t"]


streams = st.lists(
  st.lists(st.integers(-1, 60), min_size=B * L, max_size=B * L), min_size=1, max_size=7
)


# The quick loop's subset (conftest): every policy against the reference on 8
# devices, through evictions on 1, and the restore onto more shards.
QUICK = {
  "test_equals_reference": lambda p: p["num_devices"] == 8,
  "test_equals_reference_through_evictions": lambda p: p["num_devices"] == 1,
  "test_checkpoint_restores_onto_another_shard_count": lambda p: p["devices"] == 4,
}


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams)
def test_equals_reference(num_devices, policy, stream):
  _check_against_reference(num_devices, policy, stream)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_equals_reference_through_evictions(num_devices, policy, backend):
  """A long stream over more ids than rows: every rule is exercised."""
  rng = np.random.default_rng(num_devices)
  stream = rng.integers(-1, 61, (12, B * L)).tolist()
  totals = _check_against_reference(num_devices, policy, stream, backend)
  assert totals["inserts"] > 20 and totals["evictions"] > 0, totals
  assert totals["not_admitted"] > 0 or policy != "lru", totals


def _check_against_reference(num_devices, policy, stream, backend="xla"):
  """Trains `stream` on the device and in the reference, step by step
  equal rows and metrics, then equal resident ids and rows; returns the
  summed metrics."""
  vocab = POLICIES[policy]
  emb = _emb(num_devices, vocab, backend=backend)
  ref = ReferenceVocab(40, num_devices, vocab)
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  totals = {}
  for batch in stream:
    raw = np.array(batch, np.int64).reshape(B, L) * 7919 + 2**40
    raw[np.array(batch).reshape(B, L) < 0] = -1
    rows, tables, vocabs, vm = _train(emb, tables, vocabs, raw)
    want_rows, want = ref.step_keys(_as_int(vocab_keys(raw, vocab)))
    np.testing.assert_array_equal(np.asarray(rows).ravel(), want_rows)
    assert {k: int(getattr(vm, k)) for k in want} == want
    totals = {k: totals.get(k, 0) + want[k] for k in want}
  ids, got_rows = emb.resident_rows(vocabs, "t")
  resident = ref.resident()
  want_ids = raw_ids(
    np.array([[k >> 32, k & 0xFFFFFFFF] for k in resident], np.uint32).reshape(-1, 2), vocab
  )
  assert dict(zip(ids.tolist(), got_rows.tolist())) == dict(
    zip(want_ids.tolist(), resident.values())
  )
  assert len(set(got_rows.tolist())) == len(got_rows)  # no two ids share a row
  return totals


def _sketch_is_exact(vocab, universe, capacity):
  """Whether every id of `universe` has a sketch counter no other id
  shares, on one shard (then its estimate is its exact count)."""
  w = vocab_keys(np.asarray(universe), vocab).reshape(-1, 2)
  cells = sketch_slots(w[:, 0], w[:, 1], vocab.depth(), vocab.width_for(capacity))
  return all(
    any((cells[d] == cells[d, i]).sum() == 1 for d in range(cells.shape[0]))
    for i in range(len(universe))
  )


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams)
def test_not_admitted_ids_never_take_or_change_a_row(stream):
  vocab = DynamicVocabulary(admit_after=3, sketch_width=1024, probe_limit=4)
  universe = np.arange(61) * 7919 + 2**40
  assert _sketch_is_exact(vocab, universe, 40)
  emb = _emb(1, vocab)
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  seen = {}
  for batch in stream:
    raw = np.array(batch, np.int64).reshape(B, L) * 7919 + 2**40
    raw[np.array(batch).reshape(B, L) < 0] = -1
    for x in raw.ravel()[raw.ravel() >= 0]:
      seen[int(x)] = seen.get(int(x), 0) + 1
    before = emb.logical_table(tables, "t")
    rows, tables, vocabs, _ = _train(emb, tables, vocabs, raw)
    rows = np.asarray(rows)
    for x, r in zip(raw.ravel(), rows.ravel()):
      if x >= 0 and seen[int(x)] < 3:
        assert r == -2, (x, seen[int(x)], r)
    changed = np.flatnonzero((emb.logical_table(tables, "t") != before).any(axis=1))
    assert set(changed.tolist()) <= set(rows[rows >= 0].tolist())
    for x in emb.resident_ids(vocabs, "t"):
      assert seen[int(x)] >= 3


def test_ids_over_the_key_route_capacity_miss_and_take_no_other_ids_row():
  # 2 shards, 64 ids per shard, each distinct, at most 8 sent to each owner:
  # about 24 of each shard's 32 per owner are dropped. They read no row and
  # count as misses; the ids sent are admitted into distinct rows.
  spec = pe.TableSpec("t", 256, 8, vocabulary=DynamicVocabulary(probe_limit=8), route_capacity=8)
  emb = pe.ShardedEmbedding([spec], [pe.FeatureSpec("f", "t")], make_mesh(2), backend="xla")
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  raw = (np.arange(128, dtype=np.int64) * 104729 + 7).reshape(64, 2)
  rows, tables, vocabs, vm = emb.admit(tables, vocabs, {"f": raw})
  rows = np.asarray(rows["f"]).ravel()
  got = rows >= 0
  assert set(rows[~got].tolist()) == {-2}
  assert int(vm["t"].misses) == int((~got).sum()) > 0
  assert int(vm["t"].inserts) == int(got.sum()) <= 2 * 2 * 8  # sources x owners x capacity
  assert len(set(rows[got].tolist())) == got.sum()  # no two ids share a row
  assert sorted(emb.resident_ids(vocabs, "t").tolist()) == sorted(raw.ravel()[got].tolist())
  # The ids sent are found again; the dropped ones still miss.
  again, _ = emb.read_rows(vocabs, {"f": raw})
  np.testing.assert_array_equal(np.asarray(again["f"]).ravel()[got], rows[got])


def test_lfu_keeps_the_frequent_ids_of_a_zipf_stream():
  capacity, distinct, batch = 256, 2560, 256
  vocab = DynamicVocabulary(policy="lfu", probe_limit=8)
  emb = _emb(1, vocab, num_rows=capacity, optimizer=pe.SGD(0.1))
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  rng = np.random.default_rng(0)
  p = np.arange(1, distinct + 1, dtype=np.float64) ** -1.1
  perm = rng.permutation(distinct).astype(np.int64) * 104729 + 12345  # raw ids, not ranks
  for _ in range(40):
    ranks = rng.choice(distinct, size=(batch, 1), p=p / p.sum())
    rows, tables, vocabs, _ = emb.admit(tables, vocabs, {"f": perm[ranks]})
  top = set(perm[: capacity // 2].tolist())
  kept = len(top & set(emb.resident_ids(vocabs, "t").tolist())) / len(top)
  assert kept >= 0.9, kept


@pytest.mark.parametrize("backend", BACKENDS)
def test_once_seen_ids_stay_out_however_long_the_stream(backend):
  """31x the capacity in ids seen once each, over 1,000 steps, with the
  default sketch: at most 1% take a row (without the sketch's aging, 69%
  did: a full sketch reads every id as seen twice)."""
  capacity, per_step, steps = 256, 8, 1000
  emb = _emb(2, DynamicVocabulary(admit_after=2), num_rows=capacity, backend=backend)
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  admitted = 0
  for s in range(steps):
    raw = np.arange(s * per_step, (s + 1) * per_step, dtype=np.int64) * 104729 + 7
    rows, tables, vocabs, _ = emb.admit(tables, vocabs, {"f": raw.reshape(-1, 1)})
    admitted += int((np.asarray(rows["f"]) >= 0).sum())
  assert admitted <= 0.01 * steps * per_step, admitted


def test_an_aged_sketch_keeps_the_frequent_ids_of_a_long_zipf_stream():
  """8 shards, 400 steps of a Zipf(1.1) stream over 10x the capacity in
  distinct ids, admit_after=2: the most frequent capacity / 2 ids stay."""
  capacity, distinct, batch = 1024, 10240, 256
  emb = _emb(8, DynamicVocabulary(admit_after=2), num_rows=capacity, optimizer=pe.SGD(0.1))
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  rng = np.random.default_rng(0)
  p = np.arange(1, distinct + 1, dtype=np.float64) ** -1.1
  perm = rng.permutation(distinct).astype(np.int64) * 104729 + 12345
  for _ in range(400):
    ranks = rng.choice(distinct, size=(batch, 1), p=p / p.sum())
    _, tables, vocabs, _ = emb.admit(tables, vocabs, {"f": perm[ranks]})
    jax.block_until_ready(vocabs)  # 8 CPU devices: keep dispatch in step
  top = set(perm[: capacity // 2].tolist())
  kept = len(top & set(emb.resident_ids(vocabs, "t").tolist())) / len(top)
  assert kept >= 0.9, kept


def test_a_full_sketch_is_halved_before_it_counts():
  from sharding.sketch import age_sketch, sketch_sample

  full = np.full((2, 64), 1, np.int32)  # 64 in a row: at least the sample
  assert sketch_sample(64) == 16
  np.testing.assert_array_equal(age_sketch(full), np.zeros_like(full))
  np.testing.assert_array_equal(np.asarray(age_sketch(jnp.asarray(full * 3))), full)
  light = np.zeros((2, 64), np.int32)
  light[1, :15] = 1  # 15 < 16: kept as it is
  np.testing.assert_array_equal(age_sketch(light), light)


def test_eval_reads_only_and_no_recompile_as_the_vocabulary_grows():
  vocab = DynamicVocabulary(policy="lru", probe_limit=4)
  emb = _emb(2, vocab, num_rows=64, optimizer=pe.SGD(0.1))
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  compiled = []
  for step in range(100):
    raw = np.arange(B * L, dtype=np.int64).reshape(B, L) + step * 5  # new ids every step
    _, tables, vocabs, vm = _train(emb, tables, vocabs, raw)
    compiled.append(dynamic.admit._cache_size())
  assert compiled[-1] == compiled[0], compiled  # one program for all 100 steps
  assert int(vm.occupancy) == 64 and int(vm.evictions) > 0
  snapshot = jax.tree.map(np.asarray, vocabs)
  fresh = np.arange(B * L, dtype=np.int64).reshape(B, L) + 10**12
  rows, m = emb.read_rows(vocabs, {"f": fresh})
  assert (np.asarray(rows["f"]) == -2).all() and int(m["t"].inserts) == 0
  assert int(m["t"].misses) == B * L
  jax.tree.map(np.testing.assert_array_equal, snapshot, jax.tree.map(np.asarray, vocabs))
  resident = emb.resident_ids(vocabs, "t")[:B].reshape(B, 1)
  rows, _ = emb.read_rows(vocabs, {"f": resident})
  assert (np.asarray(rows["f"]) >= 0).all()


def test_keys_round_trip_and_padding():
  vocab = DynamicVocabulary(seed=3)
  raw = np.array([0, 5, -7, 2**62 + 1, -(2**63), 2**63 - 1], np.int64)
  w = vocab_keys(raw, vocab, pad=None)
  assert w.dtype == np.uint32 and w.shape == (6, 2)
  np.testing.assert_array_equal(raw_ids(w, vocab), raw)
  w = vocab_keys(np.array([[4, -1]]), vocab)
  assert (w[0, 1] == 0xFFFFFFFF).all() and not (w[0, 0] == 0xFFFFFFFF).all()
  s = vocab_keys(np.array(["a", "b", "a"], object), vocab, pad=None)
  assert (s[0] == s[2]).all() and not (s[0] == s[1]).all()
  assert _as_int(w[0, 1:])[0] == PAD_KEY


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(admit_after=0), "admit_after"),
    (dict(policy="fifo"), "policy"),
    (dict(probe_limit=65), "probe_limit=65"),
    (dict(policy="ttl"), "needs ttl"),
    (dict(policy="ttl", ttl=1), "ttl >= 2"),
    (dict(decay=0.0), "decay"),
    (dict(evict_on_insert=False), "nothing is ever evicted"),
    (dict(sketch_width=0), "sketch_width"),
  ],
)
def test_vocabulary_is_validated(kwargs, match):
  with pytest.raises(SpecError, match=match):
    DynamicVocabulary(**kwargs)


def test_dynamic_tables_are_not_replicated_or_stacked():
  vocab = DynamicVocabulary()
  with pytest.raises(SpecError, match="placement='replicated'"):
    pe.TableSpec("t", 64, 8, vocabulary=vocab, placement="replicated")
  specs = [pe.TableSpec("a", 64, 8, vocabulary=vocab), pe.TableSpec("b", 64, 8)]
  feats = [pe.FeatureSpec("fa", "a"), pe.FeatureSpec("fb", "b")]
  emb = pe.ShardedEmbedding(specs, feats, make_mesh(2), replicate_below=10**6)
  assert set(emb.table_names) == {"a", "b"} and not emb._group("a").replicated
  with pytest.raises(SpecError, match="dynamic vocabulary"):
    pe.ShardedEmbedding(specs, feats, make_mesh(2), stacking={"g": ["a", "b"]})
  with pytest.raises(InputError, match="do not read a dynamic table"):
    emb.admit(emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(0)), {"fb": [1]})


def test_checkpoint_round_trip_and_resume_equal_an_uninterrupted_run(tmp_path):
  from pallas_emb.train.checkpoint_vocab import VocabCheckpointer

  vocab = DynamicVocabulary(policy="lfu", admit_after=2, probe_limit=2, evict_every=2, ttl=3)
  emb = _emb(2, vocab, num_rows=24)
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, 50, (B, L)).astype(np.int64) for _ in range(8)]
  init = lambda: (emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1)))
  host = lambda tree: jax.tree.map(np.asarray, tree)

  tables, vocabs = init()
  ckpt = VocabCheckpointer(str(tmp_path / "ckpt"), emb)
  for i, raw in enumerate(batches):
    if i == 4:
      ckpt.save(i, tables, vocabs, extra={"position": i})
      saved = host((tables, vocabs))
    _, tables, vocabs, _ = _train(emb, tables, vocabs, raw)
  want = host((tables, vocabs))

  tables, vocabs = init()
  tables, vocabs, extra = VocabCheckpointer(str(tmp_path / "ckpt"), emb).restore(tables, vocabs)
  assert extra == {"position": 4}
  jax.tree.map(np.testing.assert_array_equal, host((tables, vocabs)), saved)
  for raw in batches[4:]:
    _, tables, vocabs, _ = _train(emb, tables, vocabs, raw)
  jax.tree.map(np.testing.assert_array_equal, host((tables, vocabs)), want)

  with pytest.raises(pe.CheckpointMismatchError, match="same table specs"):
    other = _emb(2, vocab, num_rows=32)
    VocabCheckpointer(str(tmp_path / "ckpt"), other).restore(
      other.init(jax.random.key(0)), other.init_vocabularies(jax.random.key(1))
    )


@pytest.mark.parametrize("devices", [1, 4])
def test_checkpoint_restores_onto_another_shard_count(tmp_path, devices):
  from pallas_emb.train.checkpoint_vocab import VocabCheckpointer

  vocab = DynamicVocabulary(policy="lfu", admit_after=2, probe_limit=8, evict_every=3, ttl=4)

  def emb_on(n):  # a dynamic table and a static one, unstacked
    specs = [
      pe.TableSpec("t", 64, 8, vocabulary=vocab, optimizer=pe.Adagrad(0.1)),
      pe.TableSpec("s", 40, 8, optimizer=pe.Adagrad(0.1)),
    ]
    feats = [pe.FeatureSpec("f", "t"), pe.FeatureSpec("g", "s")]
    return pe.ShardedEmbedding(specs, feats, make_mesh(n), backend="xla", stacking="off")

  def state(emb, tables, vocabs):
    ids, rows = emb.resident_rows(vocabs, "t")
    m = jax.tree.map(np.asarray, vocabs["t"].map)
    held = {
      (int(h), int(lo)): (c, t)
      for h, lo, c, t in zip(m.key_hi, m.key_lo, m.count, m.last)
      if t >= 0
    }
    table, slots = emb.logical_table(tables, "t"), emb.logical_slots(tables, "t")
    by_id = {int(i): (table[r], {k: v[r] for k, v in slots.items()}) for i, r in zip(ids, rows)}
    return by_id, sorted(held.items()), emb.logical_table(tables, "s"), dict(zip(ids, rows))

  emb = emb_on(2)
  rng = np.random.default_rng(3)
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  for _ in range(5):
    raw = rng.integers(0, 40, (B, L)).astype(np.int64) * 7919
    rows, tables, vocabs, _ = emb.admit(tables, vocabs, {"f": raw})
    ids = {**rows, "g": rng.integers(0, 40, (B, L)).astype(np.int32)}
    acts, res = emb.lookup(tables, ids)
    tables, _ = emb.apply_gradients(tables, res, {k: jnp.ones_like(a) for k, a in acts.items()})
  VocabCheckpointer(str(tmp_path / "ckpt"), emb).save(5, tables, vocabs)
  by_id, held, static, _ = state(emb, tables, vocabs)
  assert len(by_id) > 10

  other = emb_on(devices)
  ckpt = VocabCheckpointer(str(tmp_path / "ckpt"), other)
  tables, vocabs, _ = ckpt.restore(
    other.init(jax.random.key(0)), other.init_vocabularies(jax.random.key(1))
  )
  assert ckpt.resharded == {"t": {"kept": len(by_id), "dropped": 0}}
  got_by_id, got_held, got_static, got_rows = state(other, tables, vocabs)
  # Every id is resident again, with its row, slots, count and last step.
  assert sorted(got_by_id) == sorted(by_id) and got_held == held
  for i, (row, slots) in by_id.items():
    np.testing.assert_array_equal(got_by_id[i][0], row)
    for k in slots:
      np.testing.assert_array_equal(got_by_id[i][1][k], slots[k])
  np.testing.assert_array_equal(got_static, static)
  # Rows are distinct, and a read finds each id at its new row.
  assert len(set(got_rows.values())) == len(got_rows)
  ids = np.array(sorted(got_rows), np.int64)
  pad = (-ids.size) % (B * L)
  raw = np.concatenate([ids, np.full(pad, -1, np.int64)]).reshape(-1, L)
  read, _ = other.read_rows(vocabs, {"f": raw})
  np.testing.assert_array_equal(
    np.asarray(read["f"]).reshape(-1)[: ids.size], [got_rows[i] for i in ids]
  )
  # And training goes on.
  rows, tables, vocabs, vm = other.admit(tables, vocabs, {"f": raw})
  assert int(vm["t"].misses) == 0


def test_weighted_and_ragged_inputs_take_rows_like_padded_ids():
  vocab = DynamicVocabulary(probe_limit=4)
  emb = _emb(2, vocab, num_rows=64)
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  raw = np.array([[10, 11], [12, -1], [10, 13], [14, 15]], np.int64) * 2**33
  rows, tables, vocabs, _ = emb.admit(tables, vocabs, {"f": raw})
  want = emb.lookup(tables, rows)[0]["f"]
  weighted, _ = emb.read_rows(vocabs, {"f": pe.Weighted(raw, np.ones(raw.shape, np.float32))})
  assert isinstance(weighted["f"], pe.Weighted)
  np.testing.assert_array_equal(weighted["f"].ids, rows["f"])
  np.testing.assert_array_equal(emb.lookup(tables, weighted)[0]["f"], want)
  bags = [[x for x in r if x != -1] for r in raw.tolist()]
  ragged, _ = emb.read_rows(vocabs, {"f": pe.ragged(bags, num_shards=2, capacity=4)})
  assert isinstance(ragged["f"], pe.Ragged)
  np.testing.assert_array_equal(emb.lookup(tables, ragged)[0]["f"], want)


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_devices", [1, 2])
def test_new_rows_start_from_the_initializer_with_fresh_slots(
  num_devices, backend, chunk, monkeypatch
):
  """Every row given a new id (empty before, or evicted and reused after
  training moved it) holds the documented initial draw, and its slots
  their initial values, when `admit` returns. `chunk`: new rows drawn 2 at
  a time (a step's 5 in 3 chunks), or as many as this platform draws."""
  if chunk is not None:
    monkeypatch.setattr(dynamic, "_INIT_CHUNK_DEFAULT", chunk)
    jax.clear_caches()  # admit's program is cached by its table
  init = lambda key, shape, dtype=jnp.float32: jax.random.normal(key, shape, dtype)
  vocab = DynamicVocabulary(policy="lru", probe_limit=4)
  spec = pe.TableSpec("t", 16, 8, vocabulary=vocab, optimizer=pe.Adagrad(0.1), initializer=init)
  emb = pe.ShardedEmbedding(
    [spec], [pe.FeatureSpec("f", "t")], make_mesh(num_devices), backend=backend
  )
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  slot_init = {n: s.init for n, s in spec.optimizer.slot_specs().items()}
  new_total = reused_trained = 0
  for step in range(6):
    raw = np.arange(B * L, dtype=np.int64).reshape(B, L) + 5 * step  # 5 new ids a step
    held = dict(zip(*(x.tolist() for x in emb.resident_rows(vocabs, "t"))))  # id -> row
    slots_before = emb.logical_slots(tables, "t")
    map_step, key = int(vocabs["t"].map.step), jnp.asarray(np.asarray(vocabs["t"].key))  # donated
    rows, tables, vocabs, vm = emb.admit(tables, vocabs, {"f": raw})
    ids, got = emb.resident_rows(vocabs, "t")
    new = [r for i, r in zip(ids.tolist(), got.tolist()) if held.get(i) != r]
    assert len(new) == int(vm["t"].inserts)
    keys = dynamic.new_row_keys(key, jnp.asarray(new, jnp.int32), map_step)
    want = jax.vmap(lambda d: init(jax.random.wrap_key_data(d), (8,)))(keys)
    np.testing.assert_array_equal(emb.logical_table(tables, "t")[new], np.asarray(want))
    for name, value in emb.logical_slots(tables, "t").items():
      assert (value[new] == slot_init[name]).all(), name
      reused_trained += int((slots_before[name][new] != slot_init[name]).any(axis=-1).sum())
    new_total += len(new)
    acts, res = emb.lookup(tables, rows)
    tables, _ = emb.apply_gradients(tables, res, {"f": jnp.ones_like(acts["f"])})
  assert new_total > 16 and reused_trained > 0, (new_total, reused_trained)
  # No two (row, step) pairs share a key.
  grid = dynamic.new_row_keys(
    key, jnp.arange(4096, dtype=jnp.int32).repeat(8), jnp.tile(jnp.arange(8), 4096)
  )
  assert len({tuple(k) for k in np.asarray(grid).tolist()}) == 4096 * 8


def test_async_victims_are_not_the_previous_steps_ids():
  """An id used at step t - 1 keeps its row at step t (its update may
  still be pending), however full its window."""
  vocab = DynamicVocabulary(policy="lru", probe_limit=1)
  emb = _emb(1, vocab, num_rows=8)
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  first = np.arange(B * L, dtype=np.int64).reshape(B, L) + 2**35
  rows0, tables, vocabs, _ = emb.admit(tables, vocabs, {"f": first})
  held = dict(zip(*emb.resident_rows(vocabs, "t")))
  _, tables, vocabs, vm = emb.admit(tables, vocabs, {"f": first + 10**9})
  assert int(vm["t"].evictions) == 0 and int(vm["t"].failed) > 0
  assert dict(zip(*emb.resident_rows(vocabs, "t"))) == held
  _, tables, vocabs, vm = emb.admit(tables, vocabs, {"f": first + 10**9})
  assert int(vm["t"].evictions) > 0  # now two steps old: evictable


@pytest.mark.slow  # a benchmark program
def test_drift_benchmark_compares_three_tables_in_one_run():
  from pallas_emb.bench import drift

  # The synchronous pipeline: at this size one-step-stale rows blur the
  # dynamic table's lead (80 steps of 256 show it in either pipeline).
  out = drift.run(rows=256, steps=40, batch=128, dim=8, config=pe.TrainConfig(use_async_emb=False))
  assert out["pipeline"] == "sync"
  assert set(out["methods"]) == {"dynamic", "hashed", "oracle"}
  assert out["distinct_ids"] > 5 * 256 and out["final_occupancy"] <= 256
  auc = {n: m["auc"] for n, m in out["methods"].items()}
  assert auc["oracle"] > auc["hashed"] and auc["dynamic"] > auc["hashed"], auc
  assert all(m["step_ms_median"] > 0 for m in out["methods"].values())
