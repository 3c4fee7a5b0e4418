"""What the kernels need of an optimizer: its slots and its row update.

The kernels take any object with these two methods (every
`pallas_emb.optimizers` optimizer has them); they import no optimizer. An
optional `runs_in_kernel = False` says that `update_rows` cannot be lowered
in Mosaic: it then runs in XLA on rows the kernels move
(`staged_update`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import jax

from pallas_emb.packing import SlotSpec


class RowUpdate(Protocol):
  """A pure update of a block of table rows and their optimizer slots."""

  def slot_specs(self) -> Mapping[str, SlotSpec]:
    """Slot name -> `SlotSpec` of the per-row state kept beside the table."""

  def update_rows(
    self, rows: jax.Array, slots: Mapping[str, jax.Array], grads: jax.Array, scalars: NamedTuple
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(C, dim) float32 rows, slots (C, width) and grads -> new rows, slots."""
