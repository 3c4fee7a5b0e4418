"""Embedding optimizers: each is its math, one pure `update_rows` function."""

from pallas_emb.optimizers.adagrad import Adagrad
from pallas_emb.optimizers.adam import AsyncEmbAdam, LazyAdam
from pallas_emb.optimizers.base import EmbeddingOptimizer, SlotSpec
from pallas_emb.optimizers.ftrl import FTRL
from pallas_emb.optimizers.fused_async import FusedAsyncEmbUpdate
from pallas_emb.optimizers.optax_rows import OptaxRows
from pallas_emb.optimizers.rowwise_adagrad import RowWiseAdagrad
from pallas_emb.optimizers.sgd import SGD

__all__ = [
  "Adagrad",
  "AsyncEmbAdam",
  "EmbeddingOptimizer",
  "FTRL",
  "FusedAsyncEmbUpdate",
  "LazyAdam",
  "OptaxRows",
  "RowWiseAdagrad",
  "SGD",
  "SlotSpec",
]
