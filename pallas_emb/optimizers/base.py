"""What an embedding optimizer is: its slots, its per-step scalars, its math.

An optimizer here is a frozen dataclass of hyperparameters with three methods
and one flag:

* `slot_specs()` — the per-row state it keeps next to the table, by name;
* `scalars(step)` — the step's scalar hyperparameters (learning rate from a
  schedule, the step itself...) evaluated *outside* any kernel, as a NamedTuple
  of float32 scalars;
* `update_rows(rows, slots, grads, scalars)` — ONE pure function on a block of
  rows. The Pallas kernel calls it on VMEM values and the XLA path on gathered
  rows, so a new optimizer never needs a new kernel;
* `runs_in_kernel` — False for math that cannot run inside a Pallas kernel
  (arbitrary optax code): its `update_rows` then runs in XLA, on the rows
  the kernels gather and write back (`kernels.staged_update`).

Optionally, `native_rule()` names the C++ rule (csrc/row_rules.h) that does
the same math on CPU, with its static hyperparameters, as
`(name, (floats...))` or `(name, (floats...), per_row)`, or returns None;
without it the native CPU backend runs the optimizer on the XLA path.
`per_row(slot_rows, scalars) -> (C, k) float32` gives the values of each row
the rule takes from XLA (what needs XLA's transcendental functions), from
the rows' slots, (C, width) each, with the optimizer's own functions.

`update_rows` sees only rows that are in the batch (a lazy, sparse update):
rows, grads and width-`dim` slots are (C, dim) float32, scalar-per-row slots
are (C, 1). It must be elementwise across rows (no mixing between rows), may
reduce within a row, and must return arrays of the shapes and dtypes it got.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import ClassVar, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.errors import SpecError
from pallas_emb.packing import SlotSpec

# A float, or an optax-style schedule: step (int32 scalar) -> learning rate.
LearningRate = float | Callable[[jax.Array], jax.Array]
Slots = Mapping[str, jax.Array]


@runtime_checkable
class EmbeddingOptimizer(Protocol):
  """The structural interface every embedding optimizer implements.

  The optimizers of this package subclass it (for the default of
  `runs_in_kernel`); any class with the same members is accepted too.
  """

  runs_in_kernel: ClassVar[bool] = True

  def slot_specs(self) -> Mapping[str, SlotSpec]:
    """Slot name -> `SlotSpec` of the per-row state kept beside the table."""

  def scalars(self, step: jax.Array) -> NamedTuple:
    """The step's scalar hyperparameters, float32, computed outside kernels."""

  def update_rows(
    self, rows: jax.Array, slots: Slots, grads: jax.Array, scalars: NamedTuple
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(rows, slots) of a block of touched rows after one step; pure."""


def check_learning_rate(owner: str, lr: LearningRate) -> None:
  """Accepts a finite float >= 0 or a callable schedule of the step."""
  if callable(lr):
    return
  if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating)):
    raise SpecError(
      f"{owner}: learning_rate must be a float or an optax schedule "
      f"(step -> lr), got {lr!r} of type {type(lr).__name__}."
    )
  if not math.isfinite(lr) or lr < 0:
    raise SpecError(f"{owner}: learning_rate must be finite and >= 0, got {lr!r}.")


def check_range(
  owner: str,
  name: str,
  value,
  lo: float,
  hi: float,
  *,
  lo_open: bool = False,
  hi_open: bool = False,
) -> None:
  """Checks that a hyperparameter is finite and lo <(=) value <(=) hi."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
    raise SpecError(f"{owner}: {name} must be a float, got {value!r}.")
  ok = math.isfinite(value)
  ok = ok and (value > lo if lo_open else value >= lo)
  ok = ok and (value < hi if hi_open else value <= hi)
  if not ok:
    lo_s = "(" if lo_open else "["
    hi_s = ")" if hi_open else "]"
    raise SpecError(f"{owner}: {name} must be in {lo_s}{lo}, {hi}{hi_s}, got {value!r}.")


def learning_rate_at(lr: LearningRate, step: jax.Array) -> jax.Array:
  """The learning rate at `step` as a float32 scalar."""
  value = lr(step) if callable(lr) else lr
  return jnp.asarray(value, jnp.float32)


def reads_step(optimizer, dim: int) -> bool:
  """Whether `optimizer`'s row update depends on the step: a learning-rate
  schedule, a decay by the steps elapsed since a row was touched...

  Found by tracing `update_rows(..., scalars(step))` at width `dim` and
  following the step through its equations (an equation with any input
  that depends on it makes all its outputs depend on it), so the answer
  errs towards True. A stack of tables whose update reads the step updates
  each member at its own step (`pallas_emb.shard_ops`).
  """
  try:
    return _reads_step(optimizer, dim)
  except TypeError:  # an unhashable optimizer: not cached
    return _reads_step.__wrapped__(optimizer, dim)


@functools.lru_cache(maxsize=256)
def _reads_step(optimizer, dim: int) -> bool:
  rows = jax.ShapeDtypeStruct((8, dim), jnp.float32)
  slots = {
    k: jax.ShapeDtypeStruct((8, s.width_for(dim)), s.dtype)
    for k, s in optimizer.slot_specs().items()
  }

  def update(step, rows, slots, grads):
    return optimizer.update_rows(rows, slots, grads, optimizer.scalars(step))

  jaxpr = jax.make_jaxpr(update)(jax.ShapeDtypeStruct((), jnp.int32), rows, slots, rows).jaxpr
  variables = lambda vs: [v for v in vs if not hasattr(v, "val")]  # literals have .val
  dependent = {jaxpr.invars[0]}
  for eqn in jaxpr.eqns:
    if any(v in dependent for v in variables(eqn.invars)):
      dependent.update(eqn.outvars)
  return any(v in dependent for v in variables(jaxpr.outvars))
