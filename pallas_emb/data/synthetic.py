"""A synthetic click log with a planted ground truth.

Users and items are Zipf-distributed (a few hot ids, a long tail), as in real
recommender logs: id k of a vocabulary of V with probability proportional to
(k + 1)^-zipf_a, k < V. Each example's click probability comes from a hidden
model:

    logit = 2 * <u[user], v[item]> + item_bias[item] + category_bias[cat]
            + <w, dense> + mean_h <v[h], v[item]> - 1

with low-rank latent vectors u, v. An embedding model can learn all of it, so
eval AUC measures learning (the hidden model's own AUC is its ceiling).
Batches are a pure function of (seed, index), generated in blocks of 128
examples (block j of batch i from stream (seed, 0, i, j)), so a process
generates only the blocks of its own rows (`train_rows`); so is the held-out
set (`eval_rows`).

A block's stream gives only uniform and normal draws; the ids come from the
uniforms by inverting the Zipf CDF (`pallas_emb.data.zipf`: a table of V
float64s per vocabulary, a quarter of what the hidden model keeps per user),
and the rest of the arithmetic runs once over a batch's rows. Why: the main
job reads its input between steps, and a 1,024-row batch took 4.0 ms with
16-row blocks and NumPy's Zipf sampler (a generator and six draws per
block, then rejection sampling), 1.6 ms so, on a 2-core CPU; one v5e chip
steps the main job's batch in about 3.4 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import numpy as np

from pallas_emb.data import zipf
from pallas_emb.data.base import FeatureInfo

# Block j of training batch i uses stream (seed, 0, i, j); block j of the
# eval set stream (seed, 1, j).
_TRAIN, _EVAL = 0, 1
# Each block costs a generator and six draws (about 20 us): at 16 rows a
# 1,024-row batch took 2.6 ms, at 128 rows 1.6. A process makes the blocks
# its rows overlap: fewer than 256 rows beyond its own.
_BLOCK = 128


def _take_examples(tree: dict, idx: np.ndarray) -> dict:
  """Rows `idx` of every array of a (nested) batch dict."""
  return {k: _take_examples(v, idx) if isinstance(v, dict) else v[idx] for k, v in tree.items()}


@dataclasses.dataclass(frozen=True)
class SyntheticClickLog:
  """Deterministic synthetic click log.

  Attributes:
    num_users, num_items, num_categories: vocabulary sizes.
    history_len: length of the "history" bag (recent items, -1 padded).
    num_dense: dense features per example.
    latent_dim: rank of the hidden user/item interaction.
    zipf_a: Zipf exponent of user and item ids (> 0).
    eval_examples: size of the held-out set.
    seed: everything derives from it.
  """

  num_users: int = 50_000
  num_items: int = 20_000
  num_categories: int = 64
  history_len: int = 8
  num_dense: int = 4
  latent_dim: int = 4
  zipf_a: float = 1.15
  eval_examples: int = 16_384
  seed: int = 0

  # The inputs whose ids are raw user or item ids (a dynamic table's,
  # `pallas_emb.job.vocabularies`); this log's ids are its raw ids.
  raw_inputs = ("user", "item", "history")

  @property
  def features(self) -> tuple[FeatureInfo, ...]:
    return (
      FeatureInfo("user", "user", self.num_users, 1, "sum"),
      FeatureInfo("item", "item", self.num_items, 1, "sum"),
      FeatureInfo("category", "category", self.num_categories, 1, "sum"),
      FeatureInfo("history", "item", self.num_items, self.history_len, "mean"),
    )

  @functools.cached_property
  def _truth(self):
    rng = np.random.default_rng([self.seed, 2])
    k = self.latent_dim
    return {
      "u": rng.normal(size=(self.num_users, k)) / np.sqrt(k),
      "v": rng.normal(size=(self.num_items, k)) / np.sqrt(k),
      "item_bias": rng.normal(size=self.num_items) * 0.8,
      "item_category": rng.integers(0, self.num_categories, self.num_items),
      "category_bias": rng.normal(size=self.num_categories),
      "w": rng.normal(size=self.num_dense) * 0.5,
    }

  @functools.cached_property
  def _cdf(self) -> tuple[np.ndarray, np.ndarray]:
    """The Zipf CDFs of user and item ids (`zipf.cdf`)."""
    return zipf.cdf(self.num_users, self.zipf_a), zipf.cdf(self.num_items, self.zipf_a)

  def _draws(self, rng, n) -> tuple[np.ndarray, ...]:
    """One block's random draws, in the stream's order: the uniforms of
    the user, item and history ids, history lengths, dense features, the
    label's uniform."""
    return (
      rng.random(n),
      rng.random(n),
      rng.random((n, self.history_len)),
      rng.integers(0, self.history_len + 1, n),
      rng.normal(size=(n, self.num_dense)).astype(np.float32),
      rng.random(n),
    )

  def _examples(self, draws: tuple[np.ndarray, ...]) -> dict:
    """Examples from their draws (any number of blocks' rows at once)."""
    t = self._truth
    u_user, u_item, u_history, lengths, dense, uniform = draws
    users, items = self._cdf
    user, item, history = (
      zipf.ids(c, u) for c, u in ((users, u_user), (items, u_item), (items, u_history))
    )
    category = t["item_category"][item].astype(np.int32)
    history = np.where(np.arange(self.history_len) < lengths[:, None], history, -1)
    hv = np.where((history >= 0)[..., None], t["v"][np.maximum(history, 0)], 0.0)
    history_effect = np.einsum("nhk,nk->n", hv, t["v"][item]) / np.maximum(lengths, 1)
    logit = (
      2.0 * np.einsum("nk,nk->n", t["u"][user], t["v"][item])
      + t["item_bias"][item]
      + t["category_bias"][category]
      + dense @ t["w"]
      + history_effect
      - 1.0
    )
    label = (uniform < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return {
      "ids": {
        "user": user[:, None],
        "item": item[:, None],
        "category": category[:, None],
        "history": history.astype(np.int32),
      },
      "dense": dense,
      "label": label,
      "weight": np.ones(len(user), np.float32),
      "true_logit": logit.astype(np.float32),
    }

  def _blocks(self, stream: tuple, sizes: list[tuple[int, int]]) -> dict:
    """Blocks (j, examples) of stream (seed, *stream, j), concatenated.

    Only the draws are made block by block; the ids' inversion and the
    examples' arithmetic run once over all their rows (see the module
    docstring for the times)."""
    draws = [self._draws(np.random.default_rng([self.seed, *stream, j]), n) for j, n in sizes]
    return self._examples(tuple(np.concatenate(d) for d in zip(*draws)))

  def train_rows(self, index: int, batch_size: int, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of training batch `index`, generating only the blocks
    they overlap."""
    first, last = lo // _BLOCK, -(-hi // _BLOCK)
    sizes = [(j, min(_BLOCK, batch_size - j * _BLOCK)) for j in range(first, last)]
    offset = first * _BLOCK
    return _take_examples(self._blocks((_TRAIN, index), sizes), np.arange(lo - offset, hi - offset))

  def train_batch(self, index: int, batch_size: int) -> dict:
    """Training batch `index` (any int >= 0): deterministic."""
    return self.train_rows(index, batch_size, 0, batch_size)

  @property
  def eval_size(self) -> int:
    return self.eval_examples

  def eval_rows(self, index: int, batch_size: int, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of held-out batch `index`, generating only the blocks
    they overlap (block j of the set from stream (seed, 1, j): the same
    examples whatever the batch size); rows past the end repeat the last
    example at weight 0."""
    n = self.eval_examples
    positions = index * batch_size + np.arange(lo, hi)
    clamped = np.minimum(positions, n - 1)
    first, last = clamped[0] // _BLOCK, clamped[-1] // _BLOCK + 1
    sizes = [(j, min(_BLOCK, n - j * _BLOCK)) for j in range(first, last)]
    batch = _take_examples(self._blocks((_EVAL,), sizes), clamped - first * _BLOCK)
    batch["weight"] = (positions < n).astype(np.float32)
    return batch

  def eval_batches(self, batch_size: int) -> Iterator[dict]:
    """The held-out set in batches of `batch_size`; the last one
    zero-weighted past the set's end."""
    for index in range(-(-self.eval_examples // batch_size)):
      yield self.eval_rows(index, batch_size, 0, batch_size)
