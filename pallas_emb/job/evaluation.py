"""The main job's held-out numbers: the model's AUC and log-loss over the
eval set, and the baselines' on the same split.

Each process reads only its rows of each held-out batch (`GlobalBatches.eval`);
the logits, labels and weights of the whole batch are gathered from the global
arrays, so every process computes the same numbers."""

from __future__ import annotations

import itertools

import numpy as np

from pallas_emb.data.feed import GlobalBatches
from pallas_emb.job import baselines
from pallas_emb.train import metrics


def evaluate(trainer, state, feeder: GlobalBatches, max_batches: int = 0) -> dict:
  """AUC and log-loss of the held-out set (every process gets the result)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  scores, labels, weights = [], [], []
  # islice stops before the generator reads the batch after the last.
  for batch, _ in itertools.islice(feeder.eval(), max_batches or None):
    _, aux = trainer.evaluate(state, batch)
    s, y, w = multihost_utils.process_allgather(
      (aux["logits"], batch["label"], batch["weight"]), tiled=True
    )
    scores.append(np.asarray(s))
    labels.append(np.asarray(y))
    weights.append(np.asarray(w))
  s, y, w = (np.concatenate(x) for x in (scores, labels, weights))
  keep = w > 0
  return {
    "auc": metrics.auc(s[keep], y[keep]),
    "logloss": metrics.log_loss(s[keep], y[keep]),
    "examples": int(keep.sum()),
  }


def baselines_of(dataset, enabled: bool = True) -> list[dict]:
  """The two baselines on the dataset's own split (MovieLens), else []."""
  if not enabled or not hasattr(dataset, "split_columns"):
    return []
  train, eval_ = (baselines.Columns(*c) for c in dataset.split_columns())
  return baselines.run_baselines(train, eval_, dataset.num_users, dataset.num_items)
