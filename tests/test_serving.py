"""Serving artifacts: exported from a trained model, loaded anywhere, looked
up as in training.

One model holds every kind of table the issue names: float32 (sum and
weighted mean), bfloat16 at D=96 (stored padded; sqrtn and a sequence), two
tables stacked as one (one read ragged, with ids dropped for capacity), a
hashed feature, a replicated small table and a dynamic table. It trains 5
steps on 8 devices (XLA backend), is exported once, and every test reads
that artifact: in a fresh process on one device, row-sharded over 4 devices
(both mesh kinds), byte-flipped, and compiled for a TPU without one.
"""

import os
import pickle
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, child_env, make_mesh

import pallas_emb as pe
from pallas_emb.serving import artifact, program

B, L, SHARDS = 32, 4, 8
RULE = pe.HashRule(seed=3, pad="")
TABLES = (
  pe.TableSpec("f32", 4000, 64, pe.Adagrad(0.1)),
  pe.TableSpec("bf", 1000, 96, pe.RowWiseAdagrad(0.1), dtype=jnp.bfloat16),
  pe.TableSpec("s1", 1200, 32, pe.SGD(0.5)),
  pe.TableSpec("s2", 800, 32, pe.SGD(0.5)),
  pe.TableSpec("hashed", 1500, 32, pe.Adagrad(0.2), layout="range"),
  pe.TableSpec("small", 40, 16, pe.SGD(0.3), placement="replicated"),
  pe.TableSpec(
    "dyn", 1024, 32, pe.Adagrad(0.1), vocabulary=pe.DynamicVocabulary(), placement="sharded"
  ),
)
FEATURES = (
  pe.FeatureSpec("f_sum", "f32", "sum"),
  pe.FeatureSpec("f_mean", "f32", "mean"),
  pe.FeatureSpec("b_sqrtn", "bf", "sqrtn"),
  pe.FeatureSpec("b_seq", "bf", None),
  pe.FeatureSpec("s1", "s1", "sum"),
  pe.FeatureSpec("s2", "s2", "mean"),
  pe.FeatureSpec("query", "hashed", "sum"),
  pe.FeatureSpec("small", "small", "sum"),
  pe.FeatureSpec("d", "dyn", "sum"),
)
# Bit for bit; "mean" and "sqrtn" to float rounding (the bar; they
# come out equal here too).
EXACT = ("f_sum", "b_seq", "s1", "query", "small", "d")


def _request(rng):
  """(ids for the training lookup but the dynamic feature, its raw ids)."""
  queries = [
    [f"q{rng.integers(5000)}" if rng.random() > 0.2 else "" for _ in range(L)] for _ in range(B)
  ]
  ids = {
    "f_sum": rng.integers(-1, 4000, (B, L)),
    "f_mean": pe.Weighted(
      rng.integers(-1, 4000, (B, L)).astype(np.int32),
      rng.uniform(0.5, 2, (B, L)).astype(np.float32),
    ),
    "b_sqrtn": rng.integers(-1, 1000, (B, L)),
    "b_seq": rng.integers(-1, 1000, (B, 3)),
    "s1": pe.ragged(
      [rng.integers(0, 1200, rng.integers(0, 6)) for _ in range(B)], num_shards=SHARDS, capacity=12
    ),
    "s2": rng.integers(-1, 800, (B, L)),
    "query": RULE.rows(np.array(queries), 1500),
    "small": rng.integers(-1, 40, (B, 2)),
  }
  ids = {k: v.astype(np.int32) if isinstance(v, np.ndarray) else v for k, v in ids.items()}
  raw = rng.integers(0, 3000, (B, L)).astype(np.int64) * 7919 + 2**40
  raw[rng.random((B, L)) < 0.2] = -1
  return ids, raw


def _ready(x):
  """`x` once computed. XLA:CPU's simulated devices run a program's
  collectives on a shared thread pool: with several programs of 8-device
  all_to_alls in flight (six tables' lookups, then their updates) the pool
  sometimes ran out with one participant of the first still queued, and
  the process aborted at the rendezvous timeout (2 runs in 5 of this
  fixture, none in 6 with this wait)."""
  return jax.block_until_ready(x)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(emb, tables, vocabs, artifact path, request, the training lookup's
  activations and dynamic misses for it)."""
  emb = pe.ShardedEmbedding(TABLES, FEATURES, make_mesh(8), "x", "xla")
  assert "s1+s2" in emb.table_names  # the stacked pair
  rng = np.random.default_rng(0)
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  for _ in range(5):
    ids, raw = _request(rng)
    rows, tables, vocabs, _ = emb.admit(tables, vocabs, {"d": raw})
    acts, res = _ready(emb.lookup(tables, {**ids, **rows}))
    grads = {k: jnp.asarray(rng.normal(size=a.shape), jnp.float32) for k, a in acts.items()}
    tables, _ = _ready(emb.apply_gradients(tables, res, grads))
  ids, raw = _request(rng)
  raw[0, :2] = [-(2**62) + 1, 987654321987]  # never seen: zero rows, counted
  rows, vm = emb.read_rows(vocabs, {"d": raw})
  acts, _ = _ready(emb.lookup(tables, {**ids, **rows}))
  path = tmp_path_factory.mktemp("serving") / "model"
  pe.export_serving(emb, tables, str(path), vocabularies=vocabs, features={"query": RULE})
  expected = {k: np.asarray(v) for k, v in acts.items()}
  return emb, tables, vocabs, str(path), {**ids, "d": raw}, expected, int(vm["dyn"].misses)


def _assert_same(expected, acts):
  assert sorted(acts) == sorted(expected)
  for name, want in expected.items():
    got = np.asarray(acts[name])
    assert got.shape == want.shape and got.dtype == np.float32, name
    if name in EXACT:
      np.testing.assert_array_equal(got, want, err_msg=name)
    else:
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)


_CHILD = """
import pickle, sys
import numpy as np
import pallas_emb as pe
served = pe.load_serving(sys.argv[1])
with open(sys.argv[2], "rb") as f:
  request = pickle.load(f)
acts, misses = served.lookup(request)
heavy = sorted(m for m in sys.modules if m.startswith(
  ("pallas_emb.train", "pallas_emb.optimizers", "pallas_emb.kernels", "pallas_emb.embedding",
   "optax", "orbax")))
with open(sys.argv[3], "wb") as f:
  pickle.dump(({k: np.asarray(v) for k, v in acts.items()},
               {k: int(v) for k, v in misses.items()}, heavy, len(__import__("jax").devices())), f)
"""


def test_a_fresh_process_on_one_device_looks_up_as_training(trained, tmp_path):
  _, _, _, path, request, expected, dyn_misses = trained
  with open(tmp_path / "request.pkl", "wb") as f:
    pickle.dump(request, f)
  proc = subprocess.run(
    [sys.executable, "-c", _CHILD, path, str(tmp_path / "request.pkl"), str(tmp_path / "out.pkl")],
    env=child_env(),
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "out.pkl", "rb") as f:
    acts, misses, heavy, devices = pickle.load(f)
  assert devices == 1
  _assert_same(expected, acts)
  assert misses["d"] == dyn_misses >= 2 and misses["f_sum"] == 0
  # Loading needs no trainer, optimizer, kernel (native library) or orbax.
  assert heavy == [], heavy


def test_row_sharded_over_four_devices_gives_the_same_activations(trained, mesh_kind):
  _, _, _, path, request, expected, _ = trained
  mesh = make_mesh(4, "rows", kind=mesh_kind)
  served = pe.load_serving(path, mesh=mesh)
  table = served._tables["f32"]  # pylint: disable=protected-access
  assert len(table.sharding.device_set) == 4 and table.addressable_shards[0].data.shape[0] == 1000
  acts, _ = served.lookup(request)
  _assert_same(expected, acts)


def test_an_unseen_raw_id_reads_zeros_and_is_counted(trained):
  path = trained[3]
  served = pe.load_serving(path)
  raw = np.array([[-(2**62) + 1, -1, 5], [-1, -1, -1]], np.int64)  # 5: never a trained id
  acts, misses = served.lookup({"d": raw})
  np.testing.assert_array_equal(np.asarray(acts["d"]), np.zeros((2, 32), np.float32))
  assert int(misses["d"]) == 2
  # A static table's id past its rows is a miss too, even where the loader
  # padded the table (none here: 4,000 rows on one device).
  acts, misses = served.lookup({"f_sum": np.array([[3999, 4000, -1, -5]], np.int32)})
  np.testing.assert_array_equal(np.asarray(acts["f_sum"])[0], served_row(served, "f32", 3999))
  assert int(misses["f_sum"]) == 2
  # Strings go through the same keys; padding is not a miss.
  acts, misses = served.lookup({"d": np.array([["never", "seen"]], object)})
  assert int(misses["d"]) == 2 and not np.asarray(acts["d"]).any()


def served_row(served, table: str, row: int) -> np.ndarray:
  return np.asarray(served._tables[table][row], np.float32)  # pylint: disable=protected-access


def test_the_artifact_holds_the_logical_tables_and_resident_ids_only(trained):
  emb, tables, vocabs, path, *_ = trained
  manifest = artifact.read_manifest(path)
  files = artifact.read_files(path, manifest)
  resident = emb.resident_ids(vocabs, "dyn")
  logical_bytes = 0
  for spec in TABLES:
    entry = manifest["tables"][spec.name]
    rows = artifact.array(files, entry["rows"])
    want = emb.logical_table(tables, spec.name)
    if spec.vocabulary is not None:
      raw, at = emb.resident_rows(vocabs, spec.name)
      want = want[at]
      np.testing.assert_array_equal(artifact.array(files, entry["dynamic"]["ids"]), raw)
    assert rows.dtype == spec.dtype and rows.shape == want.shape
    np.testing.assert_array_equal(rows, want)
    logical_bytes += want.nbytes
  maps = 12 * resident.size  # an int64 raw id and an int32 row each
  assert 0 < resident.size < 1024
  total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
  assert logical_bytes + maps <= total <= 1.05 * (logical_bytes + maps), (total, logical_bytes)
  kinds = {re.sub(r"/.*", "", name) for name in manifest["files"]}
  assert kinds == {"tables", "maps", "programs"}  # no slots, no training state
  assert manifest["features"]["query"]["hashing"] == {"seed": 3, "pad": ""}
  assert manifest["num_shards"] == SHARDS and manifest["library_version"] == pe.__version__


def test_hashed_features_hash_by_the_recorded_rule(trained):
  served = pe.load_serving(trained[3])
  raw = np.array([["q1", "", "q7"]])
  out = served.hash_ids({"query": raw, "f_sum": np.zeros((1, 1), np.int32)})
  np.testing.assert_array_equal(out["query"], pe.hash_ids(raw, 1500, seed=3, pad=""))
  assert out["query"][0, 1] == -1 and out["f_sum"].dtype == np.int32


def test_the_programs_call_no_custom_code(trained):
  path = trained[3]
  manifest = artifact.read_manifest(path)
  files = artifact.read_files(path, manifest)
  served = pe.load_serving(path)
  served.lookup({"f_sum": np.zeros((2, 2), np.int32)})
  for name in manifest["files"]:
    if name.startswith("programs/"):
      exported = program.deserialize(files[name])
      assert exported.platforms == ("cpu", "tpu") and program.custom_calls(exported) == [], name
  compiled = served._calls["f_sum", "bags"]  # pylint: disable=protected-access
  text = (
    compiled.lower(
      served._tables["f32"],
      (),
      np.int32(4000),
      np.zeros((2, 2), np.int32),
      np.ones((2, 2), np.float32),
    )
    .compile()
    .as_text()
  )
  assert "custom-call" not in text


def test_the_key_search_orders_keys_by_both_words():
  """Keys that share their high word are told apart by the low one; a
  query between, before or after every key finds none; padding is -1."""
  rng = np.random.default_rng(1)
  keys = np.unique(
    (rng.integers(0, 4, 300, dtype=np.uint64) << np.uint64(32))
    | rng.integers(0, 2**32, 300, dtype=np.uint64)
  )
  keys = keys[:257]
  rows = rng.permutation(257).astype(np.int32)
  queries = np.concatenate([keys, keys + np.uint64(1), [np.uint64(0), np.uint64(2**63)]])
  words = lambda k: np.stack([k >> np.uint64(32), k & np.uint64(2**32 - 1)], -1).astype(np.uint32)
  hi, lo, row = (
    jnp.asarray(np.concatenate([a, b]))
    for a, b in zip((*words(keys).T, rows), program.sentinel_keys())
  )
  got = np.asarray(program.find_keys((hi, lo, row), jnp.asarray(words(queries))))
  at = np.searchsorted(keys, queries).clip(0, keys.size - 1)
  want = np.where(keys[at] == queries, rows[at], program.NO_ROW)
  np.testing.assert_array_equal(got, want)
  assert (got[:257] == rows).all() and (got[257:] == program.NO_ROW).sum() >= 250
  pad = np.full((1, 2), 0xFFFFFFFF, np.uint32)
  assert int(program.find_keys((hi, lo, row), jnp.asarray(pad))[0]) == -1


def _flip(path: str, name: str) -> None:
  full = os.path.join(path, *name.split("/"))
  data = bytearray(open(full, "rb").read())
  data[len(data) // 2] ^= 0x10
  with open(full, "wb") as f:
    f.write(bytes(data))


def test_a_flipped_byte_in_any_file_or_a_missing_file_is_refused(trained, tmp_path):
  path = trained[3]
  names = [artifact.MANIFEST, *artifact.read_manifest(path)["files"]]
  assert len(names) > 10
  for name in names:
    copy = str(tmp_path / "copy")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(path, copy)
    _flip(copy, name)
    with pytest.raises(pe.ServingArtifactError, match=re.escape(name.split("/")[-1])):
      pe.load_serving(copy)
  shutil.rmtree(copy)
  shutil.copytree(path, copy)
  os.remove(os.path.join(copy, "maps", "6.ids.bin"))
  with pytest.raises(pe.CheckpointError, match=r"6\.ids\.bin.*cannot be read"):
    pe.load_serving(copy)
  with pytest.raises(pe.ServingArtifactError, match="not a directory"):
    pe.load_serving(str(tmp_path / "nothing"))


def test_export_and_lookup_refuse_what_cannot_work(trained, tmp_path):
  emb, tables, vocabs, path, request, *_ = trained
  with pytest.raises(pe.InputError, match=r"\['dyn'\] have dynamic vocabularies"):
    pe.export_serving(emb, tables, str(tmp_path / "a"))
  with pytest.raises(pe.InputError, match="'nope', which is not a feature"):
    pe.export_serving(
      emb, tables, str(tmp_path / "a"), vocabularies=vocabs, features={"nope": RULE}
    )
  with pytest.raises(pe.InputError, match="reads dynamic table 'dyn'"):
    pe.export_serving(emb, tables, str(tmp_path / "a"), vocabularies=vocabs, features={"d": RULE})
  again = str(tmp_path / "again")  # an export replaces an earlier artifact whole
  pe.export_serving(emb, tables, again, vocabularies=vocabs)
  (tmp_path / "again" / "tables" / "stray.bin").write_bytes(b"x")
  pe.export_serving(emb, tables, again, vocabularies=vocabs)
  assert not os.path.exists(os.path.join(again, "tables", "stray.bin"))
  assert sorted(os.listdir(tmp_path)) == ["again"]  # no staging left behind
  assert pe.load_serving(again).manifest["features"]["query"]["hashing"] is None
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("mine")
  with pytest.raises(pe.CheckpointDirError, match="not a serving artifact"):
    pe.export_serving(emb, tables, str(tmp_path / "other"), vocabularies=vocabs)
  with pytest.raises(pe.SpecError, match="pad must be None, an int or a str"):
    pe.HashRule(pad=1.5)
  served = pe.load_serving(path)
  bad = [
    ({"nope": request["f_sum"]}, "no feature 'nope'"),
    ({"b_seq": pe.Weighted(request["b_seq"], np.ones((B, 3)))}, "sequence.*no weights"),
    ({"b_seq": request["s1"]}, "sequence.*Ragged"),
    ({"f_mean": pe.Weighted(request["f_sum"], np.ones((B, 1)))}, r"weights have shape \(32, 1\)"),
    ({"s1": pe.ragged([[1]] * 4, num_shards=4, capacity=2)}, "packed for the training run's 8"),
    ({"f_sum": np.zeros((0, 4), np.int32)}, "B, L >= 1"),
    ({"f_sum": np.array([["a"]])}, "ids must be integers"),
  ]
  for ids, message in bad:
    with pytest.raises(pe.InputError, match=message):
      served.lookup(ids)


@pytest.mark.slow
def test_the_programs_compile_for_a_tpu_without_one(trained, tmp_path):
  """The exported programs' TPU half, compiled deviceless (libtpu, no
  network) on one chip and row-sharded over a v5e:2x2."""
  out = tmp_path / "tpu.json"
  env = {k: v for k, v in child_env().items() if k != "JAX_COMPILATION_CACHE_DIR"}
  proc = subprocess.run(
    ["unshare", "-n", sys.executable, "-m", "pallas_emb.pod_check.serving", trained[3],
     "--topology=v5e:2x2", f"--json={out}"],
    env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  import json  # pylint: disable=g-import-not-at-top

  reports = json.loads(out.read_text())
  programs = {r["file"] for r in reports}
  assert programs == {n for n in artifact.read_manifest(trained[3])["files"] if "programs/" in n}
  assert {(r["placement"], r["chips"]) for r in reports} == {("one chip", 1), ("row-sharded", 4)}
  for r in reports:
    assert r["kernels"] == [] and r["exported_custom_calls"] == [], r
  sharded = {r["file"]: r for r in reports if r["placement"] == "row-sharded"}
  single = {r["file"]: r for r in reports if r["placement"] == "one chip"}
  # Row-sharded, a chip holds about a quarter of the biggest table.
  f32 = next(f for f, r in single.items() if r["argument_bytes"] > 1_000_000)
  assert sharded[f32]["argument_bytes"] < 0.3 * single[f32]["argument_bytes"]
