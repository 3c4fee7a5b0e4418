"""The best evaluation so far, and when to stop for lack of a better one."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class BestEval:
  """Tracks the evaluation with the lowest eval log-loss.

  Attributes:
    patience: stop after this many evaluations in a row without a lower
      eval log-loss (0: never stop early).
    step, metrics: the best evaluation's step and metrics (None before one).
    since_best: evaluations since the best one.
  """

  patience: int = 0
  step: int | None = None
  metrics: dict | None = None
  since_best: int = 0

  def add(self, step: int, metrics: dict) -> bool:
    """Records an evaluation -> whether it is the best so far."""
    loss = metrics["logloss"]
    if self.metrics is None or (math.isfinite(loss) and loss < self.metrics["logloss"]):
      self.step, self.metrics, self.since_best = step, dict(metrics), 0
      return True
    self.since_best += 1
    return False

  @property
  def should_stop(self) -> bool:
    """True once `patience` evaluations in a row did not improve."""
    return bool(self.patience) and self.since_best >= self.patience

  def state(self) -> dict:
    """JSON for a checkpoint's metadata (a resumed run keeps its best)."""
    return {"step": self.step, "metrics": self.metrics, "since_best": self.since_best}

  def restore(self, state: dict | None) -> None:
    if state:
      self.step, self.metrics = state.get("step"), state.get("metrics")
      self.since_best = state.get("since_best", 0)
