"""Row-wise Adagrad: one accumulator per row, decayed by a half-life.

The reference system's math, per row u in the batch with summed gradient g:

    decay  = exp(-ln 2 / half_life_steps)          (1 when half_life is None)
    acc[u] = acc[u] * decay + mean(g ** 2)
    row[u] -= lr * (g / (sqrt(acc[u]) + eps) + weight_decay * row[u])

Two things the reference cannot fuse:

* `lazy_decay=True` decays by `decay ** (step - last_step[u])`, i.e. as if
  every row had been decayed at every step, although only batch rows are
  touched (slot `last_step`). The default decays once per touch, like the
  reference.
* `weight_decay` (decoupled, applied to touched rows only).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.errors import SpecError
from pallas_emb.optimizers import base
from pallas_emb.optimizers.fused_async import FusedAsyncEmbUpdate


class RowWiseAdagradScalars(NamedTuple):
  learning_rate: jax.Array
  step: jax.Array  # float32: exact up to 2**24 updates


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad(base.EmbeddingOptimizer, FusedAsyncEmbUpdate):
  """Row-wise Adagrad (slot `acc`, (rows, 1); plus `last_step` when lazy).

  Attributes:
    learning_rate: float >= 0 or a schedule of the step (reference: 0.1).
    eps: > 0, added to sqrt(acc) (reference: 1e-10).
    half_life_steps: > 0 steps for the accumulator to halve, or None for no
      decay (reference: 5000).
    lazy_decay: decay by the steps since the row was last touched.
    weight_decay: >= 0, decoupled weight decay on touched rows.
    initial_accumulator_value: >= 0 (reference: 0).
  """

  learning_rate: base.LearningRate = 0.1
  eps: float = 1e-10
  half_life_steps: float | None = 5000
  lazy_decay: bool = False
  weight_decay: float = 0.0
  initial_accumulator_value: float = 0.0

  def __post_init__(self):
    name = "RowWiseAdagrad"
    base.check_learning_rate(name, self.learning_rate)
    base.check_range(name, "eps", self.eps, 0.0, math.inf, lo_open=True)
    if self.half_life_steps is not None:
      base.check_range(name, "half_life_steps", self.half_life_steps, 0.0, math.inf, lo_open=True)
    if not isinstance(self.lazy_decay, bool):
      raise SpecError(f"{name}: lazy_decay must be a bool, got {self.lazy_decay!r}.")
    base.check_range(name, "weight_decay", self.weight_decay, 0.0, math.inf)
    base.check_range(
      name, "initial_accumulator_value", self.initial_accumulator_value, 0.0, math.inf
    )

  @property
  def decay(self) -> float:
    """Per-step accumulator decay factor in (0, 1]."""
    if self.half_life_steps is None:
      return 1.0
    return math.exp(-math.log(2.0) / self.half_life_steps)

  def slot_specs(self):
    specs = {"acc": base.SlotSpec(width=1, init=self.initial_accumulator_value)}
    if self.lazy_decay:
      specs["last_step"] = base.SlotSpec(width=1, dtype=np.int32, init=0)
    return specs

  def scalars(self, step) -> RowWiseAdagradScalars:
    return RowWiseAdagradScalars(
      base.learning_rate_at(self.learning_rate, step), jnp.asarray(step, jnp.float32)
    )

  def lazy_decay_factor(self, last_step: jax.Array, step: jax.Array) -> jax.Array:
    """decay ** (step - last_step), float32 of last_step's shape: the decay a
    row touched at `last_step` owes at `step` (lazy_decay)."""
    elapsed = step - last_step.astype(jnp.float32)
    return jnp.exp(elapsed * np.float32(math.log(self.decay)))

  def native_rule(self):
    """The C++ rule of the native CPU backend doing this math:
    ("rowwise_adagrad", (eps, decay, weight_decay)), with lazy decay
    ("rowwise_adagrad_lazy", same, per_row), whose factor XLA computes per row
    with `lazy_decay_factor`; or None for a subclass with its own
    `update_rows`, which runs the XLA path."""
    if type(self).update_rows is not RowWiseAdagrad.update_rows:
      return None
    static = (self.eps, self.decay, self.weight_decay)
    if not self.lazy_decay:
      return "rowwise_adagrad", static
    per_row = lambda slots, scalars: self.lazy_decay_factor(slots["last_step"], scalars.step)
    return "rowwise_adagrad_lazy", static, per_row

  def update_rows(self, rows, slots, grads, scalars: RowWiseAdagradScalars):
    mean_sq = _row_mean(grads * grads)
    acc = slots["acc"]
    new_slots = {}
    if self.decay != 1.0:
      if self.lazy_decay:
        acc = acc * self.lazy_decay_factor(slots["last_step"], scalars.step)
      else:
        acc = acc * np.float32(self.decay)
    if self.lazy_decay:
      new_slots["last_step"] = jnp.broadcast_to(
        scalars.step.astype(jnp.int32), slots["last_step"].shape
      )
    acc = acc + mean_sq
    new_slots["acc"] = acc
    step = grads / (jnp.sqrt(acc) + np.float32(self.eps))
    if self.weight_decay:
      step = step + np.float32(self.weight_decay) * rows
    return rows - scalars.learning_rate * step, new_slots


def _row_mean(x: jax.Array) -> jax.Array:
  """(C, D) -> (C, 1) float32 mean of each row, summed as a fixed tree of
  halves. Why not `jnp.mean`: a reduction's order is the compiler's, and it
  differs between a kernel's chunk of rows and XLA's whole batch (1-ulp
  drifts between the backends at D >= 80 on CPU); elementwise adds in a
  fixed order round alike wherever they run. Zero columns pad D to a power
  of two: adding zeros is exact."""
  d = x.shape[-1]
  width = 1 << (d - 1).bit_length()
  if width != d:
    x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (width - d,), x.dtype)], axis=-1)
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x / np.float32(d)
