"""Which tables are stored together, and where each one's rows go.

Tables that can share one fused update are stored as one physical table (a
*group*): the same dim, dtype, optimizer (optimizers are frozen dataclasses,
so equal hyperparameters compare equal), initializer, layout kind and
`max_grad_norm`. A
group is deduplicated, routed and updated as one table: one routing plan,
one exchange per direction, one gather and one fused update per step
instead of one per table. What users see stays per table: ids, metrics,
`logical_table`, checkpoints (`pallas_emb.members` keeps the per-table
counts, norms and gates inside the step).

Offsets. Member i's logical row r is stacked row `offset[i] + r`. Under the
"mod" layout over S shards, row x lives on shard x % S, so

    offset[0] = 0
    offset[i] = round_up(offset[i-1] + rows[i-1], S) + (i % S)

puts member i's row 0 (its hottest id, vocabularies being Zipf-ordered) on
shard i % S: the members' hot rows are spread over the chips instead of all
landing on shard 0 (the rotation of jax-tpu-embedding's table stacking). The
gaps (< 2S rows per member) are padding no id reaches. Under "range" the
members are contiguous, `offset[i] = offset[i-1] + rows[i-1]`.

A group of one table is that table itself, unchanged (same name, layout and
state as without stacking). A replicated table (`TableSpec.placement`, or
below `replicate_below` rows) is never stacked: it is a group of one, stored
whole on every device (`pallas_emb.replicated_ops`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import jax
import numpy as np

from pallas_emb.errors import SpecError
from pallas_emb.members import Members
from pallas_emb.spec import FeatureSpec, TableSpec
from pallas_emb.state import TableState
from sharding.layout import RowLayout, round_up

STACKING_MODES = ("auto", "off")


@dataclasses.dataclass(frozen=True)
class Group:
  """One physical table and the logical tables it stores.

  Attributes:
    spec: the physical table (a member's own spec when it is alone).
    features: the features that read it, member by member, with
      `table=spec.name` (its token order).
    tables: the member tables, in stacking order.
    indices: each member's index among all tables (its init key).
    members: where each member's rows are, or None for a table alone.
    replicated: stored whole on every device (a table alone).
  """

  spec: TableSpec
  features: tuple[FeatureSpec, ...]
  tables: tuple[TableSpec, ...]
  indices: tuple[int, ...]
  members: Members | None
  replicated: bool = False

  def layout(self, num_shards: int) -> RowLayout:
    """Where the group's rows live over `num_shards` shards."""
    return RowLayout(self.spec.num_rows, 1 if self.replicated else num_shards,
                     self.spec.layout)

  @property
  def starts(self) -> tuple[int, ...]:
    return (0,) if self.members is None else self.members.starts

  @property
  def name(self) -> str:
    return self.spec.name

  def offset(self, table: str) -> int:
    """The stacked row of `table`'s row 0."""
    if self.members is None:
      return 0
    return self.members.starts[[t.name for t in self.tables].index(table)]


def stack_key(spec: TableSpec) -> tuple:
  """What tables must share to be stacked."""
  return (spec.dim, spec.dtype, spec.optimizer, spec.initializer, spec.layout,
          spec.max_grad_norm)


def offsets(tables: Sequence[TableSpec], num_shards: int) -> tuple[int, ...]:
  """Each member's first stacked row (see the module docstring)."""
  out, end = [], 0
  for i, t in enumerate(tables):
    start = (round_up(end, num_shards) + i % num_shards
             if t.layout == "mod" else end)
    out.append(start)
    end = start + t.num_rows
  return tuple(out)


def _sum_or_none(values):
  return None if any(v is None for v in values) else sum(values)


def _group(name: str, tables, indices, features, num_shards,
           replicated=False) -> Group:
  feats = [f for t in tables for f in features if f.table == t.name]
  if len(tables) == 1:
    return Group(tables[0], tuple(feats), tuple(tables), tuple(indices), None,
                 replicated)
  starts = offsets(tables, num_shards)
  first = tables[0]
  spec = dataclasses.replace(
      first, name=name, num_rows=starts[-1] + tables[-1].num_rows,
      unique_capacity=_sum_or_none([t.unique_capacity for t in tables]),
      route_capacity=_sum_or_none([t.route_capacity for t in tables]))
  names = [t.name for t in tables]
  members = Members(starts, tuple(t.num_rows for t in tables),
                    tuple(names.index(f.table) for f in feats))
  return Group(spec, tuple(dataclasses.replace(f, table=name) for f in feats),
               tuple(tables), tuple(indices), members)


def normalize(stacking) -> str | tuple[tuple[str, tuple[str, ...]], ...]:
  """"auto", "off", or a mapping group name -> table names as a hashable
  tuple of pairs."""
  if isinstance(stacking, str):
    if stacking not in STACKING_MODES:
      raise SpecError(f"stacking must be one of {STACKING_MODES} or a dict "
                      f"group name -> table names, got {stacking!r}.")
    return stacking
  if isinstance(stacking, Mapping):
    stacking = tuple(stacking.items())
  try:
    return tuple((str(k), tuple(v)) for k, v in stacking)
  except (TypeError, ValueError):
    raise SpecError(f"stacking must be one of {STACKING_MODES} or a dict "
                    f"group name -> table names, got {stacking!r}.") from None


def is_replicated(spec: TableSpec, replicate_below: int) -> bool:
  """Whether `spec` is stored whole on every device."""
  if spec.placement == "auto":
    return spec.num_rows < replicate_below
  return spec.placement == "replicated"


def plan_groups(tables: Sequence[TableSpec], features: Sequence[FeatureSpec],
                num_shards: int, stacking,
                replicate_below: int = 0) -> tuple[Group, ...]:
  """The physical tables of `tables` under a stacking choice.

  Args:
    stacking: "auto" (every set of tables with equal `stack_key`, in table
      order, named by its members joined with "+"), "off" (each table
      alone), or normalized ((group name, table names), ...) (tables not
      named stay alone).
    replicate_below: tables of `placement="auto"` with fewer rows are
      replicated (and stay alone).

  Raises:
    SpecError: a hand grouping names an unknown table, a table twice, a
      group name that is a table's, or tables that cannot share an update.
  """
  names = [t.name for t in tables]
  index = {t.name: i for i, t in enumerate(tables)}
  replicated = {t.name for t in tables if is_replicated(t, replicate_below)}
  if stacking == "off":
    sets = [(t.name, [t.name]) for t in tables]
  elif stacking == "auto":
    by_key: dict = {}
    for t in tables:
      key = ("replicated", t.name) if t.name in replicated else stack_key(t)
      by_key.setdefault(key, []).append(t.name)
    sets = [("+".join(v), v) for v in by_key.values()]
  else:
    sets, seen = [], set()
    for group, members in stacking:
      for m in members:
        if m not in index:
          raise SpecError(f"stacking group {group!r} names table {m!r}, "
                          f"which is not among the tables {names}.")
        if m in seen:
          raise SpecError(f"stacking puts table {m!r} in two groups; give "
                          "each table at most one group.")
        seen.add(m)
      if group in index and list(members) != [group]:
        raise SpecError(f"stacking group name {group!r} is a table's name; "
                        "name the group differently.")
      keys = {stack_key(tables[index[m]]) for m in members}
      if len(members) > 1 and replicated & set(members):
        raise SpecError(
            f"stacking group {group!r} has replicated tables "
            f"{sorted(replicated & set(members))}; a replicated table is "
            "stored alone: leave it out of the group.")
      if len(keys) > 1:
        raise SpecError(
            f"stacking group {group!r} mixes tables that cannot share one "
            f"update ({list(members)}): stacked tables need the same dim, "
            "dtype, optimizer, initializer, layout and max_grad_norm.")
      sets.append((group, list(members)))
    sets += [(n, [n]) for n in names if n not in seen]
  groups = []
  for name, members in sets:
    if not members:
      continue
    members = sorted(members, key=index.get)
    groups.append(_group(name, [tables[index[m]] for m in members],
                         [index[m] for m in members], features, num_shards,
                         members[0] in replicated))
  taken = set(names)
  for g in groups:
    if g.members is not None and g.name in taken:
      raise SpecError(f"the stacked table {g.name!r} has a table's name; "
                      "rename the table or group by hand (stacking={...}).")
  return tuple(groups)


# -- state of a group <-> states of its members -----------------------------------

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
  member = np.where((rows >= 0) & (rows >= starts[at]) & (
      rows < starts[at] + sizes[at]), at, -1)
  src = np.full(rows.shape, -1, np.int64)
  for i, m in enumerate(mlayouts):
    at = member == i
    src[at] = base[i] + m.physical_of(rows[at] - starts[i])
  return src.astype(np.int32)


def _take(x, idx):
  return jax.numpy.take(x, jax.numpy.where(idx >= 0, idx, x.shape[0]), axis=0,
                        mode="fill", fill_value=0)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _split(group: Group, num_shards: int, i: int, sharding, state: TableState
           ) -> TableState:
  idx = _member_source(group, i, num_shards)
  spec, mspec = group.spec, group.tables[i]
  rps = _member_layout(mspec, num_shards).rows_per_shard
  slots = spec.optimizer.slot_specs()
  put = lambda x: jax.lax.with_sharding_constraint(x, sharding)
  return TableState(
      put(_take(state.table, idx)),
      {k: put(slots[k].as_stored(_take(slots[k].as_rows(v, spec.dim), idx),
                                 spec.dim, rps))
       for k, v in state.slots.items()},
      state.step)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _join(group: Group, num_shards: int, sharding, states) -> TableState:
  idx = _group_source(group, num_shards)
  spec = group.spec
  rps = group.layout(num_shards).rows_per_shard
  slots = spec.optimizer.slot_specs()
  cat = lambda xs: jax.numpy.concatenate(xs, axis=0)
  put = lambda x: jax.lax.with_sharding_constraint(x, sharding)
  return TableState(
      put(_take(cat([s.table for s in states]), idx)),
      {k: put(slots[k].as_stored(_take(cat(
          [slots[k].as_rows(s.slots[k], spec.dim) for s in states]), idx),
          spec.dim, rps)) for k in states[0].slots},
      states[0].step)


def member_states(group: Group, num_shards: int, sharding,
                  state: TableState) -> dict[str, TableState]:
  """Each member's state as if it were stored alone (its own physical
  layout over `num_shards`, row-sharded by `sharding`); the members share
  the group's step."""
  if group.members is None and not group.replicated:
    return {group.name: state}
  return {t.name: _split(group, num_shards, i, sharding, state)
          for i, t in enumerate(group.tables)}


def group_state(group: Group, num_shards: int, sharding,
                states: Mapping[str, TableState]) -> TableState:
  """The inverse of `member_states`: the group's state from each member's
  own (the step of the group is its first member's). `sharding`: the
  group's placement."""
  if group.members is None and not group.replicated:
    return states[group.name]
  return _join(group, num_shards, sharding,
               tuple(states[t.name] for t in group.tables))
