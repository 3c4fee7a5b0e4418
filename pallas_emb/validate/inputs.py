"""Checks of the ids, weights and gradients a caller passes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_emb.errors import (
  EmptyInputError,
  InputError,
)
from pallas_emb.inputs import Ragged, Weighted
from pallas_emb.spec import FeatureSpec


def _integer_ids(f: FeatureSpec, x: Any, ndim: int, form: str) -> tuple:
  dtype = np.dtype(getattr(x, "dtype", type(x)))
  if not np.issubdtype(dtype, np.integer):
    raise InputError(
      f"ids of feature {f.name!r} must be integers (int32 or int64), got "
      f"{dtype}; map raw ids (strings, unbounded integers) to rows with "
      "pallas_emb.hash_ids(raw, num_rows)."
    )
  if np.ndim(x) != ndim:
    raise InputError(
      f"ids of feature {f.name!r} must have shape {form}, got "
      f"{np.shape(x)}"
      + (
        "; reshape a single id per example to (B, 1)."
        if ndim == 2
        else "; build them with pallas_emb.ragged(bags, num_shards=, capacity=)."
      )
    )
  return tuple(np.shape(x))


def _float_weights(f: FeatureSpec, w: Any, shape: tuple) -> None:
  if tuple(np.shape(w)) != shape or not jnp.issubdtype(
    getattr(w, "dtype", np.float64), jnp.floating
  ):
    raise InputError(
      f"weights of feature {f.name!r} are "
      f"{getattr(w, 'dtype', type(w).__name__)}{list(np.shape(w))}; "
      f"expected floats of the ids' shape {shape}."
    )


def _feature_tokens(f: FeatureSpec, x: Any, num_shards: int, axis: str) -> int:
  """Validates one feature's input (any form); returns its ids per shard."""
  if isinstance(x, (Weighted, Ragged)) and f.combiner is None:
    raise InputError(
      f"feature {f.name!r} is a sequence (combiner=None), which takes "
      f"(B, L) ids only, got {type(x).__name__}; give it a combiner to "
      "pool weighted or ragged bags."
    )
  if isinstance(x, Ragged):
    (slots,) = _integer_ids(f, x.ids, 1, "(S * capacity,)")
    (batch,) = _integer_ids(f, x.lengths, 1, "(B,) for the lengths")
    if x.weights is not None:
      _float_weights(f, x.weights, (slots,))
    if isinstance(x.lengths, np.ndarray) and (x.lengths < 0).any():
      raise InputError(f"lengths of feature {f.name!r} must be >= 0, got {int(x.lengths.min())}.")
    per_shard, bag = slots, 1
    for n, what in ((slots, "id slots"), (batch, "bags")):
      if n == 0 or n % num_shards:
        raise InputError(
          f"ragged feature {f.name!r} has {n} {what}, which is not a "
          f"positive multiple of the {num_shards} shards of axis {axis!r}; "
          f"build it with pallas_emb.ragged(..., num_shards={num_shards})."
        )
    return per_shard // num_shards * bag
  if isinstance(x, Weighted):
    shape = _integer_ids(f, x.ids, 2, "(batch, bag_size)")
    _float_weights(f, x.weights, shape)
  else:
    shape = _integer_ids(f, x, 2, "(batch, bag_size)")
  batch, bag = shape
  if batch == 0 or bag == 0:
    raise EmptyInputError(
      f"ids of feature {f.name!r} have shape {(batch, bag)}: an empty "
      "batch or empty bags have nothing to look up. Skip empty batches, "
      "and give every bag at least one slot (pad with -1, which reads a "
      "zero row and updates nothing)."
    )
  if batch % num_shards:
    raise InputError(
      f"batch size {batch} of feature {f.name!r} is not divisible by "
      f"the {num_shards} shards of mesh axis {axis!r}; use a "
      f"multiple of {num_shards}."
    )
  return batch // num_shards * bag


def check_ids(
  features: Sequence[FeatureSpec], ids: Any, num_shards: int, axis: str
) -> dict[str, int]:
  """Validates the ids of every feature.

  Args:
    features: the features that must all have ids.
    ids: feature name -> its input (`pallas_emb.inputs`): (B, L) integer
      ids with B divisible by `num_shards`, `Weighted` or `Ragged`; int32,
      or wider ids that `ids.int32_ids` converts (ids outside int32 become
      invalid, never another row).

  Returns:
    table name -> ids per data shard over its features, in feature order.
  """
  if not isinstance(ids, Mapping):
    raise InputError(
      f"ids must be a dict feature name -> (B, L) integer array, got {type(ids).__name__}."
    )
  known = {f.name for f in features}
  unknown = sorted(set(ids) - known)
  if unknown:
    raise InputError(f"ids for unknown features {unknown}; the features are {sorted(known)}.")
  tokens: dict[str, int] = {}
  for f in features:
    if f.name not in ids:
      raise InputError(f"ids are missing feature {f.name!r}.")
    n = _feature_tokens(f, ids[f.name], num_shards, axis)
    tokens[f.table] = tokens.get(f.table, 0) + n
  return tokens


def check_feature_grads(
  table: str, features: Sequence[FeatureSpec], grads: Any, shapes: Sequence[tuple[int, ...]]
) -> None:
  """Validates the gradients w.r.t. a table's lookup outputs.

  Args:
    features: the table's features.
    grads: feature name -> gradient.
    shapes: the lookup's output shape of each feature.
  """
  if not isinstance(grads, Mapping):
    raise InputError(f"grads must be a dict feature name -> gradient, got {type(grads).__name__}.")
  for f, want in zip(features, shapes):
    if f.name not in grads:
      raise InputError(
        f"grads are missing feature {f.name!r} of table {table!r}; pass the "
        "gradient of the loss w.r.t. every output of the lookup."
      )
    g = grads[f.name]
    # jnp's issubdtype knows bfloat16 is a float; NumPy's does not.
    if tuple(np.shape(g)) != tuple(want) or not jnp.issubdtype(g.dtype, jnp.floating):
      raise InputError(
        f"gradient of feature {f.name!r} is {g.dtype}{list(np.shape(g))}; "
        f"expected a float array of shape {tuple(want)}, like its lookup "
        "output."
      )


def check_token_grads(table: str, grads: Any, tokens_per_batch: int, dim: int) -> None:
  """Validates the per-token gradients of a pending async update."""
  want = (tokens_per_batch, dim)
  if tuple(np.shape(grads)) != want:
    raise InputError(
      f"update.grads of table {table!r} has shape {tuple(np.shape(grads))}, "
      f"but the context expects {want} (tokens_per_batch, emb_width)."
    )
