"""Training configuration, validated before anything is traced."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from pallas_emb import async_emb
from pallas_emb.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """How the embedding tables are trained.

  Attributes:
    use_async_emb: update the tables with the fused asynchronous update
      (requires every table's optimizer to implement `AsyncEmbOptimizer`).
      False: the synchronous sparse update, which any embedding optimizer,
      `OptaxRows` included, supports.
    exact: with use_async_emb, apply each step's embedding gradient within
      the step (no staleness) instead of overlapping it with the next step's
      dense forward (embeddings one step stale, as the reference).
  """

  use_async_emb: bool = True
  exact: bool = False

  def __post_init__(self):
    for field in ("use_async_emb", "exact"):
      if not isinstance(getattr(self, field), bool):
        raise ConfigError(f"TrainConfig.{field} must be a bool, got {getattr(self, field)!r}.")
    if self.exact and not self.use_async_emb:
      raise ConfigError(
        "TrainConfig(exact=True) selects the unstaled async pipeline and "
        "needs use_async_emb=True; the synchronous update "
        "(use_async_emb=False) is exact already."
      )


def _optimizers(emb_optimizer) -> Iterable[Any]:
  tables = getattr(emb_optimizer, "tables", None)
  if tables is not None:  # a ShardedEmbedding
    return [t.optimizer for t in tables]
  if isinstance(emb_optimizer, (list, tuple)):
    return list(emb_optimizer)
  return [emb_optimizer]


def validate_config(config: TrainConfig, emb_optimizer) -> None:
  """Refuses, before tracing, an async config whose optimizer cannot fuse.

  Args:
    config: the `TrainConfig`.
    emb_optimizer: an embedding optimizer, a sequence of them, or a
      `ShardedEmbedding` (every table's optimizer is checked).

  Raises:
    ConfigError: `use_async_emb=True` with an optimizer that does not
      implement `AsyncEmbOptimizer`; the message names it, the capable
      optimizers, and the `use_async_emb=False` alternative.
  """
  if not isinstance(config, TrainConfig):
    raise ConfigError(f"config must be a TrainConfig, got {config!r}.")
  if not config.use_async_emb:
    return
  for opt in _optimizers(emb_optimizer):
    if not async_emb.supports_async_emb(opt):
      capable = ", ".join(c.__name__ for c in async_emb.registered_async_emb_optimizers())
      raise ConfigError(
        f"{async_emb.no_fused_update_message(opt)} "
        f"(got {opt!r}). Use an optimizer that implements it: {capable} "
        "(AsyncEmbAdam = LazyAdam), or any class that implements "
        "gradient_update_start and gradient_update_done; or set "
        "TrainConfig(use_async_emb=False) to train with the synchronous "
        "sparse update, which supports every embedding optimizer."
      )
