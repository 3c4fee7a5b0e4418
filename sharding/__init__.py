"""Where embedding rows live and how ids and gradients travel between shards.

This package knows nothing of optimizers or kernels: it places rows
(`layout`), deduplicates ids with static capacities (`dedup`), and moves ids,
rows and gradients between data shards and row owners inside `shard_map`
(`route`); for dynamic vocabularies it keeps each shard's id -> row map
(`id_map`; `probe_window` reads its probe windows, `insert_rounds` places
new keys, `id_map_reshard` moves it to another shard count), whose raw-id
keys travel to their owners by `key_route`.
"""

from sharding.dedup import PAD_ID, Unique, dedup, unique_keys
from sharding.layout import SENTINEL, LayoutError, RowLayout
from sharding.route import RoutePlan, empty_plan, from_owners, plan_route, to_owners

__all__ = [
  "PAD_ID",
  "SENTINEL",
  "LayoutError",
  "RowLayout",
  "RoutePlan",
  "Unique",
  "dedup",
  "empty_plan",
  "from_owners",
  "plan_route",
  "to_owners",
  "unique_keys",
]
