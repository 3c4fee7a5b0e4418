"""Row gather and fused optimizer update over one device's row shard.

`gather` and `fused_update` dispatch on a backend name ("pallas",
"interpret", "xla"); see `backend.py`. Kernels know nothing of training.
"""

from __future__ import annotations

from pallas_emb.kernels import xla
from pallas_emb.kernels.backend import BACKENDS, default_backend, resolve_backend


def gather(table, rows, *, dtype, backend: str):
  """(C,) local rows (-1 padding) of a stored table -> (C, dim) float32."""
  if backend == "xla":
    return xla.gather(table, rows, dtype=dtype)
  from pallas_emb.kernels import gather as pallas_gather  # pylint: disable=g-import-not-at-top
  return pallas_gather.gather(table, rows, dtype=dtype,
                              interpret=backend == "interpret")


def fused_update(table, slots, rows, grads, scalars, apply, *, optimizer,
                 dtype, backend: str):
  """In-place optimizer update of distinct rows; see `xla.fused_update`."""
  if backend == "xla":
    return xla.fused_update(table, slots, rows, grads, scalars, apply,
                            optimizer=optimizer, dtype=dtype)
  from pallas_emb.kernels import fused_update as pallas_update  # pylint: disable=g-import-not-at-top
  return pallas_update.fused_update(table, slots, rows, grads, scalars, apply,
                                    optimizer=optimizer, dtype=dtype,
                                    interpret=backend == "interpret")


__all__ = ["BACKENDS", "default_backend", "fused_update", "gather",
           "resolve_backend"]
