"""pallas_emb: row-sharded embedding tables for JAX with fused, asynchronous
optimizer updates written as Pallas TPU kernels."""

from pallas_emb.embedding import (
    Capacities, ShardedEmbedding, TableMetrics, TableResiduals, TableState)
from pallas_emb.errors import (
    AsyncEmbStateError, BackendError, ConfigError, InputError, SpecError,
    VmemBudgetError)
from pallas_emb.optimizers import (
    SGD, Adagrad, EmbeddingOptimizer, LazyAdam, RowWiseAdagrad, SlotSpec)
from pallas_emb.spec import FeatureSpec, TableSpec, default_initializer

__version__ = "0.1.0"

__all__ = [
    "Adagrad", "AsyncEmbStateError", "BackendError", "Capacities",
    "ConfigError", "EmbeddingOptimizer", "FeatureSpec", "InputError",
    "LazyAdam", "RowWiseAdagrad", "SGD", "ShardedEmbedding", "SlotSpec",
    "SpecError", "TableMetrics", "TableResiduals", "TableSpec", "TableState",
    "VmemBudgetError", "default_initializer",
]
