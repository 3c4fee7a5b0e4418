"""Host batches -> global device arrays, each process reading only its rows.

Training batches come through a `grain` data source whose record t is this
process's rows of batch t (`Dataset.train_rows`): a process never builds the
global batch, only its slice. The grain iterator's state (the next batch
index) is saved with each checkpoint, so a resumed run reads the batches an
uninterrupted one would. Held-out batches are read the same way
(`Dataset.eval_rows`): each process reads its rows of each one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grain
import jax
import numpy as np

from pallas_emb.data.base import DataError
from pallas_emb.ids import int32_ids

_ENDLESS = 1 << 40  # batch indices: training streams do not end


class ProcessRows(grain.sources.RandomAccessDataSource):
  """Record t: rows [lo, hi) of training batch t (a dict of NumPy arrays).

  Attributes:
    records_read: batches (records) read.
    rows_read: examples read: hi - lo per record, never the whole batch.
  """

  def __init__(self, dataset, batch_size: int, lo: int, hi: int):
    self.dataset, self.batch_size, self.lo, self.hi = dataset, batch_size, lo, hi
    self.records_read = self.rows_read = 0

  def __len__(self) -> int:
    return _ENDLESS

  def __getitem__(self, index: int) -> dict:
    rows = self.dataset.train_rows(int(index), self.batch_size, self.lo, self.hi)
    self.records_read += 1
    self.rows_read += self.hi - self.lo
    return rows


class GlobalBatches:
  """Turns a dataset's rows into batch-sharded global arrays.

  Process p of P reads rows [p * B / P, (p + 1) * B / P) of each training
  and held-out batch and contributes them via
  `jax.make_array_from_process_local_data`; with one process that is the
  whole batch.

  Attributes:
    source: the training rows (`ProcessRows`, with its read counters).
    eval_rows_read: held-out examples this process read (hi - lo per batch).

  Args:
    dataset: a `Dataset`.
    batch_size: global batch size, a multiple of the process count.
    sharding: the batch sharding (rows over the data axis).
    words: features whose ids are dynamic tables' (B, L, 2) uint32 key
      words, placed as they are (other ids become int32).
  """

  def __init__(self, dataset, batch_size: int, sharding: jax.sharding.Sharding, words=frozenset()):
    self.dataset, self.batch_size, self.sharding = dataset, batch_size, sharding
    self.words = frozenset(words)
    n = jax.process_count()
    if batch_size % n:
      raise DataError(
        f"batch size {batch_size} must be a multiple of the {n} "
        "processes: each feeds an equal slice."
      )
    self.lo = jax.process_index() * batch_size // n
    self.hi = self.lo + batch_size // n
    self.source = ProcessRows(dataset, batch_size, self.lo, self.hi)
    self.eval_rows_read = 0

  def _global(self, batch: dict, local: bool) -> dict:
    batch = {k: v for k, v in batch.items() if k != "true_logit"}
    if "ids" in batch:
      # Converted here on the host, before JAX would wrap int64 ids.
      ids = {k: jax.tree.map(np.asarray, v) for k, v in batch["ids"].items()}
      batch["ids"] = {k: v if k in self.words else int32_ids(v) for k, v in ids.items()}
    n, p = jax.process_count(), jax.process_index()

    def one(x):
      # Local rows are this process's share already. Of global rows it takes
      # its equal share of the leading axis: its examples, or, for ragged ids
      # (S * C slots), its data shards' slots.
      x = np.asarray(x)
      if local:
        return jax.make_array_from_process_local_data(
          self.sharding, x, (x.shape[0] * n, *x.shape[1:])
        )
      lo = x.shape[0] * p // n
      return jax.make_array_from_process_local_data(
        self.sharding, x[lo : lo + x.shape[0] // n], x.shape
      )

    return jax.tree.map(one, batch)

  def put(self, batch: dict) -> dict:
    """A host batch (global rows) -> global arrays (this process's slice).

    Ids (the "ids" entry) of any integer width arrive as int32 (see
    `pallas_emb.ids`).
    """
    return self._global(batch, local=False)

  def train(self, index: int) -> dict:
    """Training batch `index` as global arrays (random access; this
    process reads only its rows)."""
    return self._global(self.source[index], local=True)

  def iterator(self, state: dict[str, Any] | None = None, start: int = 0) -> grain.DatasetIterator:
    """A grain iterator over the training batches (global arrays) from
    batch `start`, or from a saved `iterator.get_state()`."""
    ds = (
      grain.MapDataset.source(self.source)
      .map(lambda rows: self._global(rows, local=True))
      .to_iter_dataset(read_options=grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    )
    it = iter(ds)
    it.set_state(dict(state) if state else {"next_index": start})
    return it

  def eval(self) -> Iterator[tuple[dict, dict]]:
    """The held-out batches as (global arrays, this process's rows) pairs;
    labels and weights of other processes' rows are in the global arrays."""
    for index in range(-(-self.dataset.eval_size // self.batch_size)):
      rows = self.dataset.eval_rows(index, self.batch_size, self.lo, self.hi)
      self.eval_rows_read += self.hi - self.lo
      yield self._global(rows, local=True), rows
