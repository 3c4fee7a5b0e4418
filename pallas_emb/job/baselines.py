"""Two reference models on the main job's own train/eval split.

* item popularity: the number of positive training ratings of the item
  (log-loss after a one-feature logistic calibration on the training set);
* logistic regression on one-hot user and item ids (a bias per user, a
  bias per item, a global bias), L2-regularised, full-batch Adam.

Both read the split the job trains and evaluates on (`split.train` /
`split.eval`: user, item, label columns), so their numbers sit beside the
model's in the report.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pallas_emb.train import metrics


class Columns(NamedTuple):
  """(N,) int user and item indices and float labels in {0, 1}."""

  user: np.ndarray
  item: np.ndarray
  label: np.ndarray


def _sigmoid(z):
  return 0.5 * (1.0 + np.tanh(0.5 * z))


def _scores(name: str, logits: np.ndarray, label: np.ndarray) -> dict:
  return {
    "model": name,
    "auc": metrics.auc(logits, label),
    "logloss": metrics.log_loss(logits, label),
  }


def _adam(grad_fn, params: list[np.ndarray], steps: int, lr: float):
  m = [np.zeros_like(p) for p in params]
  v = [np.zeros_like(p) for p in params]
  for t in range(1, steps + 1):
    for p, g, mi, vi in zip(params, grad_fn(params), m, v):
      mi *= 0.9
      mi += 0.1 * g
      vi *= 0.999
      vi += 0.001 * g * g
      p -= lr * (mi / (1 - 0.9**t)) / (np.sqrt(vi / (1 - 0.999**t)) + 1e-8)
  return params


def _fit_logistic(
  columns: list[np.ndarray], sizes: list[int], label, l2: float, steps: int, lr: float
) -> list[np.ndarray]:
  """Weights [bias, w_0, ...] of logit = bias + sum_k w_k[columns[k]]."""
  n = len(label)

  def grads(params):
    z = params[0][0] + sum(w[c] for w, c in zip(params[1:], columns))
    r = (_sigmoid(z) - label) / n
    return [np.array([r.sum()])] + [
      np.bincount(c, r, minlength=s) + l2 * w for c, s, w in zip(columns, sizes, params[1:])
    ]

  params = [np.zeros(1)] + [np.zeros(s) for s in sizes]
  return _adam(grads, params, steps, lr)


def item_popularity(train: Columns, eval_: Columns, num_items: int) -> dict:
  """AUC and log-loss of scoring an item by its positive training count."""
  pos = np.bincount(train.item, train.label, minlength=num_items)
  feature = lambda c: np.log1p(pos[c.item])
  # Calibration: a logistic regression on the one score (two weights).
  x = feature(train)
  a, b = 0.0, 0.0
  for _ in range(200):  # Newton steps on (a, b)
    p = _sigmoid(a * x + b)
    r, h = p - train.label, np.maximum(p * (1 - p), 1e-9)
    g = np.array([np.dot(r, x), r.sum()])
    hess = np.array([[np.dot(h, x * x), np.dot(h, x)], [np.dot(h, x), h.sum()]])
    step = np.linalg.solve(hess + 1e-9 * np.eye(2), g)
    a, b = a - step[0], b - step[1]
    if np.abs(step).max() < 1e-10:
      break
  return _scores("item popularity", a * feature(eval_) + b, eval_.label)


def logistic_user_item(
  train: Columns,
  eval_: Columns,
  num_users: int,
  num_items: int,
  *,
  l2: float = 1e-5,
  steps: int = 300,
  lr: float = 0.05,
) -> dict:
  """AUC and log-loss of a logistic regression on user and item ids."""
  bias, wu, wi = _fit_logistic(
    [train.user, train.item], [num_users, num_items], train.label, l2, steps, lr
  )
  return _scores(
    "logistic regression (user, item ids)", bias[0] + wu[eval_.user] + wi[eval_.item], eval_.label
  )


def run_baselines(train: Columns, eval_: Columns, num_users: int, num_items: int) -> list[dict]:
  """Both baselines -> [{"model", "auc", "logloss"}, ...]."""
  return [
    item_popularity(train, eval_, num_items),
    logistic_user_item(train, eval_, num_users, num_items),
  ]
