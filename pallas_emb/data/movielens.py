"""MovieLens ratings as a click log: rating >= 4 is a positive.

Reads the three formats of the GroupLens releases:

* `u.data` (ML-100K): tab-separated `user item rating timestamp`;
* `ratings.dat` (ML-1M, ML-10M): `user::item::rating::timestamp`;
* `ratings.csv` (ML-20M, ML-25M, latest): `userId,movieId,rating,timestamp`
  with a header line.

Raw ids are integers end to end (never parsed through a float, so ids at or
above 2**53 stay distinct) and are remapped to dense indices. The split is by time: the latest
`eval_fraction` of ratings are held out, as a model is deployed on the future.
Features: user, item, hour of day and day of week of the rating, and the
user's history: the items the user rated positively strictly before the
rating's timestamp (newest first, at most `history_len`), a bag that shares
the item table. Nothing of a rating's own time or later enters its history.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from pallas_emb.data.base import DataError, FeatureInfo


class Ratings(NamedTuple):
  """A ratings file, one entry per rating line, in file order.

  Ids are parsed as integers end to end, never through a float, so distinct
  raw ids stay distinct at any size.

  Attributes:
    user, item: (N,) raw ids: int64, or Python ints (dtype object) when one
      does not fit int64.
    rating: (N,) float64, all finite.
    timestamp: (N,) int64 seconds since the epoch.
  """

  user: np.ndarray
  item: np.ndarray
  rating: np.ndarray
  timestamp: np.ndarray


_INT64 = np.iinfo(np.int64)


def _parse_line(line: str, sep: str | None, path: str, lineno: int):
  fields = line.split(sep) if sep else line.split()
  where = f"{path}:{lineno}"
  if len(fields) != 4:
    raise DataError(
      f"{where}: expected 4 fields (user, item, rating, timestamp), "
      f"got {len(fields)}: {line.strip()[:80]!r}"
    )
  try:
    user, item = int(fields[0]), int(fields[1])
    rating = float(fields[2])
  except ValueError as e:
    raise DataError(
      f"{where}: cannot parse {line.strip()[:80]!r} as integer user and "
      f"item ids and a numeric rating ({e})."
    ) from None
  if not math.isfinite(rating):
    raise DataError(
      f"{where}: rating {fields[2].strip()!r} is not a finite number; fix or drop the line."
    )
  return user, item, rating, _timestamp(fields[3].strip(), where)


def _timestamp(text: str, where: str) -> int:
  """Seconds since the epoch, an integer (written as one, or as a float
  with no fraction) that fits int64."""
  try:
    value = int(text)
  except ValueError:
    try:
      number = float(text)
    except ValueError:
      raise DataError(
        f"{where}: timestamp {text!r} is not a number; it must be integer seconds since the epoch."
      ) from None
    if not math.isfinite(number) or number != int(number):
      raise DataError(
        f"{where}: timestamp {text!r} is not an integer "
        "number of seconds since the epoch; fix or drop the "
        "line."
      ) from None
    value = int(number)
  if not _INT64.min <= value <= _INT64.max:
    raise DataError(
      f"{where}: timestamp {text!r} does not fit int64 seconds; fix or drop the line."
    )
  return value


def _id_array(ids: list[int]) -> np.ndarray:
  """Raw ids as int64, or as exact Python ints when one does not fit."""
  if all(_INT64.min <= i <= _INT64.max for i in ids):
    return np.array(ids, np.int64)
  return np.array(ids, dtype=object)


def load_ratings(path: str) -> Ratings:
  """Reads a ratings file (u.data, ratings.dat or ratings.csv).

  Raises:
    DataError: the file is missing or empty, or a line is malformed or holds
      a non-finite rating or timestamp (the message names the path and the
      line number).
  """
  if not os.path.isfile(path):
    raise DataError(
      f"MovieLens ratings file {path!r} does not exist; pass "
      "--data=movielens:PATH to u.data, ratings.dat or ratings.csv."
    )
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
  user, item, rating, timestamp = zip(*rows)
  return Ratings(
    _id_array(list(user)),
    _id_array(list(item)),
    np.array(rating, np.float64),
    np.array(timestamp, np.int64),
  )


def user_histories(
  user: np.ndarray, item: np.ndarray, positive: np.ndarray, timestamp: np.ndarray, cap: int
) -> np.ndarray:
  """(N, cap) int32: per rating (time-sorted input), the items its user
  rated positively at strictly earlier timestamps, newest first, -1 padded.

  Ratings that share a timestamp do not see each other: none happened
  before the other.
  """
  out = np.full((len(user), cap), -1, np.int32)
  if cap == 0:
    return out
  order = np.argsort(user, kind="stable")  # per user, time order kept
  bounds = np.flatnonzero(np.diff(user[order])) + 1
  for seg in np.split(order, bounds):
    hist = collections.deque(maxlen=cap)
    pending, pending_ts = [], None
    for j in seg:
      if pending and timestamp[j] != pending_ts:
        hist.extend(pending)
        pending = []
      if hist:
        out[j, : len(hist)] = list(reversed(hist))
      if positive[j]:
        pending.append(item[j])
        pending_ts = timestamp[j]
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class MovieLens:
  """A MovieLens ratings file as train and eval click logs.

  Attributes:
    user, item, hour, weekday: (N,) int32 dense feature indices, time-sorted.
    history: (N, history_len) int32 earlier positive items (`user_histories`).
    label: (N,) float32, rating >= 4.
    num_train: the first num_train examples train, the rest evaluate.
    num_users, num_items: vocabulary sizes.
    seed: shuffles training examples (per epoch, deterministically).
  """

  user: np.ndarray
  item: np.ndarray
  hour: np.ndarray
  weekday: np.ndarray
  history: np.ndarray
  label: np.ndarray
  num_train: int
  num_users: int
  num_items: int
  seed: int = 0
  num_dense = 0

  @classmethod
  def from_file(
    cls, path: str, *, eval_fraction: float = 0.1, seed: int = 0, history_len: int = 16
  ) -> MovieLens:
    """Reads `path`; the latest `eval_fraction` of ratings evaluate;
    `history_len` caps the history bag (0: no history feature)."""
    if not 0.0 < eval_fraction < 1.0:
      raise DataError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")
    r = load_ratings(path)
    n = len(r.rating)
    if n < 2:
      raise DataError(
        f"MovieLens ratings file {path!r} holds {n} rating; a train/eval split needs at least 2."
      )
    order = np.argsort(r.timestamp, kind="stable")
    _, user = np.unique(r.user[order], return_inverse=True)
    _, item = np.unique(r.item[order], return_inverse=True)
    ts = r.timestamp[order]
    label = r.rating[order] >= 4
    num_train = min(max(int(round(n * (1 - eval_fraction))), 1), n - 1)
    return cls(
      user=user.astype(np.int32),
      item=item.astype(np.int32),
      hour=((ts // 3600) % 24).astype(np.int32),
      weekday=((ts // 86400 + 4) % 7).astype(np.int32),  # 1970-01-01: Thursday
      history=user_histories(user, item, label, ts, history_len),
      label=label.astype(np.float32),
      num_train=num_train,
      num_users=int(user.max()) + 1,
      num_items=int(item.max()) + 1,
      seed=seed,
    )

  @property
  def features(self) -> tuple[FeatureInfo, ...]:
    return (
      FeatureInfo("user", "user", self.num_users, 1, "sum"),
      FeatureInfo("item", "item", self.num_items, 1, "sum"),
      FeatureInfo("hour", "hour", 24, 1, "sum"),
      FeatureInfo("weekday", "weekday", 7, 1, "sum"),
      *(
        [FeatureInfo("history", "item", self.num_items, self.history.shape[1], "mean")]
        if self.history.shape[1]
        else []
      ),
    )

  @property
  def train_size(self) -> int:
    """Training examples in one epoch."""
    return self.num_train

  def split_columns(self):
    """(train, eval) (user, item, label) columns of the time split, for
    the baselines (`pallas_emb.baselines.Columns`-like tuples)."""
    cut = self.num_train
    return (
      (self.user[:cut], self.item[:cut], self.label[:cut]),
      (self.user[cut:], self.item[cut:], self.label[cut:]),
    )

  def _batch(self, idx: np.ndarray, weight: np.ndarray) -> dict:
    col = lambda a: a[idx][:, None].astype(np.int32)
    return {
      "ids": {
        "user": col(self.user),
        "item": col(self.item),
        "hour": col(self.hour),
        "weekday": col(self.weekday),
        **({"history": self.history[idx]} if self.history.shape[1] else {}),
      },
      "dense": np.zeros((len(idx), 0), np.float32),
      "label": self.label[idx],
      "weight": weight.astype(np.float32),
    }

  def train_batch(self, index: int, batch_size: int) -> dict:
    """Batch `index` of an endless, per-epoch shuffled pass over train."""
    return self.train_rows(index, batch_size, 0, batch_size)

  def train_rows(self, index: int, batch_size: int, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of training batch `index`, reading only those."""
    positions = index * batch_size + np.arange(lo, hi)
    epochs, offsets = np.divmod(positions, self.num_train)
    idx = np.empty(hi - lo, np.int64)
    for epoch in np.unique(epochs):
      perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_train)
      sel = epochs == epoch
      idx[sel] = perm[offsets[sel]]
    return self._batch(idx, np.ones(hi - lo))

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    """The held-out (latest) ratings; the last batch is zero-weight padded."""
    for start in range(self.num_train, len(self.label), batch_size):
      idx = np.arange(start, start + batch_size)
      weight = idx < len(self.label)
      yield self._batch(np.minimum(idx, len(self.label) - 1), weight)
