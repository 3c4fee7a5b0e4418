"""A table's state, what its lookup leaves for the update, its metrics, and
how state is made and read on the host.

`TableState` is the only thing that changes between steps; the other two are
per-step values. The functions here build a state (each device generating
only its own rows) and move it between the physical, sharded order and the
logical row order users see.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import packing
from pallas_emb.spec import TableSpec
from pallas_emb.stacking import members as members_lib
from sharding.layout import RowLayout
from sharding.route import RoutePlan

# Rows generated per iteration at init: bounds the temporary to a chunk.
_INIT_CHUNK_ROWS = 32768


class TableState(NamedTuple):
  """One table and its optimizer state (global arrays, rows sharded).

  Attributes:
    table: (num_shards * rows_per_shard, storage_width) float32, or uint32
      words for bfloat16, or packed (`packing.table_shape`). Physical row
      order of the layout.
    slots: slot name -> (num_shards * rows_per_shard, width) float32 |
      int32, or packed (`SlotSpec.shape_for`).
    step: () int32, updates applied so far (the step of schedules); of a
      stack of tables (M,), each member's own.
  """

  table: jax.Array
  slots: dict[str, jax.Array]
  step: jax.Array


class TableResiduals(NamedTuple):
  """What the update needs from the lookup (per-device pieces, concatenated).

  Attributes:
    weights: per feature of the table, (B, L) float32 combiner weight of
      each id (0 for padding and invalid ids).
    plan: the `RoutePlan` of every device (`plan.token_slot`: where each
      id's row comes from and its gradient goes).
    num_invalid: (S,) int32 ids outside [0, num_rows), padding excluded.
    num_overflow: (S,) int32 distinct ids over unique_capacity.
    num_unique: (S,) int32 distinct valid ids per data shard, kept or not.
  """

  weights: tuple[jax.Array, ...]
  plan: RoutePlan
  num_invalid: jax.Array
  num_overflow: jax.Array
  num_unique: jax.Array


class TableMetrics(NamedTuple):
  """Per-step metrics of one table (replicated scalars).

  Attributes:
    unique_ids: distinct valid ids routed this step (global).
    invalid_ids: ids outside [0, num_rows), -1 padding excluded.
    overflow_ids: ids dropped for unique or route capacity, counted per data
      shard and summed (an id dropped on two shards counts twice).
    grad_norm: global L2 norm of the per-row summed gradients.
    applied: False when the norm was not finite, the gate was closed, or no
      id had a row (nothing to apply): then table, slots and step are
      bit-for-bit unchanged.
    max_unique_per_shard: the most distinct ids one data shard had (compare
      with `Capacities.unique`).
    max_ids_per_route: the most ids one data shard had for one owner
      (compare with `Capacities.route`).
    max_rows_per_owner: the most distinct rows one owner received (compare
      with `Capacities.owner`).
  """

  unique_ids: jax.Array
  invalid_ids: jax.Array
  overflow_ids: jax.Array
  grad_norm: jax.Array
  applied: jax.Array
  max_unique_per_shard: jax.Array
  max_ids_per_route: jax.Array
  max_rows_per_owner: jax.Array


def init_shard(
  spec: TableSpec, layout: RowLayout, key: jax.Array, shard: jax.Array, members=None
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """This device's stored rows and initial slots (inside `shard_map`).

  Row r is `spec.initializer(fold_in(key, r))`, whatever shard holds it, so
  the initial table does not depend on the shard count or layout. Rows are
  generated a chunk at a time, which bounds the temporaries. Of a stack
  (`members`, a `pallas_emb.stacking.members.Members`), `key` holds one key per
  member and each member's rows are those it would have alone.
  """
  rps = layout.rows_per_shard
  width = packing.storage_width(spec.dim, spec.dtype)

  def generate(start, size):
    logical = layout.logical_of(shard * rps + start + jnp.arange(size))
    if members is not None:
      rows = members_lib.init_rows(members, spec.initializer, key, logical, spec.dim)
      return packing.padded(packing.pack_rows(rows, spec.dtype), width)
    keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.maximum(logical, 0))
    rows = jax.vmap(lambda k: spec.initializer(k, (spec.dim,), jnp.float32))(keys)
    rows = jnp.where(logical[:, None] >= 0, rows.astype(jnp.float32), 0.0)
    return packing.padded(packing.pack_rows(rows, spec.dtype), width)

  if rps <= _INIT_CHUNK_ROWS:
    table = generate(0, rps)
  else:
    full, rest = divmod(rps, _INIT_CHUNK_ROWS)
    table = jnp.zeros((rps, width), packing.storage_dtype(spec.dtype))
    table = jax.lax.fori_loop(
      0,
      full,
      lambda i, t: jax.lax.dynamic_update_slice(
        t, generate(i * _INIT_CHUNK_ROWS, _INIT_CHUNK_ROWS), (i * _INIT_CHUNK_ROWS, 0)
      ),
      table,
    )
    if rest:
      table = jax.lax.dynamic_update_slice(
        table, generate(full * _INIT_CHUNK_ROWS, rest), (full * _INIT_CHUNK_ROWS, 0)
      )
  slots = {
    name: jnp.full(s.shape_for(rps, spec.dim), s.init, s.dtype)
    for name, s in spec.optimizer.slot_specs().items()
  }
  return packing.table_stored(table, spec.dim, spec.dtype), slots


def to_host(x: jax.Array) -> np.ndarray:
  """A global array on the host, gathered from every process if need be."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def state_from_logical(
  spec: TableSpec,
  layout: RowLayout,
  sharding: jax.sharding.Sharding,
  replicated: jax.sharding.Sharding,
  table: np.ndarray,
  slots: dict[str, np.ndarray],
  step,
) -> TableState:
  """A `TableState` from validated host arrays in logical row order.

  Args:
    table: (num_rows, dim) of any float dtype (cast to the table's).
    slots: every slot, (num_rows, width) of its dtype.
    sharding, replicated: where rows and the step go.
  """
  specs = spec.optimizer.slot_specs()
  return TableState(
    jax.device_put(
      packing.table_stored(
        layout.to_physical(packing.to_storage(table, spec.dtype)),
        spec.dim,
        spec.dtype,
        layout.rows_per_shard,
      ),
      sharding,
    ),
    {
      k: jax.device_put(
        specs[k].as_stored(layout.to_physical(v), spec.dim, layout.rows_per_shard), sharding
      )
      for k, v in slots.items()
    },
    jax.device_put(jnp.asarray(step, jnp.int32), replicated),
  )


def logical_table(spec: TableSpec, layout: RowLayout, state: TableState) -> np.ndarray:
  """(num_rows, dim) host copy of a table in logical order, of its dtype."""
  physical = packing.table_rows(to_host(state.table), spec.dim, spec.dtype)
  return packing.from_storage(layout.to_logical(physical), spec.dtype, spec.dim)


def logical_slots(spec: TableSpec, layout: RowLayout, state: TableState) -> dict[str, np.ndarray]:
  """Slot name -> (num_rows, width) host copy in logical row order."""
  specs = spec.optimizer.slot_specs()
  return {
    k: layout.to_logical(specs[k].values(to_host(v), spec.dim)) for k, v in state.slots.items()
  }


def reshard_table(spec: TableSpec, old: RowLayout, new: RowLayout, table) -> np.ndarray:
  """A host table stored for layout `old` -> stored for layout `new` (packed
  or not, as each layout's shards say)."""
  rows = packing.table_rows(np.asarray(table), spec.dim, spec.dtype)
  return packing.table_stored(old.reshard(rows, new), spec.dim, spec.dtype, new.rows_per_shard)


def reshard_slots(spec: TableSpec, old: RowLayout, new: RowLayout, slots) -> dict[str, np.ndarray]:
  """Host slots stored for layout `old` -> stored for layout `new`."""
  specs = spec.optimizer.slot_specs()
  return {
    k: specs[k].as_stored(
      old.reshard(specs[k].as_rows(np.asarray(v), spec.dim), new), spec.dim, new.rows_per_shard
    )
    for k, v in slots.items()
  }


# Checkpoint metadata key: rows of widths that pad are stored padded
# (`packing.padded_width`); a checkpoint without it holds them unpadded.
PADDED_ROWS = "padded_rows"


def saved_unpadded(meta: dict, spec: TableSpec) -> bool:
  """Whether a checkpoint with metadata `meta` holds table `spec` unpadded
  (written before padded storage)."""
  return not meta.get(PADDED_ROWS) and pads(spec)


def pads(spec: TableSpec) -> bool:
  """Whether the table or a slot of `spec` is stored padded
  (`packing.padded_width`): stored unpadded before that existed."""
  widths = [packing.row_words(spec.dim, spec.dtype)] + [
    s.width_for(spec.dim) for s in spec.optimizer.slot_specs().values()
  ]
  return any(packing.padded_width(w) != w for w in widths)


def unpadded_state(spec: TableSpec, layout: RowLayout) -> dict:
  """Zero host arrays shaped as a table, its slots and step were written
  before padded storage (what a checkpoint of then is read into): a width
  that pads was stored as it is, (rows, width), never packed; other arrays
  as today."""
  rows = layout.num_physical_rows

  def shape(width: int, now: tuple) -> tuple:
    return (rows, width) if packing.padded_width(width) != width else now

  table = shape(
    packing.row_words(spec.dim, spec.dtype),
    packing.table_shape(rows, spec.dim, spec.dtype, layout.rows_per_shard),
  )
  slots = {
    k: np.zeros(
      shape(s.width_for(spec.dim), s.shape_for(rows, spec.dim, layout.rows_per_shard)), s.dtype
    )
    for k, s in spec.optimizer.slot_specs().items()
  }
  return {
    "table": np.zeros(table, packing.storage_dtype(spec.dtype)),
    "slots": slots,
    "step": np.zeros((), np.int32),
  }


def pad_unpadded(spec: TableSpec, layout: RowLayout, table, slots) -> tuple[np.ndarray, dict]:
  """Host arrays of `unpadded_state` -> stored as today for `layout`
  (only the arrays whose width pads change)."""
  specs = spec.optimizer.slot_specs()
  rps = layout.rows_per_shard
  pads_ = lambda w: packing.padded_width(w) != w
  if pads_(packing.row_words(spec.dim, spec.dtype)):
    table = packing.table_stored(np.asarray(table), spec.dim, spec.dtype, rps)
  return table, {
    k: specs[k].as_stored(np.asarray(v), spec.dim, rps)
    if pads_(specs[k].width_for(spec.dim))
    else v
    for k, v in slots.items()
  }
