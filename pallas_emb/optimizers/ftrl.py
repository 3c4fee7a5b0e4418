"""FTRL-Proximal, as TensorFlow's TPU embedding and jax-tpu-embedding define it.

Per element of a touched row, with accumulator n, linear z, weight w, summed
gradient g, learning rate lr and k = learning_rate_power (<= 0):

    n' = n + g**2;   dp = n'**(-k) - n**(-k)
    multiply_linear_by_learning_rate=False (z holds the paper's z):
      z' = z + g - (dp / lr) * w
      w' = (clip(z', -l1, l1) - z') / ((n'**(-k) + beta) / lr + 2 * l2)
    multiply_linear_by_learning_rate=True (z holds lr * z):
      z' = z + lr * g - dp * w
      w' = (clip(z', -lr * l1, lr * l1) - z') / (n'**(-k) + beta + 2 * lr * l2)

This is TF's `ApplyFtrl` (tensorflow/core/kernels/training_ops.cc) with
l2 + beta / (2 * lr) in place of l2, which is how TF's TPU FTRL and Keras'
`Ftrl` add `beta` (McMahan et al. 2013's per-coordinate rate
lr / (beta + sqrt(n))), and jax-tpu-embedding's `FTRLOptimizerSpec` formula.
The weight is a function of (z, n) alone: the first touch of a row replaces
its initial value by that function, as in TF.

Two cases where the formula divides by zero get a defined result instead of
a NaN written into the table:

* an element whose accumulator is still 0 (possible only with
  `initial_accumulator_value=0` and no non-zero gradient yet) with
  l2 == beta == 0: the denominator is 0, and the weight is left unchanged;
* with `multiply_linear_by_learning_rate=False`, a step whose learning rate
  (from a schedule) is 0: the step leaves rows and slots unchanged. A
  constant learning rate of 0 is refused; `multiply_linear_by_learning_rate=
  True` is well defined at lr == 0 (and is what TF recommends for it).
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


class FTRLScalars(NamedTuple):
  learning_rate: jax.Array


@dataclasses.dataclass(frozen=True)
class FTRL(base.EmbeddingOptimizer, FusedAsyncEmbUpdate):
  """FTRL-Proximal (slots `accumulator` and `linear`, both (rows, dim)).

  Defaults are jax-tpu-embedding's `FTRLOptimizerSpec` (TF's TPU `FTRL`
  differs only in learning_rate, 0.001). Checkpoints of the `linear` slot are
  not interchangeable between the two `multiply_linear_by_learning_rate`
  settings (one stores lr * z).

  Attributes:
    learning_rate: float > 0 (>= 0 with multiply_linear_by_learning_rate), or
      a schedule of the step.
    learning_rate_power: k <= 0; the per-coordinate rate is
      lr / n**(-k) (-0.5: lr / sqrt(n); 0: a constant rate).
    l1: >= 0, L1 regularization strength (sparsifies: abs(z) <= l1 gives w = 0).
    l2: >= 0, L2 regularization strength.
    beta: >= 0, added to n**(-k) in the denominator (the paper's beta).
    initial_accumulator_value: >= 0, initial n (TF requires > 0; 0 is
      accepted here, see the module docstring).
    initial_linear_value: initial z.
    multiply_linear_by_learning_rate: store lr * z in `linear`, so that a
      learning rate of 0 (e.g. a warmup schedule's first step) is defined.
  """

  learning_rate: base.LearningRate = 0.01
  learning_rate_power: float = -0.5
  l1: float = 0.0
  l2: float = 0.0
  beta: float = 0.0
  initial_accumulator_value: float = 0.1
  initial_linear_value: float = 0.0
  multiply_linear_by_learning_rate: bool = False

  def __post_init__(self):
    name = "FTRL"
    base.check_learning_rate(name, self.learning_rate)
    if not isinstance(self.multiply_linear_by_learning_rate, bool):
      raise SpecError(
        f"{name}: multiply_linear_by_learning_rate must be a "
        f"bool, got {self.multiply_linear_by_learning_rate!r}."
      )
    if (
      not callable(self.learning_rate)
      and self.learning_rate == 0
      and not self.multiply_linear_by_learning_rate
    ):
      raise SpecError(
        f"{name}: learning_rate=0 divides by zero in FTRL's update; use a "
        "learning_rate > 0, or multiply_linear_by_learning_rate=True, "
        "whose formula is defined at 0."
      )
    base.check_range(name, "learning_rate_power", self.learning_rate_power, -math.inf, 0.0)
    for field in ("l1", "l2", "beta", "initial_accumulator_value"):
      base.check_range(name, field, getattr(self, field), 0.0, math.inf)
    base.check_range(name, "initial_linear_value", self.initial_linear_value, -math.inf, math.inf)

  def slot_specs(self):
    return {
      "accumulator": base.SlotSpec(width=None, init=self.initial_accumulator_value),
      "linear": base.SlotSpec(width=None, init=self.initial_linear_value),
    }

  def scalars(self, step) -> FTRLScalars:
    return FTRLScalars(base.learning_rate_at(self.learning_rate, step))

  def native_rule(self):
    """("ftrl", (learning_rate_power, l1, l2, beta, multiply)): the C++ rule
    of the native CPU backend, for learning_rate_power -0.5 (sqrt) or 0; None
    for other powers (XLA's exp and log, which C++ would not reproduce) or a
    subclass with its own `update_rows`, which run the XLA path."""
    if type(self).update_rows is not FTRL.update_rows or self.learning_rate_power not in (
      0.0,
      -0.5,
    ):
      return None
    return "ftrl", (
      self.learning_rate_power,
      self.l1,
      self.l2,
      self.beta,
      float(self.multiply_linear_by_learning_rate),
    )

  def _power(self, n: jax.Array) -> jax.Array:
    """n ** -k for n >= 0, with k = learning_rate_power (static)."""
    k = self.learning_rate_power
    if k == 0:  # exp(0 * log(0)) would be NaN; n ** 0 == 1
      return jnp.ones_like(n)
    if k == -0.5:  # TF's fast path; sqrt is exact where exp(log) rounds twice
      return jnp.sqrt(n)
    # A vector power lowers on TPU as exp(-k * log n); log(0) = -inf gives
    # exp(-inf) = 0 = 0 ** -k, since -k > 0.
    return jnp.exp(np.float32(-k) * jnp.log(n))

  def update_rows(self, rows, slots, grads, scalars: FTRLScalars):
    lr = scalars.learning_rate
    l1, l2, beta = (np.float32(x) for x in (self.l1, self.l2, self.beta))
    n, z = slots["accumulator"], slots["linear"]
    n_new = n + grads * grads
    p_new = self._power(n_new)
    dp = p_new - self._power(n)
    if self.multiply_linear_by_learning_rate:
      z_new = z + lr * grads - dp * rows
      quad = p_new + beta + np.float32(2.0) * lr * l2
      l1 = lr * l1
    else:
      z_new = z + grads - (dp / lr) * rows
      quad = (p_new + beta) / lr + np.float32(2.0) * l2
    w_new = (jnp.clip(z_new, -l1, l1) - z_new) / quad
    # quad == 0: n' == 0 with l2 == beta == 0 (no gradient seen): keep w.
    w_new = jnp.where(quad > 0, w_new, rows)
    if not self.multiply_linear_by_learning_rate:
      # A schedule's lr == 0 makes dp / lr and quad non-finite: skip the step.
      keep = lr <= 0
      return (
        jnp.where(keep, rows, w_new),
        {"accumulator": jnp.where(keep, n, n_new), "linear": jnp.where(keep, z, z_new)},
      )
    return w_new, {"accumulator": n_new, "linear": z_new}
