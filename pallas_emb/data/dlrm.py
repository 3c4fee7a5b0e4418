"""A DLRM-shaped synthetic click log: Criteo's 26 categorical features.

26 tables with the row counts of the Criteo Kaggle display-advertising
challenge's categorical features, each capped at `max_rows` (so that the
whole set fits a CPU; `max_rows=None` keeps the real counts, ~33.8M rows),
one id per feature and example (Zipf over the table's rows, by inversion:
`pallas_emb.data.zipf`), 13 dense features, and a click drawn from a
planted model (a hidden bias per row of every table plus a dense term), so
the job can learn. Row widths follow the vocabulary, as
DLRM configurations do: `dim_of(rows)` is 16 up to 1k rows, 32 up to 100k,
64 up to 1M and 128 above, so the tables fall into a few stackable groups.
Batches are a pure function of (seed, index).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import numpy as np

from pallas_emb.data import zipf
from pallas_emb.data.base import FeatureInfo

# Criteo Kaggle (DAC) categorical cardinalities, C1..C26.
CRITEO_ROWS = (
  1460,
  583,
  10131227,
  2202608,
  305,
  24,
  12517,
  633,
  3,
  93145,
  5683,
  8351593,
  3194,
  27,
  14992,
  5461306,
  10,
  5652,
  2173,
  4,
  7046547,
  18,
  15,
  286181,
  105,
  142572,
)

_TRAIN, _EVAL = 0, 1
_BLOCK = 16  # held-out examples per random stream


def dim_of(rows: int) -> int:
  """The row width DLRM-style configurations give a vocabulary of `rows`."""
  for limit, dim in ((1_000, 16), (100_000, 32), (1_000_000, 64)):
    if rows <= limit:
      return dim
  return 128


@dataclasses.dataclass(frozen=True)
class DlrmClickLog:
  """Deterministic synthetic click log shaped like Criteo's.

  Attributes:
    max_rows: cap of every table's rows (None: the real counts). The width
      follows the real count, so capping keeps the groups.
    zipf_a: Zipf exponent of the ids (> 0).
    eval_examples: size of the held-out set.
    seed: everything derives from it.
  """

  max_rows: int | None = 20_000
  zipf_a: float = 1.1
  eval_examples: int = 8_192
  seed: int = 0
  num_dense: int = 13

  @property
  def features(self) -> tuple[FeatureInfo, ...]:
    return tuple(
      FeatureInfo(f"C{i + 1}", f"C{i + 1}", self.rows(i), 1, "sum") for i in range(len(CRITEO_ROWS))
    )

  def rows(self, i: int) -> int:
    return min(CRITEO_ROWS[i], self.max_rows or CRITEO_ROWS[i])

  @property
  def dims(self) -> dict[str, int]:
    """Table name -> row width (from the real vocabulary)."""
    return {f"C{i + 1}": dim_of(r) for i, r in enumerate(CRITEO_ROWS)}

  @functools.cached_property
  def _truth(self):
    rng = np.random.default_rng([self.seed, 2])
    return {
      "bias": [rng.normal(size=self.rows(i)) * 0.4 for i in range(len(CRITEO_ROWS))],
      "w": rng.normal(size=self.num_dense) * 0.3,
    }

  @functools.cached_property
  def _cdf(self) -> dict[int, np.ndarray]:
    """The ids' Zipf CDFs (`zipf.cdf`), by row count: capped tables share one."""
    return {f.num_rows: zipf.cdf(f.num_rows, self.zipf_a) for f in self.features}

  def _examples(self, rng, n) -> dict:
    t, cdf = self._truth, self._cdf
    u = rng.random((len(self.features), n))
    ids = {f.name: zipf.ids(cdf[f.num_rows], u[i]) for i, f in enumerate(self.features)}
    dense = rng.normal(size=(n, self.num_dense)).astype(np.float32)
    logit = sum(b[ids[f.name]] for b, f in zip(t["bias"], self.features))
    logit = logit / np.sqrt(len(CRITEO_ROWS)) + dense @ t["w"] - 1.0
    label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return {
      "ids": {k: v[:, None] for k, v in ids.items()},
      "dense": dense,
      "label": label,
      "weight": np.ones(n, np.float32),
      "true_logit": logit.astype(np.float32),
    }

  def train_batch(self, index: int, batch_size: int) -> dict:
    """Training batch `index` (any int >= 0): deterministic."""
    return self._examples(np.random.default_rng([self.seed, _TRAIN, index]), batch_size)

  def train_rows(self, index: int, batch_size: int, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of training batch `index`. A batch is one random
    stream, so this generates the whole batch (cheap: one id per table)."""
    return _rows(self.train_batch(index, batch_size), np.arange(lo, hi))

  @property
  def eval_size(self) -> int:
    return self.eval_examples

  def eval_rows(self, index: int, batch_size: int, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of held-out batch `index`, generating only the blocks
    of 16 examples they overlap (block j from stream (seed, 1, j)); rows
    past the end repeat the last example at weight 0."""
    n = self.eval_examples
    positions = index * batch_size + np.arange(lo, hi)
    clamped = np.minimum(positions, n - 1)
    first, last = clamped[0] // _BLOCK, clamped[-1] // _BLOCK + 1
    blocks = [
      self._examples(np.random.default_rng([self.seed, _EVAL, j]), min(_BLOCK, n - j * _BLOCK))
      for j in range(first, last)
    ]
    whole = {
      k: {f: np.concatenate([b[k][f] for b in blocks]) for f in blocks[0][k]}
      if isinstance(blocks[0][k], dict)
      else np.concatenate([b[k] for b in blocks])
      for k in blocks[0]
    }
    batch = _rows(whole, clamped - first * _BLOCK)
    batch["weight"] = (positions < n).astype(np.float32)
    return batch

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    """The held-out set in batches; the last zero-weighted past its end."""
    for index in range(-(-self.eval_examples // batch_size)):
      yield self.eval_rows(index, batch_size, 0, batch_size)


def _rows(batch: dict, idx: np.ndarray) -> dict:
  return {
    k: ({f: a[idx] for f, a in v.items()} if isinstance(v, dict) else v[idx])
    for k, v in batch.items()
  }
