"""Checks of where arrays live and of a table's stored state against its spec."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pallas_emb import packing
from pallas_emb.errors import (
  InputError,
  MeshMismatchError,
  PlacementError,
)
from pallas_emb.kernels.checks import check_slots
from pallas_emb.spec import TableSpec
from sharding.layout import RowLayout

_BUILD_STATE = "build the state with init() or state_from_logical()."


def _device_ids(devices) -> str:
  return str(sorted(d.id for d in devices))


def describe_mesh(mesh) -> str:
  """A mesh in a message: its axes and its devices in mesh order."""
  axes = ", ".join(f"{n!r}: {s}" for n, s in zip(mesh.axis_names, mesh.devices.shape))
  return f"mesh {{{axes}}} over devices {[d.id for d in mesh.devices.flat]}"


def _same_mesh(a, b) -> bool:
  # Axis types may differ: a program of an Auto mesh takes arrays of its
  # Explicit twin and the other way round. Device order and axis names may
  # not: jit refuses the first ("incompatible devices"), and the second
  # would shard over another axis.
  return (
    a is b
    or a == b
    or (
      a.axis_names == b.axis_names
      and a.devices.shape == b.devices.shape
      and all(x.id == y.id for x, y in zip(a.devices.flat, b.devices.flat))
    )
  )


def check_devices(x: Any, mesh: jax.sharding.Mesh, what: str, error: type, fix: str) -> None:
  """Refuses a device array committed to another mesh than `mesh`: other
  devices, or the same devices in another order or under other axis names.

  Host arrays, uncommitted arrays and tracers pass: the programs place them.
  A committed array elsewhere would otherwise fail inside `jax.jit` with
  JAX's "incompatible devices" error.

  Args:
    what: the array, for the message ("ids of feature 'f'").
    error: the exception type to raise.
    fix: what to pass instead.
  """
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not x.committed:
    return
  other = getattr(x.sharding, "mesh", None)
  if isinstance(other, jax.sharding.Mesh) and _same_mesh(other, mesh):
    return
  if isinstance(other, jax.sharding.Mesh):
    where = f"the {describe_mesh(other)}"
  elif x.sharding.device_set != set(mesh.devices.flat):
    where = f"devices {_device_ids(x.sharding.device_set)}"
  else:
    return  # e.g. one device of a mesh of one
  raise error(f"{what} is on {where}, but expected the {describe_mesh(mesh)}; {fix}")


def check_on_mesh(tree: Any, mesh: jax.sharding.Mesh, what: str, fix: str) -> None:
  """`check_devices` of every array of a pytree, raising `MeshMismatchError`."""
  for x in jax.tree.leaves(tree):
    check_devices(x, mesh, what, MeshMismatchError, fix)


def check_placement(arrays: Mapping[str, Any], mesh: jax.sharding.Mesh) -> None:
  """Validates where the ids of each feature live (see `check_devices`)."""
  for name, x in arrays.items():
    for leaf in jax.tree.leaves(x):
      check_devices(
        leaf,
        mesh,
        f"ids of feature {name!r}",
        PlacementError,
        "pass a NumPy array, or place the ids with jax.device_put(ids, emb.sharding()).",
      )


def check_state(
  spec: TableSpec,
  layout: RowLayout,
  table: Any,
  slots: Mapping[str, Any] | None = None,
  mesh: jax.sharding.Mesh | None = None,
) -> None:
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
      check_devices(
        x,
        mesh,
        f"table {name!r} (or a slot)",
        MeshMismatchError,
        "use the state of an embedding (or context) on this "
        "mesh: its init(), state_from_logical() or a checkpoint "
        "restored into it.",
      )
  # Reusing a donated buffer crashes the CPU client of JAX 0.10 instead of
  # raising; catch it here with a message that says what happened.
  if any(
    isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()
    for x in leaves
  ):
    raise InputError(
      f"table {name!r} (or a slot) was donated to an earlier update and "
      "its buffer is gone; pass the state that update returned."
    )
  expected = packing.table_shape(
    layout.num_physical_rows, spec.dim, spec.dtype, layout.rows_per_shard
  )
  stored = packing.storage_dtype(spec.dtype)
  if tuple(table.shape) != expected or np.dtype(table.dtype) != stored:
    raise InputError(
      f"table {name!r} has {table.dtype}{list(table.shape)}, but its spec "
      f"(dim={spec.dim}, dtype={spec.dtype}) over {layout.num_shards} "
      f"shards stores {stored}{list(expected)}; {_BUILD_STATE}"
    )
  if slots is not None:
    check_slots(
      slots,
      spec.optimizer.slot_specs(),
      layout.num_physical_rows,
      spec.dim,
      owner=type(spec.optimizer).__name__,
      table=name,
      fix=_BUILD_STATE,
      rows_per_shard=layout.rows_per_shard,
    )


def check_tables(
  tables: Any,
  names: Sequence[str],
  spec_of,
  layout_of,
  *,
  slots: bool = True,
  mesh: jax.sharding.Mesh | None = None,
) -> None:
  """Validates `tables[name]` (a `TableState`) for each of `names`.

  Args:
    spec_of, layout_of: table name -> its `TableSpec` / `RowLayout`.
    slots: also check the optimizer slots (a lookup reads only the table).
    mesh: when given, every table must live on its devices.
  """
  if not isinstance(tables, Mapping):
    raise InputError(f"tables must be a dict name -> TableState, got {type(tables).__name__}.")
  for name in names:
    if name not in tables:
      raise InputError(f"tables are missing {name!r}; pass the dict returned by init().")
    state = tables[name]
    check_state(spec_of(name), layout_of(name), state.table, state.slots if slots else None, mesh)


def check_logical(
  spec: TableSpec, table: Any, slots: Mapping | None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Validates host arrays in logical row order for `state_from_logical`.

  Returns:
    The table, and every slot (missing ones at their initial value), as
    NumPy arrays of the slots' dtypes.
  """
  name = spec.name
  table = np.asarray(table)
  if table.shape != (spec.num_rows, spec.dim):
    raise InputError(
      f"table {name!r} must have shape {(spec.num_rows, spec.dim)}, got {table.shape}."
    )
  specs = spec.optimizer.slot_specs()
  slots = dict(slots or {})
  unknown = sorted(set(slots) - set(specs))
  if unknown:
    raise InputError(f"table {name!r} has no slots {unknown}; its optimizer keeps {sorted(specs)}.")
  out = {}
  for k, s in specs.items():
    shape = (spec.num_rows, s.width_for(spec.dim))
    value = slots.get(k)
    value = np.full(shape, s.init, s.dtype) if value is None else np.asarray(value, s.dtype)
    if value.shape != shape:
      raise InputError(f"slot {k!r} of table {name!r} must have shape {shape}, got {value.shape}.")
    out[k] = value
  return table, out
