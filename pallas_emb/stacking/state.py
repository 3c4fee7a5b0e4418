"""A stacked table's state <-> the states of its members, on global arrays.

What checkpoints, `ShardedEmbedding.logical_table` and `logical_slots` see of a
stacked table: each member as if it were stored alone and sharded over the
same devices (its own `RowLayout`), and back. Each direction is one gather of
rows per array, jitted once per group and shard count; the host plans which
physical row comes from where (`_member_source`, `_group_source`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from pallas_emb import packing, placement
from pallas_emb.spec import TableSpec
from pallas_emb.stacking.plan import Group
from pallas_emb.state import TableState
from sharding.layout import RowLayout


def _member_layout(spec: TableSpec, num_shards: int) -> RowLayout:
  return RowLayout(spec.num_rows, num_shards, spec.layout)


def _member_source(group: Group, i: int, num_shards: int) -> np.ndarray:
  """Physical group row of each physical row of member i alone (-1: none)."""
  glayout = group.layout(num_shards)
  mlayout = _member_layout(group.tables[i], num_shards)
  rows = mlayout.logical_of(np.arange(mlayout.num_physical_rows))
  src = glayout.physical_of(np.maximum(rows, 0) + group.starts[i])
  return np.where(rows >= 0, src, -1).astype(np.int32)


def _group_source(group: Group, num_shards: int) -> np.ndarray:
  """Row of the members' concatenated physical arrays held by each physical
  group row (-1: padding)."""
  glayout = group.layout(num_shards)
  mlayouts = [_member_layout(t, num_shards) for t in group.tables]
  base = np.cumsum([0] + [m.num_physical_rows for m in mlayouts])
  rows = glayout.logical_of(np.arange(glayout.num_physical_rows))
  starts = np.asarray(group.starts)
  sizes = np.asarray([t.num_rows for t in group.tables])
  at = np.maximum(np.searchsorted(starts, rows, side="right") - 1, 0)
  member = np.where((rows >= 0) & (rows >= starts[at]) & (rows < starts[at] + sizes[at]), at, -1)
  src = np.full(rows.shape, -1, np.int64)
  for i, m in enumerate(mlayouts):
    at = member == i
    src[at] = base[i] + m.physical_of(rows[at] - starts[i])
  return src.astype(np.int32)


def _take(x, idx):
  return jax.numpy.take(
    x, jax.numpy.where(idx >= 0, idx, x.shape[0]), axis=0, mode="fill", fill_value=0
  )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _split(group: Group, num_shards: int, i: int, sharding, state: TableState) -> TableState:
  idx = _member_source(group, i, num_shards)
  spec, mspec = group.spec, group.tables[i]
  rps = _member_layout(mspec, num_shards).rows_per_shard
  slots = spec.optimizer.slot_specs()

  def gather(table, state_slots):
    rows = packing.table_rows(table, spec.dim, spec.dtype)
    return packing.table_stored(_take(rows, idx), spec.dim, spec.dtype, rps), {
      k: slots[k].as_stored(_take(slots[k].as_rows(v, spec.dim), idx), spec.dim, rps)
      for k, v in state_slots.items()
    }

  table, member_slots = placement.rearrange(gather, sharding)(state.table, state.slots)
  return TableState(table, member_slots, state.step[i] if group.members is not None else state.step)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _join(group: Group, num_shards: int, sharding, states) -> TableState:
  idx = _group_source(group, num_shards)
  spec = group.spec
  rps = group.layout(num_shards).rows_per_shard
  slots = spec.optimizer.slot_specs()
  cat = lambda xs: jax.numpy.concatenate(xs, axis=0)

  def gather(tables, member_slots):
    rows = cat([packing.table_rows(t, spec.dim, spec.dtype) for t in tables])
    return packing.table_stored(_take(rows, idx), spec.dim, spec.dtype, rps), {
      k: slots[k].as_stored(
        _take(cat([slots[k].as_rows(s[k], spec.dim) for s in member_slots]), idx), spec.dim, rps
      )
      for k in member_slots[0]
    }

  table, group_slots = placement.rearrange(gather, sharding)(
    [s.table for s in states], [s.slots for s in states]
  )
  step = jax.numpy.stack([s.step for s in states]) if group.members is not None else states[0].step
  return TableState(table, group_slots, step)


def member_state(
  group: Group, num_shards: int, sharding, state: TableState, table: str
) -> TableState:
  """Member `table`'s state as if it were stored alone (its own physical
  layout over `num_shards`, row-sharded by `sharding`), from its group's
  `state`, with its own step (a stack's step is (M,), one per member)."""
  if group.members is None and not group.replicated:
    return state
  return _split(group, num_shards, [t.name for t in group.tables].index(table), sharding, state)


def member_states(
  groups: Sequence[Group], num_shards: int, sharding, tables: Mapping[str, TableState]
) -> dict[str, TableState]:
  """Logical table -> its state as if stored alone, of every group's
  members (`tables`: physical table -> state)."""
  return {
    t.name: member_state(g, num_shards, sharding, tables[g.name], t.name)
    for g in groups
    for t in g.tables
  }


def group_state(
  group: Group, num_shards: int, sharding, states: Mapping[str, TableState]
) -> TableState:
  """The inverse of `member_states`: the group's state from each member's
  own (a stack's step: the members' steps, (M,)). `sharding`: the group's
  placement."""
  if group.members is None and not group.replicated:
    return states[group.name]
  return _join(group, num_shards, sharding, tuple(states[t.name] for t in group.tables))
