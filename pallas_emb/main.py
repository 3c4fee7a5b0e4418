"""The main job: train and evaluate a ranking model with sharded tables.

    python -m pallas_emb                       # synthetic click log, 8 CPU devices
    python -m pallas_emb --data=movielens:ml-1m/ratings.dat --epochs=3 --eval_every=200 \
        --early_stop_patience=3 --checkpoint_dir=/tmp/run --tensorboard_dir=/tmp/tb
    python -m pallas_emb --checkpoint_dir=/tmp/run --checkpoint_every=100 --resume
    python -m pallas_emb --workload=dlrm [--stacking=off]   # 26 Criteo-shaped tables

With --eval_every the report names the best evaluation (lowest eval log-loss)
and its step, kept in CHECKPOINT_DIR/best. On MovieLens the job also scores
two baselines on the same time split (item popularity, logistic regression on
user and item ids). Tables train with the fused asynchronous update (one step
stale, like the reference) unless --noasync_emb or --exact_emb; the MLP with
optax Adam.
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
from pallas_emb import evaluation, host_memory
from pallas_emb.data.dlrm import DlrmClickLog
from pallas_emb.data.feed import GlobalBatches
from pallas_emb.model import build_ranking
from pallas_emb.run_log import RunLog
from pallas_emb.train.best_eval import BestEval
from pallas_emb.train.checkpoint import Checkpointer
from pallas_emb.train.checkpoint_dir import check_writable

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 500, "Training steps.")
flags.DEFINE_float("epochs", None, "Train for this many passes over the training set instead of "
                   "--steps (datasets with a finite training set: MovieLens).")
flags.DEFINE_integer("early_stop_patience", 0, "Stop after this many evaluations (--eval_every) "
                     "in a row without a lower eval log-loss (0: never).")
flags.DEFINE_string("tensorboard_dir", None, "Write TensorBoard scalars (tensorboardX) here.")
flags.DEFINE_integer("history_len", 16, "MovieLens: items in the user-history bag (0: no history).")
flags.DEFINE_bool("baselines", True, "MovieLens: also score item popularity and a logistic "
                  "regression on user and item ids on the same split.")
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
    ("early_stop_patience", 0, "0 never stops early"),
    ("history_len", 0, "0 drops the history feature"),
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
_require("epochs", lambda v: v is None or (np.isfinite(v) and v > 0), "a finite number > 0",
         "omit it to train for --steps")
flags.register_multi_flags_validator(
    ["early_stop_patience", "eval_every"],
    lambda f: not f["early_stop_patience"] or f["eval_every"],
    message="--early_stop_patience needs --eval_every: it counts evaluations without progress.")
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
  steps: int


def _build(mesh) -> _Job:
  if FLAGS.workload == "dlrm":
    dataset = DlrmClickLog(max_rows=FLAGS.dlrm_max_rows or None, seed=FLAGS.seed)
  else:
    dataset = data_lib.from_flag(FLAGS.data, seed=FLAGS.seed,
                                 history_len=FLAGS.history_len)
  steps = _total_steps(dataset)  # refuses --epochs before anything compiles
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
  return _Job(dataset, emb, config, feeder, trainer, state, steps)


def _total_steps(dataset) -> int:
  """--steps, or --epochs passes over the training set."""
  if FLAGS.epochs is None:
    return FLAGS.steps
  if FLAGS["steps"].present:
    raise app.UsageError("--epochs and --steps both set; give one: --epochs counts passes "
                         "over the training set, --steps counts batches.")
  size = getattr(dataset, "train_size", None)
  if size is None:
    raise app.UsageError(f"--epochs needs a finite training set; {FLAGS.data!r} is an endless "
                         "stream: give --steps.")
  return max(1, int(np.ceil(FLAGS.epochs * size / FLAGS.batch_size)))


class _Loop(NamedTuple):
  """What the loop keeps beside the state: its log, the best evaluation,
  the checkpointers (latest, best)."""

  log: RunLog
  best: BestEval
  ckpt: Any
  best_ckpt: Any


def _evaluate_at(job: _Job, loop: _Loop, state, done: int, batch_shapes, history):
  """Flushes, evaluates, records; keeps the best step's checkpoint."""
  state, _ = job.trainer.flush(state)
  ev = evaluation.evaluate(job.trainer, state, job.feeder, FLAGS.eval_batches)
  history.append({"step": done, **ev})
  loop.log.eval(done, ev)
  improved = loop.best.add(done, ev)
  _log(f"eval at step {done}: auc {ev['auc']:.4f}  logloss {ev['logloss']:.4f}"
       + ("  (best)" if improved else f"  (best: step {loop.best.step})"))
  if improved and loop.best_ckpt is not None:
    loop.best_ckpt.save(state, batch_shapes, {"data_position": done, "eval": ev})
  return state


def _train(job: _Job, loop: _Loop, start: int, data_state: dict | None):
  """Steps start..job.steps (or an early stop) -> (state, last loss,
  initial loss, eval history, last step)."""
  state, feeder, trainer, log = job.state, job.feeder, job.trainer, loop.log
  batch_shapes = {f.name: (FLAGS.batch_size, f.bag_size) for f in job.dataset.features}
  loss = initial_loss = float("nan")
  history = []
  # The batches come from this process's grain iterator; its state goes
  # into each checkpoint, so a resumed run reads what this one would.
  batch, done = feeder.train(start), start
  batches = feeder.iterator(data_state, start=start + 1)
  for t in range(start, job.steps):
    next_batch = next(batches)
    tic = time.perf_counter()
    state, m = trainer.step(state, batch, next_batch)
    loss = float(m["loss"])  # blocks: the step is done
    if t == start:
      initial_loss = loss
    done = t + 1
    log.add(done, m, time.perf_counter() - tic, timed=t > start)
    batch = next_batch
    if done % FLAGS.log_every == 0 or done == job.steps:
      norms = " ".join(f"{k}={float(v['grad_norm']):.3g}" for k, v in m["emb"].items())
      _log(log.line(done, loss, norms))
    if FLAGS.eval_every and done % FLAGS.eval_every == 0 and done < job.steps:
      state = _evaluate_at(job, loop, state, done, batch_shapes, history)
    last = done == job.steps or loop.best.should_stop
    periodic = FLAGS.checkpoint_every and done % FLAGS.checkpoint_every == 0
    if loop.ckpt is not None and (periodic or (last and done > start)):
      loop.ckpt.save(state, batch_shapes, {"data_position": done,
                                           "data_iterator": batches.get_state(),
                                           "counters": dict(log.counters),
                                           "best": loop.best.state()})
    if loop.best.should_stop:
      _log(f"early stop at step {done}: {loop.best.since_best} evaluations without a lower "
           f"eval log-loss than step {loop.best.step}'s")
      break
  return state, loss, initial_loss, history, done


def run(argv=()) -> dict:
  """Trains per FLAGS and returns the report."""
  del argv
  if FLAGS.checkpoint_dir:
    check_writable(FLAGS.checkpoint_dir)  # before anything compiles
  mesh = _setup()
  job = _build(mesh)
  emb, config = job.emb, job.config
  ckpt = best_ckpt = None
  if FLAGS.checkpoint_dir:
    ckpt = Checkpointer(FLAGS.checkpoint_dir, job.trainer)
    best_ckpt = Checkpointer(os.path.join(FLAGS.checkpoint_dir, "best"), job.trainer,
                             max_to_keep=1)
  start, counters, best, data_state = 0, {}, BestEval(FLAGS.early_stop_patience), None
  if FLAGS.resume and ckpt.latest_step() is not None:
    restored = ckpt.restore_verified(job.state, job.feeder.train)
    for step, why in restored.skipped:
      _log(f"checkpoint step {step} is not intact, skipped (kept as {step}.corrupt): {why}")
    job = job._replace(state=restored.state)
    start = restored.step
    counters = restored.meta["extra"].get("counters", {})
    best.restore(restored.meta["extra"].get("best"))
    data_state = restored.meta["extra"].get("data_iterator")
    _log(f"resumed from step {start} of {ckpt.directory}")

  _log(f"pallas_emb: {'dlrm' if FLAGS.workload == 'dlrm' else FLAGS.data}, {mesh.size} devices ({jax.process_count()} processes), "
       f"backend {emb.backend}, {'exact ' if config.exact else ''}"
       f"{'async' if config.use_async_emb else 'sync'} embedding update, "
       f"{FLAGS.optimizer}, {job.steps} steps, tables "
       + ", ".join(f"{t.name}:{t.num_rows}x{t.dim}" for t in emb.tables)
       + f" stored as {len(emb.table_names)} physical tables (--stacking={FLAGS.stacking})")
  loop = _Loop(RunLog(job.steps, FLAGS.batch_size, counters, FLAGS.tensorboard_dir),
               best, ckpt, best_ckpt)
  try:
    state, loss, initial_loss, history, done = _train(job, loop, start, data_state)
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
  ev = evaluation.evaluate(job.trainer, state, job.feeder, FLAGS.eval_batches)
  loop.log.eval(done, ev)
  if best.add(done, ev) and best_ckpt is not None and done > start:
    best_ckpt.save(state, {f.name: (FLAGS.batch_size, f.bag_size)
                           for f in job.dataset.features}, {"data_position": done, "eval": ev})
  loop.log.close()
  _log(f"final: step {done}  train loss {loss:.4f}  eval auc {ev['auc']:.4f}  "
       f"logloss {ev['logloss']:.4f}  ({ev['examples']} eval examples); best: step {best.step}  "
       f"auc {best.metrics['auc']:.4f}  logloss {best.metrics['logloss']:.4f}")
  baselines = evaluation.baselines_of(job.dataset, FLAGS.baselines)
  for b in baselines:
    _log(f"baseline {b['model']}: auc {b['auc']:.4f}  logloss {b['logloss']:.4f}")
  counters = loop.log.counters
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  reads = multihost_utils.process_allgather(
      np.array([job.feeder.source.records_read, job.feeder.source.rows_read]))
  report = {
      "steps": done, "planned_steps": job.steps, "stopped_early": done < job.steps,
      "epochs": done * FLAGS.batch_size / job.dataset.train_size
      if hasattr(job.dataset, "train_size") else None,
      "final_train_loss": loss,
      "initial_train_loss": initial_loss, "eval_auc": ev["auc"],
      "eval_logloss": ev["logloss"], "best_step": best.step, "best_eval": best.metrics,
      "baselines": baselines, "examples_per_sec": loop.log.rate,
      "emb_updates_skipped": counters["skipped"],
      "invalid_ids": counters["invalid"],
      "overflow_ids": counters["overflow"],
      "devices": mesh.size, "backend": emb.backend, "async_emb": config.use_async_emb,
      "exact_emb": config.exact, "optimizer": FLAGS.optimizer, "data": FLAGS.data,
      "processes": jax.process_count(), "eval_history": history,
      # Per process: [training batches read, training examples read].
      "input_reads": np.asarray(reads).reshape(-1, 2).tolist(),
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
