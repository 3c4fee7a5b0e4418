"""What the main job tells while it trains: counters of the embedding
updates, throughput, a progress line with steps/s and ETA, and TensorBoard
scalars (tensorboardX), written by process 0 only."""

from __future__ import annotations

import time

import jax


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
    self.writer = None
    if tensorboard_dir and jax.process_index() == 0:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

      self.writer = SummaryWriter(tensorboard_dir)

  def add(self, step: int, m: dict, elapsed: float, timed: bool) -> None:
    """Counts step `step`'s metrics; `timed`: its time counts (the first
    step of a run compiles)."""
    if timed:
      self.steps += 1
      self.seconds += elapsed
    for tm in m["emb"].values():
      self.counters["skipped"] += int(tm["skipped"])
      self.counters["invalid"] += int(tm["invalid_ids"])
      self.counters["overflow"] += int(tm["overflow_ids"])
    if self.writer is not None:
      self.writer.add_scalar("train/loss", float(m["loss"]), step)
      for name, tm in m["emb"].items():
        self.writer.add_scalar(f"emb/{name}/grad_norm", float(tm["grad_norm"]), step)

  @property
  def rate(self) -> float | None:
    """Examples per second of the timed steps."""
    return self.steps * self.batch_size / self.seconds if self.seconds else None

  def line(self, step: int, loss: float, norms: str) -> str:
    """The progress line: step, loss, steps/s, examples/s, ETA."""
    sps = self.steps / self.seconds if self.seconds else float("nan")
    left = (self.total_steps - step) / sps if self.seconds else float("nan")
    eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left == left else "?"
    return (
      f"step {step:6d}/{self.total_steps}  loss {loss:.4f}  {sps:7.2f} steps/s  "
      f"{(self.rate or float('nan')):9.0f} ex/s  ETA {eta}  emb grad norm {norms}  "
      f"skipped {self.counters['skipped']}"
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
