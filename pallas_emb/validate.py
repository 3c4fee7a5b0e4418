"""Every check of what a caller passes to the sharded API, written once.

`ShardedEmbedding`, the asynchronous API and checkpoints call these before
anything is traced, so a mistake is an `InputError` that names the value, the
expected one and the fix, never an error from deep inside a jitted step.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np

from pallas_emb import packing
from pallas_emb.errors import InputError
from pallas_emb.kernels.checks import check_slots
from pallas_emb.spec import FeatureSpec, TableSpec
from sharding.layout import RowLayout

_BUILD_STATE = "build the state with init() or state_from_logical()."


def check_ids(features: Sequence[FeatureSpec], ids: Any, num_shards: int,
              axis: str) -> dict[str, int]:
  """Validates the ids of every feature.

  Args:
    features: the features that must all have ids.
    ids: feature name -> (B, L) integer ids, B divisible by `num_shards`;
      int32, or wider ids that `ids.int32_ids` converts (ids outside int32
      become invalid, never another row).

  Returns:
    table name -> ids per data shard over its features, in feature order.
  """
  if not isinstance(ids, Mapping):
    raise InputError(f"ids must be a dict feature name -> (B, L) integer "
                     f"array, got {type(ids).__name__}.")
  known = {f.name for f in features}
  unknown = sorted(set(ids) - known)
  if unknown:
    raise InputError(f"ids for unknown features {unknown}; the features are "
                     f"{sorted(known)}.")
  tokens: dict[str, int] = {}
  for f in features:
    if f.name not in ids:
      raise InputError(f"ids are missing feature {f.name!r}.")
    x = ids[f.name]
    dtype = np.dtype(getattr(x, "dtype", type(x)))
    if not np.issubdtype(dtype, np.integer):
      raise InputError(
          f"ids of feature {f.name!r} must be integers (int32 or int64), got "
          f"{dtype}; map raw ids (strings, unbounded integers) to rows with "
          "pallas_emb.hash_ids(raw, num_rows).")
    if np.ndim(x) != 2:
      raise InputError(
          f"ids of feature {f.name!r} must have shape (batch, bag_size), "
          f"got {np.shape(x)}; reshape a single id per example to (B, 1).")
    batch, bag = np.shape(x)
    if batch % num_shards:
      raise InputError(
          f"batch size {batch} of feature {f.name!r} is not divisible by "
          f"the {num_shards} shards of mesh axis {axis!r}; use a "
          f"multiple of {num_shards}.")
    tokens[f.table] = tokens.get(f.table, 0) + batch // num_shards * bag
  return tokens


def check_state(spec: TableSpec, layout: RowLayout, table: Any,
                slots: Mapping[str, Any] | None = None) -> None:
  """Validates a stored table (and, unless None, its slots) against its spec.

  Raises:
    InputError: a donated (deleted) buffer, or a stored array or slot whose
      shape or dtype is not the spec's.
  """
  name = spec.name
  leaves = [table, *(slots or {}).values()]
  # Reusing a donated buffer crashes the CPU client of JAX 0.10 instead of
  # raising; catch it here with a message that says what happened.
  if any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
         and x.is_deleted() for x in leaves):
    raise InputError(
        f"table {name!r} (or a slot) was donated to an earlier update and "
        "its buffer is gone; pass the state that update returned.")
  expected = (layout.num_physical_rows,
              packing.storage_width(spec.dim, spec.dtype))
  stored = packing.storage_dtype(spec.dtype)
  if tuple(table.shape) != expected or np.dtype(table.dtype) != stored:
    raise InputError(
        f"table {name!r} has {table.dtype}{list(table.shape)}, but its spec "
        f"(dim={spec.dim}, dtype={spec.dtype}) over {layout.num_shards} "
        f"shards stores {stored}{list(expected)}; {_BUILD_STATE}")
  if slots is not None:
    check_slots(slots, spec.optimizer.slot_specs(), layout.num_physical_rows,
                spec.dim, owner=type(spec.optimizer).__name__, table=name,
                fix=_BUILD_STATE, rows_per_shard=layout.rows_per_shard)


def check_tables(tables: Any, names: Sequence[str], spec_of, layout_of, *,
                 slots: bool = True) -> None:
  """Validates `tables[name]` (a `TableState`) for each of `names`.

  Args:
    spec_of, layout_of: table name -> its `TableSpec` / `RowLayout`.
    slots: also check the optimizer slots (a lookup reads only the table).
  """
  if not isinstance(tables, Mapping):
    raise InputError(f"tables must be a dict name -> TableState, got "
                     f"{type(tables).__name__}.")
  for name in names:
    if name not in tables:
      raise InputError(f"tables are missing {name!r}; pass the dict "
                       "returned by init().")
    state = tables[name]
    check_state(spec_of(name), layout_of(name), state.table,
                state.slots if slots else None)


def check_feature_grads(table: str, features: Sequence[FeatureSpec],
                        grads: Any, shapes: Sequence[tuple[int, ...]]) -> None:
  """Validates the gradients w.r.t. a table's lookup outputs.

  Args:
    features: the table's features.
    grads: feature name -> gradient.
    shapes: the lookup's output shape of each feature.
  """
  if not isinstance(grads, Mapping):
    raise InputError(f"grads must be a dict feature name -> gradient, got "
                     f"{type(grads).__name__}.")
  for f, want in zip(features, shapes):
    if f.name not in grads:
      raise InputError(
          f"grads are missing feature {f.name!r} of table {table!r}; pass the "
          "gradient of the loss w.r.t. every output of the lookup.")
    g = grads[f.name]
    if (tuple(np.shape(g)) != tuple(want)
        or not np.issubdtype(np.dtype(g.dtype), np.floating)):
      raise InputError(
          f"gradient of feature {f.name!r} is {g.dtype}{list(np.shape(g))}; "
          f"expected a float array of shape {tuple(want)}, like its lookup "
          "output.")


def output_shape(feature: FeatureSpec, ids_shape: tuple[int, int],
                 dim: int) -> tuple[int, ...]:
  """The lookup output shape of a feature whose ids are (B, L)."""
  if feature.combiner is None:
    return (*ids_shape, dim)
  return (ids_shape[0], dim)


def check_logical(spec: TableSpec, table: Any, slots: Mapping | None
                  ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Validates host arrays in logical row order for `state_from_logical`.

  Returns:
    The table, and every slot (missing ones at their initial value), as
    NumPy arrays of the slots' dtypes.
  """
  name = spec.name
  table = np.asarray(table)
  if table.shape != (spec.num_rows, spec.dim):
    raise InputError(f"table {name!r} must have shape "
                     f"{(spec.num_rows, spec.dim)}, got {table.shape}.")
  specs = spec.optimizer.slot_specs()
  slots = dict(slots or {})
  unknown = sorted(set(slots) - set(specs))
  if unknown:
    raise InputError(f"table {name!r} has no slots {unknown}; its optimizer "
                     f"keeps {sorted(specs)}.")
  out = {}
  for k, s in specs.items():
    shape = (spec.num_rows, s.width_for(spec.dim))
    value = slots.get(k)
    value = (np.full(shape, s.init, s.dtype) if value is None
             else np.asarray(value, s.dtype))
    if value.shape != shape:
      raise InputError(f"slot {k!r} of table {name!r} must have shape "
                       f"{shape}, got {value.shape}.")
    out[k] = value
  return table, out


def check_token_grads(table: str, grads: Any, tokens_per_batch: int,
                      dim: int) -> None:
  """Validates the per-token gradients of a pending async update."""
  want = (tokens_per_batch, dim)
  if tuple(np.shape(grads)) != want:
    raise InputError(
        f"update.grads of table {table!r} has shape {tuple(np.shape(grads))}, "
        f"but the context expects {want} (tokens_per_batch, emb_width).")
