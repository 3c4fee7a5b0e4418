"""`ShardedTable`: one physical table as its sparse step sees it.

The static description that the per-device steps (`shard_ops`,
`replicated_ops`), the jitted programs (`programs`) and the async context
share: the spec, its features, where its rows live, buffer sizes for one
batch shape, the mesh and backend. Frozen and hashable: a static argument of
`jax.jit`.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from pallas_emb.capacity import Capacities
from pallas_emb.kernels.backend import platform_of
from pallas_emb.packing import LANES
from pallas_emb.spec import FeatureSpec, TableSpec
from pallas_emb.stacking.members import Members
from sharding.layout import RowLayout


@dataclasses.dataclass(frozen=True)
class ShardedTable:
  """One table as its sparse step sees it: static and hashable.

  Attributes:
    spec: the table.
    features: the features that read it, in token order.
    layout: where its rows live.
    capacities: its buffer sizes for this batch shape.
    mesh: the device mesh.
    axis: the mesh axis rows and data are sharded over.
    backend: "pallas", "interpret", "xla" or "native".
    members: the member tables when this is a stack of several (see
      `pallas_emb.stacking.members`): then the counts of `TableResiduals` and every
      field of `TableMetrics` are per member, (M,).
    replicated: stored whole on every device (`layout` has one shard) and
      stepped by `pallas_emb.replicated_ops` instead.
  """

  spec: TableSpec
  features: tuple[FeatureSpec, ...]
  layout: RowLayout
  capacities: Capacities
  mesh: Mesh
  axis: str
  backend: str
  members: Members | None = None
  replicated: bool = False

  @property
  def name(self) -> str:
    return self.spec.name

  @property
  def num_shards(self) -> int:
    return self.layout.num_shards

  @property
  def dedup_method(self) -> str:
    """How dedup finds each id's slot: binary search on CPU, where it is
    fastest; a sort that carries positions elsewhere (see `sharding.dedup`)."""
    return "search" if platform_of(self.mesh.devices.flat) == "cpu" else "sort"

  def route_width(self, width: int) -> int:
    """The width at which rows `width` words wide are routed between
    shards: on a TPU mesh a width over 128 lanes that is not a multiple of
    128 is padded to one (192 -> 256), else XLA keeps the all-to-all's
    blocks in another layout than its neighbours' and copies them on each
    side (W-TPU at D=192: 321 MiB of temp, 194 MiB padded); `width`
    elsewhere."""
    if width > LANES and width % LANES and platform_of(self.mesh.devices.flat) == "tpu":
      return -(-width // LANES) * LANES
    return width
