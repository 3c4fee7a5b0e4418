"""Data sources: the synthetic log is deterministic; MovieLens in four
formats, real ml-100k among them; each process reads only its rows."""

import numpy as np
import pytest
import real_movielens

from pallas_emb import data


def test_synthetic_batches_are_a_function_of_seed_and_index():
  a, b = data.SyntheticClickLog(seed=3), data.SyntheticClickLog(seed=3)
  x, y = a.train_batch(7, 64), b.train_batch(7, 64)
  for k in x["ids"]:
    np.testing.assert_array_equal(x["ids"][k], y["ids"][k])
  np.testing.assert_array_equal(x["label"], y["label"])
  assert not np.array_equal(a.train_batch(8, 64)["ids"]["user"], x["ids"]["user"])
  assert x["ids"]["history"].shape == (64, a.history_len) and (x["ids"]["history"] >= -1).all()
  assert x["ids"]["user"].dtype == np.int32 and x["dense"].shape == (64, a.num_dense)
  # A row is the same whichever blocks are made with it: rows 100..299
  # (parts of three 128-row blocks) are the whole batch's.
  whole = a.train_batch(7, 320)
  part = a.train_rows(7, 320, 100, 300)
  for k in x["ids"]:
    np.testing.assert_array_equal(part["ids"][k], whole["ids"][k][100:300])
  for k in ("dense", "label", "true_logit"):
    np.testing.assert_array_equal(part[k], whole[k][100:300])


def _assert_zipf(ids, vocab: int, a: float):
  """`ids` (padding -1 aside) follow P(k) ~ (k + 1)^-a on [0, vocab): a
  chi-square statistic within 3x its mean (vocab - 1)."""
  ids = ids[ids >= 0]
  law = np.arange(1, vocab + 1.0) ** -a
  expected = len(ids) * law / law.sum()
  chi2 = (((np.bincount(ids, minlength=vocab) - expected) ** 2) / expected).sum()
  assert chi2 < 3 * vocab, chi2


def test_zipf_ids_invert_the_law():
  from pallas_emb.data import zipf  # pylint: disable=g-import-not-at-top

  table = zipf.cdf(50, 1.1)
  _assert_zipf(zipf.ids(table, np.random.default_rng(0).random((100, 100))), 50, 1.1)
  # The ends: u = 0 is id 0, u just under 1 the last id.
  assert table[-1] == 1.0
  assert zipf.ids(table, np.array([0.0, 1 - 2**-53])).tolist() == [0, 49]


def test_both_logs_ids_follow_the_zipf_law_and_the_signal_is_learnable():
  from pallas_emb.data.dlrm import DlrmClickLog  # pylint: disable=g-import-not-at-top

  d = data.SyntheticClickLog(num_users=20, num_items=30)
  batch = d.train_batch(0, 8192)
  for name, vocab in (("user", 20), ("item", 30), ("history", 30)):
    _assert_zipf(batch["ids"][name], vocab, d.zipf_a)
  dlrm = DlrmClickLog(max_rows=40)
  batch = dlrm.train_batch(0, 8192)
  for f in ("C9", "C17", "C1"):  # 3, 10 and (capped) 40 rows
    _assert_zipf(batch["ids"][f], dlrm.rows(int(f[1:]) - 1), dlrm.zipf_a)
  # The planted model separates clicks from non-clicks (its AUC is the ceiling).
  batch = data.SyntheticClickLog().train_batch(0, 8192)
  from pallas_emb.train.metrics import auc

  assert auc(batch["true_logit"], batch["label"]) > 0.75


def test_synthetic_eval_set_has_the_requested_size():
  d = data.SyntheticClickLog(eval_examples=1000)
  batches = list(d.eval_batches(256))
  assert len(batches) == 4 and sum(b["weight"].sum() for b in batches) == 1000


def _write(tmp_path, name, text):
  p = tmp_path / name
  p.write_text(text)
  return str(p)


ROWS = [(1, 10, 5, 1000), (2, 10, 3, 900), (1, 20, 4, 1100), (3, 30, 1, 800), (2, 20, 4.5, 1200)]


@pytest.mark.parametrize(
  "name,fmt",
  [
    ("u.data", lambda r: "\t".join(map(str, r))),
    ("ratings.dat", lambda r: "::".join(map(str, r))),
    ("ratings.csv", lambda r: ",".join(map(str, r))),
    ("ml.inter", lambda r: "\t".join(map(str, r))),
  ],
)
def test_movielens_formats_parse_alike(tmp_path, name, fmt):
  header = {
    "ratings.csv": "userId,movieId,rating,timestamp\n",
    "ml.inter": "user_id:token\titem_id:token\trating:float\ttimestamp:float\n",
  }.get(name, "")
  path = _write(tmp_path, name, header + "\n".join(fmt(r) for r in ROWS) + "\n")
  ratings = data.load_ratings(path)
  cols = list(zip(*ROWS))
  np.testing.assert_array_equal(ratings.user, cols[0])
  np.testing.assert_array_equal(ratings.item, cols[1])
  np.testing.assert_array_equal(ratings.rating, cols[2])
  np.testing.assert_array_equal(ratings.timestamp, cols[3])
  assert ratings.user.dtype == ratings.timestamp.dtype == np.int64
  ml = data.MovieLens.from_file(path, eval_fraction=0.2)
  # Time-ordered: ts 800, 900, 1000, 1100 train; 1200 (the latest) evaluates.
  assert ml.num_train == 4 and ml.num_users == 3 and ml.num_items == 3
  np.testing.assert_array_equal(ml.label, [0, 0, 1, 1, 1])  # rating >= 4
  ev = list(ml.eval_batches(4))
  assert len(ev) == 1 and ev[0]["weight"].tolist() == [1, 0, 0, 0]
  tb = ml.train_batch(0, 4)
  assert sorted(tb["label"].tolist()) == [0, 0, 1, 1]  # one epoch = the train set
  assert set(tb["ids"]) == {"user", "item", "hour", "weekday", "history"}


def test_inter_columns_are_found_by_name(tmp_path):
  # Any order, other columns ignored; a float-typed timestamp may be integral.
  text = "item_id:token\tnote:token_seq\ttimestamp:float\tuser_id:token\trating:float\n"
  text += "".join(f"{i}\tx y\t{t}.0\t{u}\t{r}\n" for u, i, r, t in ROWS)
  ratings = data.load_ratings(_write(tmp_path, "a.inter", text))
  cols = list(zip(*ROWS))
  for got, want in zip(ratings, cols):
    np.testing.assert_array_equal(got, want)
  bad = _write(tmp_path, "b.inter", "user_id:token\titem_id:token\trating:float\n1\t2\t3\n")
  with pytest.raises(data.DataError, match=r"b.inter:1: the header .* has 0 timestamp columns"):
    data.load_ratings(bad)


def test_real_ml100k_inter_reads_as_its_u_data(tmp_path, request):
  inter = real_movielens.head(request.config, tmp_path, 3000)
  udata = real_movielens.head(request.config, tmp_path, 3000, name="u.data")
  a, b = data.load_ratings(inter), data.load_ratings(udata)
  assert len(a.user) == 3000
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  # u.data's first line (user 196 gave item 242 three stars).
  assert (a.user[0], a.item[0], a.rating[0], a.timestamp[0]) == (196, 242, 3.0, 881250949)


def test_validation_window_is_the_share_before_the_evaluation_window(tmp_path, request):
  path = real_movielens.head(request.config, tmp_path, 3000)
  full = data.MovieLens.from_file(path)
  val = data.MovieLens.from_file(path, validation_fraction=0.2)
  assert (full.window, val.window) == ("evaluation", "validation")
  assert (full.num_train, full.eval_size) == (2700, 300)
  # Train on the first 70% by time, evaluate the next 20%; the latest 10%
  # is never read.
  assert (val.num_train, val.eval_size) == (2100, 600) and len(val.label) == full.num_train
  for a in ("user", "item", "history", "label"):
    np.testing.assert_array_equal(getattr(val, a), getattr(full, a)[: full.num_train])
  (train, evaluated), (_, latest) = val.split_columns(), full.split_columns()
  assert len(train[2]) == 2100 and len(evaluated[2]) == 600 and len(latest[2]) == 300
  with pytest.raises(data.DataError, match=r"validation_fraction must be in \[0, 1 - eval"):
    data.MovieLens.from_file(path, validation_fraction=0.9)


def test_history_tokens_are_earlier_ratings_and_whether_liked(tmp_path):
  path = _write(tmp_path, "u.data", "1\t5\t5\t100\n1\t6\t2\t200\n2\t5\t1\t300\n1\t7\t3\t400\n")
  ml = data.MovieLens.from_file(path, eval_fraction=0.25, history_len=3)
  (hist,) = [f for f in ml.features if f.name == "history"]
  assert (hist.table, hist.num_rows, hist.bag_size, hist.combiner) == ("history", 6, 3, "mean")
  # Items 5, 6, 7 are 0, 1, 2; a token is 2 * item + liked (rating >= 4).
  np.testing.assert_array_equal(ml.history, [[-1, -1, -1], [1, -1, -1], [-1, -1, -1], [2, 1, -1]])
  assert [f.name for f in data.MovieLens.from_file(path, history_len=0).features] == [
    "user",
    "item",
    "hour",
    "weekday",
  ]


def test_movielens_errors_name_the_path_and_line(tmp_path):
  with pytest.raises(data.DataError, match=r"'/nope/u.data' does not exist"):
    data.load_ratings("/nope/u.data")
  path = _write(tmp_path, "u.data", "1\t2\t3\t4\n1\t2\t3\n")
  with pytest.raises(data.DataError, match=r"u.data:2: expected 4 fields .* got 3"):
    data.load_ratings(path)
  path = _write(tmp_path, "ratings.dat", "1::2::3::4\n1::x::3::4\n")
  with pytest.raises(data.DataError, match=r"ratings.dat:2: cannot parse"):
    data.load_ratings(path)
  path = _write(tmp_path, "ratings.csv", "userId,movieId,rating,timestamp\n")
  with pytest.raises(data.DataError, match=r"holds no ratings"):
    data.load_ratings(path)
  with pytest.raises(data.DataError, match=r"--data='hive' is not a known source"):
    data.from_flag("hive")


def test_auc_and_log_loss_against_direct_formulas():
  from pallas_emb.train import metrics

  rng = np.random.default_rng(0)
  s = np.round(rng.normal(size=300), 1)  # ties
  y = (rng.random(300) < 0.4).astype(np.float32)
  pos, neg = s[y > 0.5], s[y < 0.5]
  pairs = (pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean()
  assert metrics.auc(s, y) == pytest.approx(pairs)
  p = 1 / (1 + np.exp(-s))
  assert metrics.log_loss(s, y) == pytest.approx(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
  assert np.isnan(metrics.auc(s, np.ones(300)))


def test_movielens_needs_two_ratings(tmp_path):
  path = _write(tmp_path, "u.data", "1\t2\t5\t100\n")
  with pytest.raises(data.DataError, match=r"holds 1 rating; a train/eval split needs at least 2"):
    data.MovieLens.from_file(path)


def test_synthetic_eval_set_does_not_depend_on_the_batch_size():
  d = data.SyntheticClickLog(eval_examples=1000)
  a = np.concatenate([b["label"][b["weight"] > 0] for b in d.eval_batches(256)])
  b = np.concatenate([b["label"][b["weight"] > 0] for b in d.eval_batches(1000)])
  np.testing.assert_array_equal(a, b)


def test_movielens_raw_ids_are_the_files_own(tmp_path):
  # What --vocabulary=dynamic feeds a dynamic table: the file's user and item
  # ids of each example (padding stays -1); history tokens are not raw ids.
  path = _write(tmp_path, "u.data", "\n".join("\t".join(map(str, r)) for r in ROWS) + "\n")
  ml = data.MovieLens.from_file(path, eval_fraction=0.2)
  ids = ml.train_batch(0, 4)["ids"]
  users, items = ml.raw_ids("user", ids["user"]), ml.raw_ids("item", ids["item"])
  got = sorted((int(u), int(i)) for u, i in zip(users[:, 0], items[:, 0]))
  assert got == sorted((u, i) for u, i, _, ts in ROWS if ts < 1200)  # the 4 training ratings
  assert ml.raw_ids("user", np.array([[-1, 0]])).tolist() == [[-1, 1]]
  assert ml.raw_inputs == ("user", "item")


def test_movielens_ids_stay_integers_at_any_size(tmp_path):
  # Through float64, 2**53 and 2**53 + 1 are one number, and ids >= 2**63
  # do not fit int64: each must still be its own user.
  big = [2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64 + 5, 2**64 + 6]
  lines = [f"{u}\t{i}\t5\t{100 + k}" for k, (u, i) in enumerate(zip(big, reversed(big)))]
  path = _write(tmp_path, "u.data", "\n".join(lines) + "\n")
  ratings = data.load_ratings(path)
  assert list(ratings.user) == big
  ml = data.MovieLens.from_file(path, eval_fraction=0.5)
  assert ml.num_users == ml.num_items == len(big)
  assert sorted(ml.user.tolist()) == list(range(len(big)))
  # Sorted raw ids map to sorted dense ids: user k is the k-th largest.
  assert ml.user.tolist() == list(range(len(big)))


@pytest.mark.parametrize(
  "line,match",
  [
    ("1\t2\tnan\t100", r"u.data:2: rating 'nan' is not a finite number"),
    ("1\t2\tinf\t100", r"u.data:2: rating 'inf' is not a finite number"),
    ("1\t2\t4\tinf", r"u.data:2: timestamp 'inf' is not an integer"),
    ("1\t2\t4\tnan", r"u.data:2: timestamp 'nan' is not an integer"),
    ("1\t2\t4\t1.5", r"u.data:2: timestamp '1.5' is not an integer"),
    ("1\t2\t4\t1e30", r"u.data:2: timestamp '1e30' does not fit int64"),
    ("1\t2\t4\t99999999999999999999", r"u.data:2: timestamp '99999999999999999999' does not fit"),
    ("1.5\t2\t4\t100", r"u.data:2: cannot parse .* integer user and item ids"),
  ],
)
def test_movielens_non_finite_values_name_the_file_and_line(tmp_path, line, match):
  path = _write(tmp_path, "u.data", "1\t2\t4\t100\n" + line + "\n")
  with pytest.raises(data.DataError, match=match):
    data.load_ratings(path)


def test_movielens_integral_float_timestamps_are_accepted(tmp_path):
  path = _write(tmp_path, "ratings.csv", "userId,movieId,rating,timestamp\n1,2,4.5,978300760.0\n")
  assert data.load_ratings(path).timestamp.tolist() == [978300760]


@pytest.mark.parametrize("source", ["synthetic", "movielens"])
def test_a_process_reads_only_its_rows(tmp_path, source, monkeypatch, request):
  from pallas_emb.data.feed import ProcessRows  # pylint: disable=g-import-not-at-top

  if source == "synthetic":
    ds = data.SyntheticClickLog(num_users=100, num_items=50, eval_examples=200)
    counted = "_examples"
  else:
    # Real ml-100k's first 320 ratings: 288 train, the latest 32 evaluate.
    ds = data.MovieLens.from_file(real_movielens.head(request.config, tmp_path, 320))
    counted = "_batch"
  made = []
  original = getattr(type(ds), counted)

  def counting(self, *args):
    out = original(self, *args)
    made.append(len(out["label"]))
    return out

  monkeypatch.setattr(type(ds), counted, counting)
  # Process 1 of 2: the second half of each batch (the generator's two
  # blocks of 128 rows of a batch of 512).
  size = 512 if source == "synthetic" else 128
  half = size // 2
  whole = ds.train_batch(5, size)
  made.clear()
  src = ProcessRows(ds, size, half, size)
  rows = src[5]
  assert sum(made) == half and src.records_read == 1 and src.rows_read == half
  for k in whole["ids"]:
    np.testing.assert_array_equal(rows["ids"][k], whole["ids"][k][half:])
  np.testing.assert_array_equal(rows["label"], whole["label"][half:])
  # Held-out batches too: rows 8..15 of batch 1 of 16 (the set's examples
  # 24..31), and a last batch's rows past the end weigh 0.
  assert ds.eval_size in (200, 32)
  whole = list(ds.eval_batches(16))[1]
  made.clear()
  rows = ds.eval_rows(1, 16, 8, 16)
  # Its 8 rows only: MovieLens reads those, the generator makes the one
  # block of 128 that holds them (never the whole set of 200).
  assert sum(made) == (8 if source == "movielens" else 128)
  for k in whole["ids"]:
    np.testing.assert_array_equal(rows["ids"][k], whole["ids"][k][8:])
  np.testing.assert_array_equal(rows["label"], whole["label"][8:])
  assert rows["weight"].tolist() == [1.0] * 8
  past = ds.eval_rows(ds.eval_size // 16, 16, 0, 16)["weight"]
  assert past.tolist() == [1.0] * (ds.eval_size % 16) + [0.0] * (16 - ds.eval_size % 16)


def test_dlrm_rows_are_rows_of_its_batches():
  from pallas_emb.data.dlrm import DlrmClickLog  # pylint: disable=g-import-not-at-top

  d = DlrmClickLog(max_rows=1000, eval_examples=40)
  whole, rows = d.train_batch(2, 32), d.train_rows(2, 32, 16, 32)
  for k in whole["ids"]:
    np.testing.assert_array_equal(rows["ids"][k], whole["ids"][k][16:])
  np.testing.assert_array_equal(rows["dense"], whole["dense"][16:])
  # Held-out batch 2 of 16 holds the set's last 8 examples, then padding.
  batches = list(d.eval_batches(16))
  assert len(batches) == 3 and sum(b["weight"].sum() for b in batches) == 40
  rows = d.eval_rows(2, 16, 0, 8)
  np.testing.assert_array_equal(rows["label"], batches[2]["label"][:8])
  assert rows["weight"].tolist() == [1.0] * 8 and d.eval_rows(2, 16, 8, 16)["weight"].sum() == 0
