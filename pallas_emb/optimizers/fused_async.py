"""The reference's two method names on an optimizer, as delegations.

Users of the reference call `opt.gradient_update_start(context, ...)`. Here
the work belongs to the async layer, which sits above the optimizers: each
method hands the call to the context it is given and imports nothing.
"""


class FusedAsyncEmbUpdate:
  """Implements `AsyncEmbOptimizer` by delegating to the context handle.

  Mixed into every optimizer whose `update_rows` the fused update (Pallas
  kernel or XLA) can run.
  """

  def gradient_update_start(self, context, update, table, state, gate=None):
    """Launches the update -> (pins, table, state, metrics); see
    `pallas_emb.gradient_update_start`."""
    return context.fused_update_start(self, update, table, state, gate)

  def gradient_update_done(self, context, gate=None):
    """Collects the update -> (norm, valid, done_pin)."""
    return context.fused_update_done(self, gate)
