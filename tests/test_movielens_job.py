"""The main job on real MovieLens-100K (fetched: tests/real_movielens.py):
the history feature without the future, the factorization model, the
baselines, epochs, evaluation cadence, the best step, the validation window,
early stopping, TensorBoard and the progress line."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import real_movielens
from absl import flags
from conftest import make_mesh

import pallas_emb as pe
from pallas_emb import data
from pallas_emb.job import baselines
from pallas_emb.job import run as main_lib
from pallas_emb.job.factorization import Factorization, build_factorization
from pallas_emb.train.best_eval import BestEval


def test_history_holds_only_earlier_kept_tokens():
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


def test_baselines_on_real_ml100k(request):
  # The README's two baseline rows: the whole file, its time split.
  ml = data.MovieLens.from_file(real_movielens.path(request.config), history_len=0)
  assert (ml.num_train, ml.eval_size, ml.num_users, ml.num_items) == (90_000, 10_000, 943, 1682)
  train, eval_ = (baselines.Columns(*c) for c in ml.split_columns())
  pop, lr = baselines.run_baselines(train, eval_, ml.num_users, ml.num_items)
  assert pop["auc"] == pytest.approx(0.6470, abs=5e-4), pop
  assert lr["auc"] == pytest.approx(0.7279, abs=5e-4), lr
  assert lr["logloss"] == pytest.approx(0.6016, abs=5e-4), lr


def test_factorization_reads_history_and_biases(tmp_path, request):
  ml = data.MovieLens.from_file(real_movielens.head(request.config, tmp_path, 2000), history_len=4)
  opt = pe.RowWiseAdagrad(0.1, eps=1e-8, half_life_steps=None)
  emb, model, inputs = build_factorization(ml, make_mesh(4), emb_dim=8, optimizer=opt)
  assert [(t.name, t.num_rows, t.dim) for t in emb.tables] == [
    ("item", ml.num_items, 8),
    ("history", 2 * ml.num_items, 8),
    ("user_bias", ml.num_users, 1),
    ("item_bias", ml.num_items, 1),
    ("history_bias", 2 * ml.num_items, 1),
  ]
  assert len(emb.table_names) == 2  # the vectors stack, and so do the biases
  assert model == Factorization("history", ("user_bias", "item_bias", "history_bias"), 0.01)
  # Each bias reads its vector's ids; the batches carry nothing else.
  rows, ev = inputs.train_rows(3, 64, 16, 48), ml.train_rows(3, 64, 16, 48)
  assert set(rows["ids"]) == {"item", "history", "user_bias", "item_bias", "history_bias"}
  np.testing.assert_array_equal(rows["ids"]["user_bias"], ev["ids"]["user"])
  np.testing.assert_array_equal(rows["ids"]["history_bias"], ev["ids"]["history"])
  assert inputs.eval_size == ml.eval_size and inputs.train_size == ml.train_size
  # logit = b + sum of the biases + <history, item>.
  rng = np.random.default_rng(0)
  acts = {
    f.name: jnp.asarray(rng.normal(size=(5, 8 if f.table in ("item", "history") else 1)))
    for f in inputs.features
  }
  want = (
    0.5
    + sum(acts[f][:, 0] for f in model.biases)
    + np.sum(np.asarray(acts["history"]) * np.asarray(acts["item"]), axis=1)
  )
  np.testing.assert_allclose(model.logits({"bias": 0.5}, acts), want, rtol=1e-5, atol=1e-6)
  # Without a history, the user's vector is the query.
  no_hist = data.MovieLens.from_file(
    real_movielens.head(request.config, tmp_path, 2000), history_len=0
  )
  _, plain, _ = build_factorization(no_hist, make_mesh(4), emb_dim=8, optimizer=opt)
  assert plain.query == "user" and plain.biases == ("user_bias", "item_bias")


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
def test_movielens_job_epochs_eval_best_step_and_tensorboard(tmp_path, capsys, request):
  path = real_movielens.head(request.config, tmp_path, 3000)
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
  assert (report["model"], report["eval_window"]) == ("factorization", "evaluation")
  # The held-out rows were read per process like the training rows: here
  # one process read every padded eval batch, each time.
  batches = -(-ml.eval_size // 256)
  assert report["eval_input_reads"] == [batches * 256 * (len(evals) + 1)]
  assert report["best_eval"]["examples"] == ml.eval_size == 300
  out = capsys.readouterr().out
  assert "steps/s" in out and "ETA" in out and "baseline item popularity" in out
  assert "factorization model" in out and "evaluating the evaluation window" in out


@pytest.mark.slow
def test_movielens_job_validation_window_and_the_mlp(tmp_path, request):
  path = real_movielens.head(request.config, tmp_path, 5000)
  report = _run_in_process(
    f"--data=movielens:{path}",
    "--steps=3",
    "--batch_size=256",
    "--emb_dim=8",
    "--backend=xla",
    "--model=mlp",
    "--validation_fraction=0.2",
    "--nobaselines",
  )
  # Trained on the first 70% by time, evaluated on the next 20%.
  assert (report["model"], report["eval_window"]) == ("mlp", "validation")
  assert report["best_eval"]["examples"] == 1000 and report["baselines"] == []


def test_epochs_and_steps_are_alternatives(tmp_path):
  with pytest.raises(Exception, match="--epochs and --steps both set"):
    _run_in_process("--data=synthetic", "--epochs=1", "--steps=3")
  with pytest.raises(Exception, match="--epochs needs a finite training set"):
    _run_in_process("--data=synthetic", "--epochs=1")
  flags.FLAGS.unparse_flags()
  with pytest.raises(flags.IllegalFlagValueError, match="--early_stop_patience needs --eval_every"):
    flags.FLAGS(["pallas_emb", "--early_stop_patience=2"])
