"""A run of the main job, from the flags to the report.

    python -m pallas_emb                       # synthetic click log, 8 CPU devices
    python -m pallas_emb --data=movielens:ml-1m/ratings.dat --epochs=3 --eval_every=200 \\
        --early_stop_patience=3 --checkpoint_dir=/tmp/run --tensorboard_dir=/tmp/tb
    python -m pallas_emb --checkpoint_dir=/tmp/run --checkpoint_every=100 --resume
    python -m pallas_emb --workload=dlrm [--stacking=off]   # 26 Criteo-shaped tables

With --eval_every the report names the best evaluation (lowest eval log-loss)
and its step, kept in CHECKPOINT_DIR/best. On MovieLens the job trains the
factorization model (--model) and also scores two baselines on the same time
split (item popularity, logistic regression on user and item ids);
--validation_fraction evaluates on ratings before the latest instead.
Tables train with the fused asynchronous update (one step stale, like the
reference) unless --noasync_emb or --exact_emb; the dense parameters with
optax Adam.
"""

from __future__ import annotations

import json
import logging as std_logging
import os
import sys
import time

import jax
import numpy as np
from absl import logging

from pallas_emb import shard_kernels
from pallas_emb.data.base import DataError
from pallas_emb.errors import PallasEmbError
from pallas_emb.job import distributed, evaluation, host_memory, vocabularies
from pallas_emb.job.build import Job, build
from pallas_emb.job.distributed import log
from pallas_emb.job.flags import FLAGS
from pallas_emb.job.loop import Loop, flush, train
from pallas_emb.job.run_log import VOCAB_COUNTS, RunLog
from pallas_emb.train.best_eval import BestEval
from pallas_emb.train.checkpoint import Checkpointer
from pallas_emb.train.checkpoint_dir import check_writable

# When the job's process started: its startup phase ends where training begins.
_STARTED = time.perf_counter()


def _process_settings() -> None:
  """Allocator and logging settings of this process."""
  if FLAGS.keep_freed_memory:
    host_memory.keep_freed_memory()
  if FLAGS["verbosity"].using_default_value:
    # JAX's INFO lines (e.g. "Unable to initialize backend 'tpu'") drown the
    # progress; -v 0 brings them back.
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("jax").setLevel(std_logging.WARNING)


def _resume(job: Job, ckpt: Checkpointer, best: BestEval):
  """(job at the checkpoint, its step, counters, data iterator state)."""
  restored = ckpt.restore_verified(job.state, job.feeder.train)
  for step, why in restored.skipped:
    log(f"checkpoint step {step} is not intact, skipped (kept as {step}.corrupt): {why}")
  extra = restored.meta["extra"]
  best.restore(extra.get("best"))
  log(f"resumed from step {restored.step} of {ckpt.directory}")
  return (
    job._replace(state=restored.state),
    restored.step,
    extra.get("counters", {}),
    extra.get("data_iterator"),
  )


def _describe(job: Job, mesh) -> str:
  emb, config = job.emb, job.config
  return (
    f"pallas_emb: {'dlrm' if FLAGS.workload == 'dlrm' else FLAGS.data}, {mesh.size} "
    f"devices ({jax.process_count()} processes), backend {emb.backend}, "
    f"{'exact ' if config.exact else ''}"
    f"{'async' if config.use_async_emb else 'sync'} embedding update, "
    f"{FLAGS.optimizer}, {job.model} model, {job.steps} steps, "
    + (f"evaluating the {job.dataset.window} window, " if hasattr(job.dataset, "window") else "")
    + "tables "
    + ", ".join(
      f"{t.name}:{t.num_rows}x{t.dim}" + (" (dynamic)" if t.vocabulary else "") for t in emb.tables
    )
    + f" stored as {len(emb.table_names)} physical tables (--stacking={FLAGS.stacking})"
  )


def _train_watched(job: Job, loop: Loop, start: int, data_state):
  try:
    return train(job, loop, start, data_state)
  except Exception:
    if jax.process_count() > 1:
      # A collective with a lost peer fails at once, a moment before the
      # coordination service stops this process and names the lost one
      # (see `supervisor`): let it, rather than exit with the bare error.
      print(
        f"process {jax.process_index()}: a step failed; waiting for the "
        "coordination service's verdict on the other processes",
        flush=True,
      )
      time.sleep(FLAGS.heartbeat_timeout + 5)
    raise


def run(argv=()) -> dict:
  """Trains per FLAGS and returns the report."""
  del argv
  vocabularies.check_flags()
  if FLAGS.checkpoint_dir:
    check_writable(FLAGS.checkpoint_dir)  # before anything compiles
  _process_settings()
  distributed.initialize()
  mesh = distributed.make_mesh()
  job = build(mesh)
  ckpt = best_ckpt = None
  if FLAGS.checkpoint_dir:
    ckpt = Checkpointer(FLAGS.checkpoint_dir, job.trainer)
    best_ckpt = Checkpointer(os.path.join(FLAGS.checkpoint_dir, "best"), job.trainer, max_to_keep=1)
  start, counters, best, data_state = 0, {}, BestEval(FLAGS.early_stop_patience), None
  if FLAGS.resume and ckpt.latest_step() is not None:
    job, start, counters, data_state = _resume(job, ckpt, best)
  log(_describe(job, mesh))
  loop = Loop(
    RunLog(job.steps, FLAGS.batch_size, counters, FLAGS.tensorboard_dir), best, ckpt, best_ckpt
  )
  loop.log.add_phase("startup", time.perf_counter() - _STARTED)
  trained = _train_watched(job, loop, start, data_state)
  done = trained.steps
  state = flush(job, loop, trained.state)  # the last gradient reaches the tables
  served = None
  if FLAGS.export_dir:
    with loop.log.phase("export"):
      served = _export(job.emb, state)
  with loop.log.phase("evaluation"):
    ev = evaluation.evaluate(job.trainer, state, job.feeder, FLAGS.eval_batches, served)
  served_ev = ev.pop("served", None)
  loop.log.eval(done, ev)
  if best.add(done, ev) and best_ckpt is not None and done > start:
    with loop.log.phase("checkpoints"):
      best_ckpt.save(state, job.batch_shapes, {"data_position": done, "eval": ev})
  loop.log.close()
  log(
    f"final: step {done}  train loss {trained.loss:.4f}  eval auc {ev['auc']:.4f}  "
    f"logloss {ev['logloss']:.4f}  ({ev['examples']} eval examples); best: step {best.step}  "
    f"auc {best.metrics['auc']:.4f}  logloss {best.metrics['logloss']:.4f}"
  )
  if served_ev is not None:
    log(
      f"served from {served.path}: eval auc {served_ev['auc']:.4f}  logloss "
      f"{served_ev['logloss']:.4f}; largest logit difference from the training lookup "
      f"{served_ev['max_abs_logit_difference']:.2e}"
    )
  with loop.log.phase("baselines"):
    baselines = evaluation.baselines_of(job.dataset, FLAGS.baselines)
  for b in baselines:
    log(f"baseline {b['model']}: auc {b['auc']:.4f}  logloss {b['logloss']:.4f}")
  log(
    f"steady state {loop.log.rate or float('nan'):.0f} ex/s, cumulative "
    f"{loop.log.cumulative_rate:.0f} ex/s; {loop.log.phases_line()}"
  )
  report = _report(job, loop, trained, ev, baselines, mesh)
  report["serving"] = None if served is None else {"export_dir": served.path, **served_ev}
  _write_outputs(job.emb, state, report)
  return report


def _export(emb, state):
  """Writes --export_dir and loads it back on process 0 (None elsewhere):
  the artifact's lookup, for the evaluation."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  import pallas_emb as pe  # pylint: disable=g-import-not-at-top

  path = pe.export_serving(emb, state.tables, FLAGS.export_dir, vocabularies=state.vocabs or None)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("pallas_emb serving export")
  if jax.process_index() != 0:
    return None
  served = pe.load_serving(path)
  log(f"exported a serving artifact to {path} ({_bytes(path) / 2**20:.1f} MiB)")
  return served


def _bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _report(job: Job, loop: Loop, trained, ev: dict, baselines, mesh) -> dict:
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  counters, done, best = loop.log.counters, trained.steps, loop.best
  feeder = job.feeder
  reads = multihost_utils.process_allgather(
    np.array([feeder.source.records_read, feeder.source.rows_read, feeder.eval_rows_read])
  )
  return {
    "steps": done,
    "planned_steps": job.steps,
    "stopped_early": done < job.steps,
    "epochs": done * FLAGS.batch_size / job.dataset.train_size
    if hasattr(job.dataset, "train_size")
    else None,
    "final_train_loss": trained.loss,
    "initial_train_loss": trained.initial_loss,
    "eval_auc": ev["auc"],
    "eval_logloss": ev["logloss"],
    "best_step": best.step,
    "best_eval": best.metrics,
    "baselines": baselines,
    "examples_per_sec": loop.log.rate,
    "cumulative_examples_per_sec": loop.log.cumulative_rate,
    "phases_seconds": loop.log.phases,
    "input_seconds": loop.log.input_seconds,
    # Which form (kernels.forms) runs each physical table's update and
    # owners' gather at this batch.
    "kernel_forms": shard_kernels.embedding_forms(job.emb, job.batch_shapes),
    # Dynamic tables (--vocabulary=dynamic): the last step's metrics of each,
    # and the run's sums of their inserts, evictions, not admitted, failed.
    "vocabularies": loop.log.vocab,
    "vocabulary_counts": {k: counters[k] for k in VOCAB_COUNTS if k in counters},
    "emb_updates_skipped": counters["skipped"],
    "invalid_ids": counters["invalid"],
    "overflow_ids": counters["overflow"],
    "devices": mesh.size,
    "backend": job.emb.backend,
    "async_emb": job.config.use_async_emb,
    "exact_emb": job.config.exact,
    "optimizer": FLAGS.optimizer,
    "model": job.model,
    "data": FLAGS.data,
    "eval_window": getattr(job.dataset, "window", None),
    "processes": jax.process_count(),
    "eval_history": trained.history,
    # Per process: [training batches read, training examples read].
    "input_reads": np.asarray(reads).reshape(-1, 3)[:, :2].tolist(),
    # Per process: held-out examples read (its rows of every eval batch).
    "eval_input_reads": np.asarray(reads).reshape(-1, 3)[:, 2].tolist(),
  }


def _write_outputs(emb, state, report: dict) -> None:
  if FLAGS.save_tables:
    tables = {
      t.name: emb.logical_table(state.tables, t.name).astype(np.float32) for t in emb.tables
    }
    if jax.process_index() == 0:
      np.savez(FLAGS.save_tables, **tables)
  if FLAGS.report_json and jax.process_index() == 0:
    with open(FLAGS.report_json, "w") as f:
      json.dump(report, f, indent=2)


def main(argv):
  """The job's absl main. The library's own errors (`PallasEmbError`, a bad
  data file's `DataError`) name what is wrong and the fix: they are printed
  as one line, and exit with status 1, without the traceback that --debug
  (or PALLAS_EMB_DEBUG=1) shows."""
  try:
    run(argv)
  except (PallasEmbError, DataError) as e:
    if FLAGS.debug or os.environ.get("PALLAS_EMB_DEBUG", "0") not in ("", "0"):
      raise
    message = " ".join(str(e).split())
    print(f"pallas_emb: {type(e).__name__}: {message}", file=sys.stderr, flush=True)
    sys.exit(1)
