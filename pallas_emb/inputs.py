"""The forms a feature's ids may take: padded, weighted, ragged.

A feature's value in the `ids` dict of `ShardedEmbedding.lookup` (and of the
async API and the `Trainer`) is one of

- a (B, L) integer array: B bags of L ids, -1 padding;
- `Weighted(ids, weights)`: the same with a float weight per id, so a pooled
  output is `combiner(sum_i w_i * row_i)` (`nn.EmbeddingBag`'s
  `per_sample_weights`, jax-tpu-embedding's gains);
- `Ragged(ids, lengths, weights=None)`: B bags of any lengths, CSR style,
  packed per data shard with a static capacity of ids per shard (`ragged`
  and `ragged_from_csr` build one on the host).

Ragged packing: the batch is split into S data shards of B/S consecutive
bags (as every input is). Shard s's ids are the concatenation of its bags'
ids, in bag order, written into slice [s*C, (s+1)*C) of `ids` and padded
with -1; `lengths` keeps every bag's full length. A shard whose bags hold
more than C ids keeps the first C; the device counts the rest as overflow
(`TableMetrics.overflow_ids`), like any id dropped for capacity. So C is a
per-shard budget, not a padding of every bag to the longest one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from pallas_emb.errors import InputError, check_int


class Weighted(NamedTuple):
  """Ids with one float weight each.

  Attributes:
    ids: (B, L) integer ids, -1 padding.
    weights: (B, L) float weights (any sign; padding, invalid and dropped
      ids count as weight 0).
  """

  ids: Any
  weights: Any


class Ragged(NamedTuple):
  """Bags of any length, packed per data shard (see the module docstring).

  Attributes:
    ids: (S * C,) integer ids: C slots per data shard, that shard's bags'
      ids in order, then -1.
    lengths: (B,) int32 ids per bag (B divisible by S).
    weights: None, or (S * C,) float weights aligned with `ids`.
  """

  ids: Any
  lengths: Any
  weights: Any | None = None


def ids_of(x: Any) -> Any:
  """The integer ids of any input form."""
  return x.ids if isinstance(x, (Weighted, Ragged)) else x


def with_ids(x: Any, ids: Any) -> Any:
  """The same input form with other ids."""
  return x._replace(ids=ids) if isinstance(x, (Weighted, Ragged)) else ids


def token_shape(x: Any) -> tuple[int, int]:
  """(B, L) of a padded or weighted input; (S * C, 1) of a ragged one: the
  shape its per-token arrays (gradients of a pending update) take."""
  ids = ids_of(x)
  if isinstance(x, Ragged):
    return (int(np.shape(ids)[0]), 1)
  return tuple(int(v) for v in np.shape(ids))


def _pack(bags: Sequence[np.ndarray], weights, num_shards: int, capacity: int, dtype) -> Ragged:
  check_int(num_shards, "num_shards", error=InputError)
  check_int(
    capacity, "capacity", error=InputError, fix="pass the ids one data shard may hold per step."
  )
  if len(bags) == 0 or len(bags) % num_shards:
    raise InputError(
      f"ragged input has {len(bags)} bags; it needs a positive multiple of "
      f"num_shards={num_shards} (every data shard gets B/S bags)."
    )
  per_shard = len(bags) // num_shards
  ids = np.full((num_shards * capacity,), -1, dtype)
  w = None if weights is None else np.zeros((num_shards * capacity,), np.float32)
  for s in range(num_shards):
    shard = range(s * per_shard, (s + 1) * per_shard)
    flat = np.concatenate([bags[i] for i in shard]) if per_shard else []
    n = min(len(flat), capacity)
    ids[s * capacity : s * capacity + n] = np.asarray(flat, dtype)[:n]
    if w is not None:
      flat_w = np.concatenate([weights[i] for i in shard])
      w[s * capacity : s * capacity + n] = flat_w[:n]
  lengths = np.array([len(b) for b in bags], np.int32)
  return Ragged(ids, lengths, w)


def ragged(
  bags: Sequence[Sequence[int]],
  *,
  num_shards: int,
  capacity: int,
  weights: Sequence[Sequence[float]] | None = None,
) -> Ragged:
  """Packs B bags (lists or 1-D arrays of ids) as a `Ragged` input.

  Args:
    bags: B sequences of integer ids (empty bags allowed), B divisible by
      `num_shards`.
    num_shards: the data shards of the mesh axis (`emb.num_shards`).
    capacity: C, ids one data shard holds per step (static: one compiled
      step per C). Ids past it are dropped and counted as overflow.
    weights: None, or B float sequences of the bags' lengths.

  Returns:
    A `Ragged` of NumPy arrays: ids (S*C,) int64 if any id needs it, else
    int32; lengths (B,) int32; weights (S*C,) float32 or None.
  """
  arrays = [np.asarray(b).reshape(-1) for b in bags]
  for i, a in enumerate(arrays):
    if a.size and not np.issubdtype(a.dtype, np.integer):
      raise InputError(
        f"bag {i} holds {a.dtype} values; ids must be "
        "integers (hash raw ids with pallas_emb.hash_ids)."
      )
  if weights is not None:
    weights = [np.asarray(w, np.float32).reshape(-1) for w in weights]
    bad = [i for i, (a, w) in enumerate(zip(arrays, weights)) if a.shape != w.shape]
    if len(weights) != len(arrays) or bad:
      raise InputError(
        f"weights must have one float per id of every bag; bags "
        f"{bad or 'count'} differ ({len(weights)} weight lists for "
        f"{len(arrays)} bags)."
      )
  wide = any(a.size and (a.max() > 2**31 - 1 or a.min() < -(2**31)) for a in arrays)
  return _pack(arrays, weights, num_shards, capacity, np.int64 if wide else np.int32)


def ragged_from_csr(
  values: Any, lengths: Any, *, num_shards: int, capacity: int, weights: Any = None
) -> Ragged:
  """`ragged` from flat ids and per-bag lengths (CSR: bag i is
  values[offsets[i]:offsets[i+1]], offsets the running sum of lengths).

  Args:
    values: (N,) integer ids, N = sum(lengths).
    lengths: (B,) non-negative integers.
    weights: None, or (N,) floats aligned with `values`.
  """
  values, lengths = np.asarray(values).reshape(-1), np.asarray(lengths)
  if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
    raise InputError(
      f"lengths must be a 1-D integer array, got {lengths.dtype}{list(lengths.shape)}."
    )
  if (lengths < 0).any() or lengths.sum() != values.shape[0]:
    raise InputError(
      f"lengths must be non-negative and sum to the {values.shape[0]} "
      f"values; they sum to {int(lengths.sum())} (min "
      f"{int(lengths.min(initial=0))})."
    )
  cuts = np.cumsum(lengths)[:-1]
  w = None if weights is None else np.split(np.asarray(weights, np.float32).reshape(-1), cuts)
  return ragged(np.split(values, cuts), num_shards=num_shards, capacity=capacity, weights=w)
