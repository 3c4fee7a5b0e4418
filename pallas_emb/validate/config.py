"""Checks of static configuration: an embedding's specs and mesh, an async
context's arguments, and an async lookup against its context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pallas_emb.errors import (
  InputError,
  SpecError,
  check_int,
)
from pallas_emb.spec import FeatureSpec, TableSpec
from pallas_emb.validate.inputs import check_ids
from pallas_emb.validate.state import check_placement, check_state
from sharding import map_slots
from sharding.layout import RowLayout


def _unique_names(kind: str, names: Sequence[str]) -> None:
  if len(set(names)) != len(names):
    raise SpecError(f"{kind} names must be unique, got {list(names)}.")


def check_embedding(
  tables: Sequence[TableSpec], features: Sequence[FeatureSpec], mesh: Any, axis: str
) -> None:
  """Validates a `ShardedEmbedding`'s tables, features, mesh and axis."""
  for kind, items, cls in (("tables", tables, TableSpec), ("features", features, FeatureSpec)):
    for x in items:
      if not isinstance(x, cls):
        raise SpecError(f"{kind} must be {cls.__name__}s, got {x!r}.")
  names = [t.name for t in tables]
  _unique_names("table", names)
  _unique_names("feature", [f.name for f in features])
  for f in features:
    if f.table not in names:
      raise SpecError(
        f"feature {f.name!r} reads table {f.table!r}, which is not among "
        f"the tables {names}; add a TableSpec named {f.table!r}."
      )
  if not isinstance(mesh, jax.sharding.Mesh):
    raise SpecError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}.")
  if axis not in mesh.axis_names:
    raise SpecError(
      f"axis {axis!r} is not an axis of the mesh, whose axes are "
      f"{mesh.axis_names}; pass one of them as axis=."
    )
  for t in tables:
    if t.vocabulary is not None:
      check_probe_windows(t, RowLayout(t.num_rows, mesh.shape[axis], t.layout))


def check_probe_windows(spec: TableSpec, layout: RowLayout) -> None:
  """Refuses a dynamic table whose probe windows could miss every row of a
  shard (`sharding.map_slots.max_gap`): an id homed there could never get
  one, however empty the table."""
  gap = map_slots.max_gap(layout)
  probe = min(spec.vocabulary.probe_limit, layout.rows_per_shard)
  if gap < probe:
    return
  empty = [s for s in range(layout.num_shards) if map_slots.used_rows(layout, s) == 0]
  why = (
    f"shards {empty} hold none of its rows"
    if empty
    else f"up to {gap} consecutive slots of a shard's id map hold no row"
  )
  raise SpecError(
    f"table {spec.name!r}: {spec.num_rows} rows over {layout.num_shards} shards "
    f"(layout {spec.layout!r}): {why}, and ids whose probe window of {probe} lies there "
    f"could never get a row. Use layout='mod' (every shard holds rows), num_rows a multiple "
    f"of {layout.num_shards * 128}, or probe_limit >= {gap + 1}."
  )


def check_context_args(
  mesh: jax.sharding.Mesh,
  table_axis: str,
  data_axis,
  tokens_per_batch,
  emb_width,
  num_unique,
  table: TableSpec,
  num_devices_per_node,
) -> tuple[tuple[str, ...], int]:
  """Validates `make_context_handle`'s arguments, with the reference's
  `ValueError`s.

  Returns:
    (data axes as a tuple, devices along `table_axis`).
  """
  axes = tuple(mesh.axis_names)
  if table_axis not in axes:
    raise ValueError(f"table_axis {table_axis!r} is not a mesh axis; the mesh axes are {axes}.")
  data_axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
  for a in data_axes:
    if a not in axes:
      raise ValueError(f"data_axis {a!r} is not a mesh axis; the mesh axes are {axes}.")
  if table_axis not in data_axes:
    raise ValueError(
      f"table_axis {table_axis!r} is missing from data_axis {data_axes}: the "
      "tokens must be sharded over the axis the table is sharded over."
    )
  group = mesh.shape[table_axis]
  token_shards = int(np.prod([mesh.shape[a] for a in data_axes]))
  if token_shards != group:
    raise ValueError(
      f"data_axis {data_axes} splits the tokens into {token_shards} shards "
      f"but the communicator (table_axis {table_axis!r}) has {group} ranks: "
      "more than one token shard per communicator rank is not supported; "
      f"use data_axis={table_axis!r}."
    )
  tokens_per_batch = check_int(tokens_per_batch, "tokens_per_batch")
  emb_width = check_int(emb_width, "emb_width")
  check_int(num_unique, "num_unique")
  if tokens_per_batch % group:
    raise ValueError(
      f"tokens_per_batch={tokens_per_batch!r} must be a positive multiple "
      f"of the group size {group} (devices along {table_axis!r})."
    )
  if emb_width != table.dim:
    raise ValueError(
      f"emb_width={emb_width} does not match table {table.name!r}'s dim={table.dim}."
    )
  if num_devices_per_node is not None and (
    check_int(num_devices_per_node, "num_devices_per_node") and mesh.size % num_devices_per_node
  ):
    raise ValueError(
      f"num_devices_per_node={num_devices_per_node} must divide the "
      f"{mesh.size} devices of the mesh."
    )
  return data_axes, group


def check_lookup(t, table: Any, ids: Any, tokens_per_batch: int) -> None:
  """Validates an async lookup of `t` (a `ShardedTable`): its ids, where
  they live, their number against the context's `tokens_per_batch`, and the
  stored table."""
  tokens = check_ids(t.features, ids, t.num_shards, t.axis)[t.name] * t.num_shards
  check_placement(ids, t.mesh)
  if tokens != tokens_per_batch:
    raise InputError(
      f"lookup_start on table {t.name!r}: the ids hold {tokens} "
      f"tokens, but the context was made for tokens_per_batch="
      f"{tokens_per_batch}; make a context for this batch shape."
    )
  check_state(t.spec, t.layout, table, None, t.mesh)
