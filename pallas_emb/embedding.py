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
device holds a slice of the batch and a slice of every table).

`lookup_shard` and `update_shard` are the per-table, per-device halves that the
asynchronous API (`async_emb.py`) reuses.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_emb import kernels, packing
from pallas_emb.errors import InputError, SpecError
from pallas_emb.spec import FeatureSpec, TableSpec
from sharding.dedup import dedup
from sharding.layout import ROW_ALIGNMENT, RowLayout, round_up
from sharding.route import RoutePlan, from_owners, plan_route, to_owners

# Rows generated per iteration at init: bounds the temporary to a chunk.
_INIT_CHUNK_ROWS = 32768


class TableState(NamedTuple):
  """One table and its optimizer state (global arrays, rows sharded).

  Attributes:
    table: (num_shards * rows_per_shard, storage_width) float32, or uint32
      words for bfloat16 (see `packing`). Physical row order of the layout.
    slots: slot name -> (num_shards * rows_per_shard, width) float32 | int32.
    step: () int32, updates applied so far (the step of schedules).
  """

  table: jax.Array
  slots: dict[str, jax.Array]
  step: jax.Array


class TableResiduals(NamedTuple):
  """What the update needs from the lookup (per-device pieces, concatenated).

  Attributes:
    unique_keys: (S * unique_capacity,) int32 physical rows per data shard.
    inverse: (S * tokens_per_shard,) int32 slot in unique_keys, -1 = none.
    weights: per feature of the table, (B, L) float32 combiner weight of
      each id (0 for padding and invalid ids).
    plan: the `RoutePlan` of every device.
    num_invalid: (S,) int32 ids outside [0, num_rows), padding excluded.
    num_overflow: (S,) int32 distinct ids over unique_capacity.
  """

  unique_keys: jax.Array
  inverse: jax.Array
  weights: jax.Array
  plan: RoutePlan
  num_invalid: jax.Array
  num_overflow: jax.Array


class TableMetrics(NamedTuple):
  """Per-step metrics of one table (replicated scalars).

  Attributes:
    unique_ids: distinct valid ids routed this step (global).
    invalid_ids: ids outside [0, num_rows), -1 padding excluded.
    overflow_ids: ids dropped for unique or route capacity, counted per data
      shard and summed (an id dropped on two shards counts twice).
    grad_norm: global L2 norm of the per-row summed gradients.
    applied: False when the norm was not finite (or the gate was closed):
      then table and slots are bit-for-bit unchanged.
  """

  unique_ids: jax.Array
  invalid_ids: jax.Array
  overflow_ids: jax.Array
  grad_norm: jax.Array
  applied: jax.Array


@dataclasses.dataclass(frozen=True)
class Capacities:
  """Static buffer sizes of one table for one batch shape (multiples of 8).

  Attributes:
    unique: distinct ids per data shard.
    route: ids one data shard sends to one owner.
    owner: distinct rows one owner merges.
  """

  unique: int
  route: int
  owner: int

  @classmethod
  def for_table(cls, spec: TableSpec, layout: RowLayout,
                tokens_per_shard: int) -> "Capacities":
    """Capacities from the spec; None fields become exact (never overflow)."""
    rps = layout.rows_per_shard
    unique = min(spec.unique_capacity or tokens_per_shard, spec.num_rows)
    unique = round_up(max(unique, 1), ROW_ALIGNMENT)
    route = min(spec.route_capacity or unique, unique, rps)
    route = round_up(route, ROW_ALIGNMENT)
    owner = min(layout.num_shards * route, rps)
    return cls(unique=unique, route=route, owner=owner)


@dataclasses.dataclass(frozen=True)
class TableRouting:
  """Static per-table context of the shard-level functions."""

  spec: TableSpec
  layout: RowLayout
  capacities: Capacities
  axis: str
  backend: str

  @property
  def num_shards(self) -> int:
    return self.layout.num_shards


def lookup_shard(r: TableRouting, table: jax.Array, ids: jax.Array):
  """One device's lookup of one table (inside `shard_map`).

  Args:
    r: static routing.
    table: (rows_per_shard, storage_width) this device's row shard, or None
      to plan the routing only.
    ids: (n,) int32 this data shard's ids of every feature of the table.

  Returns:
    (rows, has_row, residuals): (n, dim) float32 row per id (zero for
    padding, invalid and overflowed ids; None without a table), (n,) bool
    whether the id got a row, and the `TableResiduals` pieces of this device
    (`weights` left for the caller, who knows the features, to fill).
  """
  caps = r.capacities
  unique = dedup(ids, r.layout, caps.unique)
  plan = plan_route(unique.keys, rows_per_shard=r.layout.rows_per_shard,
                    num_shards=r.num_shards, route_capacity=caps.route,
                    owner_capacity=caps.owner, axis_name=r.axis)
  # Which ids got a row: in range, and not dropped for unique or route
  # capacity (an owner never drops one: its capacity covers all it can get).
  has_row = (unique.inverse >= 0) & (
      jnp.take(plan.send_slot, jnp.maximum(unique.inverse, 0)) >= 0)
  rows = None
  if table is not None:
    owner_rows = kernels.gather(table, plan.owner_rows, dtype=r.spec.dtype,
                                backend=r.backend)
    unique_rows = from_owners(plan, owner_rows, axis_name=r.axis)
    rows = jnp.take(unique_rows, jnp.where(unique.inverse < 0, caps.unique,
                                           unique.inverse),
                    axis=0, mode="fill", fill_value=0)
  residuals = TableResiduals(
      unique_keys=unique.keys, inverse=unique.inverse,
      weights=(),
      plan=plan._replace(num_owner_unique=plan.num_owner_unique[None],
                         num_overflow=plan.num_overflow[None]),
      num_invalid=unique.num_invalid[None],
      num_overflow=unique.num_overflow[None])
  return rows, has_row, residuals


def update_shard(r: TableRouting, table, slots, step, res: TableResiduals,
                 token_grads: jax.Array, gate: jax.Array):
  """One device's sparse update of one table (inside `shard_map`).

  Args:
    r: static routing.
    table, slots: this device's row shard of the table and its slots.
    step: () int32 updates applied so far.
    res: this device's `TableResiduals`.
    token_grads: (n, dim) float32 gradient per id (already weighted).
    gate: bool scalar; False skips the update (e.g. an empty async update).

  Returns:
    (table, slots, step, TableMetrics).
  """
  caps = r.capacities
  unique_grads = jax.ops.segment_sum(
      token_grads, jnp.where(res.inverse < 0, caps.unique, res.inverse),
      num_segments=caps.unique)
  owner_grads = to_owners(res.plan, unique_grads, axis_name=r.axis)
  norm = jnp.sqrt(jax.lax.psum(jnp.sum(owner_grads * owner_grads), r.axis))
  apply = jnp.isfinite(norm) & gate
  opt = r.spec.optimizer
  # Optimizers whose math cannot run inside a kernel (arbitrary optax code)
  # take the XLA path whatever the backend.
  backend = r.backend if getattr(opt, "runs_in_kernel", True) else "xla"
  table, slots = kernels.fused_update(
      table, slots, res.plan.owner_rows, owner_grads, opt.scalars(step), apply,
      optimizer=opt, dtype=r.spec.dtype, backend=backend)
  psum = lambda x: jax.lax.psum(jnp.sum(x), r.axis)
  metrics = TableMetrics(
      unique_ids=psum(res.plan.num_owner_unique),
      invalid_ids=psum(res.num_invalid),
      overflow_ids=psum(res.num_overflow) + psum(res.plan.num_overflow),
      grad_norm=norm, applied=apply)
  return table, slots, step + apply.astype(jnp.int32), metrics


def _place(emb: "ShardedEmbedding", tree, rows: bool = True):
  """Puts a pytree on the mesh row-sharded (or replicated) inside jit.

  `shard_map` requires its inputs to carry the matching sharding already;
  meshes with Explicit axes (the default of `jax.make_mesh`) need `reshard`,
  Auto axes a sharding constraint.
  """
  sharding = emb.sharding(rows=rows)
  axis_type = emb.mesh.axis_types[emb.mesh.axis_names.index(emb.axis)]
  if axis_type == jax.sharding.AxisType.Explicit:
    return jax.tree.map(lambda x: jax.reshard(x, sharding), tree)
  return jax.lax.with_sharding_constraint(tree, sharding)


def _to_host(x: jax.Array) -> np.ndarray:
  """A global array on the host, gathered from every process if need be."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _combine(rows: jax.Array, valid: jax.Array, combiner):
  """(b, L, D) rows and (b, L) validity -> output and per-token weights."""
  weights = valid.astype(jnp.float32)
  if combiner is None:
    return rows, weights
  count = jnp.maximum(jnp.sum(weights, axis=1, keepdims=True), 1.0)
  if combiner == "mean":
    weights = weights / count
  elif combiner == "sqrtn":
    weights = weights * jax.lax.rsqrt(count)
  return jnp.sum(rows * weights[..., None], axis=1), weights


def _expand_grads(grads: jax.Array, weights: jax.Array, combiner):
  """Output gradient -> (b * L, D) per-token gradient."""
  grads = grads.astype(jnp.float32)
  if combiner in ("sum", None):
    # The weights are 1 for every id that has a row and 0 for the others,
    # whose inverse is -1 anyway: multiplying would only cost a token-sized
    # temporary (on CPU, its page faults cost more than the whole segment sum).
    token = grads if combiner is None else jnp.broadcast_to(
        grads[:, None, :], weights.shape + grads.shape[-1:])
  else:
    token = grads[:, None, :] * weights[..., None]
  return token.reshape(-1, token.shape[-1])


def _token_grads_shard(feats, weights, feature_grads) -> jax.Array:
  """One device's (n, D) per-id gradient, in the order of its lookup's ids."""
  return jnp.concatenate([_expand_grads(g, w, f.combiner)
                          for f, g, w in zip(feats, feature_grads, weights)])


@dataclasses.dataclass(frozen=True)
class ShardedEmbedding:
  """Tables row-sharded over one mesh axis, and the features that read them.

  Attributes:
    tables: the `TableSpec`s (unique names).
    features: the `FeatureSpec`s (unique names, each naming a table).
    mesh: the device mesh. The batch and every table are sharded over `axis`;
      other mesh axes (if any) hold replicas.
    axis: the mesh axis name tables and data are sharded over.
    backend: "pallas", "interpret", "xla" or None (by platform).
  """

  tables: Sequence[TableSpec]
  features: Sequence[FeatureSpec]
  mesh: Mesh
  axis: str = "x"
  backend: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "tables", tuple(self.tables))
    object.__setattr__(self, "features", tuple(self.features))
    for t in self.tables:
      if not isinstance(t, TableSpec):
        raise SpecError(f"tables must be TableSpecs, got {t!r}.")
    for f in self.features:
      if not isinstance(f, FeatureSpec):
        raise SpecError(f"features must be FeatureSpecs, got {f!r}.")
    names = [t.name for t in self.tables]
    if len(set(names)) != len(names):
      raise SpecError(f"table names must be unique, got {names}.")
    fnames = [f.name for f in self.features]
    if len(set(fnames)) != len(fnames):
      raise SpecError(f"feature names must be unique, got {fnames}.")
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
    object.__setattr__(self, "backend", kernels.resolve_backend(self.backend))

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

  def routing(self, name: str, tokens_per_shard: int) -> TableRouting:
    """The static routing of table `name` for `tokens_per_shard` ids."""
    spec = self.table_spec(name)
    layout = self.layout(name)
    return TableRouting(spec, layout,
                        Capacities.for_table(spec, layout, tokens_per_shard),
                        self.axis, self.backend)

  def sharding(self, *, rows: bool = True) -> NamedSharding:
    """Row-sharded (or replicated) placement on the mesh."""
    return NamedSharding(self.mesh, P(self.axis) if rows else P())

  def check_ids(self, ids: Mapping[str, jax.Array]) -> dict[str, int]:
    """Validates the ids of every feature; returns tokens per shard by table."""
    if not isinstance(ids, Mapping):
      raise InputError(f"ids must be a dict feature name -> (B, L) int32 "
                       f"array, got {type(ids).__name__}.")
    known = {f.name for f in self.features}
    unknown = sorted(set(ids) - known)
    if unknown:
      raise InputError(f"ids for unknown features {unknown}; the features are "
                       f"{sorted(known)}.")
    tokens: dict[str, int] = {}
    for f in self.features:
      if f.name not in ids:
        raise InputError(f"ids are missing feature {f.name!r}.")
      x = ids[f.name]
      dtype = np.dtype(getattr(x, "dtype", type(x)))
      if dtype != np.int32:
        raise InputError(
            f"ids of feature {f.name!r} must be int32, got {dtype}; cast with "
            ".astype(np.int32) (ids >= 2**31 cannot address a row).")
      if np.ndim(x) != 2:
        raise InputError(
            f"ids of feature {f.name!r} must have shape (batch, bag_size), "
            f"got {np.shape(x)}; reshape a single id per example to (B, 1).")
      batch, bag = np.shape(x)
      if batch % self.num_shards:
        raise InputError(
            f"batch size {batch} of feature {f.name!r} is not divisible by "
            f"the {self.num_shards} shards of mesh axis {self.axis!r}; use a "
            f"multiple of {self.num_shards}.")
      tokens[f.table] = tokens.get(f.table, 0) + batch // self.num_shards * bag
    return tokens

  def check_tables(self, tables: Mapping[str, TableState], names, *,
                   slots: bool = True) -> None:
    """Validates that `tables[name]` for each name fits its spec and mesh.

    Args:
      tables: name -> `TableState`.
      names: the tables to check.
      slots: also check the optimizer slots (a lookup reads only the table).

    Raises:
      InputError: a missing table, a donated (deleted) buffer, or a stored
        array or slot whose shape or dtype is not the spec's.
    """
    if not isinstance(tables, Mapping):
      raise InputError(f"tables must be a dict name -> TableState, got "
                       f"{type(tables).__name__}.")
    for name in names:
      if name not in tables:
        raise InputError(f"tables are missing {name!r}; pass the dict "
                         "returned by init().")
      spec, layout = self.table_spec(name), self.layout(name)
      expected = (layout.num_physical_rows,
                  packing.storage_width(spec.dim, spec.dtype))
      got = tables[name].table
      # Reusing a donated buffer crashes the CPU client of JAX 0.10 instead
      # of raising; catch it here with a message that says what happened.
      leaves = [got, *tables[name].slots.values()]
      if any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
             and x.is_deleted() for x in leaves):
        raise InputError(
            f"table {name!r} (or a slot) was donated to an earlier update and "
            "its buffer is gone; pass the state that update returned.")
      if tuple(got.shape) != expected or got.dtype != packing.storage_dtype(spec.dtype):
        raise InputError(
            f"table {name!r} has {got.dtype}{list(got.shape)}, but its spec "
            f"(dim={spec.dim}, dtype={spec.dtype}) over {self.num_shards} "
            f"shards stores {packing.storage_dtype(spec.dtype)}{list(expected)};"
            " build the state with this ShardedEmbedding's init() or "
            "state_from_logical().")
      if slots:
        self._check_slots(name, tables[name].slots)

  def _check_slots(self, name: str, slots) -> None:
    spec = self.table_spec(name)
    want = spec.optimizer.slot_specs()
    if set(slots) != set(want):
      raise InputError(
          f"table {name!r} has slots {sorted(slots)}, but its optimizer "
          f"{type(spec.optimizer).__name__} keeps {sorted(want)}; build the "
          "state with init() or state_from_logical().")
    rows = self.layout(name).num_physical_rows
    for k, s in want.items():
      shape = (rows, spec.dim if s.width is None else s.width)
      x = slots[k]
      if tuple(x.shape) != shape or np.dtype(x.dtype) != np.dtype(s.dtype):
        raise InputError(
            f"slot {k!r} of table {name!r} is {x.dtype}{list(x.shape)}, but "
            f"{type(spec.optimizer).__name__} keeps {np.dtype(s.dtype)}"
            f"{list(shape)}; build the state with init() or "
            "state_from_logical().")

  # -- state --------------------------------------------------------------

  def init(self, key: jax.Array) -> dict[str, TableState]:
    """Initial tables and slots, each device generating only its own rows.

    Args:
      key: a PRNG key; table i uses `fold_in(key, i)`, row r of it
        `fold_in(fold_in(key, i), r)`.
    """
    return _init(self, key)

  def state_from_logical(self, name: str, table, slots=None,
                         step=0) -> TableState:
    """Builds a `TableState` from host arrays in logical row order.

    Args:
      name: the table.
      table: (num_rows, dim) values (cast to the table dtype).
      slots: slot name -> (num_rows, width), or None for initial slots.
      step: updates applied so far.
    """
    spec, layout = self.table_spec(name), self.layout(name)
    table = np.asarray(table)
    if table.shape != (spec.num_rows, spec.dim):
      raise InputError(f"table {name!r} must have shape "
                       f"{(spec.num_rows, spec.dim)}, got {table.shape}.")
    put = lambda x: jax.device_put(layout.to_physical(x), self.sharding())
    specs = spec.optimizer.slot_specs()
    slots = dict(slots or {})
    unknown = sorted(set(slots) - set(specs))
    if unknown:
      raise InputError(f"table {name!r} has no slots {unknown}; its optimizer "
                       f"keeps {sorted(specs)}.")
    out = {}
    for k, s in specs.items():
      width = spec.dim if s.width is None else s.width
      value = slots.get(k)
      if value is None:
        value = np.full((spec.num_rows, width), s.init, s.dtype)
      value = np.asarray(value, s.dtype)
      if value.shape != (spec.num_rows, width):
        raise InputError(f"slot {k!r} of table {name!r} must have shape "
                         f"{(spec.num_rows, width)}, got {value.shape}.")
      out[k] = put(value)
    return TableState(put(packing.to_storage(table, spec.dtype)), out,
                      jax.device_put(jnp.asarray(step, jnp.int32),
                                     self.sharding(rows=False)))

  def logical_table(self, tables: Mapping[str, TableState], name: str) -> np.ndarray:
    """(num_rows, dim) host copy of a table in logical row order, of the
    table's dtype. With several processes every process gets it whole."""
    spec = self.table_spec(name)
    physical = _to_host(tables[name].table)
    return packing.from_storage(self.layout(name).to_logical(physical), spec.dtype)

  def logical_slots(self, tables: Mapping[str, TableState], name: str) -> dict[str, np.ndarray]:
    """Slot name -> (num_rows, width) host copy in logical row order."""
    layout = self.layout(name)
    return {k: layout.to_logical(_to_host(v)) for k, v in tables[name].slots.items()}

  # -- the step ---------------------------------------------------------------

  def lookup(self, tables: Mapping[str, TableState],
             ids: Mapping[str, jax.Array]):
    """Embeddings of every feature.

    Args:
      tables: name -> `TableState`.
      ids: feature name -> (B, L) int32, B divisible by the number of shards.
        -1 is padding; other ids outside [0, num_rows) are invalid (zero row,
        counted).

    Returns:
      (acts, residuals): feature -> (B, dim) float32 (pooled) or (B, L, dim)
      (sequence); table name -> `TableResiduals` for `apply_gradients`.
    """
    tokens = self.check_ids(ids)
    self.check_tables(tables, tokens, slots=False)
    return _lookup(self, {k: tables[k].table for k in tokens}, dict(ids))

  def plan(self, ids: Mapping[str, jax.Array]) -> dict[str, TableResiduals]:
    """Dedup and routing of `ids` without reading any row.

    What `lookup` returns as residuals, for callers that have the per-id
    gradients already (no forward pass), e.g. `apply_gradients` from logged
    gradients or a benchmark of the update alone.

    Args:
      ids: feature -> (B, L) int32, as for `lookup`.

    Returns:
      table name -> `TableResiduals`.
    """
    self.check_ids(ids)
    return _plan(self, dict(ids))

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
    for name in residuals:
      for f, w in zip(self.features_of(name), residuals[name].weights):
        if f.name not in grads:
          raise InputError(
              f"grads are missing feature {f.name!r}; pass the gradient of the "
              "loss w.r.t. every output of lookup().")
        g = grads[f.name]
        want = (*w.shape, self.table_spec(name).dim)  # (B, L, dim)
        if f.combiner is not None:
          want = (want[0], want[2])
        if tuple(g.shape) != want or not jnp.issubdtype(g.dtype, jnp.floating):
          raise InputError(
              f"gradient of feature {f.name!r} is {g.dtype}{list(g.shape)}; "
              f"expected a float array of shape {want}, like its lookup "
              "output.")
    return _apply_gradients(self, dict(tables), dict(residuals), dict(grads),
                            jnp.asarray(gate, jnp.bool_))


@functools.partial(jax.jit, static_argnums=0)
def _init(emb: ShardedEmbedding, key):
  out = {}
  for i, spec in enumerate(emb.tables):
    layout = emb.layout(spec.name)
    table_key = jax.random.fold_in(key, i)

    def shard_fn(k, spec=spec, layout=layout):
      shard = jax.lax.axis_index(emb.axis)
      table = _init_rows(spec, layout, k, shard)
      slots = {}
      for name, s in spec.optimizer.slot_specs().items():
        width = spec.dim if s.width is None else s.width
        slots[name] = jnp.full((layout.rows_per_shard, width), s.init, s.dtype)
      return table, slots

    table, slots = jax.shard_map(
        shard_fn, mesh=emb.mesh, in_specs=P(), out_specs=P(emb.axis),
        check_vma=False)(_place(emb, table_key, rows=False))
    out[spec.name] = TableState(table, slots, jnp.zeros((), jnp.int32))
  return out


def _init_rows(spec: TableSpec, layout: RowLayout, key, shard):
  """This shard's stored rows, generated a chunk at a time."""
  rps = layout.rows_per_shard
  width = packing.storage_width(spec.dim, spec.dtype)

  def generate(start, size):
    logical = layout.logical_of(shard * rps + start + jnp.arange(size))
    keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.maximum(logical, 0))
    rows = jax.vmap(lambda k: spec.initializer(k, (spec.dim,), jnp.float32))(keys)
    rows = jnp.where(logical[:, None] >= 0, rows.astype(jnp.float32), 0.0)
    return packing.pack_rows(rows, spec.dtype)

  if rps <= _INIT_CHUNK_ROWS:
    return generate(0, rps)
  full, rest = divmod(rps, _INIT_CHUNK_ROWS)
  table = jnp.zeros((rps, width), packing.storage_dtype(spec.dtype))
  table = jax.lax.fori_loop(
      0, full, lambda i, t: jax.lax.dynamic_update_slice(
          t, generate(i * _INIT_CHUNK_ROWS, _INIT_CHUNK_ROWS),
          (i * _INIT_CHUNK_ROWS, 0)), table)
  if rest:
    table = jax.lax.dynamic_update_slice(
        table, generate(full * _INIT_CHUNK_ROWS, rest),
        (full * _INIT_CHUNK_ROWS, 0))
  return table


def plan_table(emb: ShardedEmbedding, name: str,
               ids: Mapping[str, jax.Array]) -> TableResiduals:
  """Residuals of table `name` for `ids`, without reading rows (traceable)."""
  return lookup_table(emb, name, None, ids)[1]


def lookup_table(emb: ShardedEmbedding, name: str, table: jax.Array | None,
                 ids: Mapping[str, jax.Array]):
  """Looks up every feature of table `name` (traceable; no validation).

  Args:
    emb: the configuration.
    name: the table.
    table: its stored (physical) array; None plans the routing only.
    ids: feature -> (B, L) int32, for (at least) the table's features.

  Returns:
    (acts, residuals): feature -> output ({} without a table), and the
    `TableResiduals`.
  """
  feats = emb.features_of(name)
  tokens = sum(ids[f.name].shape[0] // emb.num_shards * ids[f.name].shape[1]
               for f in feats)
  routing = emb.routing(name, tokens)

  def shard_fn(*args):
    table, feature_ids = (None, args) if table_missing else (args[0], args[1:])
    flat = jnp.concatenate([x.reshape(-1) for x in feature_ids])
    rows, has_row, res = lookup_shard(routing, table, flat)
    outs, weights, start = [], [], 0
    for f, x in zip(feats, feature_ids):
      valid = has_row[start:start + x.size].reshape(x.shape)
      if rows is None:
        w = _combine(jnp.zeros(x.shape + (0,)), valid, f.combiner)[1]
      else:
        out, w = _combine(rows[start:start + x.size].reshape(*x.shape, -1),
                          valid, f.combiner)
        outs.append(out)
      weights.append(w)
      start += x.size
    return tuple(outs), res._replace(weights=tuple(weights))

  table_missing = table is None
  args = [ids[f.name] for f in feats] if table_missing else [table] + [
      ids[f.name] for f in feats]
  outs, res = jax.shard_map(
      shard_fn, mesh=emb.mesh, in_specs=P(emb.axis), out_specs=P(emb.axis),
      check_vma=False)(*_place(emb, tuple(args)))
  return {f.name: o for f, o in zip(feats, outs)}, res


def token_gradients(emb: ShardedEmbedding, name: str, res: TableResiduals,
                    grads: Mapping[str, jax.Array]) -> jax.Array:
  """Gradients w.r.t. the outputs -> (S * tokens_per_shard, dim) per id.

  Each device's block is in the order of its ids in the lookup (features
  concatenated per device), so it lines up with `res.inverse`.
  """
  feats = emb.features_of(name)

  def shard_fn(weights, *feature_grads):
    return _token_grads_shard(feats, weights, feature_grads)

  return jax.shard_map(
      shard_fn, mesh=emb.mesh, in_specs=P(emb.axis), out_specs=P(emb.axis),
      check_vma=False)(*_place(emb, (res.weights,
                                     *[grads[f.name] for f in feats])))


def update_table(emb: ShardedEmbedding, name: str, state: TableState,
                 res: TableResiduals, gate, *, token_grads=None,
                 feature_grads=None):
  """Sparse fused update of table `name` (traceable; no validation).

  Args:
    emb: the configuration.
    name: the table.
    state: its `TableState`.
    res: the residuals of the lookup whose gradient this is.
    gate: bool scalar; False writes nothing.
    token_grads: (S * tokens_per_shard, dim) float32 from `token_gradients`;
      or instead
    feature_grads: feature -> gradient w.r.t. its lookup output, expanded to
      ids inside the update (no token-sized array between the two).

  Returns:
    (new TableState, TableMetrics).
  """
  routing = emb.routing(name, res.inverse.shape[0] // emb.num_shards)
  feats = emb.features_of(name)
  if (token_grads is None) == (feature_grads is None):
    raise TypeError("pass exactly one of token_grads and feature_grads")
  grads = (token_grads,) if feature_grads is None else tuple(
      feature_grads[f.name] for f in feats)

  def shard_fn(table, slots, step, res, gate, *grads):
    if feature_grads is not None:
      grads = (_token_grads_shard(feats, res.weights, grads),)
    return update_shard(routing, table, slots, step, res, grads[0], gate)

  table, slots, step, metrics = jax.shard_map(
      shard_fn, mesh=emb.mesh,
      in_specs=(P(emb.axis), P(emb.axis), P(), P(emb.axis), P())
      + (P(emb.axis),) * len(grads),
      out_specs=(P(emb.axis), P(emb.axis), P(), P()), check_vma=False)(
          *_place(emb, (state.table, state.slots)),
          _place(emb, state.step, rows=False), _place(emb, res),
          _place(emb, jnp.asarray(gate, jnp.bool_), rows=False),
          *_place(emb, grads))
  return TableState(table, slots, step), metrics


@functools.partial(jax.jit, static_argnums=0)
def _plan(emb: ShardedEmbedding, ids):
  return {name: plan_table(emb, name, ids) for name in emb.check_ids(ids)}


@functools.partial(jax.jit, static_argnums=0)
def _lookup(emb: ShardedEmbedding, tables, ids):
  acts, residuals = {}, {}
  for name in tables:
    table_acts, residuals[name] = lookup_table(emb, name, tables[name], ids)
    acts.update(table_acts)
  return acts, residuals


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _apply_gradients(emb: ShardedEmbedding, tables, residuals, grads, gate):
  tables = dict(tables)
  metrics = {}
  for name, res in residuals.items():
    tables[name], metrics[name] = update_table(
        emb, name, tables[name], res, gate, feature_grads=grads)
  return tables, metrics
