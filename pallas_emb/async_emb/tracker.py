"""Which async updates are in flight: the one mutable state of the async API.

Context handles are static and hashable (they are `jax.jit` arguments), so
what changes between `gradient_update_start` and `gradient_update_done` lives
here, in `IN_FLIGHT`, keyed by the handle: start arms a record, done consumes
it, and a lookup or a second start while it is armed is refused. Equal
handles describe the same table on the same mesh and share one record.

The records are written when Python runs the calls: eagerly at every call,
under `jax.jit` at trace time. A record also remembers the trace it was
armed in, so a start and its done must be traced in the same function.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
from jax.extend.core import get_opaque_trace_state

from pallas_emb.errors import AsyncEmbStateError


class InFlight(NamedTuple):
  """An armed update: what `gradient_update_done` returns, and its trace."""

  norm: jax.Array
  valid: jax.Array
  done_pin: jax.Array
  trace: Any


def _describe(context) -> str:
  return f"table {context.name!r} (context {context.context_id})"


class InFlightUpdates:
  """The armed updates, by context handle."""

  def __init__(self):
    self._records: dict[Hashable, InFlight] = {}

  def is_armed(self, context) -> bool:
    """Whether `context` has an update started and not yet collected."""
    return context in self._records

  def check_idle(self, context, call: str) -> None:
    """Refuses `call` ("gradient_update_start" or "lookup_start") while
    `context` has an update in flight."""
    if context in self._records:
      what = (
        "scheduled an update start before the pending update done"
        if call == "gradient_update_start"
        else "looked up the table while its gradient update is in flight"
      )
      raise AsyncEmbStateError(
        f"{call} on {_describe(context)} {what}: call "
        "gradient_update_done(context, gate) first. If a previous trace "
        "failed between start and done, call context.reset()."
      )

  def arm(self, context, norm, valid, done_pin) -> None:
    """Records a started update (the caller checked `check_idle` first)."""
    self._records[context] = InFlight(
      norm, valid, done_pin, get_opaque_trace_state(convention="flax")
    )

  def consume(self, context) -> InFlight:
    """The armed update of `context`, now collected."""
    record = self._records.get(context)
    if record is None:
      raise AsyncEmbStateError(
        f"gradient_update_done on {_describe(context)}: update_done has no "
        "armed update_start to consume; call gradient_update_start(context, "
        "update, table, state) first."
      )
    if record.trace != get_opaque_trace_state(convention="flax"):
      raise AsyncEmbStateError(
        f"gradient_update_done on {_describe(context)} runs in another "
        "trace than its gradient_update_start: call both in the same "
        "jitted function (or both eagerly). Call context.reset() to drop "
        "the stale record."
      )
    del self._records[context]
    return record

  def reset(self, context) -> None:
    """Forgets the record of `context` (after a trace that failed between
    start and done)."""
    self._records.pop(context, None)


IN_FLIGHT = InFlightUpdates()
