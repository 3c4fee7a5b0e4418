"""MovieLens ratings as a click log: rating >= 4 is a positive.

Reads the three formats of the GroupLens releases:

* `u.data` (ML-100K): tab-separated `user item rating timestamp`;
* `ratings.dat` (ML-1M, ML-10M): `user::item::rating::timestamp`;
* `ratings.csv` (ML-20M, ML-25M, latest): `userId,movieId,rating,timestamp`
  with a header line.

Raw ids are remapped to dense indices. The split is by time: the latest
`eval_fraction` of ratings are held out, as a model is deployed on the future.
Features: user, item, hour of day and day of week of the rating.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import numpy as np

from pallas_emb.data.base import DataError, FeatureInfo


def _parse_line(line: str, sep: str | None, path: str, lineno: int):
  fields = line.split(sep) if sep else line.split()
  if len(fields) != 4:
    raise DataError(
        f"{path}:{lineno}: expected 4 fields (user, item, rating, timestamp), "
        f"got {len(fields)}: {line.strip()[:80]!r}")
  try:
    return int(fields[0]), int(fields[1]), float(fields[2]), int(float(fields[3]))
  except ValueError as e:
    raise DataError(
        f"{path}:{lineno}: cannot parse {line.strip()[:80]!r} as integer "
        f"user, item, timestamp and numeric rating ({e}).") from None


def load_ratings(path: str) -> np.ndarray:
  """Reads a ratings file into an (N, 4) float64 array (user, item, rating, ts).

  Raises:
    DataError: the file is missing, empty, or has a malformed line (the
      message names the path and the line number).
  """
  if not os.path.isfile(path):
    raise DataError(f"MovieLens ratings file {path!r} does not exist; pass "
                    "--data=movielens:PATH to u.data, ratings.dat or ratings.csv.")
  name = os.path.basename(path)
  if name.endswith(".csv"):
    sep = ","
  elif name.endswith(".dat"):
    sep = "::"
  else:
    sep = None  # u.data: tabs (any whitespace)
  rows = []
  with open(path, encoding="utf-8", errors="replace") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      if lineno == 1 and sep == "," and line.lower().startswith("userid"):
        continue
      rows.append(_parse_line(line, sep, path, lineno))
  if not rows:
    raise DataError(f"MovieLens ratings file {path!r} holds no ratings.")
  return np.asarray(rows, dtype=np.float64)


@dataclasses.dataclass(frozen=True, eq=False)
class MovieLens:
  """A MovieLens ratings file as train and eval click logs.

  Attributes:
    user, item, hour, weekday: (N,) int32 dense feature indices, time-sorted.
    label: (N,) float32, rating >= 4.
    num_train: the first num_train examples train, the rest evaluate.
    num_users, num_items: vocabulary sizes.
    seed: shuffles training examples (per epoch, deterministically).
  """

  user: np.ndarray
  item: np.ndarray
  hour: np.ndarray
  weekday: np.ndarray
  label: np.ndarray
  num_train: int
  num_users: int
  num_items: int
  seed: int = 0
  num_dense = 0

  @classmethod
  def from_file(cls, path: str, *, eval_fraction: float = 0.1,
                seed: int = 0) -> "MovieLens":
    if not 0.0 < eval_fraction < 1.0:
      raise DataError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")
    r = load_ratings(path)
    if len(r) < 2:
      raise DataError(f"MovieLens ratings file {path!r} holds {len(r)} rating; "
                      "a train/eval split needs at least 2.")
    r = r[np.argsort(r[:, 3], kind="stable")]
    _, user = np.unique(r[:, 0].astype(np.int64), return_inverse=True)
    _, item = np.unique(r[:, 1].astype(np.int64), return_inverse=True)
    ts = r[:, 3].astype(np.int64)
    n = len(r)
    num_train = min(max(int(round(n * (1 - eval_fraction))), 1), n - 1)
    return cls(user=user.astype(np.int32), item=item.astype(np.int32),
               hour=((ts // 3600) % 24).astype(np.int32),
               weekday=((ts // 86400 + 4) % 7).astype(np.int32),  # 1970-01-01: Thursday
               label=(r[:, 2] >= 4).astype(np.float32), num_train=num_train,
               num_users=int(user.max()) + 1, num_items=int(item.max()) + 1,
               seed=seed)

  @property
  def features(self) -> tuple[FeatureInfo, ...]:
    return (FeatureInfo("user", "user", self.num_users, 1, "sum"),
            FeatureInfo("item", "item", self.num_items, 1, "sum"),
            FeatureInfo("hour", "hour", 24, 1, "sum"),
            FeatureInfo("weekday", "weekday", 7, 1, "sum"))

  def _batch(self, idx: np.ndarray, weight: np.ndarray) -> dict:
    col = lambda a: a[idx][:, None].astype(np.int32)
    return {"ids": {"user": col(self.user), "item": col(self.item),
                    "hour": col(self.hour), "weekday": col(self.weekday)},
            "dense": np.zeros((len(idx), 0), np.float32),
            "label": self.label[idx], "weight": weight.astype(np.float32)}

  def train_batch(self, index: int, batch_size: int) -> dict:
    """Batch `index` of an endless, per-epoch shuffled pass over train."""
    positions = index * batch_size + np.arange(batch_size)
    epochs, offsets = np.divmod(positions, self.num_train)
    idx = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
      perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_train)
      sel = epochs == epoch
      idx[sel] = perm[offsets[sel]]
    return self._batch(idx, np.ones(batch_size))

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    """The held-out (latest) ratings; the last batch is zero-weight padded."""
    for start in range(self.num_train, len(self.label), batch_size):
      idx = np.arange(start, start + batch_size)
      weight = idx < len(self.label)
      yield self._batch(np.minimum(idx, len(self.label) - 1), weight)
