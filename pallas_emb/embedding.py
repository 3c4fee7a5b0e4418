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
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_emb import kernels, programs, state as state_lib, validate
from pallas_emb.ids import int32_ids
from pallas_emb.capacity import Capacities
from pallas_emb.errors import InputError, SpecError
from pallas_emb.shard_ops import ShardedTable
from pallas_emb.spec import FeatureSpec, TableSpec
from pallas_emb.state import TableMetrics, TableResiduals, TableState
from sharding.layout import RowLayout


def _unique_names(kind: str, names: Sequence[str]) -> None:
  if len(set(names)) != len(names):
    raise SpecError(f"{kind} names must be unique, got {list(names)}.")


@dataclasses.dataclass(frozen=True)
class ShardedEmbedding:
  """Tables row-sharded over one mesh axis, and the features that read them.

  Attributes:
    tables: the `TableSpec`s (unique names).
    features: the `FeatureSpec`s (unique names, each naming a table).
    mesh: the device mesh. The batch and every table are sharded over `axis`;
      other mesh axes (if any) hold replicas.
    axis: the mesh axis name tables and data are sharded over.
    backend: "pallas", "interpret", "xla", "native" or None: "pallas" on a
      mesh of TPUs, "native" on CPUs when its library is built, else "xla".
  """

  tables: Sequence[TableSpec]
  features: Sequence[FeatureSpec]
  mesh: Mesh
  axis: str = "x"
  backend: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "tables", tuple(self.tables))
    object.__setattr__(self, "features", tuple(self.features))
    for kind, items, cls in (("tables", self.tables, TableSpec),
                             ("features", self.features, FeatureSpec)):
      for x in items:
        if not isinstance(x, cls):
          raise SpecError(f"{kind} must be {cls.__name__}s, got {x!r}.")
    names = [t.name for t in self.tables]
    _unique_names("table", names)
    _unique_names("feature", [f.name for f in self.features])
    for f in self.features:
      if f.table not in names:
        raise SpecError(
            f"feature {f.name!r} reads table {f.table!r}, which is not among "
            f"the tables {names}; add a TableSpec named {f.table!r}.")
    if not isinstance(self.mesh, Mesh):
      raise SpecError(f"mesh must be a jax.sharding.Mesh, got {self.mesh!r}.")
    if self.axis not in self.mesh.axis_names:
      raise SpecError(
          f"axis {self.axis!r} is not an axis of the mesh, whose axes are "
          f"{self.mesh.axis_names}; pass one of them as axis=.")
    object.__setattr__(self, "backend", kernels.resolve_backend(
        self.backend, self.mesh.devices.flat))

  # -- static helpers ---------------------------------------------------------

  @property
  def num_shards(self) -> int:
    return self.mesh.shape[self.axis]

  def table_spec(self, name: str) -> TableSpec:
    for t in self.tables:
      if t.name == name:
        return t
    raise InputError(f"unknown table {name!r}; the tables are "
                     f"{[t.name for t in self.tables]}.")

  def layout(self, name: str) -> RowLayout:
    spec = self.table_spec(name)
    return RowLayout(spec.num_rows, self.num_shards, spec.layout)

  def features_of(self, table: str) -> tuple[FeatureSpec, ...]:
    return tuple(f for f in self.features if f.table == table)

  def sharded_table(self, name: str, tokens_per_shard: int,
                    unique_capacity: int | None = None) -> ShardedTable:
    """Table `name` as its sparse step sees it, for `tokens_per_shard` ids
    per data shard (`unique_capacity` overrides the spec's)."""
    spec, layout = self.table_spec(name), self.layout(name)
    caps = Capacities.for_table(spec, layout, tokens_per_shard,
                                unique_capacity)
    return ShardedTable(spec, self.features_of(name), layout, caps, self.mesh,
                        self.axis, self.backend)

  def sharding(self, *, rows: bool = True) -> NamedSharding:
    """Row-sharded (or replicated) placement on the mesh."""
    return NamedSharding(self.mesh, P(self.axis) if rows else P())

  def check_ids(self, ids: Mapping[str, jax.Array]) -> dict[str, int]:
    """Validates the ids of every feature and where they live; returns
    tokens per shard by table."""
    tokens = validate.check_ids(self.features, ids, self.num_shards, self.axis)
    validate.check_placement(ids, self.mesh)
    return tokens

  def check_tables(self, tables: Mapping[str, TableState], names, *,
                   slots: bool = True) -> None:
    """Validates that `tables[name]` for each name fits its spec and mesh."""
    validate.check_tables(tables, names, self.table_spec, self.layout,
                          slots=slots, mesh=self.mesh)

  def _tables_of(self, ids) -> dict[str, ShardedTable]:
    return {name: self.sharded_table(name, n)
            for name, n in self.check_ids(ids).items()}

  def _feature_args(self, name: str, per_feature: Mapping) -> tuple:
    return tuple(per_feature[f.name] for f in self.features_of(name))

  # -- state --------------------------------------------------------------

  def init(self, key: jax.Array) -> dict[str, TableState]:
    """Initial tables and slots, each device generating only its own rows.

    Args:
      key: a PRNG key; table i uses `fold_in(key, i)`, row r of it
        `fold_in(fold_in(key, i), r)`.
    """
    return {spec.name: programs.init(self.sharded_table(spec.name, 1),
                                     jax.random.fold_in(key, i))
            for i, spec in enumerate(self.tables)}

  def state_from_logical(self, name: str, table, slots=None,
                         step=0) -> TableState:
    """Builds a `TableState` from host arrays in logical row order.

    Args:
      name: the table.
      table: (num_rows, dim) values (cast to the table dtype).
      slots: slot name -> (num_rows, width), or None for initial slots.
      step: updates applied so far.
    """
    spec = self.table_spec(name)
    table, slots = validate.check_logical(spec, table, slots)
    return state_lib.state_from_logical(
        spec, self.layout(name), self.sharding(), self.sharding(rows=False),
        table, slots, step)

  def logical_table(self, tables: Mapping[str, TableState], name: str) -> np.ndarray:
    """(num_rows, dim) host copy of a table in logical row order, of the
    table's dtype. With several processes every process gets it whole."""
    return state_lib.logical_table(self.table_spec(name), self.layout(name),
                                   tables[name])

  def logical_slots(self, tables: Mapping[str, TableState], name: str) -> dict[str, np.ndarray]:
    """Slot name -> (num_rows, width) host copy in logical row order."""
    return state_lib.logical_slots(self.table_spec(name), self.layout(name),
                                   tables[name])

  # -- the step ---------------------------------------------------------------

  def lookup(self, tables: Mapping[str, TableState],
             ids: Mapping[str, jax.Array]):
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
      outs, residuals[name] = programs.lookup(
          t, tables[name].table, self._feature_args(name, ids))
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
    return {name: programs.plan(t, self._feature_args(name, ids))
            for name, t in shards.items()}

  def apply_gradients(self, tables: Mapping[str, TableState],
                      residuals: Mapping[str, TableResiduals],
                      grads: Mapping[str, jax.Array], gate=True):
    """Sparse, fused optimizer update of every looked-up table, in place.

    `tables` is donated: its buffers are reused for the result.

    Args:
      tables: name -> `TableState`.
      residuals: the second result of `lookup`.
      grads: feature -> gradient of the loss w.r.t. that feature's output.
      gate: bool scalar; False skips every update (metrics still computed).

    Returns:
      (tables, metrics): the updated states and table name -> `TableMetrics`.
    """
    self.check_tables(tables, residuals)
    tables, metrics = dict(tables), {}
    gate = jnp.asarray(gate, jnp.bool_)
    for name, res in residuals.items():
      spec, feats = self.table_spec(name), self.features_of(name)
      validate.check_feature_grads(
          name, feats, grads,
          [validate.output_shape(f, w.shape, spec.dim)
           for f, w in zip(feats, res.weights)])
      t = self.sharded_table(name,
                             res.plan.token_slot.shape[0] // self.num_shards)
      tables[name], metrics[name] = programs.apply_gradients(
          t, tables[name], res, self._feature_args(name, grads), gate)
    return tables, metrics


__all__ = ["Capacities", "ShardedEmbedding", "TableMetrics", "TableResiduals",
           "TableState"]
