"""The main job: train and evaluate a ranking model with sharded tables.

    python -m pallas_emb                       # synthetic click log, 8 CPU devices
    python -m pallas_emb --data=movielens:ml-100k/u.data --steps=2000
    python -m pallas_emb --checkpoint_dir=/tmp/run --checkpoint_every=100 --resume
    python -m pallas_emb --workload=dlrm [--stacking=off]   # 26 Criteo-shaped tables

Every categorical feature is looked up from a row-sharded table; the tables
are trained with the fused asynchronous update (one step stale, like the
reference) unless --noasync_emb or --exact_emb; the MLP with optax Adam.
"""

from __future__ import annotations

import json
import logging as std_logging
import os
import time
from typing import Any, NamedTuple

from absl import app, flags, logging
import jax
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb import data as data_lib
from pallas_emb import host_memory
from pallas_emb.data.dlrm import DlrmClickLog
from pallas_emb.data.feed import GlobalBatches
from pallas_emb.model import build_ranking
from pallas_emb.train import metrics
from pallas_emb.train.checkpoint import Checkpointer
from pallas_emb.train.checkpoint_dir import check_writable

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 500, "Training steps.")
flags.DEFINE_integer("batch_size", 1024, "Global batch size (a multiple of the device count).")
flags.DEFINE_string("data", "synthetic", "'synthetic' or 'movielens:PATH' (u.data, ratings.dat, ratings.csv).")
flags.DEFINE_integer("devices", None, "Devices per process in the mesh (default: all of them; on CPU "
                     "8 simulated devices, or this many).")
flags.DEFINE_enum("backend", None, ["xla", "native", "interpret", "pallas"],
                  "Kernel backend; default: pallas on TPU, native on CPU (when its library is built), "
                  "xla elsewhere.")
flags.DEFINE_bool("async_emb", True, "Train tables with the fused asynchronous update (--noasync_emb: synchronous sparse update).")
flags.DEFINE_bool("exact_emb", False, "With --async_emb, apply each step's embedding gradient within the step (no staleness).")
flags.DEFINE_enum("optimizer", "rowwise_adagrad", ["rowwise_adagrad", "adagrad", "sgd", "lazy_adam", "ftrl", "optax_adam"],
                  "Embedding optimizer (optax_adam has no fused update: it needs --noasync_emb).")
flags.DEFINE_float("emb_learning_rate", None, "Embedding learning rate; default per optimizer.")
flags.DEFINE_float("dense_learning_rate", 1e-3, "Adam learning rate of the MLP.")
flags.DEFINE_integer("emb_dim", 16, "Width of every embedding table (--workload=dlrm: by vocabulary).")
flags.DEFINE_enum("workload", "default", ["default", "dlrm"], "default: the tables of --data; dlrm: "
                  "26 Criteo-shaped tables (rows capped by --dlrm_max_rows, D=16..128, "
                  "pallas_emb.data.dlrm) with synthetic clicks.")
flags.DEFINE_integer("dlrm_max_rows", 20_000, "--workload=dlrm: cap of every table's rows (0: Criteo's).")
flags.DEFINE_enum("stacking", "auto", ["auto", "off"], "Store tables of equal dim and optimizer as one "
                  "(pallas_emb.stacking) or each alone.")
flags.DEFINE_string("checkpoint_dir", None, "Directory for orbax checkpoints.")
flags.DEFINE_integer("checkpoint_every", 0, "Checkpoint every N steps (0: only at the end, if --checkpoint_dir).")
flags.DEFINE_bool("resume", False, "Continue from the latest checkpoint in --checkpoint_dir.")
flags.DEFINE_integer("eval_every", 0, "Evaluate every N steps (0: only at the end).")
flags.DEFINE_integer("eval_batches", 0, "Evaluate on at most this many batches (0: the whole held-out set).")
flags.DEFINE_integer("log_every", 50, "Print progress every N steps.")
flags.DEFINE_string("report_json", None, "Write the final report to this JSON file.")
flags.DEFINE_string("save_tables", None, "Write the final tables (logical row order) to this .npz file.")
flags.DEFINE_integer("seed", 0, "Seed of the data and the initial parameters.")
flags.DEFINE_bool("keep_freed_memory", True, "Keep freed heap memory between steps (XLA:CPU "
                  "reallocates its temporaries each step; see pallas_emb.host_memory).")
flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0 (or JAX_COORDINATOR_ADDRESS).")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes (or JAX_NUM_PROCESSES).")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index (or JAX_PROCESS_ID).")
flags.DEFINE_integer("heartbeat_timeout", 10, "Multi-host: seconds without a heartbeat after which a "
                     "process counts as lost (a process that dies is noticed within about a second).")


def _require(name: str, ok, limit: str, fix: str) -> None:
  """Refuses --name unless ok(value), at parse time, before JAX sees it."""
  flags.register_validator(name, ok, message=f"--{name} must be {limit}; {fix}")


for _name, _low, _fix in (
    ("steps", 1, "it is the number of training steps"),
    ("batch_size", 1, "it is the global batch (a multiple of the device count)"),
    ("emb_dim", 1, "it is the width of every table"),
    ("log_every", 1, "it is the progress period in steps"),
    ("checkpoint_every", 0, "0 checkpoints only at the end"),
    ("eval_every", 0, "0 evaluates only at the end"),
    ("eval_batches", 0, "0 evaluates the whole held-out set"),
    ("seed", 0, "it seeds the data and the initial parameters"),
    ("heartbeat_timeout", 1, "it is in seconds"),
    ("devices", 1, "omit it to use every device of the process"),
    ("num_processes", 1, "omit it for one process"),
    ("process_id", 0, "it counts from 0")):
  _require(_name, lambda v, low=_low: v is None or v >= low, f"an integer >= {_low}", _fix)
for _name, _fix in (("emb_learning_rate", "omit it for the optimizer's default"),
                   ("dense_learning_rate", "it is Adam's step size for the MLP")):
  _require(_name, lambda v: v is None or (np.isfinite(v) and v >= 0),
           "a finite number >= 0", _fix)
flags.register_multi_flags_validator(
    ["process_id", "num_processes"],
    lambda f: None in (f["process_id"], f["num_processes"]) or f["process_id"] < f["num_processes"],
    message="--process_id must be below --num_processes; processes are numbered 0 .. N-1.")
flags.register_multi_flags_validator(
    ["resume", "checkpoint_dir"], lambda f: not f["resume"] or f["checkpoint_dir"],
    message="--resume needs --checkpoint_dir: the directory to resume from.")

# FTRL's rate is lr / sqrt(accumulator) and its first touch replaces a row's
# initial value: on the synthetic log (500 steps) eval AUC rose from 0.728 at
# lr 0.05 to 0.752 at 5.0 (row-wise Adagrad at 0.05: 0.755).
_DEFAULT_LR = {"rowwise_adagrad": 0.05, "adagrad": 0.05, "sgd": 0.5,
               "lazy_adam": 0.005, "ftrl": 5.0, "optax_adam": 0.005}


def _log(*args) -> None:
  if jax.process_index() == 0:
    print(*args, flush=True)


def _maybe_initialize_distributed() -> None:
  address = FLAGS.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  num = FLAGS.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
  if not address and not num:
    return
  pid = FLAGS.process_id
  if pid is None and "JAX_PROCESS_ID" in os.environ:
    pid = int(os.environ["JAX_PROCESS_ID"])
  if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
    # CPU processes exchange collectives through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # A lost process is noticed by the coordination service, which then stops
  # the others; `supervisor` names it and the last checkpoint.
  jax.distributed.initialize(coordinator_address=address, num_processes=num or None,
                             process_id=pid,
                             heartbeat_timeout_seconds=FLAGS.heartbeat_timeout)


def _embedding_optimizer(name: str, lr: float):
  return {"rowwise_adagrad": lambda: pe.RowWiseAdagrad(lr, eps=1e-8, half_life_steps=None),
          "adagrad": lambda: pe.Adagrad(lr),
          "sgd": lambda: pe.SGD(lr),
          "lazy_adam": lambda: pe.LazyAdam(lr),
          "ftrl": lambda: pe.FTRL(lr),
          "optax_adam": lambda: pe.OptaxRows(optax.adam(lr))}[name]()


def evaluate(trainer, state, feeder: GlobalBatches, max_batches: int = 0) -> dict:
  """AUC and log-loss of the held-out set (every process gets the result)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  scores, labels, weights = [], [], []
  for k, (batch, host) in enumerate(feeder.eval()):
    if max_batches and k == max_batches:
      break
    _, aux = trainer.evaluate(state, batch)
    scores.append(np.asarray(multihost_utils.process_allgather(aux["logits"], tiled=True)))
    labels.append(host["label"])
    weights.append(host["weight"])
  s, y, w = (np.concatenate(x) for x in (scores, labels, weights))
  keep = w > 0
  return {"auc": metrics.auc(s[keep], y[keep]), "logloss": metrics.log_loss(s[keep], y[keep]),
          "examples": int(keep.sum())}


def _setup() -> jax.sharding.Mesh:
  """Process-wide settings, multi-host initialisation and the mesh."""
  if FLAGS.keep_freed_memory:
    host_memory.keep_freed_memory()
  if FLAGS["verbosity"].using_default_value:
    # JAX's INFO lines (e.g. "Unable to initialize backend 'tpu'") drown the
    # progress; -v 0 brings them back.
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("jax").setLevel(std_logging.WARNING)
  _maybe_initialize_distributed()
  devices = jax.devices()
  local = jax.local_device_count()
  if FLAGS.devices is not None and FLAGS.devices > local:
    raise app.UsageError(f"--devices={FLAGS.devices} but this process has only {local} devices.")
  if jax.process_count() > 1:
    mesh_devices = devices  # every process brings all its devices
  else:
    mesh_devices = devices[:FLAGS.devices or len(devices)]
  for what, n in (("devices of the mesh", len(mesh_devices)),
                  ("processes", jax.process_count())):
    if FLAGS.batch_size % n:
      raise app.UsageError(f"--batch_size={FLAGS.batch_size} must be a multiple of the "
                           f"{n} {what}.")
  return jax.sharding.Mesh(np.array(mesh_devices), ("x",))


class _Job(NamedTuple):
  """What a run trains: data, tables, model, trainer and its batches."""

  dataset: Any
  emb: pe.ShardedEmbedding
  config: pe.TrainConfig
  feeder: GlobalBatches
  trainer: pe.Trainer
  state: pe.TrainState


def _build(mesh) -> _Job:
  if FLAGS.workload == "dlrm":
    dataset = DlrmClickLog(max_rows=FLAGS.dlrm_max_rows or None, seed=FLAGS.seed)
  else:
    dataset = data_lib.from_flag(FLAGS.data, seed=FLAGS.seed)
  lr = (_DEFAULT_LR[FLAGS.optimizer] if FLAGS.emb_learning_rate is None
        else FLAGS.emb_learning_rate)
  emb, model = build_ranking(dataset, mesh, emb_dim=FLAGS.emb_dim,
                             optimizer=_embedding_optimizer(FLAGS.optimizer, lr),
                             backend=FLAGS.backend, stacking=FLAGS.stacking)
  config = pe.TrainConfig(use_async_emb=FLAGS.async_emb,
                          exact=FLAGS.exact_emb and FLAGS.async_emb)
  feeder = GlobalBatches(dataset, FLAGS.batch_size, emb.sharding())
  trainer = pe.make_trainer(emb, model.loss, optax.adam(FLAGS.dense_learning_rate),
                            config, feeder.train(0))
  key = jax.random.key(FLAGS.seed)
  state = trainer.init(model.init(jax.random.fold_in(key, 1)),
                       emb.init(jax.random.fold_in(key, 2)), feeder.train(0))
  return _Job(dataset, emb, config, feeder, trainer, state)


class _Progress:
  """Counters of the embedding metrics and the timed throughput."""

  def __init__(self, counters: dict):
    self.counters = {"skipped": 0, "invalid": 0, "overflow": 0, **counters}
    self.examples, self.seconds = 0, 0.0

  def add(self, m: dict, elapsed: float, timed: bool) -> None:
    if timed:  # the first step compiles
      self.examples += FLAGS.batch_size
      self.seconds += elapsed
    for tm in m["emb"].values():
      self.counters["skipped"] += int(tm["skipped"])
      self.counters["invalid"] += int(tm["invalid_ids"])
      self.counters["overflow"] += int(tm["overflow_ids"])

  @property
  def rate(self) -> float | None:
    return self.examples / self.seconds if self.seconds else None


def _train(job: _Job, ckpt, start: int, progress: _Progress):
  """Steps start..--steps -> (state, last loss, initial loss, eval history)."""
  state, feeder, trainer = job.state, job.feeder, job.trainer
  batch_shapes = {f.name: (FLAGS.batch_size, f.bag_size) for f in job.dataset.features}
  loss = initial_loss = float("nan")
  history = []
  batch = feeder.train(start)
  for t in range(start, FLAGS.steps):
    next_batch = feeder.train(t + 1)
    tic = time.perf_counter()
    state, m = trainer.step(state, batch, next_batch)
    loss = float(m["loss"])  # blocks: the step is done
    if t == start:
      initial_loss = loss
    progress.add(m, time.perf_counter() - tic, timed=t > start)
    batch = next_batch
    done = t + 1
    if done % FLAGS.log_every == 0 or done == FLAGS.steps:
      norms = " ".join(f"{k}={float(v['grad_norm']):.3g}" for k, v in m["emb"].items())
      rate = progress.rate or float("nan")
      _log(f"step {done:6d}  loss {loss:.4f}  {rate:9.0f} ex/s  emb grad norm {norms}  "
           f"skipped {progress.counters['skipped']}")
    if FLAGS.eval_every and done % FLAGS.eval_every == 0 and done < FLAGS.steps:
      state, _ = trainer.flush(state)
      ev = evaluate(trainer, state, feeder, FLAGS.eval_batches)
      history.append({"step": done, **ev})
      _log(f"eval at step {done}: auc {ev['auc']:.4f}  logloss {ev['logloss']:.4f}")
    last = done == FLAGS.steps
    periodic = FLAGS.checkpoint_every and done % FLAGS.checkpoint_every == 0
    if ckpt is not None and (periodic or (last and done > start)):
      ckpt.save(state, batch_shapes, {"data_position": done,
                                      "counters": dict(progress.counters)})
  return state, loss, initial_loss, history


def run(argv=()) -> dict:
  """Trains per FLAGS and returns the report."""
  del argv
  if FLAGS.checkpoint_dir:
    check_writable(FLAGS.checkpoint_dir)  # before anything compiles
  mesh = _setup()
  job = _build(mesh)
  emb, config = job.emb, job.config
  ckpt = Checkpointer(FLAGS.checkpoint_dir, job.trainer) if FLAGS.checkpoint_dir else None
  start, counters = 0, {}
  if FLAGS.resume and ckpt.latest_step() is not None:
    restored = ckpt.restore_verified(job.state, job.feeder.train)
    for step, why in restored.skipped:
      _log(f"checkpoint step {step} is not intact, skipped (kept as {step}.corrupt): {why}")
    job = job._replace(state=restored.state)
    start = restored.step
    counters = restored.meta["extra"].get("counters", {})
    _log(f"resumed from step {start} of {ckpt.directory}")

  _log(f"pallas_emb: {'dlrm' if FLAGS.workload == 'dlrm' else FLAGS.data}, {mesh.size} devices ({jax.process_count()} processes), "
       f"backend {emb.backend}, {'exact ' if config.exact else ''}"
       f"{'async' if config.use_async_emb else 'sync'} embedding update, "
       f"{FLAGS.optimizer}, tables " + ", ".join(f"{t.name}:{t.num_rows}x{t.dim}" for t in emb.tables)
       + f" stored as {len(emb.table_names)} physical tables (--stacking={FLAGS.stacking})")
  progress = _Progress(counters)
  try:
    state, loss, initial_loss, history = _train(job, ckpt, start, progress)
  except Exception:
    if jax.process_count() > 1:
      # A collective with a lost peer fails at once, a moment before the
      # coordination service stops this process and names the lost one
      # (see `supervisor`): let it, rather than exit with the bare error.
      print(f"process {jax.process_index()}: a step failed; waiting for the "
            "coordination service's verdict on the other processes", flush=True)
      time.sleep(FLAGS.heartbeat_timeout + 5)
    raise
  state, _ = job.trainer.flush(state)  # the last gradient reaches the tables
  ev = evaluate(job.trainer, state, job.feeder, FLAGS.eval_batches)
  _log(f"final: step {FLAGS.steps}  train loss {loss:.4f}  eval auc {ev['auc']:.4f}  "
       f"logloss {ev['logloss']:.4f}  ({ev['examples']} eval examples)")
  report = {
      "steps": FLAGS.steps, "final_train_loss": loss,
      "initial_train_loss": initial_loss, "eval_auc": ev["auc"],
      "eval_logloss": ev["logloss"], "examples_per_sec": progress.rate,
      "emb_updates_skipped": progress.counters["skipped"],
      "invalid_ids": progress.counters["invalid"],
      "overflow_ids": progress.counters["overflow"],
      "devices": mesh.size, "backend": emb.backend, "async_emb": config.use_async_emb,
      "exact_emb": config.exact, "optimizer": FLAGS.optimizer, "data": FLAGS.data,
      "processes": jax.process_count(), "eval_history": history,
  }
  _write_outputs(emb, state, report)
  return report


def _write_outputs(emb, state, report: dict) -> None:
  if FLAGS.save_tables:
    tables = {t.name: emb.logical_table(state.tables, t.name).astype(np.float32)
              for t in emb.tables}
    if jax.process_index() == 0:
      np.savez(FLAGS.save_tables, **tables)
  if FLAGS.report_json and jax.process_index() == 0:
    with open(FLAGS.report_json, "w") as f:
      json.dump(report, f, indent=2)


def main(argv):
  run(argv)
