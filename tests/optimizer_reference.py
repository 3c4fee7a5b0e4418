"""The optimizers' row math in float64 NumPy, written from their docstrings:
the oracle of the differential test (`test_differential.py`), independent of
`update_rows` and of every backend. Each takes (V, D) float64 rows, their
slots {name: (V, width)} and (V, D) summed gradients, and returns the new
rows and slots."""

from __future__ import annotations

import numpy as np

import pallas_emb as pe


def _sgd(opt, rows, slots, g):
  return rows - opt.learning_rate * g, {}


def _adagrad(opt, rows, slots, g):
  acc = slots["acc"] + g * g
  scale = np.where(acc > 0, 1.0 / np.sqrt(acc + opt.eps), 0.0)
  return rows - opt.learning_rate * g * scale, {"acc": acc}


def _rowwise_adagrad(opt, rows, slots, g):
  # Reference configuration: no decay, no weight decay.
  acc = slots["acc"] + np.mean(g * g, axis=1, keepdims=True)
  return rows - opt.learning_rate * g / (np.sqrt(acc) + opt.eps), {"acc": acc}


def _lazy_adam(opt, rows, slots, g):
  count = slots["count"] + 1
  m = opt.b1 * slots["m"] + (1 - opt.b1) * g
  v = opt.b2 * slots["v"] + (1 - opt.b2) * g * g
  bc1, bc2 = 1 - opt.b1**count, 1 - opt.b2**count
  step = (m / bc1) / (np.sqrt(v / bc2) + opt.eps)
  return rows - opt.learning_rate * step, {"m": m, "v": v, "count": count}


def _ftrl(opt, rows, slots, g):
  # learning_rate_power -0.5, l1 = l2 = beta = 0 (the reference configuration).
  lr, n, z = opt.learning_rate, slots["accumulator"], slots["linear"]
  n_new = n + g * g
  z_new = z + g - (np.sqrt(n_new) - np.sqrt(n)) / lr * rows
  quad = np.sqrt(n_new) / lr
  w = np.where(quad > 0, -z_new / np.where(quad > 0, quad, 1.0), rows)
  return w, {"accumulator": n_new, "linear": z_new}


# The configurations the differential test draws, each with its float64 math.
OPTIMIZERS = {
  "sgd": (pe.SGD(0.5), _sgd),
  "adagrad": (pe.Adagrad(0.25), _adagrad),
  "rowwise_adagrad": (pe.RowWiseAdagrad(0.1, half_life_steps=None), _rowwise_adagrad),
  "lazy_adam": (pe.LazyAdam(0.05), _lazy_adam),
  "ftrl": (pe.FTRL(0.1), _ftrl),
}


def apply(name: str, rows, slots, grads, touched):
  """The update of the `touched` (V,) bool rows; the others unchanged."""
  opt, math = OPTIMIZERS[name]
  new_rows, new_slots = math(opt, rows, slots, grads)
  keep = touched[:, None]
  return np.where(keep, new_rows, rows), {
    k: np.where(keep, new_slots[k], v) for k, v in slots.items()
  }
