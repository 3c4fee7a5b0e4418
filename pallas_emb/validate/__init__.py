"""Every check of what a caller passes to the sharded API, written once.

`ShardedEmbedding`, the asynchronous API and checkpoints call these before
anything is traced, so a mistake is an `InputError` that names the value, the
expected one and the fix, never an error from deep inside a jitted step.
"""

from pallas_emb.validate.config import check_context_args, check_embedding, check_lookup
from pallas_emb.validate.inputs import (
  check_feature_grads,
  check_ids,
  check_token_grads,
)
from pallas_emb.validate.state import (
  check_devices,
  check_logical,
  check_on_mesh,
  check_placement,
  check_state,
  check_tables,
  describe_mesh,
)

__all__ = [
  "check_context_args",
  "check_devices",
  "check_embedding",
  "check_feature_grads",
  "check_ids",
  "check_lookup",
  "check_logical",
  "check_on_mesh",
  "check_placement",
  "check_state",
  "check_tables",
  "check_token_grads",
  "describe_mesh",
]
