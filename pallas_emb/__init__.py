"""pallas_emb: row-sharded embedding tables for JAX with fused, asynchronous
optimizer updates written as Pallas TPU kernels."""

from pallas_emb.async_emb import (
    AsyncEmbContextHandle, AsyncEmbGradientUpdate, AsyncEmbOptimizer,
    EmbLookup, EmbOptState, empty_gradient_update, gradient_update_done,
    gradient_update_start, lookup_done, lookup_start, make_context_handle,
    make_gradient_update, supports_async_emb)
from pallas_emb.embedding import (
    Capacities, ShardedEmbedding, TableMetrics, TableResiduals, TableState)
from pallas_emb.errors import (
    AsyncEmbStateError, BackendError, ConfigError, InputError, SpecError,
    VmemBudgetError)
from pallas_emb.optimizers import (
    SGD, Adagrad, AsyncEmbAdam, EmbeddingOptimizer, LazyAdam, OptaxRows,
    RowWiseAdagrad, SlotSpec)
from pallas_emb.spec import FeatureSpec, TableSpec, default_initializer
from pallas_emb.train import TrainConfig, TrainState, Trainer, make_trainer, validate_config

__version__ = "0.1.0"

__all__ = [
    "Adagrad", "AsyncEmbAdam", "AsyncEmbContextHandle",
    "AsyncEmbGradientUpdate", "AsyncEmbOptimizer", "AsyncEmbStateError",
    "BackendError", "Capacities", "ConfigError", "EmbLookup", "EmbOptState",
    "EmbeddingOptimizer", "FeatureSpec", "InputError", "LazyAdam", "OptaxRows",
    "RowWiseAdagrad", "SGD", "ShardedEmbedding", "SlotSpec", "SpecError",
    "TableMetrics", "TableResiduals", "TableSpec", "TableState", "TrainConfig",
    "TrainState", "Trainer", "VmemBudgetError", "default_initializer",
    "empty_gradient_update", "gradient_update_done", "gradient_update_start",
    "lookup_done", "lookup_start", "make_context_handle",
    "make_gradient_update", "make_trainer", "supports_async_emb",
    "validate_config",
]
