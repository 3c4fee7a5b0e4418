"""Every check of what a caller passes to the sharded API, written once.

`ShardedEmbedding`, the asynchronous API and checkpoints call these before
anything is traced, so a mistake is an `InputError` that names the value, the
expected one and the fix, never an error from deep inside a jitted step.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import packing
from pallas_emb.inputs import Ragged, Weighted
from pallas_emb.errors import (
    EmptyInputError, InputError, MeshMismatchError, PlacementError)
from pallas_emb.kernels.checks import check_slots
from pallas_emb.spec import FeatureSpec, TableSpec
from sharding.layout import RowLayout

_BUILD_STATE = "build the state with init() or state_from_logical()."


def _integer_ids(f: FeatureSpec, x: Any, ndim: int, form: str) -> tuple:
  dtype = np.dtype(getattr(x, "dtype", type(x)))
  if not np.issubdtype(dtype, np.integer):
    raise InputError(
        f"ids of feature {f.name!r} must be integers (int32 or int64), got "
        f"{dtype}; map raw ids (strings, unbounded integers) to rows with "
        "pallas_emb.hash_ids(raw, num_rows).")
  if np.ndim(x) != ndim:
    raise InputError(
        f"ids of feature {f.name!r} must have shape {form}, got "
        f"{np.shape(x)}" + ("; reshape a single id per example to (B, 1)."
                            if ndim == 2 else "; build them with "
                            "pallas_emb.ragged(bags, num_shards=, capacity=)."))
  return tuple(np.shape(x))


def _float_weights(f: FeatureSpec, w: Any, shape: tuple) -> None:
  if (tuple(np.shape(w)) != shape
      or not jnp.issubdtype(getattr(w, "dtype", np.float64), jnp.floating)):
    raise InputError(
        f"weights of feature {f.name!r} are "
        f"{getattr(w, 'dtype', type(w).__name__)}{list(np.shape(w))}; "
        f"expected floats of the ids' shape {shape}.")


def _feature_tokens(f: FeatureSpec, x: Any, num_shards: int, axis: str) -> int:
  """Validates one feature's input (any form); returns its ids per shard."""
  if isinstance(x, (Weighted, Ragged)) and f.combiner is None:
    raise InputError(
        f"feature {f.name!r} is a sequence (combiner=None), which takes "
        f"(B, L) ids only, got {type(x).__name__}; give it a combiner to "
        "pool weighted or ragged bags.")
  if isinstance(x, Ragged):
    (slots,) = _integer_ids(f, x.ids, 1, "(S * capacity,)")
    (batch,) = _integer_ids(f, x.lengths, 1, "(B,) for the lengths")
    if x.weights is not None:
      _float_weights(f, x.weights, (slots,))
    if isinstance(x.lengths, np.ndarray) and (x.lengths < 0).any():
      raise InputError(f"lengths of feature {f.name!r} must be >= 0, got "
                       f"{int(x.lengths.min())}.")
    per_shard, bag = slots, 1
    for n, what in ((slots, "id slots"), (batch, "bags")):
      if n == 0 or n % num_shards:
        raise InputError(
            f"ragged feature {f.name!r} has {n} {what}, which is not a "
            f"positive multiple of the {num_shards} shards of axis {axis!r}; "
            f"build it with pallas_emb.ragged(..., num_shards={num_shards}).")
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
        "zero row and updates nothing).")
  if batch % num_shards:
    raise InputError(
        f"batch size {batch} of feature {f.name!r} is not divisible by "
        f"the {num_shards} shards of mesh axis {axis!r}; use a "
        f"multiple of {num_shards}.")
  return batch // num_shards * bag


def check_ids(features: Sequence[FeatureSpec], ids: Any, num_shards: int,
              axis: str) -> dict[str, int]:
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
    n = _feature_tokens(f, ids[f.name], num_shards, axis)
    tokens[f.table] = tokens.get(f.table, 0) + n
  return tokens


def _device_ids(devices) -> str:
  return str(sorted(d.id for d in devices))


def check_devices(x: Any, mesh: jax.sharding.Mesh, what: str,
                  error: type, fix: str) -> None:
  """Refuses a device array committed to other devices than `mesh`'s.

  Host arrays, uncommitted arrays and tracers pass: the programs place them.
  A committed array elsewhere would otherwise fail inside `jax.jit` with
  JAX's "incompatible devices" error.

  Args:
    what: the array, for the message ("ids of feature 'f'").
    error: the exception type to raise.
    fix: what to pass instead.
  """
  if (not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer)
      or not x.committed):
    return
  placed, devices = x.sharding.device_set, set(mesh.devices.flat)
  if placed != devices:
    raise error(f"{what} is on devices {_device_ids(placed)}, but the mesh "
                f"is over devices {_device_ids(devices)}; {fix}")


def check_placement(arrays: Mapping[str, Any], mesh: jax.sharding.Mesh) -> None:
  """Validates where the ids of each feature live (see `check_devices`)."""
  for name, x in arrays.items():
    for leaf in jax.tree.leaves(x):
      check_devices(leaf, mesh, f"ids of feature {name!r}", PlacementError,
                    "pass a NumPy array, or place the ids with "
                    "jax.device_put(ids, emb.sharding()).")


def check_state(spec: TableSpec, layout: RowLayout, table: Any,
                slots: Mapping[str, Any] | None = None,
                mesh: jax.sharding.Mesh | None = None) -> None:
  """Validates a stored table (and, unless None, its slots) against its spec.

  Args:
    mesh: when given, the table and slots must live on its devices.

  Raises:
    InputError: a donated (deleted) buffer, or a stored array or slot whose
      shape or dtype is not the spec's.
    MeshMismatchError: a table or slot of another mesh.
  """
  name = spec.name
  leaves = [table, *(slots or {}).values()]
  if mesh is not None:
    for x in leaves:
      check_devices(x, mesh, f"table {name!r} (or a slot)", MeshMismatchError,
                    "use the state of an embedding (or context) on this "
                    "mesh: its init(), state_from_logical() or a checkpoint "
                    "restored into it.")
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
                 slots: bool = True,
                 mesh: jax.sharding.Mesh | None = None) -> None:
  """Validates `tables[name]` (a `TableState`) for each of `names`.

  Args:
    spec_of, layout_of: table name -> its `TableSpec` / `RowLayout`.
    slots: also check the optimizer slots (a lookup reads only the table).
    mesh: when given, every table must live on its devices.
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
                state.slots if slots else None, mesh)


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
    # jnp's issubdtype knows bfloat16 is a float; NumPy's does not.
    if (tuple(np.shape(g)) != tuple(want)
        or not jnp.issubdtype(g.dtype, jnp.floating)):
      raise InputError(
          f"gradient of feature {f.name!r} is {g.dtype}{list(np.shape(g))}; "
          f"expected a float array of shape {tuple(want)}, like its lookup "
          "output.")


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
