"""The reference system's async types and optimizer protocol, and the registry
of optimizers that implement it.

Differences from the reference, all because tables are row-sharded:
`unique_tokens` holds each data shard's unique ids (sharded, not replicated),
and the update carries the lookup's routing plan so that the owners need not
route again.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax

from pallas_emb.errors import ConfigError
from pallas_emb.optimizers import FTRL, SGD, Adagrad, LazyAdam, RowWiseAdagrad
from pallas_emb.state import TableResiduals
from sharding.route import RoutePlan


def no_fused_update_message(opt) -> str:
  """The reference's sentence for an optimizer without a fused update."""
  return (
    "use_async_emb requires an embedding optimizer implementing "
    f"AsyncEmbOptimizer, and {type(opt).__name__} has no fused table "
    "update"
  )


class AsyncEmbGradientUpdate(NamedTuple):
  """A deferred embedding gradient (one table), applied by the next step.

  Attributes:
    unique_tokens: (S * S * route_capacity,) int32 physical row ids of each
      data shard's unique ids, in the slots it sends them in (grouped by
      owner), padded with a fill id >= vocab. Sharded.
    grads: (tokens_per_batch, dim) float32 gradient per id, already weighted
      by the combiner. Sharded over the data axis.
    segment_ids: (tokens_per_batch,) int32 index of each id into its shard's
      unique_tokens; -1 = no gradient (padding, invalid, overflow).
    pending: bool scalar; False for the empty update (first step, after a
      flush): nothing is applied.
    plan: the lookup's `RoutePlan` (which owner holds which unique id).
      Where the dedup sorted (a TPU), its `token_sums` are `segment_ids`
      in sorted order: an update is made whole by `from_residuals`, never
      by replacing `segment_ids` alone.
    num_invalid: (S,) int32 invalid ids per data shard in that lookup.
    num_overflow: (S,) int32 unique-capacity overflow per data shard.
    num_unique: (S,) int32 distinct valid ids per data shard, kept or not.
    owner: the `identity` of the context that made it (its table, optimizer
      and mesh); `gradient_update_start` refuses an update of another.
      Static: pytree auxiliary data, never a traced leaf.
  """

  unique_tokens: jax.Array
  grads: jax.Array
  segment_ids: jax.Array
  pending: jax.Array
  plan: RoutePlan | None = None
  num_invalid: jax.Array | None = None
  num_overflow: jax.Array | None = None
  num_unique: jax.Array | None = None
  owner: str | None = None

  @classmethod
  def from_residuals(
    cls, residuals: TableResiduals, token_grads: jax.Array, pending, owner: str | None = None
  ) -> AsyncEmbGradientUpdate:
    """An update from a lookup's (or `ShardedEmbedding.plan`'s) residuals and
    (S * tokens_per_shard, dim) per-token gradients in its device order;
    `owner` is the identity of the context that will apply it."""
    plan = residuals.plan
    # unique_tokens and segment_ids are the plan's own send_keys and
    # token_slot; the plan does not hold them twice (a donated state may not
    # hold one buffer twice).
    return cls(
      unique_tokens=plan.send_keys,
      grads=token_grads,
      segment_ids=plan.token_slot,
      pending=pending,
      plan=plan._replace(send_keys=None, token_slot=None),
      num_invalid=residuals.num_invalid,
      num_overflow=residuals.num_overflow,
      num_unique=residuals.num_unique,
      owner=owner,
    )

  def residuals(self) -> TableResiduals:
    """The lookup residuals this update routes by."""
    plan = self.plan._replace(send_keys=self.unique_tokens, token_slot=self.segment_ids)
    return TableResiduals(
      weights=(),
      plan=plan,
      num_invalid=self.num_invalid,
      num_overflow=self.num_overflow,
      num_unique=self.num_unique,
    )


# The owner is auxiliary data, so it stays a static Python string through
# `jax.jit` and `tree.map`. A registration takes precedence over JAX's own
# handling of NamedTuples, which would make every field a child.
_ARRAY_FIELDS = AsyncEmbGradientUpdate._fields[:-1]


def _flatten_with_keys(update: AsyncEmbGradientUpdate):
  return (
    tuple((jax.tree_util.GetAttrKey(k), getattr(update, k)) for k in _ARRAY_FIELDS),
    update.owner,
  )


jax.tree_util.register_pytree_with_keys(
  AsyncEmbGradientUpdate,
  _flatten_with_keys,
  lambda owner, children: AsyncEmbGradientUpdate(*children, owner=owner),
  lambda update: (tuple(update[:-1]), update.owner),
)


class EmbOptState(NamedTuple):
  """The optimizer state of one table: slots and the applied-update count."""

  slots: dict[str, jax.Array]
  step: jax.Array


class EmbLookup(NamedTuple):
  """A started lookup: the embeddings and what the update will need."""

  acts: dict[str, jax.Array]
  residuals: TableResiduals


@runtime_checkable
class AsyncEmbOptimizer(Protocol):
  """An embedding optimizer with a fused, asynchronous table update.

  Both defaults raise; `supports_async_emb` tells whether a class really
  overrides them (an `isinstance` check alone does not: every subclass of
  this protocol has the methods).
  """

  def gradient_update_start(self, context, update, table, state, gate=None):
    """Launches the update -> (pins, table, state, metrics)."""
    raise NotImplementedError(no_fused_update_message(self))

  def gradient_update_done(self, context, gate=None):
    """Collects the update -> (norm, valid, done_pin)."""
    raise NotImplementedError(no_fused_update_message(self))


def supports_async_emb(opt: Any) -> bool:
  """True when `type(opt)` implements both protocol methods itself."""
  cls = opt if isinstance(opt, type) else type(opt)
  for name in ("gradient_update_start", "gradient_update_done"):
    impl = getattr(cls, name, None)
    if not callable(impl) or impl is getattr(AsyncEmbOptimizer, name):
      return False
  return True


_REGISTRY: list[type] = []


def register(cls: type) -> type:
  """Adds an optimizer class to the capable optimizers that error messages
  and `registered_async_emb_optimizers` list. Usable as a decorator.

  Raises:
    ConfigError: `cls` does not implement both protocol methods.
  """
  if not isinstance(cls, type) or not supports_async_emb(cls):
    raise ConfigError(
      f"register({cls!r}): only a class that implements both "
      "gradient_update_start and gradient_update_done can be registered as "
      "an AsyncEmbOptimizer."
    )
  if cls not in _REGISTRY:
    _REGISTRY.append(cls)
  return cls


def registered_async_emb_optimizers() -> tuple[type, ...]:
  """The registered optimizer classes with a fused async update, in
  registration order."""
  return tuple(_REGISTRY)


for _cls in (SGD, Adagrad, RowWiseAdagrad, LazyAdam, FTRL):
  register(_cls)
