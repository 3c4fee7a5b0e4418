"""Plain SGD on the rows of the batch: row -= lr * g."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from pallas_emb.optimizers import base
from pallas_emb.optimizers.fused_async import FusedAsyncEmbUpdate


class SGDScalars(NamedTuple):
  learning_rate: jax.Array


@dataclasses.dataclass(frozen=True)
class SGD(base.EmbeddingOptimizer, FusedAsyncEmbUpdate):
  """Stochastic gradient descent; no slots. Matches `optax.sgd(lr)` bitwise.

  Attributes:
    learning_rate: float >= 0 or a schedule of the step.
  """

  learning_rate: base.LearningRate = 0.01

  def __post_init__(self):
    base.check_learning_rate("SGD", self.learning_rate)

  def slot_specs(self):
    return {}

  def scalars(self, step) -> SGDScalars:
    return SGDScalars(base.learning_rate_at(self.learning_rate, step))

  def native_rule(self):
    """("sgd", ()): the C++ rule of the native CPU backend, or None for a
    subclass with its own `update_rows`."""
    if type(self).update_rows is not SGD.update_rows:
      return None
    return "sgd", ()

  def update_rows(self, rows, slots, grads, scalars: SGDScalars):
    return rows + grads * (-scalars.learning_rate), dict(slots)
