"""Capacities measured on real batches, with headroom.

The default capacities (`capacity`) assume a shard's distinct ids spread
evenly over the owners. A planner measures instead: it routes a sample of
batches with exact capacities (nothing can overflow) and reads what each
step needed -- distinct ids per data shard, ids one data shard sent one
owner, distinct rows one owner merged -- then adds headroom. Buffers sized so
follow the ids a chip really sends and owns. A later batch that needs more is
not clamped: its extra ids are dropped and counted (`TableMetrics`), and the
step reports the maxima it saw, so a run shows how close it is to overflow.

    planned = plan_capacities(emb, [batch["ids"] for batch in sample])
    emb = with_capacities(emb, planned)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from pallas_emb.embedding import ShardedEmbedding
from pallas_emb.errors import InputError, check_int
from sharding.layout import ROW_ALIGNMENT, round_up

# A route capacity no batch reaches: planning routes without overflow.
_UNLIMITED = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class PlannedCapacity:
  """What one table needed on the measured batches, and what to allocate.

  Attributes:
    max_unique_per_shard: the most distinct ids of one data shard.
    max_ids_per_route: the most ids one data shard sent one owner.
    max_rows_per_owner: the most distinct rows one owner merged.
    unique_capacity: `TableSpec.unique_capacity` to use (with headroom).
    route_capacity: `TableSpec.route_capacity` to use (with headroom).
    batches: how many batches were measured.
  """

  max_unique_per_shard: int
  max_ids_per_route: int
  max_rows_per_owner: int
  unique_capacity: int
  route_capacity: int
  batches: int


def _with_headroom(observed: int, headroom: float, slack: int) -> int:
  return round_up(max(int(np.ceil(observed * headroom)) + slack, 1), ROW_ALIGNMENT)


def plan_capacities(
  emb: ShardedEmbedding,
  batches: Iterable[Mapping[str, np.ndarray]],
  *,
  headroom: float = 1.2,
  slack: int = 8,
) -> dict[str, PlannedCapacity]:
  """Measures a sample of batches and returns per-table capacities.

  Args:
    emb: the embedding whose tables to plan.
    batches: feature -> (B, L) ids, like `ShardedEmbedding.lookup`'s, of the
      same shapes as training's (capacities are per batch shape).
    headroom: multiply the observed maxima by this (>= 1)...
    slack: ...and add this many ids.

  Returns:
    table name -> `PlannedCapacity`. Apply with `with_capacities`.

  Raises:
    InputError: no batch, or a bad headroom or slack.
  """
  if not (np.isfinite(headroom) and headroom >= 1.0):
    raise InputError(f"headroom must be a finite float >= 1, got {headroom!r}.")
  check_int(slack, "slack", minimum=0, error=InputError)
  # Measured per table, stacked or not (a stack's capacities are the sums
  # of its members', see `pallas_emb.stacking`).
  exact = dataclasses.replace(
    emb,
    stacking="off",
    tables=tuple(
      dataclasses.replace(t, unique_capacity=None, route_capacity=_UNLIMITED) for t in emb.tables
    ),
  )
  seen: dict[str, list[int]] = {}
  tokens: dict[str, int] = {}
  count = 0
  for ids in batches:
    count += 1
    for name, n in exact.check_ids(ids).items():
      tokens[name] = max(tokens.get(name, 0), n)
    for name, res in exact.plan(ids).items():
      observed = [
        int(np.max(np.asarray(x)))
        for x in (res.num_unique, res.plan.route_demand, res.plan.owner_demand)
      ]
      seen[name] = [max(a, b) for a, b in zip(seen.get(name, observed), observed)]
  if not count:
    raise InputError("plan_capacities needs at least one batch to measure.")
  planned = {}
  for name, (u, r, o) in seen.items():
    # Never more than exact: a shard has no more distinct ids than ids.
    unique = min(_with_headroom(u, headroom, slack), round_up(tokens[name], ROW_ALIGNMENT))
    planned[name] = PlannedCapacity(
      max_unique_per_shard=u,
      max_ids_per_route=r,
      max_rows_per_owner=o,
      unique_capacity=unique,
      route_capacity=min(_with_headroom(r, headroom, slack), unique),
      batches=count,
    )
  return planned


def with_capacities(
  emb: ShardedEmbedding, planned: Mapping[str, PlannedCapacity]
) -> ShardedEmbedding:
  """`emb` with the planned capacities set on its tables' specs."""
  unknown = sorted(set(planned) - {t.name for t in emb.tables})
  if unknown:
    raise InputError(
      f"planned capacities for unknown tables {unknown}; the "
      f"tables are {[t.name for t in emb.tables]}."
    )
  return dataclasses.replace(
    emb,
    tables=tuple(
      dataclasses.replace(
        t,
        unique_capacity=planned[t.name].unique_capacity,
        route_capacity=planned[t.name].route_capacity,
      )
      if t.name in planned
      else t
      for t in emb.tables
    ),
  )
