"""Embedding optimizers: each is its math, one pure `update_rows` function."""

from pallas_emb.optimizers.adagrad import Adagrad
from pallas_emb.optimizers.adam import LazyAdam
from pallas_emb.optimizers.base import EmbeddingOptimizer, SlotSpec
from pallas_emb.optimizers.rowwise_adagrad import RowWiseAdagrad
from pallas_emb.optimizers.sgd import SGD

__all__ = ["Adagrad", "EmbeddingOptimizer", "LazyAdam", "RowWiseAdagrad",
           "SGD", "SlotSpec"]
