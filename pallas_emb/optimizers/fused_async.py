"""The mixin through which the optimizers implement the async protocol.

Kept out of `base` so that what the kernels import (the optimizer protocol
and its math) does not lead to the async layer.
"""


class FusedAsyncEmbUpdate:
  """Implements `async_emb.AsyncEmbOptimizer` through the fused table update.

  Mixed into every optimizer whose `update_rows` the fused update (Pallas
  kernel or XLA) can run; the work is in `async_emb.fused_gradient_update_*`.
  """

  def gradient_update_start(self, context, update, table, state, gate=None):
    # Imported here: async_emb imports the specs, which import optimizers.
    from pallas_emb import async_emb  # pylint: disable=g-import-not-at-top
    return async_emb.fused_gradient_update_start(self, context, update, table,
                                                 state, gate)

  def gradient_update_done(self, context, gate=None):
    from pallas_emb import async_emb  # pylint: disable=g-import-not-at-top
    return async_emb.fused_gradient_update_done(self, context, gate)
