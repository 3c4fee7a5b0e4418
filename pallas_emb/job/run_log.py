"""What the main job tells while it trains: counters of the embedding
updates, throughput, a progress line with steps/s and ETA, the time of each
phase of the run, and TensorBoard scalars (tensorboardX), written by
process 0 only.

Throughput is given twice. The steady-state rate counts the steps after the
first `WARMUP_STEPS` of a run, which compile (the async pipeline's first
step, with no pending update, is its own program): what the chip sustains.
A step's time is the loop's, from the step's dispatch to its result: the
input of a later step is read in that time (`loop.train`), so a run whose
input is slower than its steps shows it in this rate, and the time spent
reading is reported beside the phases. The cumulative rate is every example
over the wall time since the loop began, compiles, evaluations and
checkpoints included: what the run got.
"""

from __future__ import annotations

import contextlib
import time

import jax

# The first steps of a run compile their programs; the steady-state rate
# leaves them out.
WARMUP_STEPS = 2
# A dynamic table's per-step counts that the run sums (`VocabMetrics`).
VOCAB_COUNTS = ("inserts", "evictions", "not_admitted", "failed")


class RunLog:
  """Progress of a run of `total_steps` steps of `batch_size` examples.

  Args:
    total_steps: the last step (for the ETA).
    batch_size: global batch size (for examples/s).
    counters: counters restored from a checkpoint.
    tensorboard_dir: where to write TensorBoard event files (None: none).
  """

  def __init__(
    self, total_steps: int, batch_size: int, counters: dict, tensorboard_dir: str | None = None
  ):
    self.total_steps, self.batch_size = total_steps, batch_size
    self.counters = {"skipped": 0, "invalid": 0, "overflow": 0, **counters}
    self.steps, self.seconds = 0, 0.0
    self.input_seconds = 0.0  # reading batches, while the steps ran
    self.all_steps, self.started = 0, time.perf_counter()
    # Seconds per phase but "compile" and "training" (`phases`).
    self._phases: dict[str, float] = {}
    self._warmup_steps, self._warmup = 0, 0.0
    self.vocab: dict[str, dict[str, int]] = {}  # the latest step's, by dynamic table
    self.writer = None
    if tensorboard_dir and jax.process_index() == 0:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

      self.writer = SummaryWriter(tensorboard_dir)

  def add(
    self, step: int, m: dict, elapsed: float, warmup: bool, input_seconds: float = 0.0
  ) -> None:
    """Counts step `step`'s metrics and its `elapsed` seconds (a `warmup`
    step compiles: its time goes to the "compile" phase beyond what a
    steady step takes), of which `input_seconds` read a batch."""
    self.all_steps += 1
    self.input_seconds += input_seconds
    if warmup:
      self._warmup_steps += 1
      self._warmup += elapsed
    else:
      self.steps += 1
      self.seconds += elapsed
    for tm in m["emb"].values():
      self.counters["skipped"] += int(tm["skipped"])
      self.counters["invalid"] += int(tm["invalid_ids"])
      self.counters["overflow"] += int(tm["overflow_ids"])
    self.vocab = {t: {k: int(v) for k, v in vm.items()} for t, vm in m.get("vocab", {}).items()}
    for vm in self.vocab.values():
      for k in VOCAB_COUNTS:
        self.counters[k] = self.counters.get(k, 0) + vm[k]
    if self.writer is not None:
      self.writer.add_scalar("train/loss", float(m["loss"]), step)
      for name, tm in m["emb"].items():
        self.writer.add_scalar(f"emb/{name}/grad_norm", float(tm["grad_norm"]), step)
      for name, vm in self.vocab.items():
        for k, v in vm.items():
          self.writer.add_scalar(f"vocab/{name}/{k}", v, step)

  @property
  def step_seconds(self) -> float:
    """A steady step's mean seconds (0 before one ran)."""
    return self.seconds / self.steps if self.steps else 0.0

  @property
  def rate(self) -> float | None:
    """Steady-state examples per second: the steps after the warm-up."""
    return self.steps * self.batch_size / self.seconds if self.seconds else None

  @property
  def cumulative_rate(self) -> float:
    """Every example over the wall time since the loop began."""
    return self.all_steps * self.batch_size / max(time.perf_counter() - self.started, 1e-9)

  @property
  def phases(self) -> dict[str, float]:
    """Seconds by phase: "compile" (the warm-up steps beyond what steady
    steps take), "training" (every step, less that), and what `phase`
    timed ("startup", "flush", "evaluation", "checkpoints", "baselines")."""
    steady = self._warmup_steps * self.step_seconds
    compile_s = max(0.0, self._warmup - steady) if self.steps else self._warmup
    return {
      **{k: v for k, v in self._phases.items() if k == "startup"},
      "compile": compile_s,
      "training": self.seconds + self._warmup - compile_s,
      **{k: v for k, v in self._phases.items() if k != "startup"},
    }

  @contextlib.contextmanager
  def phase(self, name: str):
    """Adds the time of the enclosed code to phase `name`."""
    tic = time.perf_counter()
    try:
      yield
    finally:
      self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - tic

  def add_phase(self, name: str, seconds: float) -> None:
    """Adds `seconds` to phase `name` (timed outside the log)."""
    self._phases[name] = self._phases.get(name, 0.0) + seconds

  def line(self, step: int, loss: float, norms: str) -> str:
    """The progress line: step, loss, steps/s, examples/s (steady state and
    cumulative), ETA; with dynamic tables, each one's occupancy (the
    latest step's) and inserts, evictions, ids not admitted and failed
    inserts (the run's sums)."""
    sps = self.steps / self.seconds if self.seconds else float("nan")
    left = (self.total_steps - step) / sps if self.seconds else float("nan")
    eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left == left else "?"
    return (
      f"step {step:6d}/{self.total_steps}  loss {loss:.4f}  {sps:7.2f} steps/s  "
      f"{(self.rate or float('nan')):9.0f} ex/s (cumulative {self.cumulative_rate:.0f})  "
      f"ETA {eta}  emb grad norm {norms}  skipped {self.counters['skipped']}"
      + "".join(f"  vocab {t} occupancy {vm['occupancy']}" for t, vm in self.vocab.items())
      + ("  " + " ".join(f"{k} {self.counters[k]}" for k in VOCAB_COUNTS) if self.vocab else "")
    )

  def phases_line(self) -> str:
    """Where the run's time went, in seconds, by phase, and how much of
    the steps' time read their input."""
    return (
      "phases: "
      + "  ".join(f"{k} {v:.1f} s" for k, v in self.phases.items())
      + f"; input read while the steps ran {self.input_seconds:.1f} s"
    )

  def eval(self, step: int, metrics: dict) -> None:
    """Writes an evaluation's AUC and log-loss."""
    if self.writer is not None:
      for k in ("auc", "logloss"):
        self.writer.add_scalar(f"eval/{k}", metrics[k], step)
      self.writer.flush()

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()
