"""The main job's held-out numbers: the model's AUC and log-loss over the
eval set (gathered from every process), and the baselines' on the same split."""

from __future__ import annotations

import numpy as np

from pallas_emb.data.feed import GlobalBatches
from pallas_emb.job import baselines
from pallas_emb.train import metrics


def evaluate(trainer, state, feeder: GlobalBatches, max_batches: int = 0) -> dict:
  """AUC and log-loss of the held-out set (every process gets the result)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  scores, labels, weights = [], [], []
  for k, (batch, host) in enumerate(feeder.eval()):
    if max_batches and k == max_batches:
      break
    _, aux = trainer.evaluate(state, batch)
    scores.append(np.asarray(multihost_utils.process_allgather(aux["logits"], tiled=True)))
    labels.append(host["label"])
    weights.append(host["weight"])
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
