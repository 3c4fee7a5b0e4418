"""A served feature's ids, in any input form, as its program's arguments.

A request takes what the training lookup takes (`pallas_emb.inputs`): a
(B, L) array, `Weighted` or `Ragged` (packed for the training run's data
shards, which the manifest records); int32 rows (wider integers converted by
`int32_ids`), or a dynamic table's raw ids (int64 or strings, -1 padding) or
their (..., 2) uint32 key words. Converted on the host, in NumPy, before
anything reaches a device (so an int64 id is never wrapped).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pallas_emb.errors import EmptyInputError, InputError
from pallas_emb.ids import int32_ids
from pallas_emb.inputs import Ragged, Weighted
from pallas_emb.serving.program import FeatureProgram
from pallas_emb.vocabulary import key_words


def _ids(name: str, p: FeatureProgram, ids: Any, seed: int | None, ndim: int) -> np.ndarray:
  """Int32 rows, or a dynamic table's (..., 2) uint32 key words, of `ndim`
  id dimensions."""
  ids = np.asarray(ids)
  if p.dynamic and ids.dtype == np.uint32 and ids.ndim == ndim + 1 and ids.shape[-1] == 2:
    return ids  # key words already
  if ids.ndim != ndim:
    form = "(B, L)" if ndim == 2 else "a Ragged input's (S * C,)"
    raise InputError(f"feature {name!r}: ids must be {form}, got shape {ids.shape}.")
  if p.dynamic:
    return key_words(ids, seed)
  if not np.issubdtype(ids.dtype, np.integer):
    raise InputError(
      f"feature {name!r}: ids must be integers, got {ids.dtype}; hash raw ids first "
      "(ServingModel.hash_ids)."
    )
  return int32_ids(ids)


def _weights(name: str, weights: Any, shape: tuple[int, ...]) -> np.ndarray:
  if weights is None:
    return np.ones(shape, np.float32)
  weights = np.asarray(weights, np.float32)
  if weights.shape != shape:
    raise InputError(
      f"feature {name!r}: weights have shape {weights.shape}, the ids {shape}; pass one "
      "weight per id."
    )
  return weights


def _bags(name: str, p: FeatureProgram, x: Any, seed) -> tuple:
  weights = None
  if isinstance(x, Weighted):
    if p.combiner is None:
      raise InputError(
        f"feature {name!r} is a sequence (combiner None): its ids take no weights; pass a "
        "(B, L) array."
      )
    x, weights = x.ids, x.weights
  ids = _ids(name, p, x, seed, 2)
  b, l = ids.shape[:2]
  if not b or not l:
    raise EmptyInputError(f"feature {name!r}: a request needs B, L >= 1, got ids {ids.shape}.")
  return ids, _weights(name, weights, (b, l))


def _ragged(name: str, p: FeatureProgram, x: Ragged, seed) -> tuple:
  s = p.num_shards
  if p.combiner is None:
    raise InputError(
      f"feature {name!r} is a sequence (combiner None); a Ragged input pools bags: pass (B, L) ids."
    )
  ids = _ids(name, p, x.ids, seed, 1)
  lengths = np.asarray(x.lengths)
  if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer) or (lengths < 0).any():
    raise InputError(
      f"feature {name!r}: Ragged lengths must be (B,) non-negative integers, got "
      f"{lengths.dtype}{list(lengths.shape)}."
    )
  if not ids.shape[0] or not lengths.shape[0] or ids.shape[0] % s or lengths.shape[0] % s:
    raise InputError(
      f"feature {name!r}: a Ragged input is packed for the training run's {s} data shards "
      f"(pallas_emb.ragged(..., num_shards={s})): its {ids.shape[0]} id slots and "
      f"{lengths.shape[0]} bags must be positive multiples of {s}."
    )
  weights = _weights(name, x.weights, (ids.shape[0],))
  per_shard = lambda a: a.reshape(s, -1, *a.shape[1:])
  return per_shard(ids), per_shard(lengths.astype(np.int32)), per_shard(weights)


def program_args(name: str, p: FeatureProgram, x: Any, seed: int | None) -> tuple[str, tuple]:
  """(form, the ids' arguments of that form's program) of one feature's
  request `x`; `seed`: a dynamic table's key seed."""
  if isinstance(x, Ragged):
    return "ragged", _ragged(name, p, x, seed)
  return "bags", _bags(name, p, x, seed)
