"""A pure-Python dynamic vocabulary: dicts and loops, the same policy and
tie-breaks as `sharding.id_map`, written from its docstring.

Keys are Python ints (the 64-bit key `(high << 32) | low`); each shard keeps
a dict key -> slot and per-slot lists. The device step's simultaneous rules
are written sequentially in rank (ascending key) order: in a probe round a
slot taken by a lower rank is no longer free, and in the eviction round
every victim is chosen from the state before the round.
"""

from __future__ import annotations

import numpy as np

from sharding import map_slots
from sharding.layout import RowLayout
from sharding.sketch import sketch_slots

PAD_KEY = 2**64 - 1


class ReferenceVocab:
  def __init__(self, num_rows, num_shards, vocab, kind="mod"):
    self.v = vocab
    self.layout = RowLayout(num_rows, num_shards, kind)
    self.S, self.C = num_shards, self.layout.rows_per_shard
    self.P = min(vocab.probe_limit, self.C)
    self.D, self.W = vocab.depth(), vocab.width_for(self.C)
    self.where = [dict() for _ in range(self.S)]
    self.key = [[None] * self.C for _ in range(self.S)]
    self.count = [[np.float32(0)] * self.C for _ in range(self.S)]
    self.last = [[-1] * self.C for _ in range(self.S)]
    self.sketch = [np.zeros((max(self.D, 1), self.W), np.int64) for _ in range(self.S)]
    self.step = 0

  def usable(self, s, j):
    return bool(map_slots.usable(self.layout, s, j))

  def row(self, s, j):
    """The logical row of slot j of shard s (`sharding.map_slots`)."""
    return int(self.layout.logical_of(s * self.C + int(map_slots.slot_rows(self.layout, s, j))))

  def _evict(self, s, j):
    del self.where[s][self.key[s][j]]
    self.key[s][j], self.last[s][j] = None, -1

  def _put(self, s, j, k, cnt):
    self.where[s][k] = j
    self.key[s][j], self.count[s][j], self.last[s][j] = k, np.float32(cnt), self.step

  def _window(self, k):
    home = (k & 0xFFFFFFFF) % self.C
    return [(home + r) % self.C for r in range(self.P)]

  def _victim(self, s, k):
    best = None
    for p, j in enumerate(self._window(k)):
      last = self.last[s][j]
      if last < 0 or last >= self.step - 1:
        continue
      if self.v.policy == "ttl" and self.step - last < self.v.ttl:
        continue
      score = (self.count[s][j], last, p) if self.v.policy == "lfu" else (last, p)
      if best is None or score < best[0]:
        best = (score, j)
    return None if best is None else best[1]

  def step_keys(self, keys, train=True):
    """`keys`: list of ints (PAD_KEY padding) of all sources, in source
    order. Returns (rows per key, metrics dict)."""
    m = dict(inserts=0, evictions=0, not_admitted=0, failed=0)
    counts = [dict() for _ in range(self.S)]
    for k in keys:
      if k != PAD_KEY:
        s = (k >> 32) % self.S
        counts[s][k] = counts[s].get(k, 0) + 1
    for s in range(self.S):
      if train:
        self._train_shard(s, counts[s], m)
    if train:
      self.step += 1
    rows = []
    for k in keys:
      if k == PAD_KEY:
        rows.append(-1)
        continue
      s = (k >> 32) % self.S
      j = self.where[s].get(k)
      rows.append(-2 if j is None else self.row(s, j))
    m["occupancy"] = sum(len(w) for w in self.where)
    m["misses"] = sum(r == -2 for r in rows)
    return rows, m

  def _train_shard(self, s, counts, m):
    v = self.v
    if v.evict_every is not None and self.step > 0 and self.step % v.evict_every == 0:
      for j in range(self.C):
        if v.policy == "lfu" and v.decay != 1:
          self.count[s][j] = np.float32(self.count[s][j] * np.float32(v.decay))
        if v.ttl is not None and self.last[s][j] >= 0 and self.step - self.last[s][j] >= v.ttl:
          self._evict(s, j)
          m["evictions"] += 1
    ranked = sorted(counts)
    waiting = []
    for k in ranked:
      j = self.where[s].get(k)
      if j is None:
        waiting.append(k)
      else:
        self.count[s][j] = np.float32(self.count[s][j] + np.float32(counts[k]))
        self.last[s][j] = self.step
    if v.admit_after > 1:
      # TinyLFU's reset: halved once its fullest row holds a quarter of its width.
      if self.sketch[s].sum(axis=1).max() >= max(self.W // 4, 1):
        self.sketch[s] //= 2
      hi = np.array([k >> 32 for k in waiting], np.uint32)
      lo = np.array([k & 0xFFFFFFFF for k in waiting], np.uint32)
      cells = sketch_slots(hi, lo, self.D, self.W)
      for i, k in enumerate(waiting):
        for d in range(self.D):
          self.sketch[s][d, cells[d, i]] += counts[k]
      est = [
        min(self.sketch[s][d, cells[d, i]] for d in range(self.D)) for i in range(len(waiting))
      ]
      admitted = [k for k, e in zip(waiting, est) if e >= v.admit_after]
      score = dict(zip(waiting, est))
    else:
      admitted, score = waiting, counts
    m["not_admitted"] += len(waiting) - len(admitted)
    left = list(admitted)
    for r in range(self.P):
      still = []
      for k in left:
        j = self._window(k)[r]
        if self.last[s][j] < 0 and self.usable(s, j):
          self._put(s, j, k, counts[k])
          m["inserts"] += 1
        else:
          still.append(k)
      left = still
    if v.evict_on_insert:
      victims = {k: self._victim(s, k) for k in left}
      claimed, still = set(), []
      for k in left:
        j = victims[k]
        if j is not None and v.policy == "lfu" and self.count[s][j] > np.float32(score[k]):
          j = None  # the victim is more frequent than the newcomer
        if j is None or j in claimed:
          still.append(k)
          continue
        claimed.add(j)
        self._evict(s, j)
        self._put(s, j, k, counts[k])
        m["inserts"] += 1
        m["evictions"] += 1
      left = still
    m["failed"] += len(left)

  def resident(self):
    """{key: logical row}."""
    return {k: self.row(s, j) for s in range(self.S) for k, j in self.where[s].items()}
