"""Static buffer sizes of one table's sparse step.

Everything in a step has a static shape, so each table has three capacities
per batch shape: distinct ids per data shard, ids one data shard sends one
owner, and distinct rows one owner merges. Ids beyond a capacity are dropped
and counted as overflow, never clamped onto another row.

The defaults follow what a chip sends and owns, never chips x ids per shard:

* unique: the ids per data shard (exact: it cannot overflow);
* route: under the "mod" layout a shard's distinct ids spread evenly over
  the owners, so each owner gets its even share with headroom
  (`ROUTE_HEADROOM` plus `ROUTE_SLACK` ids); one shard, or the "range" layout
  (whose hot, low ids all live on the first shard), is exact;
* owner: what all sources may send it, capped at its rows.

The exchange buffers hold num_shards x route rows, about 1.25 x unique
whatever the chip count. `capacity_planner` measures real batches instead.
"""

from __future__ import annotations

import dataclasses

from pallas_emb.spec import TableSpec
from sharding.layout import ROW_ALIGNMENT, RowLayout, round_up

# The default route capacity over a "mod" layout: the even share of the
# unique capacity, times this, plus ROUTE_SLACK ids for small shares.
ROUTE_HEADROOM = 1.25
ROUTE_SLACK = 64


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
  def for_table(
    cls, spec: TableSpec, layout: RowLayout, tokens_per_shard: int, unique: int | None = None
  ) -> Capacities:
    """Capacities from the spec; None fields become the defaults above.

    Args:
      spec: the table (its `unique_capacity` and `route_capacity`).
      layout: where its rows live.
      tokens_per_shard: ids per data shard per step, over the table's
        features.
      unique: overrides `spec.unique_capacity` (the async context's
        `num_unique`).
    """
    rps, shards = layout.rows_per_shard, layout.num_shards
    unique = min(unique or spec.unique_capacity or tokens_per_shard, spec.num_rows)
    unique = round_up(max(unique, 1), ROW_ALIGNMENT)
    route = spec.route_capacity
    if route is None:
      even = shards > 1 and layout.kind == "mod"
      route = _even_share(unique, shards) if even else unique
    route = round_up(min(route, unique, rps), ROW_ALIGNMENT)
    owner = min(shards * route, rps)
    return cls(unique=unique, route=route, owner=owner)


def _even_share(ids: int, shards: int) -> int:
  return int(ROUTE_HEADROOM * ids / shards) + ROUTE_SLACK


def key_capacity(spec: TableSpec, num_shards: int, tokens_per_shard: int) -> int:
  """Distinct raw ids one data shard sends one owner's id map per step.

  For a dynamic vocabulary (`sharding.key_route`): `spec.route_capacity` if
  set, else the even share of the tokens with headroom (keys go to owners
  by hash, so they spread evenly), at most the tokens. Unlike `route`, not
  capped by the rows: ids beyond them still count toward admission.
  """
  tokens = max(tokens_per_shard, 1)
  cap = spec.route_capacity or (_even_share(tokens, num_shards) if num_shards > 1 else tokens)
  return round_up(min(cap, tokens), ROW_ALIGNMENT)
