"""Adam applied lazily: only rows in the batch move, with a per-row step count.

For a touched row with summed gradient g and per-row count t (after += 1):

    m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g ** 2
    row -= lr * (m / (1 - b1 ** t)) / (sqrt(v / (1 - b2 ** t)) + eps)

Rows absent from a batch keep m, v and t: the bias correction uses the row's
own count, so a rare row is not under-corrected (unlike a global count).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.optimizers import base
from pallas_emb.optimizers.fused_async import FusedAsyncEmbUpdate


def _bias_correction(b: float, t: jax.Array):
  """1 - b ** t for a float32 count t >= 1, accurate to float32 rounding.

  `1 - exp(t * log b)` cancels catastrophically while b ** t is near 1 (at
  t = 1, b = 0.999 loses 8 of float32's 24 bits; a rarely seen row keeps a
  small count for ever, and b near 1 keeps b ** t near 1 for long runs).
  This is -expm1(x) for x = t * log b <= 0, written with tanh because Pallas
  has no TPU lowering of expm1: with h = tanh(x / 2), expm1(x) =
  2h / (1 - h), and 1 - h lies in [1, 2), so nothing cancels. log b is
  rounded once, on the host in float64; nothing on the device is float64
  (TPU has none).
  """
  if not b:
    return 1
  h = jnp.tanh(t * np.float32(math.log(b) / 2))
  return -2 * h / (1 - h)


class AdamScalars(NamedTuple):
  learning_rate: jax.Array


@dataclasses.dataclass(frozen=True)
class LazyAdam(base.EmbeddingOptimizer, FusedAsyncEmbUpdate):
  """Row-lazy Adam (slots `m`, `v`: (rows, dim); `count`: (rows, 1) int32).

  Attributes:
    learning_rate: float >= 0 or a schedule of the step.
    b1, b2: moment decays in [0, 1).
    eps: > 0.
  """

  learning_rate: base.LearningRate = 1e-3
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8

  def __post_init__(self):
    name = type(self).__name__
    base.check_learning_rate(name, self.learning_rate)
    base.check_range(name, "b1", self.b1, 0.0, 1.0, hi_open=True)
    base.check_range(name, "b2", self.b2, 0.0, 1.0, hi_open=True)
    base.check_range(name, "eps", self.eps, 0.0, math.inf, lo_open=True)

  def slot_specs(self):
    return {
      "m": base.SlotSpec(width=None),
      "v": base.SlotSpec(width=None),
      "count": base.SlotSpec(width=1, dtype=np.int32, init=0),
    }

  def scalars(self, step) -> AdamScalars:
    return AdamScalars(base.learning_rate_at(self.learning_rate, step))

  def bias_corrections(self, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(1 - b1 ** t, 1 - b2 ** t), float32 of count's shape, for the
    updated per-row counts t = `count` (int32)."""
    t = count.astype(jnp.float32)
    return tuple(
      jnp.broadcast_to(jnp.asarray(_bias_correction(b, t), jnp.float32), t.shape)
      for b in (self.b1, self.b2)
    )

  def native_rule(self):
    """("lazy_adam", (b1, b2, eps), per_row): the C++ rule of the native CPU
    backend, whose bias corrections (per row, from the `count` slot) XLA
    computes with `bias_corrections`; or None for a subclass with its own
    `update_rows`."""
    if type(self).update_rows is not LazyAdam.update_rows:
      return None
    per_row = lambda slots, scalars: jnp.concatenate(
      self.bias_corrections(slots["count"] + 1), axis=-1
    )
    return "lazy_adam", (self.b1, self.b2, self.eps), per_row

  def update_rows(self, rows, slots, grads, scalars: AdamScalars):
    count = slots["count"] + 1
    bc1, bc2 = self.bias_corrections(count)
    b1, b2 = np.float32(self.b1), np.float32(self.b2)
    m = b1 * slots["m"] + (1 - b1) * grads
    v = b2 * slots["v"] + (1 - b2) * (grads * grads)
    update = (m / bc1) / (jnp.sqrt(v / bc2) + np.float32(self.eps))
    return rows - scalars.learning_rate * update, {"m": m, "v": v, "count": count}


# The reference's name for it.
AsyncEmbAdam = LazyAdam
