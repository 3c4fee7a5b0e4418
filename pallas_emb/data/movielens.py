"""MovieLens ratings as a click log: rating >= 4 is a positive.

Reads every format of `pallas_emb.data.ratings_file` (u.data, ratings.dat,
ratings.csv, RecBole's .inter). Raw ids are remapped to dense indices. The
split is by time: the latest `eval_fraction` of ratings evaluate, as a model
is deployed on the future; `validation_fraction` instead evaluates on that
share of ratings just before them (and drops the latest `eval_fraction`), so
that settings are chosen without looking at the evaluation window.

Features: user, item, hour of day and day of week of the rating, and the
user's history: the user's ratings strictly before this one's timestamp
(newest first, at most `history_len`), each as a token `2 * item + liked`
(liked: rating >= 4), a bag of its own table. A bag of such tokens tells
what the user liked and disliked, and its mean how often they liked: most
of the latest ratings come from users with none in the training period
(71% of ml-100k's last 10%), whom only their history describes. Nothing of
a rating's own time or later enters its history.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

import numpy as np

from pallas_emb.data.base import DataError, FeatureInfo
from pallas_emb.data.ratings_file import load_ratings


def user_histories(
  user: np.ndarray, token: np.ndarray, keep: np.ndarray, timestamp: np.ndarray, cap: int
) -> np.ndarray:
  """(N, cap) int32: per rating (time-sorted input), the tokens of its
  user's ratings at strictly earlier timestamps that `keep` selects, newest
  first, -1 padded.

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
      if keep[j]:
        pending.append(token[j])
        pending_ts = timestamp[j]
  return out


def _split(n: int, eval_fraction: float, validation_fraction: float) -> tuple[int, int]:
  """(train examples, evaluated end): train [0, t), evaluate [t, end)."""
  if not 0.0 < eval_fraction < 1.0:
    raise DataError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")
  if not 0.0 <= validation_fraction < 1.0 - eval_fraction:
    raise DataError(
      f"validation_fraction must be in [0, 1 - eval_fraction = {1 - eval_fraction:g}), got "
      f"{validation_fraction}; it is the share of all ratings, just before the evaluation "
      "window, that evaluates instead of it (0: evaluate on the evaluation window)."
    )
  end = min(max(int(round(n * (1 - eval_fraction))), 1), n - 1)
  if not validation_fraction:
    return end, n
  train = int(round(n * (1 - eval_fraction - validation_fraction)))
  if not 1 <= train < end:
    raise DataError(
      f"validation_fraction={validation_fraction} of {n} ratings leaves {train} to train "
      f"and {end - train} to validate; each needs at least one."
    )
  return train, end


@dataclasses.dataclass(frozen=True, eq=False)
class MovieLens:
  """A MovieLens ratings file as train and eval click logs.

  Attributes:
    user, item, hour, weekday: (N,) int32 dense feature indices, time-sorted,
      the training examples then the evaluated ones (with a validation
      window, the latest ratings are not among them).
    history: (N, history_len) int32 tokens `2 * item + liked` of the user's
      earlier ratings (`user_histories`).
    label: (N,) float32, rating >= 4.
    num_train: the first num_train examples train, the rest evaluate.
    num_users, num_items: vocabulary sizes (of the whole file).
    window: "evaluation" (the latest ratings) or "validation" (those just
      before them) is evaluated.
    seed: shuffles training examples (per epoch, deterministically).
    user_raw, item_raw: the file's own id of each user and item index
      (`raw_ids`), or None.
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
  window: str = "evaluation"
  seed: int = 0
  user_raw: np.ndarray | None = None
  item_raw: np.ndarray | None = None
  num_dense = 0
  # The inputs whose ids are raw user or item ids (`raw_ids`); the history
  # tokens are not (2 * item + liked).
  raw_inputs = ("user", "item")

  @classmethod
  def from_file(
    cls,
    path: str,
    *,
    eval_fraction: float = 0.1,
    validation_fraction: float = 0.0,
    seed: int = 0,
    history_len: int = 50,
  ) -> MovieLens:
    """Reads `path`; the latest `eval_fraction` of ratings evaluate, or,
    with `validation_fraction` > 0, that share of all ratings just before
    them (the latest are dropped); `history_len` caps the history bag (0: no
    history feature)."""
    r = load_ratings(path)
    n = len(r.rating)
    if n < 2:
      raise DataError(
        f"MovieLens ratings file {path!r} holds {n} rating; a train/eval split needs at least 2."
      )
    num_train, end = _split(n, eval_fraction, validation_fraction)
    order = np.argsort(r.timestamp, kind="stable")
    user_raw, user = np.unique(r.user[order], return_inverse=True)
    item_raw, item = np.unique(r.item[order], return_inverse=True)
    ts = r.timestamp[order]
    label = r.rating[order] >= 4
    history = user_histories(user, 2 * item + label, np.ones(n, bool), ts, history_len)
    keep = slice(0, end)
    return cls(
      user=user[keep].astype(np.int32),
      item=item[keep].astype(np.int32),
      hour=((ts[keep] // 3600) % 24).astype(np.int32),
      weekday=((ts[keep] // 86400 + 4) % 7).astype(np.int32),  # 1970-01-01: Thursday
      history=history[keep],
      label=label[keep].astype(np.float32),
      num_train=num_train,
      num_users=int(user.max()) + 1,
      num_items=int(item.max()) + 1,
      window="validation" if validation_fraction else "evaluation",
      seed=seed,
      user_raw=user_raw,
      item_raw=item_raw,
    )

  @property
  def features(self) -> tuple[FeatureInfo, ...]:
    return (
      FeatureInfo("user", "user", self.num_users, 1, "sum"),
      FeatureInfo("item", "item", self.num_items, 1, "sum"),
      FeatureInfo("hour", "hour", 24, 1, "sum"),
      FeatureInfo("weekday", "weekday", 7, 1, "sum"),
      *(
        [FeatureInfo("history", "history", 2 * self.num_items, self.history.shape[1], "mean")]
        if self.history.shape[1]
        else []
      ),
    )

  def raw_ids(self, name: str, ids: np.ndarray) -> np.ndarray:
    """The file's own ids of input `name`'s ("user" or "item") indices
    `ids` (-1 stays -1); other inputs' ids as they are (int64)."""
    raw = {"user": self.user_raw, "item": self.item_raw}.get(name)
    ids = np.asarray(ids)
    if raw is None:
      return ids.astype(np.int64)
    return np.where(ids >= 0, raw[np.maximum(ids, 0)], -1)

  @property
  def train_size(self) -> int:
    """Training examples in one epoch."""
    return self.num_train

  @property
  def eval_size(self) -> int:
    """Evaluated examples."""
    return len(self.label) - self.num_train

  def split_columns(self):
    """(train, eval) (user, item, label) columns of the time split, for
    the baselines (`pallas_emb.job.baselines.Columns`-like tuples)."""
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

  def eval_rows(self, index: int, batch_size: int, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of evaluation batch `index` (in time order), reading
    only those; rows past the end repeat the last example at weight 0."""
    positions = self.num_train + index * batch_size + np.arange(lo, hi)
    last = len(self.label) - 1
    return self._batch(np.minimum(positions, last), positions <= last)

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    """The evaluated (latest, or validation) ratings; the last batch is
    zero-weight padded."""
    for index in range(-(-self.eval_size // batch_size)):
      yield self.eval_rows(index, batch_size, 0, batch_size)
