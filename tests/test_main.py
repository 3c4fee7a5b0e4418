"""The main job end to end: learning, checkpoints, resharding, multi-process."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from absl import app, flags
from conftest import child_env, small_trainer

import pallas_emb as pe
from pallas_emb.job import flags as job_flags
from pallas_emb.job import run as main_lib
from pallas_emb.job import supervisor
from pallas_emb.train.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_in_process(*args):
  flags.FLAGS.unparse_flags()
  # This process has 9 simulated devices (conftest); the job uses 8 of them.
  flags.FLAGS(["pallas_emb", "--devices=8", *args])
  return main_lib.run()


# Small jobs: the same batch shapes in every test, so they share compilations.
SMALL = ["--batch_size=128", "--log_every=1000", "--eval_batches=4"]


def _job(*args, timeout=300, env=None):
  """`python -m pallas_emb ...` bounded by a timeout that really kills
  (jax.distributed catches SIGTERM, hence -k)."""
  return subprocess.Popen(
    ["timeout", "-k", "5", str(timeout), sys.executable, "-m", "pallas_emb", *SMALL, *args],
    cwd=REPO,
    env={**child_env(), **(env or {})},
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _finish(proc):
  out, _ = proc.communicate()
  assert proc.returncode == 0, out[-3000:]
  return out


@pytest.mark.slow
def test_short_run_learns(tmp_path):
  # Measured: 150 steps of 512 reach eval AUC ~0.72 (the planted model's own
  # AUC is 0.83); 0.65 leaves room for seed-to-seed variation.
  report = _run_in_process(
    "--steps=150",
    "--batch_size=512",
    "--log_every=1000",
    f"--report_json={tmp_path}/r.json",
    f"--export_dir={tmp_path}/served",
  )
  saved = json.loads((tmp_path / "r.json").read_text())
  assert saved == json.loads(json.dumps(report))
  assert report["eval_auc"] > 0.65, report
  # Evaluated through the exported artifact too: the same logits.
  served = report["serving"]
  assert served["export_dir"] == str(tmp_path / "served") and served["examples"] > 0
  assert served["max_abs_logit_difference"] < 1e-5 and served["auc"] == report["eval_auc"]
  assert report["final_train_loss"] < report["initial_train_loss"] - 0.05
  for key in (
    "steps",
    "final_train_loss",
    "eval_auc",
    "eval_logloss",
    "examples_per_sec",
    "input_seconds",
    "emb_updates_skipped",
    "invalid_ids",
    "overflow_ids",
    "devices",
    "backend",
    "async_emb",
  ):
    assert key in report
  # Every part of the run after startup is some phase's: the last flush too
  # (its program compiles there).
  assert list(report["phases_seconds"]) == [
    "startup",
    "compile",
    "training",
    "flush",
    "export",
    "evaluation",
    "baselines",
  ], report["phases_seconds"]
  assert all(v >= 0 for v in report["phases_seconds"].values())
  assert report["devices"] == 8 and report["async_emb"] is True
  assert report["emb_updates_skipped"] == 0 and report["overflow_ids"] == 0


def test_dynamic_vocabulary_trains_checkpoints_resumes_evaluates_and_serves(tmp_path):
  dynamic = [*SMALL, "--vocabulary=dynamic", "--capacity=4096"]
  report = _run_in_process(*dynamic, "--steps=20", f"--export_dir={tmp_path}/served")
  # Stopped at step 10 and resumed: the maps come back with the tables, and
  # the run ends where the uninterrupted one did.
  _run_in_process(*dynamic, "--steps=10", f"--checkpoint_dir={tmp_path}/ckpt")
  resumed = _run_in_process(*dynamic, "--steps=20", f"--checkpoint_dir={tmp_path}/ckpt", "--resume")
  assert resumed["final_train_loss"] == report["final_train_loss"]
  assert resumed["eval_auc"] == report["eval_auc"]
  assert resumed["vocabularies"] == report["vocabularies"]
  vocab = report["vocabularies"]
  assert set(vocab) == {"user", "item"}  # category stays static
  assert 0 < vocab["item"]["occupancy"] <= 4096 and vocab["user"]["occupancy"] > 0
  counts = report["vocabulary_counts"]
  assert counts["inserts"] >= vocab["item"]["occupancy"] and counts["not_admitted"] > 0
  assert report["final_train_loss"] < report["initial_train_loss"]
  # The artifact holds the maps: served logits equal the training lookup's.
  assert report["serving"]["max_abs_logit_difference"] < 1e-5


def test_dynamic_vocabulary_refuses_row_ids():
  with pytest.raises(app.UsageError, match="--workload=dlrm"):
    _run_in_process("--vocabulary=dynamic", "--workload=dlrm")


def test_every_optimizer_flag_has_a_default_rate_and_ftrl_is_one():
  choices = flags.FLAGS["optimizer"].parser.enum_values
  assert "ftrl" in choices and sorted(job_flags.DEFAULT_LR) == sorted(choices)
  opt = job_flags.embedding_optimizer("ftrl")
  assert opt == pe.FTRL(5.0) and pe.supports_async_emb(opt)


def test_async_mode_refuses_the_optax_optimizer_before_training():
  with pytest.raises(pe.ConfigError, match="OptaxRows has no fused table update"):
    _run_in_process("--steps=1", "--optimizer=optax_adam")


@pytest.mark.slow
def test_library_errors_are_one_line_with_the_fix_and_no_traceback(tmp_path):
  unwritable = "/sys/fs/pallas_emb" if os.geteuid() == 0 else "/proc/pallas_emb"
  for args, error, fix in (
    ([f"--checkpoint_dir={unwritable}"], "CheckpointDirError", "or fix its permissions."),
    (["--data=nonsense"], "DataError", "use 'synthetic' or 'movielens:PATH'"),
  ):
    proc = _job(*args, timeout=120)
    out, _ = proc.communicate()
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("pallas_emb: ")]
    assert len(lines) == 1 and lines[0].startswith(f"pallas_emb: {error}: ") and fix in lines[0]
  # PALLAS_EMB_DEBUG=1 (or --debug) shows the traceback.
  proc = _job("--data=nonsense", timeout=120, env={"PALLAS_EMB_DEBUG": "1"})
  out, _ = proc.communicate()
  assert proc.returncode != 0 and "Traceback" in out and "DataError" in out, out[-3000:]


@pytest.mark.slow
def test_kill_and_resume_is_bit_identical(tmp_path, capsys):
  ckpt = tmp_path / "ckpt"
  run = ["--steps=40", "--eval_every=15"]
  common = [*run, f"--checkpoint_dir={ckpt}", "--checkpoint_every=10"]
  # The uninterrupted run and the resumes run here and share their
  # compiles; the run that is killed needs a process of its own.
  _run_in_process(*SMALL, *run, f"--save_tables={tmp_path}/ref.npz")
  victim = _job(*common)
  # SIGKILL at a random moment after the first checkpoint landed.
  deadline = time.time() + 240
  while not (ckpt.exists() and any(p.name.isdigit() for p in ckpt.iterdir())):
    assert victim.poll() is None and time.time() < deadline, victim.stdout.read()
    time.sleep(0.2)
  time.sleep(random.uniform(0.0, 2.0))
  victim.send_signal(signal.SIGKILL)  # the `timeout` wrapper: kill the job itself too
  subprocess.run(["pkill", "-9", "-f", f"--checkpoint_dir={ckpt}"], check=False)
  victim.communicate()
  capsys.readouterr()
  _run_in_process(*SMALL, *common, "--resume", f"--save_tables={tmp_path}/resumed.npz")
  assert "resumed from step" in capsys.readouterr().out
  ref, got = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "resumed.npz")
  assert sorted(ref) == sorted(got) == ["category", "item", "user"]
  for name in ref:
    np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
  # Damage the newest step: a resume skips it, says why, continues from the
  # newest intact step, and still ends bit-identical.
  newest = ckpt / "40"
  data = max(
    (p for p in newest.rglob("*") if p.is_file() and p.parent.name == "d"),
    key=lambda p: p.stat().st_size,
  )
  data.write_bytes(data.read_bytes()[:100])
  _run_in_process(*SMALL, *common, "--resume", f"--save_tables={tmp_path}/again.npz")
  out = capsys.readouterr().out
  assert "checkpoint step 40 is not intact, skipped (kept as 40.corrupt)" in out, out[-3000:]
  assert "resumed from step 30" in out
  got = np.load(tmp_path / "again.npz")
  for name in ref:
    np.testing.assert_array_equal(got[name], ref[name], err_msg=name)


def test_the_loop_reads_the_batch_after_next_while_a_step_runs():
  """`loop.train` reads batch t + 2 after it dispatched step t and before it
  waits for the step's loss; a checkpoint keeps the data position before
  that read, so a resume reads what an uninterrupted run would."""
  from types import SimpleNamespace

  from pallas_emb.job.build import Job
  from pallas_emb.job.loop import Loop, train
  from pallas_emb.job.run_log import RunLog
  from pallas_emb.train.best_eval import BestEval

  events = []

  class Batches:  # a grain iterator of batch indices
    def __init__(self, start):
      self.next_index = start

    def __next__(self):
      events.append(f"read {self.next_index}")
      self.next_index += 1
      return self.next_index - 1

    def get_state(self):
      return {"next_index": self.next_index}

  class Loss:  # a step's result, awaited when it is read
    def __init__(self, t):
      self.t = t

    def __float__(self):
      events.append(f"await {self.t}")
      return 0.5

  def step(state, batch, next_batch):
    events.append(f"step {batch} {next_batch}")
    return state, {"loss": Loss(batch), "emb": {}}

  def save(state, shapes, extra):
    events.append(f"save {extra['data_position']} {extra['data_iterator']}")

  flags.FLAGS.unparse_flags()
  flags.FLAGS(["pallas_emb", "--log_every=1000", "--checkpoint_every=2"])
  feeder = SimpleNamespace(
    train=lambda i: events.append(f"read {i}") or i, iterator=lambda state, start: Batches(start)
  )
  job = Job(
    None, SimpleNamespace(features=[]), "mlp", None, None, feeder, SimpleNamespace(step=step), 0, 4
  )
  loop = Loop(RunLog(4, 8, {}), BestEval(), SimpleNamespace(save=save), None)
  assert train(job, loop, 0, None).steps == 4
  assert events == [
    "read 0", "read 1",
    "step 0 1", "read 2", "await 0",
    "step 1 2", "read 3", "await 1", "save 2 {'next_index': 3}",
    "step 2 3", "read 4", "await 2",
    "step 3 4", "await 3", "save 4 {'next_index': 5}",
  ]  # fmt: skip


def _trainer(num_devices, layout="mod"):
  trainer, model, feeder = small_trainer(num_devices, layout)
  state = trainer.init(
    model.init(jax.random.key(1)), trainer.emb.init(jax.random.key(2)), feeder.train(0)
  )
  return trainer, state, feeder


@pytest.mark.slow
def test_restore_written_on_8_devices_onto_4(tmp_path):
  tr8, state8, feed8 = _trainer(8)
  for t in range(3):
    state8, _ = tr8.step(state8, feed8.train(t), feed8.train(t + 1))
  shapes = {f.name: (64, f.bag_size) for f in feed8.dataset.features}
  Checkpointer(str(tmp_path), tr8).save(state8, shapes)
  tr4, template, feed4 = _trainer(4)
  state4 = Checkpointer(str(tmp_path), tr4).restore(template, feed4.train)
  assert int(state4.step) == 3
  # Rows of 8 floats pack 16 to a 128-lane row where a shard's rows allow:
  # the item table's shards of 40 rows (8 devices) store rows, of 80 (4
  # devices) packed rows, so the restore repacked it.
  assert tr8.emb.member_states(state8.tables)["item"].table.shape[1] == 8
  assert tr4.emb.member_states(state4.tables)["item"].table.shape[1] == 128
  for name in ("user", "item", "category"):
    np.testing.assert_array_equal(
      tr4.emb.logical_table(state4.tables, name), tr8.emb.logical_table(state8.tables, name)
    )
    for k, v in tr8.emb.logical_slots(state8.tables, name).items():
      np.testing.assert_array_equal(tr4.emb.logical_slots(state4.tables, name)[k], v)
  # The pending update (step 2's gradient) survived the resharding: applying
  # it on 4 devices gives the table the 8-device run gets (to rounding: the
  # per-row sums are added in another order).
  state8, _ = tr8.flush(state8)
  state4, _ = tr4.flush(state4)
  for name in ("user", "item", "category"):
    np.testing.assert_allclose(
      tr4.emb.logical_table(state4.tables, name),
      tr8.emb.logical_table(state8.tables, name),
      rtol=1e-6,
      atol=1e-7,
    )


@pytest.mark.slow
def test_restore_into_another_layout_kind(tmp_path):
  # Same shard count, "mod" -> "range": rows must go through logical order.
  tr8, state8, feed8 = _trainer(8)
  for t in range(2):
    state8, _ = tr8.step(state8, feed8.train(t), feed8.train(t + 1))
  Checkpointer(str(tmp_path), tr8).save(
    state8, {f.name: (64, f.bag_size) for f in feed8.dataset.features}
  )
  tr_r, template, feed_r = _trainer(8, layout="range")
  restored = Checkpointer(str(tmp_path), tr_r).restore(template, feed_r.train)
  for name in ("user", "item", "category"):
    np.testing.assert_array_equal(
      tr_r.emb.logical_table(restored.tables, name), tr8.emb.logical_table(state8.tables, name)
    )


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  common = ["--steps=10"]
  # The one-process run in this process (8 of its devices).
  _run_in_process(
    *SMALL, *common, f"--save_tables={tmp_path}/sp.npz", f"--report_json={tmp_path}/sp.json"
  )
  port = _free_port()
  procs = [
    _job(
      *common,
      "--devices=4",
      "--num_processes=2",
      f"--process_id={i}",
      f"--coordinator_address=127.0.0.1:{port}",
      f"--save_tables={tmp_path}/mp.npz",
      f"--report_json={tmp_path}/mp.json",
      timeout=240,
    )
    for i in range(2)
  ]
  for p in procs:
    _finish(p)
  mp, sp = (json.loads((tmp_path / f).read_text()) for f in ("mp.json", "sp.json"))
  assert mp["processes"] == 2 and mp["devices"] == sp["devices"] == 8
  assert mp["eval_auc"] == pytest.approx(sp["eval_auc"], abs=1e-4)
  # Each process read only its half of every batch (SMALL: batches of 128).
  ((batches, rows),) = sp["input_reads"]
  assert rows == batches * 128
  assert mp["input_reads"] == [[batches, batches * 64]] * 2
  # And of every held-out batch (--eval_batches=4 of 128 rows, once).
  assert sp["eval_input_reads"] == [4 * 128] and mp["eval_input_reads"] == [4 * 64] * 2
  a, b = np.load(tmp_path / "mp.npz"), np.load(tmp_path / "sp.npz")
  for name in a:
    # Dense all-reduces run through gloo in another order: rounding only.
    np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_a_lost_process_is_named_with_the_last_checkpoint(tmp_path):
  ckpt, port = tmp_path / "ckpt", _free_port()
  procs = [
    _job(
      "--steps=100000",
      "--devices=4",
      "--num_processes=2",
      f"--process_id={i}",
      f"--coordinator_address=127.0.0.1:{port}",
      f"--checkpoint_dir={ckpt}",
      "--checkpoint_every=2",
      "--heartbeat_timeout=5",
      timeout=240,
    )
    for i in range(2)
  ]
  steps = lambda: [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.exists() else []
  deadline = time.time() + 200
  while not steps():
    assert all(p.poll() is None for p in procs) and time.time() < deadline, [
      p.stdout.read()[-2000:] for p in procs if p.poll() is not None
    ]
    time.sleep(0.2)
  # SIGKILL process 1 whole: `timeout`, its supervisor and its worker.
  os.killpg(procs[1].pid, signal.SIGKILL)
  killed = time.time()
  out, _ = procs[0].communicate(timeout=60)
  procs[1].wait()
  assert procs[0].returncode == supervisor.EXIT_PEER_LOST, out[-3000:]
  assert time.time() - killed < 30
  match = re.search(
    r"pallas_emb: lost process 1 of 2 .* process 0 stops too\. Last good "
    r"checkpoint: step (\d+) in (\S+); restart every process with --resume",
    out,
  )
  assert match, out[-3000:]
  assert int(match.group(1)) == max(steps()) and match.group(2) == str(ckpt)
