"""Static buffer sizes of one table's sparse step.

Everything in a step has a static shape, so each table has three capacities
per batch shape: distinct ids per data shard, ids one data shard sends one
owner, and distinct rows one owner merges. Ids beyond a capacity are dropped
and counted as overflow, never clamped onto another row.
"""

from __future__ import annotations

import dataclasses

from pallas_emb.spec import TableSpec
from sharding.layout import ROW_ALIGNMENT, RowLayout, round_up


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
                tokens_per_shard: int,
                unique: int | None = None) -> "Capacities":
    """Capacities from the spec; None fields become exact (never overflow).

    Args:
      spec: the table (its `unique_capacity` and `route_capacity`).
      layout: where its rows live.
      tokens_per_shard: ids per data shard per step, over the table's
        features.
      unique: overrides `spec.unique_capacity` (the async context's
        `num_unique`).
    """
    rps = layout.rows_per_shard
    unique = min(unique or spec.unique_capacity or tokens_per_shard,
                 spec.num_rows)
    unique = round_up(max(unique, 1), ROW_ALIGNMENT)
    route = min(spec.route_capacity or unique, unique, rps)
    route = round_up(route, ROW_ALIGNMENT)
    owner = min(layout.num_shards * route, rps)
    return cls(unique=unique, route=route, owner=owner)
