"""Host batches -> global device arrays, each process feeding its slice."""

from __future__ import annotations

import jax
import numpy as np

from pallas_emb.data.base import DataError
from pallas_emb.ids import int32_ids


class GlobalBatches:
  """Turns a dataset's host batches into batch-sharded global arrays.

  Every process builds the same global batch (datasets are deterministic by
  index) and contributes the rows its devices hold, via
  `jax.make_array_from_process_local_data`; with one process that is the
  whole batch.

  Args:
    dataset: a `Dataset`.
    batch_size: global batch size, a multiple of the process count.
    sharding: the batch sharding (rows over the data axis).
  """

  def __init__(self, dataset, batch_size: int, sharding: jax.sharding.Sharding):
    self.dataset, self.batch_size, self.sharding = dataset, batch_size, sharding
    n = jax.process_count()
    if batch_size % n:
      raise DataError(f"batch size {batch_size} must be a multiple of the {n} "
                      "processes: each feeds an equal slice.")

  def put(self, batch: dict) -> dict:
    """A host batch (global rows) -> global arrays (this process's slice).

    Ids (the "ids" entry) of any integer width arrive as int32: converted
    here on the host, before JAX would wrap int64 ids (see `pallas_emb.ids`).
    """
    batch = {k: v for k, v in batch.items() if k != "true_logit"}
    if "ids" in batch:
      batch["ids"] = int32_ids({k: jax.tree.map(np.asarray, v)
                                for k, v in batch["ids"].items()})

    n, p = jax.process_count(), jax.process_index()

    def one(x):
      # This process's equal share of the leading axis: its examples, or,
      # for ragged ids (S * C slots), its data shards' slots.
      x = np.asarray(x)
      lo = x.shape[0] * p // n
      return jax.make_array_from_process_local_data(
          self.sharding, x[lo:lo + x.shape[0] // n], x.shape)

    return jax.tree.map(one, batch)

  def train(self, index: int) -> dict:
    """Training batch `index` as global arrays."""
    return self.put(self.dataset.train_batch(index, self.batch_size))

  def eval(self):
    """The held-out batches as (global arrays, host batch) pairs."""
    for batch in self.dataset.eval_batches(self.batch_size):
      yield self.put(batch), batch
