"""Static descriptions of tables and features: frozen, hashable, validated.

Specs are configuration, not state: they are hashed into `jax.jit` caches and
carry no arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np

from pallas_emb import packing
from pallas_emb.errors import SpecError, check_int
from pallas_emb.optimizers.base import EmbeddingOptimizer
from pallas_emb.optimizers.sgd import SGD
from pallas_emb.vocabulary import DynamicVocabulary

Combiner = Literal["sum", "mean", "sqrtn"] | None
COMBINERS = ("sum", "mean", "sqrtn", None)
Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


def default_initializer(key, shape, dtype=np.float32):
  """Truncated normal with stddev 1/sqrt(dim): unit-scale dot products."""
  stddev = 1.0 / np.sqrt(shape[-1])
  return jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype) * stddev


def _check_name(owner: str, name) -> None:
  if not isinstance(name, str) or not name:
    raise SpecError(f"{owner}: name must be a non-empty str, got {name!r}.")


@dataclasses.dataclass(frozen=True)
class TableSpec:
  """One embedding table, row-sharded over a mesh axis.

  Attributes:
    name: unique table name.
    num_rows: vocabulary size V (ids in [0, V) are valid).
    dim: row width D. bfloat16 tables need an even D (stored as D/2 words).
    dtype: float32 or bfloat16 (optimizer slots are always 32-bit).
    optimizer: an `EmbeddingOptimizer` (SGD, Adagrad, RowWiseAdagrad,
      LazyAdam, ...).
    initializer: `(key, (dim,), float32) -> (dim,)`, called once per logical
      row with a key derived from the row id, so the initial table does not
      depend on the number of shards or the layout.
    layout: "mod" (row r on shard r % S) or "range" (contiguous blocks).
    unique_capacity: distinct ids per data shard per step; None = the number
      of ids per shard (never overflows). Extra distinct ids are dropped and
      counted as overflow. Rounded up to a multiple of 8 and capped at
      num_rows (see `Capacities`).
    route_capacity: ids one data shard may send to one owner per step; None =
      under the "mod" layout the even share of unique_capacity with 25%
      headroom plus 64 (see `capacity`: the exchange then scales with the ids
      per chip, not the chip count), else unique_capacity (exact). Extra ids
      are dropped and counted as overflow. Rounded up to a multiple of 8 and
      capped at the rows per shard.
    max_grad_norm: None, or clip the table's summed row gradients to this
      global L2 norm before the update: when the norm (over all rows and
      devices, `TableMetrics.grad_norm`) exceeds it, every row gradient is
      scaled by max_grad_norm / norm. A non-finite norm still skips the
      update. For one norm over all tables, see
      `ShardedEmbedding.apply_gradients(max_global_norm=...)`.
    placement: "sharded" (rows over the mesh axis), "replicated" (the whole
      table on every device, updated without all_to_all, see
      `pallas_emb.replicated_ops`; for small tables), or "auto": replicated
      below `ShardedEmbedding.replicate_below` rows, else sharded.
    vocabulary: None (ids are row numbers), or a `DynamicVocabulary`.
    stochastic_rounding: bfloat16 tables only: round each updated value
      to one of its two bfloat16 neighbours with probability by nearness,
      so that updates smaller than half a bfloat16 ulp still move the row in
      expectation (round-to-nearest-even drops them). Deterministic for a
      given seed and step, the same on every backend, mesh and stacking (see
      `pallas_emb.packing`).
    rounding_seed: the seed of stochastic rounding, in [0, 2**32).
  """

  name: str
  num_rows: int
  dim: int
  optimizer: EmbeddingOptimizer = dataclasses.field(default_factory=SGD)
  dtype: Any = np.float32
  initializer: Initializer = default_initializer
  layout: Literal["mod", "range"] = "mod"
  unique_capacity: int | None = None
  route_capacity: int | None = None
  max_grad_norm: float | None = None
  placement: Literal["auto", "sharded", "replicated"] = "auto"
  vocabulary: DynamicVocabulary | None = None
  stochastic_rounding: bool = False
  rounding_seed: int = 0

  def __post_init__(self):
    owner = f"TableSpec({self.name!r})"
    _check_name("TableSpec", self.name)
    for field in ("num_rows", "dim"):
      check_int(getattr(self, field), f"{owner}: {field}", error=SpecError)
    try:
      dtype = np.dtype(self.dtype)
    except TypeError as e:
      raise SpecError(
        f"{owner}: dtype {self.dtype!r} is not a dtype; use jnp.float32 or jnp.bfloat16."
      ) from e
    if dtype not in packing.SUPPORTED_DTYPES:
      raise SpecError(f"{owner}: dtype {dtype} is not supported; use jnp.float32 or jnp.bfloat16.")
    object.__setattr__(self, "dtype", dtype)
    if dtype == packing.SUPPORTED_DTYPES[1] and self.dim % 2:
      raise SpecError(
        f"{owner}: a bfloat16 table needs an even dim (rows are stored as "
        f"pairs of bfloat16 in 32-bit words), got dim={self.dim}; pad dim "
        f"to {self.dim + 1} or use float32."
      )
    _check_rounding(owner, self.stochastic_rounding, self.rounding_seed, dtype)
    if not isinstance(self.optimizer, EmbeddingOptimizer):
      raise SpecError(
        f"{owner}: optimizer {self.optimizer!r} does not implement "
        "EmbeddingOptimizer (slot_specs, scalars, update_rows); use one of "
        "pallas_emb.optimizers."
      )
    if not callable(self.initializer):
      raise SpecError(
        f"{owner}: initializer must be callable (key, shape, "
        f"dtype) -> array, got {self.initializer!r}."
      )
    if self.layout not in ("mod", "range"):
      raise SpecError(f"{owner}: layout must be 'mod' or 'range', got {self.layout!r}.")
    if self.placement not in ("auto", "sharded", "replicated"):
      raise SpecError(
        f"{owner}: placement must be 'auto', 'sharded' or 'replicated', got {self.placement!r}."
      )
    for field in ("unique_capacity", "route_capacity"):
      check_int(
        getattr(self, field),
        f"{owner}: {field}",
        error=SpecError,
        optional=True,
        fix="None is the default (see TableSpec).",
      )
    check_max_norm(self.max_grad_norm, f"{owner}: max_grad_norm")
    if self.vocabulary is not None:
      if not isinstance(self.vocabulary, DynamicVocabulary):
        raise SpecError(
          f"{owner}: vocabulary must be None or a DynamicVocabulary, got {self.vocabulary!r}."
        )
      if self.placement == "replicated":
        raise SpecError(
          f"{owner}: a dynamic vocabulary's id maps are row-sharded, so the table cannot be "
          "placement='replicated'; use placement='sharded' (or 'auto', which never "
          "replicates a dynamic table)."
        )


def _check_rounding(owner: str, stochastic, seed, dtype: np.dtype) -> None:
  if not isinstance(stochastic, (bool, np.bool_)):
    raise SpecError(f"{owner}: stochastic_rounding must be True or False, got {stochastic!r}.")
  check_int(seed, f"{owner}: rounding_seed", error=SpecError, minimum=0)
  if seed >= 2**32:
    raise SpecError(f"{owner}: rounding_seed must be below 2**32, got {seed}.")
  if stochastic and dtype != packing.SUPPORTED_DTYPES[1]:
    raise SpecError(
      f"{owner}: stochastic_rounding applies to bfloat16 tables, and this one is {dtype} "
      "(its rows are stored exactly); use dtype=jnp.bfloat16 or stochastic_rounding=False."
    )


def check_max_norm(value, name: str) -> None:
  """A gradient-clipping norm is None or a finite float > 0."""
  if value is None:
    return
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, float))
    or not np.isfinite(value)
    or value <= 0
  ):
    raise SpecError(
      f"{name} must be None or a finite number > 0, got {value!r}; None turns clipping off."
    )


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """One categorical input looked up in a table.

  Attributes:
    name: unique feature name (the key of its ids and its output).
    table: the `TableSpec.name` it reads.
    combiner: how a bag of ids (B, L) becomes one row: "sum", "mean", "sqrtn"
      -> (B, dim); None keeps the sequence -> (B, L, dim). Padding (-1),
      invalid and capacity-dropped ids contribute zero; "mean" and "sqrtn"
      count only the ids that got a row.
  """

  name: str
  table: str
  combiner: Combiner = "sum"

  def __post_init__(self):
    _check_name("FeatureSpec", self.name)
    _check_name(f"FeatureSpec({self.name!r}).table", self.table)
    if self.combiner not in COMBINERS:
      raise SpecError(
        f"FeatureSpec({self.name!r}): combiner must be one of {COMBINERS}, got {self.combiner!r}."
      )
