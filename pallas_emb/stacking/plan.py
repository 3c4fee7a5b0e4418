"""Which tables are stored together, and where each one's rows go.

Tables that can share one fused update are stored as one physical table (a
*group*): the same dim, dtype, optimizer (optimizers are frozen dataclasses,
so equal hyperparameters compare equal), initializer, layout kind and
`max_grad_norm`. A
group is deduplicated, routed and updated as one table: one routing plan,
one exchange per direction, one gather and one fused update per step
instead of one per table. What users see stays per table: ids, metrics,
`logical_table`, checkpoints (`pallas_emb.stacking.members` keeps the per-table
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
from collections.abc import Mapping, Sequence

import jax

from pallas_emb import packing
from pallas_emb.errors import InputError, SpecError
from pallas_emb.spec import FeatureSpec, TableSpec
from pallas_emb.stacking.members import Members
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
    return RowLayout(self.spec.num_rows, 1 if self.replicated else num_shards, self.spec.layout)

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
  """What tables must share to be stacked (a dynamic table: nothing)."""
  if spec.vocabulary is not None:
    return ("dynamic", spec.name)
  return (
    spec.dim,
    spec.dtype,
    spec.optimizer,
    spec.initializer,
    spec.layout,
    spec.max_grad_norm,
    spec.stochastic_rounding,
    spec.rounding_seed,
  )


def offsets(tables: Sequence[TableSpec], num_shards: int) -> tuple[int, ...]:
  """Each member's first stacked row (see the module docstring)."""
  out, end = [], 0
  for i, t in enumerate(tables):
    start = round_up(end, num_shards) + i % num_shards if t.layout == "mod" else end
    out.append(start)
    end = start + t.num_rows
  return tuple(out)


def _sum_or_none(values):
  return None if any(v is None for v in values) else sum(values)


def _group(name: str, tables, indices, features, num_shards, replicated=False) -> Group:
  feats = [f for t in tables for f in features if f.table == t.name]
  if len(tables) == 1:
    return Group(tables[0], tuple(feats), tuple(tables), tuple(indices), None, replicated)
  starts = offsets(tables, num_shards)
  first = tables[0]
  spec = dataclasses.replace(
    first,
    name=name,
    num_rows=starts[-1] + tables[-1].num_rows,
    unique_capacity=_sum_or_none([t.unique_capacity for t in tables]),
    route_capacity=_sum_or_none([t.route_capacity for t in tables]),
  )
  names = [t.name for t in tables]
  members = Members(
    starts,
    tuple(t.num_rows for t in tables),
    tuple(names.index(f.table) for f in feats),
    tuple(packing.table_tag(n) for n in names),
  )
  return Group(
    spec,
    tuple(dataclasses.replace(f, table=name) for f in feats),
    tuple(tables),
    tuple(indices),
    members,
  )


def normalize(stacking) -> str | tuple[tuple[str, tuple[str, ...]], ...]:
  """ "auto", "off", or a mapping group name -> table names as a hashable
  tuple of pairs."""
  if isinstance(stacking, str):
    if stacking not in STACKING_MODES:
      raise SpecError(
        f"stacking must be one of {STACKING_MODES} or a dict "
        f"group name -> table names, got {stacking!r}."
      )
    return stacking
  if isinstance(stacking, Mapping):
    stacking = tuple(stacking.items())
  try:
    return tuple((str(k), tuple(v)) for k, v in stacking)
  except (TypeError, ValueError):
    raise SpecError(
      f"stacking must be one of {STACKING_MODES} or a dict "
      f"group name -> table names, got {stacking!r}."
    ) from None


def is_replicated(spec: TableSpec, replicate_below: int) -> bool:
  """Whether `spec` is stored whole on every device."""
  if spec.placement == "auto":
    return spec.vocabulary is None and spec.num_rows < replicate_below
  return spec.placement == "replicated"


def plan_groups(
  tables: Sequence[TableSpec],
  features: Sequence[FeatureSpec],
  num_shards: int,
  stacking,
  replicate_below: int = 0,
) -> tuple[Group, ...]:
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
          raise SpecError(
            f"stacking group {group!r} names table {m!r}, which is not among the tables {names}."
          )
        if m in seen:
          raise SpecError(
            f"stacking puts table {m!r} in two groups; give each table at most one group."
          )
        seen.add(m)
      if group in index and list(members) != [group]:
        raise SpecError(
          f"stacking group name {group!r} is a table's name; name the group differently."
        )
      keys = {stack_key(tables[index[m]]) for m in members}
      dynamic = [m for m in members if tables[index[m]].vocabulary is not None]
      if len(members) > 1 and dynamic:
        raise SpecError(
          f"stacking group {group!r} has tables with a dynamic vocabulary {dynamic}; "
          "their id maps are per table, so they are stored alone: leave them out of the group."
        )
      if len(members) > 1 and replicated & set(members):
        raise SpecError(
          f"stacking group {group!r} has replicated tables "
          f"{sorted(replicated & set(members))}; a replicated table is "
          "stored alone: leave it out of the group."
        )
      if len(keys) > 1:
        raise SpecError(
          f"stacking group {group!r} mixes tables that cannot share one "
          f"update ({list(members)}): stacked tables need the same dim, "
          "dtype, optimizer, initializer, layout, max_grad_norm and rounding."
        )
      sets.append((group, list(members)))
    sets += [(n, [n]) for n in names if n not in seen]
  groups = []
  for name, members in sets:
    if not members:
      continue
    members = sorted(members, key=index.get)
    groups.append(
      _group(
        name,
        [tables[index[m]] for m in members],
        [index[m] for m in members],
        features,
        num_shards,
        members[0] in replicated,
      )
    )
  taken = set(names)
  for g in groups:
    if g.members is not None and g.name in taken:
      raise SpecError(
        f"the stacked table {g.name!r} has a table's name; "
        "rename the table or group by hand (stacking={...})."
      )
  return tuple(groups)


def group_of(groups: Sequence[Group], table: str) -> Group:
  """The group that stores logical table `table`."""
  for g in groups:
    if any(t.name == table for t in g.tables):
      return g
  raise InputError(
    f"unknown table {table!r}; the tables are {[t.name for g in groups for t in g.tables]}."
  )


def metrics_by_table(groups: Sequence[Group], metrics: Mapping) -> dict:
  """Physical table -> metrics (pytrees of (M,) arrays for a stack) ->
  logical table -> metrics."""
  by_name = {g.name: g for g in groups}
  out = {}
  for name, m in metrics.items():
    g = by_name[name]
    if g.members is None:
      out[name] = m
    else:
      out.update((t.name, jax.tree.map(lambda x, i=i: x[i], m)) for i, t in enumerate(g.tables))
  return out
