"""pallas_emb: row-sharded embedding tables for JAX with fused, asynchronous
optimizer updates written as Pallas TPU kernels.

The public names below load on first use, so importing a leaf module (say
`pallas_emb.kernels` or `pallas_emb.optimizers`) does not load the layers
above it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
  **dict.fromkeys(
    [
      "AsyncEmbContextHandle",
      "AsyncEmbGradientUpdate",
      "AsyncEmbOptimizer",
      "EmbLookup",
      "EmbOptState",
      "empty_gradient_update",
      "gradient_update_done",
      "gradient_update_start",
      "lookup_done",
      "lookup_start",
      "make_context_handle",
      "make_gradient_update",
      "supports_async_emb",
    ],
    "pallas_emb.async_emb",
  ),
  "Capacities": "pallas_emb.capacity",
  "ShardedEmbedding": "pallas_emb.embedding",
  **dict.fromkeys(["TableMetrics", "TableResiduals", "TableState"], "pallas_emb.state"),
  **dict.fromkeys(
    [
      "AsyncEmbStateError",
      "BackendError",
      "CheckpointCorruptError",
      "CheckpointDirError",
      "CheckpointError",
      "CheckpointMismatchError",
      "ConfigError",
      "EmptyInputError",
      "InputError",
      "MeshMismatchError",
      "PallasEmbError",
      "PlacementError",
      "ServingArtifactError",
      "SpecError",
      "UpdateMismatchError",
      "VmemBudgetError",
    ],
    "pallas_emb.errors",
  ),
  **dict.fromkeys(
    [
      "SGD",
      "Adagrad",
      "AsyncEmbAdam",
      "EmbeddingOptimizer",
      "FTRL",
      "LazyAdam",
      "OptaxRows",
      "RowWiseAdagrad",
      "SlotSpec",
    ],
    "pallas_emb.optimizers",
  ),
  **dict.fromkeys(
    ["HashRule", "expected_collision_fraction", "hash64", "hash_ids"], "pallas_emb.hashing"
  ),
  **dict.fromkeys(["ServingModel", "export_serving", "load_serving"], "pallas_emb.serving"),
  "int32_ids": "pallas_emb.ids",
  **dict.fromkeys(["DynamicVocabulary", "vocab_keys", "raw_ids"], "pallas_emb.vocabulary"),
  **dict.fromkeys(["VocabMetrics", "VocabState"], "pallas_emb.dynamic"),
  **dict.fromkeys(["Ragged", "Weighted", "ragged", "ragged_from_csr"], "pallas_emb.inputs"),
  **dict.fromkeys(["FeatureSpec", "TableSpec", "default_initializer"], "pallas_emb.spec"),
  **dict.fromkeys(
    ["TrainConfig", "TrainState", "Trainer", "make_trainer", "validate_config"], "pallas_emb.train"
  ),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'pallas_emb' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
  from pallas_emb.async_emb import (
    AsyncEmbContextHandle,
    AsyncEmbGradientUpdate,
    AsyncEmbOptimizer,
    EmbLookup,
    EmbOptState,
    empty_gradient_update,
    gradient_update_done,
    gradient_update_start,
    lookup_done,
    lookup_start,
    make_context_handle,
    make_gradient_update,
    supports_async_emb,
  )
  from pallas_emb.capacity import Capacities
  from pallas_emb.dynamic import VocabMetrics, VocabState
  from pallas_emb.embedding import ShardedEmbedding
  from pallas_emb.errors import (
    AsyncEmbStateError,
    BackendError,
    CheckpointCorruptError,
    CheckpointDirError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    EmptyInputError,
    InputError,
    MeshMismatchError,
    PallasEmbError,
    PlacementError,
    ServingArtifactError,
    SpecError,
    UpdateMismatchError,
    VmemBudgetError,
  )
  from pallas_emb.hashing import HashRule, expected_collision_fraction, hash64, hash_ids
  from pallas_emb.ids import int32_ids
  from pallas_emb.inputs import Ragged, Weighted, ragged, ragged_from_csr
  from pallas_emb.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AsyncEmbAdam,
    EmbeddingOptimizer,
    LazyAdam,
    OptaxRows,
    RowWiseAdagrad,
    SlotSpec,
  )
  from pallas_emb.serving import ServingModel, export_serving, load_serving
  from pallas_emb.spec import FeatureSpec, TableSpec, default_initializer
  from pallas_emb.state import TableMetrics, TableResiduals, TableState
  from pallas_emb.train import TrainConfig, Trainer, TrainState, make_trainer, validate_config
  from pallas_emb.vocabulary import DynamicVocabulary, raw_ids, vocab_keys
