"""The training loop: steps, periodic evaluation, checkpoints, early stop."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax

from pallas_emb.job import evaluation
from pallas_emb.job.build import Job
from pallas_emb.job.distributed import log
from pallas_emb.job.flags import FLAGS
from pallas_emb.job.run_log import WARMUP_STEPS, RunLog
from pallas_emb.train.best_eval import BestEval


class Loop(NamedTuple):
  """What the loop keeps beside the state: its log, the best evaluation,
  the checkpointers (latest, best; None without --checkpoint_dir)."""

  log: RunLog
  best: BestEval
  ckpt: Any
  best_ckpt: Any


class Trained(NamedTuple):
  """Where the loop stopped."""

  state: Any
  loss: float  # the last step's
  initial_loss: float  # the first step's
  history: list  # the periodic evaluations
  steps: int  # steps done (of job.steps, fewer after an early stop)


def flush(job: Job, loop: Loop, state):
  """`state` with its pending update applied, timed as the phase "flush":
  its program compiles at the first call (DLRM on CPU: about 7 s), which
  the run's phases must account for."""
  with loop.log.phase("flush"):
    state, _ = job.trainer.flush(state)
    return jax.block_until_ready(state)


def evaluate_at(job: Job, loop: Loop, state, done: int, history: list):
  """Flushes, evaluates, records; keeps the best step's checkpoint."""
  state = flush(job, loop, state)
  with loop.log.phase("evaluation"):
    ev = evaluation.evaluate(job.trainer, state, job.feeder, FLAGS.eval_batches)
  history.append({"step": done, **ev})
  loop.log.eval(done, ev)
  improved = loop.best.add(done, ev)
  log(
    f"eval at step {done}: auc {ev['auc']:.4f}  logloss {ev['logloss']:.4f}"
    + ("  (best)" if improved else f"  (best: step {loop.best.step})")
  )
  if improved and loop.best_ckpt is not None:
    with loop.log.phase("checkpoints"):
      loop.best_ckpt.save(state, job.batch_shapes, {"data_position": done, "eval": ev})
  return state


def train(job: Job, loop: Loop, start: int, data_state: dict | None) -> Trained:
  """Steps start..job.steps, or until an early stop."""
  state, feeder, trainer, run_log = job.state, job.feeder, job.trainer, loop.log
  loss = initial_loss = float("nan")
  history = []
  # The batches come from this process's grain iterator; its state goes
  # into each checkpoint, so a resumed run reads what this one would.
  batch, done = feeder.train(start), start
  batches = feeder.iterator(data_state, start=start + 1)
  next_batch = next(batches) if start < job.steps else None
  for t in range(start, job.steps):
    tic = time.perf_counter()
    state, m = trainer.step(state, batch, next_batch)
    # The step is dispatched, not done: the batch after next is read while
    # it runs, and checkpoints keep the position before that read.
    position = batches.get_state()
    read = time.perf_counter()
    following = next(batches) if t + 1 < job.steps else None
    read = time.perf_counter() - read
    loss = float(m["loss"])  # blocks: the step is done
    if t == start:
      initial_loss = loss
    done = t + 1
    # A step's time is the loop's whole: its compute and the read beside it.
    run_log.add(done, m, time.perf_counter() - tic, t - start < WARMUP_STEPS, read)
    batch, next_batch = next_batch, following
    if done % FLAGS.log_every == 0 or done == job.steps:
      norms = " ".join(f"{k}={float(v['grad_norm']):.3g}" for k, v in m["emb"].items())
      log(run_log.line(done, loss, norms))
    if FLAGS.eval_every and done % FLAGS.eval_every == 0 and done < job.steps:
      state = evaluate_at(job, loop, state, done, history)
    last = done == job.steps or loop.best.should_stop
    periodic = FLAGS.checkpoint_every and done % FLAGS.checkpoint_every == 0
    if loop.ckpt is not None and (periodic or (last and done > start)):
      with run_log.phase("checkpoints"):
        _save(loop, state, job, done, position, run_log)
    if loop.best.should_stop:
      log(
        f"early stop at step {done}: {loop.best.since_best} evaluations without a lower "
        f"eval log-loss than step {loop.best.step}'s"
      )
      break
  return Trained(state, loss, initial_loss, history, done)


def _save(loop: Loop, state, job: Job, done: int, position: dict, run_log) -> None:
  """The latest checkpoint, with where the data (`position`: the grain
  iterator's state) and the counters stand."""
  loop.ckpt.save(
    state,
    job.batch_shapes,
    {
      "data_position": done,
      "data_iterator": position,
      "counters": dict(run_log.counters),
      "best": loop.best.state(),
    },
  )
