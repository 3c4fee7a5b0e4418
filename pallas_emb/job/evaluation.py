"""The main job's held-out numbers: the model's AUC and log-loss over the
eval set, and the baselines' on the same split.

Each process reads only its rows of each held-out batch (`GlobalBatches.eval`);
the logits, labels and weights of the whole batch are gathered from the global
arrays, so every process computes the same numbers."""

from __future__ import annotations

import itertools

import jax
import numpy as np

from pallas_emb.data.feed import GlobalBatches
from pallas_emb.job import baselines
from pallas_emb.train import metrics


def evaluate(trainer, state, feeder: GlobalBatches, max_batches: int = 0, served=None) -> dict:
  """AUC and log-loss of the held-out set (every process gets the result).

  With `served` (a `ServingModel` of these tables, on this process), each
  batch is also scored through it: the whole batch's ids looked up by the
  artifact, the dense model applied to its activations on the host's
  parameters; the result's "served" holds those numbers and the largest
  difference of a logit from the training lookup's.
  """
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  scores, labels, weights, served_scores = [], [], [], []
  if served is not None:
    params = jax.device_get(state.params)
    served_loss = jax.jit(trainer.loss_fn)
  # islice stops before the generator reads the batch after the last.
  for batch, _ in itertools.islice(feeder.eval(), max_batches or None):
    _, aux = trainer.evaluate(state, batch)
    # The whole batch reaches the host only for the artifact's lookup.
    rows = batch if served is not None else {k: batch[k] for k in ("label", "weight")}
    s, whole = multihost_utils.process_allgather((aux["logits"], rows), tiled=True)
    scores.append(np.asarray(s))
    labels.append(np.asarray(whole["label"]))
    weights.append(np.asarray(whole["weight"]))
    if served is not None:
      whole = jax.tree.map(np.asarray, whole)
      acts, _ = served.lookup(whole["ids"])
      served_scores.append(np.asarray(served_loss(params, acts, whole)[1]["logits"]))
  s, y, w = (np.concatenate(x) for x in (scores, labels, weights))
  keep = w > 0
  out = _scores(s[keep], y[keep])
  if served is not None:
    s_served = np.concatenate(served_scores)
    out["served"] = {
      **_scores(s_served[keep], y[keep]),
      "max_abs_logit_difference": float(np.max(np.abs(s_served - s), initial=0.0)),
    }
  return out


def _scores(s: np.ndarray, y: np.ndarray) -> dict:
  return {"auc": metrics.auc(s, y), "logloss": metrics.log_loss(s, y), "examples": int(s.size)}


def baselines_of(dataset, enabled: bool = True) -> list[dict]:
  """The two baselines on the dataset's own split (MovieLens), else []."""
  if not enabled or not hasattr(dataset, "split_columns"):
    return []
  train, eval_ = (baselines.Columns(*c) for c in dataset.split_columns())
  return baselines.run_baselines(train, eval_, dataset.num_users, dataset.num_items)
