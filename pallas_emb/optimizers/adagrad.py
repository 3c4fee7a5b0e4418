"""Element-wise Adagrad on the rows of the batch, with optax's exact formula."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_emb.optimizers import base
from pallas_emb.optimizers.fused_async import FusedAsyncEmbUpdate


class AdagradScalars(NamedTuple):
  learning_rate: jax.Array


@dataclasses.dataclass(frozen=True)
class Adagrad(base.EmbeddingOptimizer, FusedAsyncEmbUpdate):
  """Adagrad with one accumulator per element (slot `acc`, (rows, dim)).

  `acc += g**2; row -= lr * g * rsqrt(acc + eps)` (0 where acc == 0), the
  formula of `optax.adagrad`, so a sparse step equals optax's dense step on
  every row: rows outside the batch have g == 0 and would not move anyway.

  Attributes:
    learning_rate: float >= 0 or a schedule of the step.
    initial_accumulator_value: >= 0 (optax's default 0.1).
    eps: > 0 (optax's default 1e-7).
  """

  learning_rate: base.LearningRate = 0.1
  initial_accumulator_value: float = 0.1
  eps: float = 1e-7

  def __post_init__(self):
    base.check_learning_rate("Adagrad", self.learning_rate)
    base.check_range(
      "Adagrad", "initial_accumulator_value", self.initial_accumulator_value, 0.0, float("inf")
    )
    base.check_range("Adagrad", "eps", self.eps, 0.0, float("inf"), lo_open=True)

  def slot_specs(self):
    return {"acc": base.SlotSpec(width=None, init=self.initial_accumulator_value)}

  def scalars(self, step) -> AdagradScalars:
    return AdagradScalars(base.learning_rate_at(self.learning_rate, step))

  def native_rule(self):
    """("adagrad", (eps,)): the C++ rule of the native CPU backend, or None
    for a subclass with its own `update_rows`."""
    if type(self).update_rows is not Adagrad.update_rows:
      return None
    return "adagrad", (self.eps,)

  def update_rows(self, rows, slots, grads, scalars: AdagradScalars):
    acc = slots["acc"] + grads * grads
    scale = jnp.where(acc > 0, jax.lax.rsqrt(acc + self.eps), 0.0)
    return rows + (grads * scale) * (-scalars.learning_rate), {"acc": acc}
