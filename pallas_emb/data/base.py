"""What the main job needs from a data source.

A batch is a dict of NumPy arrays:
  "ids":    feature -> (B, L) int32 (-1 = padding),
  "dense":  (B, num_dense) float32,
  "label":  (B,) float32 click / positive in {0, 1},
  "weight": (B,) float32, 0 for padding examples of a last eval batch.
Training batches are a pure function of (seed, index), so a resumed run sees
the same data as an uninterrupted one. Each process reads only its rows of a
batch, training (`train_rows`) and held-out (`eval_rows`) alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol


class DataError(ValueError):
  """A data source that cannot be read: missing file, malformed line."""


class FeatureInfo(NamedTuple):
  """A categorical feature: its table, vocabulary, bag size and combiner."""

  name: str
  table: str
  num_rows: int
  bag_size: int
  combiner: str | None


class Dataset(Protocol):
  """A click log: feature layout, training batches by index, eval batches."""

  @property
  def features(self) -> tuple[FeatureInfo, ...]:
    """The categorical features, in model input order."""

  @property
  def num_dense(self) -> int:
    """Dense (float) inputs per example."""

  def train_batch(self, index: int, batch_size: int) -> dict:
    """Training batch `index`, a pure function of the dataset and index."""

  def train_rows(self, index: int, batch_size: int, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of `train_batch(index, batch_size)`, computing or
    reading only those (each process feeds its own rows)."""

  @property
  def eval_size(self) -> int:
    """Examples in the held-out set."""

  def eval_rows(self, index: int, batch_size: int, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of held-out batch `index` (of ceil(eval_size /
    batch_size)), computing or reading only those; rows past the set's end
    have weight 0."""

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    """The held-out set; the last batch zero-weighted past its end."""
