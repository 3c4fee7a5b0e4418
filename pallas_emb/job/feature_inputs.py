"""A dataset's batches as a model's features read them.

A model may read one input through several tables (the factorization model
reads the item ids through the item vectors and the item biases): the
embedding needs one id array per feature, so each batch gets, for each model
feature, the ids of the dataset input it names. Everything else (training
and held-out rows, their sizes) is the dataset's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pallas_emb.data.base import FeatureInfo


class BatchMap:
  """A data source whose training and held-out batches are those of
  `self.source` passed through `_map`."""

  source: Any

  def _map(self, batch: dict) -> dict:
    raise NotImplementedError

  def train_rows(self, index: int, batch_size: int, lo: int, hi: int) -> dict:
    return self._map(self.source.train_rows(index, batch_size, lo, hi))

  def train_batch(self, index: int, batch_size: int) -> dict:
    return self.train_rows(index, batch_size, 0, batch_size)

  def eval_rows(self, index: int, batch_size: int, lo: int, hi: int) -> dict:
    return self._map(self.source.eval_rows(index, batch_size, lo, hi))

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    for batch in self.source.eval_batches(batch_size):
      yield self._map(batch)


class FeatureInputs(BatchMap):
  """`dataset` whose batches' "ids" are keyed by the model's features.

  Args:
    dataset: a `pallas_emb.data.Dataset`.
    features: the model's features (their bag sizes are the inputs').
    inputs: model feature -> the dataset input whose ids it reads.
  """

  def __init__(self, dataset, features: tuple[FeatureInfo, ...], inputs: Mapping[str, str]):
    self.dataset, self.features, self.inputs = dataset, tuple(features), dict(inputs)
    self.source = dataset
    self.num_dense = dataset.num_dense

  @property
  def train_size(self) -> int:
    return self.dataset.train_size

  @property
  def eval_size(self) -> int:
    return self.dataset.eval_size

  def _map(self, batch: dict) -> dict:
    ids = batch["ids"]
    return {**batch, "ids": {f: ids[source] for f, source in self.inputs.items()}}
