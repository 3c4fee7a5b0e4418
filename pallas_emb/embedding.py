"""Row-sharded embedding tables: initialise, look up, update sparsely.

The synchronous API. A `ShardedEmbedding` is static configuration (tables,
features, mesh, axis, backend); the state is a dict of `TableState` pytrees.
One step is

    acts, res = emb.lookup(tables, ids)          # dict feature -> embeddings
    g_acts = jax.grad(loss)(acts, ...)          # the model's backward
    tables, metrics = emb.apply_gradients(tables, res, g_acts)

The backward never builds a dense gradient of a table: per-token gradients are
summed per unique id, routed to the owners of the rows and applied by the fused
optimizer update, in place. Everything here works eagerly and inside
`jax.jit`; the data and the table are sharded over the same mesh axis (each
device holds a slice of the batch and a slice of every table). The methods
validate (`validate`) and call one jitted program per table (`programs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_emb import kernels, pooling, programs, validate
from pallas_emb import state as state_lib
from pallas_emb.capacity import Capacities
from pallas_emb.dynamic import DynamicTables
from pallas_emb.errors import InputError
from pallas_emb.ids import int32_ids
from pallas_emb.sharded_table import ShardedTable
from pallas_emb.spec import FeatureSpec, TableSpec, check_max_norm
from pallas_emb.stacking import plan as stacking_plan
from pallas_emb.stacking import state as stacking_state
from pallas_emb.state import TableMetrics, TableResiduals, TableState
from sharding.layout import RowLayout


@dataclasses.dataclass(frozen=True)
class ShardedEmbedding(DynamicTables):
  """Tables row-sharded over one mesh axis, and the features that read them.

  Attributes:
    tables: a `TableSpec` per table (unique names).
    features: a `FeatureSpec` per feature (unique names, each naming a table).
    mesh: the device mesh. The batch and every table are sharded over `axis`;
      other mesh axes (if any) hold replicas.
    axis: the mesh axis name tables and data are sharded over.
    backend: "pallas", "interpret", "xla", "native" or None: "pallas" on a
      mesh of TPUs, "native" on CPUs when its library is built, else "xla".
    stacking: "auto" (default: tables of equal dim, dtype, optimizer,
      initializer and layout are stored and updated as one, see
      `pallas_emb.stacking`), "off", or a dict group name -> table names.
      The state dict is keyed by *physical* table (`table_names`: a stacked
      group's name, or the table's own); ids, activations, metrics,
      `logical_table` and checkpoints stay per *logical* table (a
      `TableSpec.name`). Methods say which namespace they take: `table_spec`,
      `layout`, `features_of` and `table_sharding` take a physical name,
      the `logical_*` methods and `group_of` a logical one.
    replicate_below: tables of `placement="auto"` with fewer rows are
      stored whole on every device and updated without all_to_all (see
      `pallas_emb.replicated_ops`); 0 (default): none unless their spec
      says "replicated".
  """

  tables: Sequence[TableSpec]
  features: Sequence[FeatureSpec]
  mesh: Mesh
  axis: str = "x"
  backend: str | None = None
  stacking: Any = "auto"
  replicate_below: int = 0

  def __post_init__(self):
    object.__setattr__(self, "tables", tuple(self.tables))
    object.__setattr__(self, "features", tuple(self.features))
    validate.check_embedding(self.tables, self.features, self.mesh, self.axis)
    object.__setattr__(
      self, "backend", kernels.resolve_backend(self.backend, self.mesh.devices.flat)
    )
    object.__setattr__(self, "stacking", stacking_plan.normalize(self.stacking))
    # Derived, not a field: equality and hashing stay those of the fields.
    object.__setattr__(
      self,
      "_groups",
      {
        g.name: g
        for g in stacking_plan.plan_groups(
          self.tables, self.features, self.num_shards, self.stacking, self.replicate_below
        )
      },
    )

  # -- static helpers ---------------------------------------------------------

  @property
  def num_shards(self) -> int:
    return self.mesh.shape[self.axis]

  @property
  def groups(self) -> tuple[stacking_plan.Group, ...]:
    """The physical tables (see `pallas_emb.stacking`)."""
    return tuple(self._groups.values())

  @property
  def table_names(self) -> tuple[str, ...]:
    """The keys of the state dict: one per physical table."""
    return tuple(self._groups)

  def _group(self, name: str) -> stacking_plan.Group:
    """The group of physical table `name`, or an error that says which
    namespace a logical name belongs to."""
    group = self._groups.get(name)
    if group is not None:
      return group
    stored_in = stacking_plan.group_of(self.groups, name).name  # unknown: raises
    raise InputError(
      f"{name!r} is a logical table stored in the stacked table {stored_in!r}; this "
      f"method takes a physical table (one of {list(self._groups)}): pass {stored_in!r}, "
      "or use the logical_* methods for one table."
    )

  def group_of(self, table: str) -> stacking_plan.Group:
    """The group that stores logical table `table`."""
    return stacking_plan.group_of(self.groups, table)

  def table_spec(self, name: str) -> TableSpec:
    """The spec of physical table `name` (a key of the state dict)."""
    return self._group(name).spec

  def logical_spec(self, table: str) -> TableSpec:
    """The spec of logical table `table` (a `TableSpec.name`)."""
    g = self.group_of(table)
    return g.tables[[t.name for t in g.tables].index(table)]

  def layout(self, name: str) -> RowLayout:
    """Where physical table `name`'s rows live (one shard if replicated)."""
    return self._group(name).layout(self.num_shards)

  def logical_layout(self, table: str) -> RowLayout:
    """Where logical table `table`'s rows would live stored alone and
    sharded (the layout of `member_states` and of checkpoints)."""
    spec = self.logical_spec(table)
    return RowLayout(spec.num_rows, self.num_shards, spec.layout)

  def table_sharding(self, name: str) -> NamedSharding:
    """Where a physical table's state lives: row-sharded or replicated."""
    return self.sharding(rows=not self._group(name).replicated)

  def features_of(self, name: str) -> tuple[FeatureSpec, ...]:
    """The features of physical table `name`, in its token order (of a
    stack: with `table` set to the stack's name)."""
    return self._group(name).features

  def logical_features(self, table: str) -> tuple[FeatureSpec, ...]:
    """The features that read logical table `table`."""
    self.group_of(table)  # an unknown table raises
    return tuple(f for f in self.features if f.table == table)

  @property
  def physical_features(self) -> tuple[FeatureSpec, ...]:
    return tuple(f for g in self.groups for f in g.features)

  def unstacked(self) -> ShardedEmbedding:
    """The same tables with stacking off."""
    return dataclasses.replace(self, stacking="off")

  def metrics_by_table(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Physical table -> metrics (pytrees of (M,) arrays for a stack) ->
    logical table -> metrics."""
    return stacking_plan.metrics_by_table(self.groups, metrics)

  def member_states(self, tables: Mapping[str, TableState]) -> dict[str, TableState]:
    """Logical table -> its state as if stored alone (stacking off)."""
    self.check_on_mesh(tables)
    return stacking_state.member_states(self.groups, self.num_shards, self.sharding(), tables)

  def from_member_states(self, states: Mapping[str, TableState]) -> dict[str, TableState]:
    """The inverse of `member_states`: logical -> physical states."""
    self.check_on_mesh(states)
    return {
      g.name: stacking_state.group_state(g, self.num_shards, self.table_sharding(g.name), states)
      for g in self.groups
    }

  def sharded_table(
    self, name: str, tokens_per_shard: int, unique_capacity: int | None = None
  ) -> ShardedTable:
    """Physical table `name` as its sparse step sees it, for
    `tokens_per_shard` ids per data shard (`unique_capacity` overrides the
    spec's)."""
    g, layout = self._group(name), self.layout(name)
    caps = Capacities.for_table(g.spec, layout, tokens_per_shard, unique_capacity)
    return ShardedTable(
      g.spec, g.features, layout, caps, self.mesh, self.axis, self.backend, g.members, g.replicated
    )

  def sharding(self, *, rows: bool = True) -> NamedSharding:
    """Row-sharded (or replicated) placement on the mesh."""
    return NamedSharding(self.mesh, P(self.axis) if rows else P())

  def check_ids(self, ids: Mapping[str, jax.Array]) -> dict[str, int]:
    """Validates the ids of every feature and where they live; returns
    tokens per shard by table."""
    tokens = validate.check_ids(self.physical_features, ids, self.num_shards, self.axis)
    validate.check_placement(ids, self.mesh)
    return tokens

  def check_tables(self, tables: Mapping[str, TableState], names, *, slots: bool = True) -> None:
    """Validates that `tables[name]` for each name fits its spec and mesh."""
    validate.check_tables(tables, names, self.table_spec, self.layout, slots=slots, mesh=self.mesh)

  def check_on_mesh(self, tree, what: str = "a table state") -> None:
    """Refuses (`MeshMismatchError`) device arrays of `tree` on another mesh."""
    fix = "pass arrays of this embedding's mesh (its init(), lookup(), a restored checkpoint)."
    validate.check_on_mesh(tree, self.mesh, what, fix)

  def _tables_of(self, ids) -> dict[str, ShardedTable]:
    return {name: self.sharded_table(name, n) for name, n in self.check_ids(ids).items()}

  def _feature_args(self, name: str, per_feature: Mapping) -> tuple:
    return tuple(per_feature[f.name] for f in self.features_of(name))

  # -- state --------------------------------------------------------------

  def init(self, key: jax.Array) -> dict[str, TableState]:
    """Initial tables and slots, each device generating only its own rows.

    Args:
      key: a PRNG key; table i uses `fold_in(key, i)`, row r of it
        `fold_in(fold_in(key, i), r)`, whether it is stacked or not.

    Returns:
      physical table name (`table_names`) -> `TableState`.
    """
    out = {}
    for g in self.groups:
      keys = [jax.random.fold_in(key, i) for i in g.indices]
      out[g.name] = programs.init(
        self.sharded_table(g.name, 1), keys[0] if g.members is None else jnp.stack(keys)
      )
    return out

  def state_from_logical(self, name: str, table, slots=None, step=0) -> TableState:
    """Builds a `TableState` from host arrays in logical row order.

    Args:
      name: the table.
      table: (num_rows, dim) values (cast to the table dtype).
      slots: slot name -> (num_rows, width), or None for initial slots.
      step: updates applied so far.
    """
    if name not in self._groups:
      raise InputError(
        f"table {name!r} is stacked in {self.group_of(name).name!r}; build "
        "per-table states with emb.unstacked().state_from_logical and "
        "stack them with emb.from_member_states."
      )
    spec = self.table_spec(name)
    table, slots = validate.check_logical(spec, table, slots)
    return state_lib.state_from_logical(
      spec,
      self.layout(name),
      self.table_sharding(name),
      self.sharding(rows=False),
      table,
      slots,
      step,
    )

  def logical_table(self, tables: Mapping[str, TableState], table: str) -> np.ndarray:
    """(num_rows, dim) host copy of logical table `table` in logical row
    order, of the table's dtype. With several processes every process gets
    it whole."""
    return state_lib.logical_table(
      self.logical_spec(table), self.logical_layout(table), self._member_state(tables, table)
    )

  def logical_slots(self, tables: Mapping[str, TableState], table: str) -> dict[str, np.ndarray]:
    """Slot name -> (num_rows, width) host copy of logical table `table`'s
    slots in logical row order."""
    return state_lib.logical_slots(
      self.logical_spec(table), self.logical_layout(table), self._member_state(tables, table)
    )

  def _member_state(self, tables, table: str) -> TableState:
    g = self.group_of(table)
    self.check_on_mesh(tables[g.name], f"table {table!r}")
    return stacking_state.member_state(g, self.num_shards, self.sharding(), tables[g.name], table)

  # -- the step ---------------------------------------------------------------

  def lookup(self, tables: Mapping[str, TableState], ids: Mapping[str, jax.Array]):
    """Embeddings of every feature.

    Args:
      tables: name -> `TableState`.
      ids: feature name -> (B, L) int32 or int64 (see `pallas_emb.ids`), B
        divisible by the number of shards. -1 is padding; other ids outside
        [0, num_rows) are invalid (zero row, counted).

    Returns:
      (acts, residuals): feature -> (B, dim) float32 (pooled) or (B, L, dim)
      (sequence); table name -> `TableResiduals` for `apply_gradients`.
    """
    shards = self._tables_of(ids)
    self.check_tables(tables, shards, slots=False)
    ids = int32_ids(ids)  # on the host for NumPy ids: before jit can wrap
    acts, residuals = {}, {}
    for name, t in shards.items():
      outs, residuals[name] = programs.lookup(t, tables[name].table, self._feature_args(name, ids))
      acts.update(zip((f.name for f in t.features), outs))
    return acts, residuals

  def plan(self, ids: Mapping[str, jax.Array]) -> dict[str, TableResiduals]:
    """Dedup and routing of `ids` without reading any row.

    What `lookup` returns as residuals, for callers that have the per-id
    gradients already (no forward pass), e.g. `apply_gradients` from logged
    gradients or a benchmark of the update alone.

    Args:
      ids: feature -> (B, L) int32 or int64, as for `lookup`.

    Returns:
      table name -> `TableResiduals`.
    """
    shards = self._tables_of(ids)
    ids = int32_ids(ids)
    return {name: programs.plan(t, self._feature_args(name, ids)) for name, t in shards.items()}

  def apply_gradients(
    self,
    tables: Mapping[str, TableState],
    residuals: Mapping[str, TableResiduals],
    grads: Mapping[str, jax.Array],
    gate=True,
    *,
    max_global_norm: float | None = None,
  ):
    """Sparse, fused optimizer update of every looked-up table, in place.

    `tables` is donated: its buffers are reused for the result.

    Args:
      tables: name -> `TableState`.
      residuals: the second result of `lookup`.
      grads: feature -> gradient of the loss w.r.t. that feature's output.
      gate: bool scalar; False skips every update (metrics still computed).
      max_global_norm: None, or clip by one norm over every table's summed
        row gradients: sqrt(sum of the tables' `grad_norm`**2). When it
        exceeds max_global_norm every table's gradients are scaled by
        max_global_norm / that norm, and when it is not finite no table is
        updated. It replaces the tables' own `max_grad_norm`, and routes
        each table's gradients twice (once for the norm).

    Returns:
      (tables, metrics): the updated states and logical table name ->
      `TableMetrics` (per table also when stacked; `grad_norm` is each
      table's own, unclipped norm).
    """
    self.check_tables(tables, residuals)
    self.check_on_mesh((residuals, grads), "the residuals or gradients")
    check_max_norm(max_global_norm, "max_global_norm")
    tables, metrics = dict(tables), {}
    gate = jnp.asarray(gate, jnp.bool_)
    shards = {}
    for name, res in residuals.items():
      spec, feats = self.table_spec(name), self.features_of(name)
      validate.check_feature_grads(
        name,
        feats,
        grads,
        [pooling.output_shape(f.combiner, w, spec.dim) for f, w in zip(feats, res.weights)],
      )
      shards[name] = self.sharded_table(name, res.plan.token_slot.shape[0] // self.num_shards)
    clip = None
    if max_global_norm is not None:
      clip = (
        jnp.float32(max_global_norm),
        programs.global_grad_norm(
          tuple(shards.values()),
          tuple(residuals[n] for n in shards),
          tuple(self._feature_args(n, grads) for n in shards),
        ),
      )
    for name, t in shards.items():
      tables[name], metrics[name] = programs.apply_gradients(
        t, tables[name], residuals[name], self._feature_args(name, grads), gate, clip
      )
    return tables, self.metrics_by_table(metrics)


__all__ = ["Capacities", "ShardedEmbedding", "TableMetrics", "TableResiduals", "TableState"]
