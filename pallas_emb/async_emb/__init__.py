"""The asynchronous embedding update, with the reference system's interface.

`protocol` holds the reference's types, the `AsyncEmbOptimizer` protocol and
the registry of optimizers that implement it; `context` the per-table handle;
`tracker` the record of updates in flight; `calls` the start/done/lookup
functions a training step makes.
"""

from pallas_emb.async_emb.calls import (
  empty_gradient_update,
  gradient_update_done,
  gradient_update_start,
  lookup_done,
  lookup_start,
  make_gradient_update,
)
from pallas_emb.async_emb.context import AsyncEmbContextHandle, context_handles, make_context_handle
from pallas_emb.async_emb.protocol import (
  AsyncEmbGradientUpdate,
  AsyncEmbOptimizer,
  EmbLookup,
  EmbOptState,
  no_fused_update_message,
  register,
  registered_async_emb_optimizers,
  supports_async_emb,
)
from pallas_emb.async_emb.tracker import IN_FLIGHT, InFlightUpdates

__all__ = [
  "IN_FLIGHT",
  "AsyncEmbContextHandle",
  "AsyncEmbGradientUpdate",
  "AsyncEmbOptimizer",
  "EmbLookup",
  "EmbOptState",
  "InFlightUpdates",
  "context_handles",
  "empty_gradient_update",
  "gradient_update_done",
  "gradient_update_start",
  "lookup_done",
  "lookup_start",
  "make_context_handle",
  "make_gradient_update",
  "no_fused_update_message",
  "register",
  "registered_async_emb_optimizers",
  "supports_async_emb",
]
