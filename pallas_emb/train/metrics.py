"""Evaluation metrics of a click model: ROC AUC and log-loss, on the host."""

from __future__ import annotations

import numpy as np


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """ROC AUC by ranks (tied scores get their average rank); NaN if a class
  is missing."""
  scores, labels = np.asarray(scores, np.float64), np.asarray(labels)
  pos = labels > 0.5
  n_pos, n_neg = int(pos.sum()), int((~pos).sum())
  if not n_pos or not n_neg:
    return float("nan")
  _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
  # Rank of a tied group = mean of the ranks it spans.
  upper = np.cumsum(counts)
  mean_rank = upper - (counts - 1) / 2.0
  ranks = mean_rank[inverse]
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def log_loss(logits: np.ndarray, labels: np.ndarray) -> float:
  """Mean binary cross-entropy of logits, computed stably."""
  z, y = np.asarray(logits, np.float64), np.asarray(labels, np.float64)
  return float(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))))
