"""Any optax transformation, applied row by row to the rows of the batch.

Each table row is treated as its own parameter vector with its own optax
state: leaves of `tx.init(row)` shaped like the row become width-`dim` slots,
scalar leaves (step counts) become width-1 slots, and `tx.update` runs under
`jax.vmap` over the touched rows. For `optax.adam` that is exactly row-lazy
Adam with per-row step counts.

It is synchronous: arbitrary optax code runs in XLA, not in the fused Pallas
kernel (the kernels only move its rows), so it does not implement
`AsyncEmbOptimizer` and `use_async_emb=True` refuses it at config validation.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pallas_emb.errors import SpecError
from pallas_emb.optimizers.base import EmbeddingOptimizer, SlotSpec

# A probe width that no scalar leaf can be confused with.
_PROBE_DIM = 3


class OptaxRowsScalars(NamedTuple):
  step: jax.Array


@dataclasses.dataclass(frozen=True)
class OptaxRows(EmbeddingOptimizer):
  """A sparse, synchronous embedding optimizer from an optax transformation.

  Attributes:
    tx: an `optax.GradientTransformation` whose state leaves are float32 or
      int32 arrays shaped like the parameter or scalars, with uniform initial
      values (true of optax's element-wise optimizers).
  """

  tx: optax.GradientTransformation

  # Arbitrary optax code does not lower in Mosaic: XLA runs it, on the rows
  # the kernels move (`kernels.staged_update`).
  runs_in_kernel = False

  def __post_init__(self):
    if not isinstance(self.tx, optax.GradientTransformation):
      raise SpecError(f"OptaxRows: tx must be an optax.GradientTransformation, got {self.tx!r}.")
    self.slot_specs()  # validates the state structure now, not in a trace

  def _leaves(self):
    # Concrete even when called inside a trace (slot shapes are static).
    with jax.ensure_compile_time_eval():
      state = self.tx.init(jnp.zeros((_PROBE_DIM,), jnp.float32))
    return jax.tree.flatten(state)

  def slot_specs(self):
    leaves, _ = self._leaves()
    specs = {}
    for i, leaf in enumerate(leaves):
      leaf = np.asarray(leaf)
      if leaf.dtype not in (np.float32, np.int32):
        raise SpecError(
          f"OptaxRows: state leaf {i} has dtype {leaf.dtype}; "
          "only float32 and int32 state can be stored per row."
        )
      if leaf.shape not in ((), (_PROBE_DIM,)):
        raise SpecError(
          f"OptaxRows: state leaf {i} has shape {leaf.shape} for a row of "
          f"{_PROBE_DIM}; only row-shaped and scalar leaves are supported."
        )
      if leaf.size and not (leaf == leaf.flat[0]).all():
        raise SpecError(
          f"OptaxRows: state leaf {i} starts as {leaf.tolist()}, not one "
          "value repeated, so it cannot be stored as a per-row slot with one "
          "initial value; use an element-wise optax transformation."
        )
      specs[f"s{i}"] = SlotSpec(
        width=None if leaf.shape else 1,
        dtype=leaf.dtype,
        init=float(leaf.flat[0]) if leaf.size else 0.0,
      )
    return specs

  def scalars(self, step) -> OptaxRowsScalars:
    return OptaxRowsScalars(jnp.asarray(step, jnp.float32))

  def update_rows(self, rows, slots, grads, scalars):
    del scalars
    leaves, treedef = self._leaves()
    names = [f"s{i}" for i in range(len(leaves))]
    row_shaped = [np.ndim(leaf) == 1 for leaf in leaves]

    def one_row(row, grad, *state_leaves):
      state_leaves = [s if r else s[0] for s, r in zip(state_leaves, row_shaped)]
      state = jax.tree.unflatten(treedef, state_leaves)
      updates, state = self.tx.update(grad, state, row)
      new_leaves = jax.tree.leaves(state)
      return (
        optax.apply_updates(row, updates),
        *[s if r else s[None] for s, r in zip(new_leaves, row_shaped)],
      )

    out = jax.vmap(one_row)(rows, grads, *[slots[k] for k in names])
    return out[0], dict(zip(names, out[1:]))
