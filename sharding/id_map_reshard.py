"""A dynamic vocabulary's map moved to another shard count, on the host.

Runs when a checkpoint is restored onto another device count: every resident
key goes to its owner and window under the new layout, as `sharding.id_map`
places keys.
"""

from __future__ import annotations

import numpy as np

from sharding import map_slots
from sharding.id_map import IdMap, init_map
from sharding.layout import RowLayout


def reshard(m: IdMap, new: RowLayout, probe_limit: int, sketch_shape):
  """A host map, whatever shard count wrote it, re-inserted for `new`'s.

  Runs on the host (NumPy), when a checkpoint is restored onto another
  shard count. Every resident key goes to its owner and window under `new`
  (`high % shards`, `low % capacity`, `probe_limit` slots), keeping its
  count and last step; keys are placed in rounds as `translate` inserts
  them: in round r each key still waiting claims slot home + r if it is
  free and usable, and of keys claiming one slot the one of highest count
  (then latest step, then smallest key) wins. Keys left after the last
  round are dropped. The sketch of keys not yet admitted starts empty
  (`sketch_shape`): its counters are per shard and not per key.

  Args:
    m: the whole map as NumPy arrays (global slots, shards concatenated).
    new: the table's layout now.
    probe_limit: the window under `new` (at most `new.rows_per_shard`).
    sketch_shape: the new sketch's (rows, width).

  Returns:
    (the new map; (new.num_physical_rows,) int64 the old (global) slot whose
    key each new slot holds, -1 where empty; the number of keys dropped).
    Slots are map slots: `map_slots.physical_rows` says which rows they are.
  """
  m = IdMap(*(np.asarray(x) for x in m))
  held = np.flatnonzero(m.last >= 0)
  held = held[np.lexsort((m.key_lo[held], m.key_hi[held], -m.last[held], -m.count[held]))]
  shards, capacity = new.num_shards, new.rows_per_shard
  base = (m.key_hi[held] % np.uint32(shards)).astype(np.int64) * capacity
  home = (m.key_lo[held] % np.uint32(capacity)).astype(np.int64)
  slots = np.arange(new.num_physical_rows, dtype=np.int64)
  usable = map_slots.usable(new, slots // capacity, slots % capacity)
  source = np.full((new.num_physical_rows,), -1, np.int64)
  waiting = np.ones(held.shape, bool)
  for r in range(probe_limit):
    cand = base + (home + r) % capacity
    want = np.flatnonzero(waiting & usable[cand] & (source[cand] < 0))
    # Keys are in priority order: a slot's first claimant takes it.
    slots, first = np.unique(cand[want], return_index=True)
    source[slots] = held[want[first]]
    waiting[want[first]] = False
  taken = source >= 0
  out = init_map(shards, capacity, 0, 1)._replace(
    sketch=np.zeros(sketch_shape, np.int32), step=m.step.astype(np.int32)
  )
  for name in ("key_hi", "key_lo", "count", "last"):
    getattr(out, name)[taken] = getattr(m, name)[source[taken]]
  return out, source, int(waiting.sum())
