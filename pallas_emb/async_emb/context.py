"""The async context of one table: its static description and the fused
start/done that the optimizers' protocol methods delegate to.

An `AsyncEmbContextHandle` is immutable and hashable, a static `jax.jit`
argument. What an update in flight changes is kept in `tracker.IN_FLIGHT`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from pallas_emb import programs, validate
from pallas_emb.async_emb.protocol import AsyncEmbGradientUpdate, EmbOptState
from pallas_emb.async_emb.tracker import IN_FLIGHT
from pallas_emb.embedding import ShardedEmbedding
from pallas_emb.errors import InputError, UpdateMismatchError
from pallas_emb.sharded_table import ShardedTable
from pallas_emb.spec import FeatureSpec, TableSpec
from pallas_emb.state import TableState


def tie(x, gate):
  """`x` after `gate` is computed (an ordering-only dependency)."""
  if gate is None:
    return x
  x, _ = jax.lax.optimization_barrier((x, gate))
  return x


@dataclasses.dataclass(frozen=True)
class AsyncEmbContextHandle:
  """One table's static async context. Build it with `make_context_handle`.

  Attributes:
    context_id: an id for messages and logs.
    sharded_table: the table, its features, mesh, backend and capacities.
    table_axis: the mesh axis the table is sharded over (the communicator).
    data_axis: the mesh axes the tokens are sharded over (== (table_axis,)).
    tokens_per_batch: ids per global batch over all the table's features.
    emb_width: the row width (the table's dim).
    num_unique: unique-id capacity per data shard as asked; the buffers hold
      `sharded_table.capacities.unique` (rounded up to 8, capped at the
      vocabulary).
    group_size: devices along table_axis.
    tokens_per_rank: tokens_per_batch // group_size.
  """

  context_id: int
  sharded_table: ShardedTable
  table_axis: str
  data_axis: tuple[str, ...]
  tokens_per_batch: int
  emb_width: int
  num_unique: int
  group_size: int
  tokens_per_rank: int

  @property
  def spec(self) -> TableSpec:
    return self.sharded_table.spec

  @property
  def name(self) -> str:
    return self.spec.name

  @property
  def features(self) -> tuple[FeatureSpec, ...]:
    return self.sharded_table.features

  @property
  def mesh(self) -> Mesh:
    return self.sharded_table.mesh

  @property
  def embedding(self) -> ShardedEmbedding:
    """This table alone as a `ShardedEmbedding` (to `init` it, read it...)."""
    t = self.sharded_table
    return ShardedEmbedding((t.spec,), t.features, t.mesh, t.axis, t.backend)

  @property
  def in_flight(self) -> bool:
    """Whether an update was started and not yet collected."""
    return IN_FLIGHT.is_armed(self)

  def reset(self) -> None:
    """Forgets an in-flight record (after a trace that failed between start
    and done)."""
    IN_FLIGHT.reset(self)

  def table_inputs(self, per_feature: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a feature -> array dict that belong to this table."""
    return {f.name: per_feature[f.name] for f in self.features}

  @property
  def identity(self) -> str:
    """Which table, optimizer and mesh this context updates: the owner
    recorded in each `AsyncEmbGradientUpdate` it makes."""
    t = self.sharded_table
    return (
      f"table {t.name!r} ({t.spec.num_rows}x{t.spec.dim} "
      f"{np.dtype(t.spec.dtype).name}, features "
      f"{[f.name for f in t.features]}, {t.spec.optimizer!r}) on axis "
      f"{t.axis!r} of the {validate.describe_mesh(t.mesh)}"
    )

  def check_state(self, table, slots=None) -> None:
    """Validates the stored table (and slots) against the table's spec and
    mesh."""
    validate.check_state(self.spec, self.sharded_table.layout, table, slots, self.mesh)

  def check_update(self, update) -> None:
    """Refuses an update that is not an `AsyncEmbGradientUpdate` of this
    table, optimizer and mesh."""
    if not isinstance(update, AsyncEmbGradientUpdate) or update.plan is None:
      raise InputError(
        f"gradient_update_start on table {self.name!r} needs an "
        "AsyncEmbGradientUpdate from make_gradient_update or "
        f"empty_gradient_update, got {type(update).__name__}."
      )
    if update.owner != self.identity:
      raise UpdateMismatchError(
        f"gradient_update_start on {self.identity} was given the update "
        f"of {update.owner or 'an unknown context (owner=None)'}; pass "
        "the update that this table's make_gradient_update (or "
        "empty_gradient_update) returned."
      )
    validate.check_token_grads(self.name, update.grads, self.tokens_per_batch, self.emb_width)

  # -- what the optimizers' protocol methods delegate to ------------------------

  def fused_update_start(
    self, opt, update: AsyncEmbGradientUpdate, table, state: EmbOptState, gate=None
  ):
    """`AsyncEmbOptimizer.gradient_update_start` through the fused update."""
    if opt != self.spec.optimizer:
      raise InputError(
        f"gradient_update_start was called on {opt!r}, but table "
        f"{self.name!r} is trained by {self.spec.optimizer!r}; call it on "
        "the table's optimizer (or use pallas_emb.gradient_update_start)."
      )
    IN_FLIGHT.check_idle(self, "gradient_update_start")
    self.check_update(update)
    self.check_state(table, state.slots)
    new, metrics = programs.apply_token_gradients(
      self.sharded_table,
      TableState(tie(table, gate), dict(state.slots), state.step),
      update.residuals(),
      update.grads,
      update.pending,
    )
    IN_FLIGHT.arm(self, metrics.grad_norm, metrics.applied, new.step)
    pins = (metrics.grad_norm, metrics.applied)
    return pins, new.table, EmbOptState(new.slots, new.step), metrics._asdict()

  def fused_update_done(self, opt, gate=None):
    """`AsyncEmbOptimizer.gradient_update_done` through the fused update."""
    del opt
    record = IN_FLIGHT.consume(self)
    return tie((record.norm, record.valid, record.done_pin), gate)


def make_context_handle(
  mesh: Mesh,
  table_axis: str,
  *,
  data_axis,
  tokens_per_batch: int,
  emb_width: int,
  num_unique: int,
  table: TableSpec,
  features: Sequence[FeatureSpec] | None = None,
  backend: str | None = None,
  num_devices_per_node: int | None = None,
  context_id: int = 0,
) -> AsyncEmbContextHandle:
  """Builds the immutable async context of one row-sharded table.

  Args:
    mesh: the device mesh.
    table_axis: mesh axis the table's rows are sharded over.
    data_axis: mesh axis (or tuple of axes) the tokens are sharded over; must
      be `table_axis` (each device is both a data shard and a row owner).
    tokens_per_batch: ids per global batch, over all features of the table.
    emb_width: the table's dim.
    num_unique: unique-id capacity per data shard (overflow is dropped and
      counted), rounded up to a multiple of 8 and capped at the vocabulary.
    table: the table's `TableSpec`.
    features: the features that read it; default one sequence feature named
      like the table.
    backend: "pallas" | "interpret" | "xla" | "native" | None (by platform).
    num_devices_per_node: accepted for compatibility; must divide the number
      of devices when given (TPU slices need no node grouping).
    context_id: an id for messages.

  Raises:
    ValueError: for an axis not in the mesh, a `table_axis` missing from
      `data_axis`, more than one token shard per communicator rank, sizes
      not divisible by the group size, or a width that is not the table's.
  """
  data_axes, group = validate.check_context_args(
    mesh,
    table_axis,
    data_axis,
    tokens_per_batch,
    emb_width,
    num_unique,
    table,
    num_devices_per_node,
  )
  features = tuple(features or (FeatureSpec(table.name, table.name, None),))
  emb = ShardedEmbedding((table,), features, mesh, table_axis, backend)
  tokens_per_batch, emb_width, num_unique = int(tokens_per_batch), int(emb_width), int(num_unique)
  tokens_per_rank = tokens_per_batch // group
  return AsyncEmbContextHandle(
    context_id=context_id,
    sharded_table=emb.sharded_table(table.name, tokens_per_rank, num_unique),
    table_axis=table_axis,
    data_axis=data_axes,
    tokens_per_batch=tokens_per_batch,
    emb_width=emb_width,
    num_unique=num_unique,
    group_size=group,
    tokens_per_rank=tokens_per_rank,
  )


def context_handles(
  emb: ShardedEmbedding, ids: Mapping[str, Any], *, backend: str | None = None
) -> dict[str, AsyncEmbContextHandle]:
  """One context per looked-up physical table of `emb` (a stack of tables
  has one), sized for batches like `ids`, with the same capacities as
  `emb`'s synchronous lookup."""
  handles = {}
  for i, (name, per_shard) in enumerate(emb.check_ids(ids).items()):
    spec = emb.table_spec(name)
    handle = make_context_handle(
      emb.mesh,
      emb.axis,
      data_axis=emb.axis,
      tokens_per_batch=per_shard * emb.num_shards,
      emb_width=spec.dim,
      num_unique=emb.sharded_table(name, per_shard).capacities.unique,
      table=spec,
      features=emb.features_of(name),
      backend=backend or emb.backend,
      context_id=i,
    )
    # A stack keeps its members and a replicated table its placement (the
    # handle's own embedding sees one plain table); the capacities agree.
    handles[name] = dataclasses.replace(handle, sharded_table=emb.sharded_table(name, per_shard))
  return handles
