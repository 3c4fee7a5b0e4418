"""The main job on MovieLens-format data: the history feature without the
future, the baselines, epochs, evaluation cadence, the best step,
early stopping, TensorBoard and the progress line."""

import json
import os

import numpy as np
import pytest
from absl import flags

from pallas_emb import data
from pallas_emb.data.simulated_ratings import write_simulated_ratings
from pallas_emb.job import baselines
from pallas_emb.job import run as main_lib
from pallas_emb.train.best_eval import BestEval


def test_history_holds_only_earlier_positive_items():
  # user 0: items 10 (+, t=1), 11 (-, t=2), 12 (+, t=3), 13 (+, t=3), 14 (?, t=4)
  user = np.array([0, 0, 1, 0, 0, 0, 0])
  item = np.array([10, 11, 10, 12, 13, 14, 15])
  pos = np.array([1, 0, 1, 1, 1, 1, 0], bool)
  ts = np.array([1, 2, 2, 3, 3, 4, 5])
  h = data.movielens.user_histories(user, item, pos, ts, cap=2)
  np.testing.assert_array_equal(
    h,
    [
      [-1, -1],  # nothing before
      [10, -1],  # the earlier positive only
      [-1, -1],  # another user's items never
      [10, -1],  # a rating at the same time is not "before"
      [10, -1],
      [13, 12],  # newest first (12 and 13 tie at t=3, kept in file order)
      [14, 13],
    ],
  )  # capped at 2, the oldest dropped


def test_movielens_history_shares_the_item_table(tmp_path):
  path = tmp_path / "u.data"
  path.write_text("1\t5\t5\t100\n1\t6\t4\t200\n2\t5\t1\t300\n1\t7\t3\t400\n")
  ml = data.MovieLens.from_file(str(path), eval_fraction=0.25, history_len=3)
  (hist,) = [f for f in ml.features if f.name == "history"]
  assert hist.table == "item" and hist.bag_size == 3 and hist.num_rows == ml.num_items
  batch = ml.train_batch(0, 3)
  assert batch["ids"]["history"].shape == (3, 3)
  assert [f.name for f in data.MovieLens.from_file(str(path), history_len=0).features] == [
    "user",
    "item",
    "hour",
    "weekday",
  ]


def test_baselines_score_the_time_split(tmp_path):
  path = str(tmp_path / "u.data")
  write_simulated_ratings(path, num_users=300, num_items=150, ratings_per_user=30)
  ml = data.MovieLens.from_file(path)
  train, eval_ = (baselines.Columns(*c) for c in ml.split_columns())
  assert len(train.label) == ml.num_train and len(eval_.label) == len(ml.label) - ml.num_train
  pop, lr = baselines.run_baselines(train, eval_, ml.num_users, ml.num_items)
  # The planted model has user tastes: user and item ids beat popularity.
  assert lr["auc"] > pop["auc"] + 0.05 and lr["auc"] > 0.6, (pop, lr)
  assert 0 < lr["logloss"] < 0.7


def test_best_eval_keeps_the_lowest_logloss_and_stops_after_patience():
  best = BestEval(patience=2)
  assert best.add(10, {"logloss": 0.6, "auc": 0.6})
  assert not best.add(20, {"logloss": 0.61, "auc": 0.7})
  assert not best.should_stop
  assert not best.add(30, {"logloss": float("nan"), "auc": 0.5})
  assert best.should_stop and best.step == 10
  again = BestEval(patience=2)
  again.restore(json.loads(json.dumps(best.state())))
  assert again.state() == best.state() and again.should_stop


def _run_in_process(*args):
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["pallas_emb", "--devices=4", *args])
  return main_lib.run()


@pytest.mark.slow
def test_movielens_job_epochs_eval_best_step_and_tensorboard(tmp_path, capsys):
  path = str(tmp_path / "u.data")
  write_simulated_ratings(path, num_users=300, num_items=150, ratings_per_user=20)
  ml = data.MovieLens.from_file(path)
  ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
  report = _run_in_process(
    f"--data=movielens:{path}",
    "--epochs=2",
    "--batch_size=256",
    "--eval_every=8",
    "--log_every=8",
    "--emb_dim=8",
    "--backend=xla",
    "--early_stop_patience=50",
    f"--checkpoint_dir={ckpt}",
    f"--tensorboard_dir={tb}",
    f"--report_json={tmp_path}/r.json",
  )
  planned = int(np.ceil(2 * ml.num_train / 256))
  assert report["planned_steps"] == planned == report["steps"] and not report["stopped_early"]
  assert report["epochs"] == pytest.approx(planned * 256 / ml.num_train)
  evals = [h["step"] for h in report["eval_history"]]
  assert evals == list(range(8, planned, 8))
  best = min(
    report["eval_history"] + [{"step": planned, "logloss": report["eval_logloss"]}],
    key=lambda h: h["logloss"],
  )
  assert report["best_step"] == best["step"]
  assert report["best_eval"]["logloss"] == best["logloss"]
  assert sorted(int(p) for p in os.listdir(ckpt / "best") if p.isdigit()) == [best["step"]]
  assert [b["model"] for b in report["baselines"]] == [
    "item popularity",
    "logistic regression (user, item ids)",
  ]
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))
  out = capsys.readouterr().out
  assert "steps/s" in out and "ETA" in out and "baseline item popularity" in out


def test_epochs_and_steps_are_alternatives(tmp_path):
  with pytest.raises(Exception, match="--epochs and --steps both set"):
    _run_in_process("--data=synthetic", "--epochs=1", "--steps=3")
  with pytest.raises(Exception, match="--epochs needs a finite training set"):
    _run_in_process("--data=synthetic", "--epochs=1")
  flags.FLAGS.unparse_flags()
  with pytest.raises(flags.IllegalFlagValueError, match="--early_stop_patience needs --eval_every"):
    flags.FLAGS(["pallas_emb", "--early_stop_patience=2"])
