"""Integer ids of any width -> the int32 ids a table step reads.

Ids travel as int32 on the device (a table has fewer than 2**31 - 1 rows).
Wider ids (int64, uint32, uint64) are accepted and converted here: an id
that int32 can hold keeps its value, and every other one becomes
`INVALID_ID`, which the step counts as invalid (zero row, no update), like
any other id outside [0, num_rows). So an id >= 2**31 is never wrapped onto
a row: `(2**32 + 5).astype(np.int32)` would read and train row 5.

Where the conversion runs matters. With `jax_enable_x64` off, JAX turns a
NumPy int64 array into int32 by wrapping the moment it enters `jax.jit` or
`jax.device_put`. So NumPy ids are converted on the host, in NumPy, before
anything is traced or transferred (the public entry points do it); JAX
arrays, which can be int64 only with `jax_enable_x64` on, are converted with
the same rule in the graph. Ids passed through a user's own `jax.jit` are
wrapped by JAX before any of this code sees them: convert them with
`int32_ids` (or `pallas_emb.hash_ids`) first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.inputs import Ragged, Weighted

# Out of every table's range and not the padding id -1.
INVALID_ID = -2

_LO, _HI = -(2**31), 2**31 - 1


def _in_range(x, dtype: np.dtype):
  # Comparisons in the ids' own dtype: no cast can wrap before the check.
  if np.issubdtype(dtype, np.unsignedinteger):
    return x <= _HI
  return (x >= _LO) & (x <= _HI)


def int32_ids(x: Any) -> Any:
  """Ids of any integer dtype as int32; ids outside int32 -> `INVALID_ID`.

  Args:
    x: an integer array of any shape (NumPy, or JAX, traced or not), a
      `Weighted` or `Ragged` input (its ids are converted), or a mapping of
      them (feature name -> ids; other values pass through).
      Arrays whose values all fit int32 keep them.

  Returns:
    The same kind of value: int32 NumPy arrays for NumPy input (converted
    on the host), int32 JAX arrays for JAX input (converted in the graph),
    int32 input unchanged.
  """
  if isinstance(x, Mapping):
    return {k: int32_ids(v) for k, v in x.items()}
  if isinstance(x, (Weighted, Ragged)):
    return x._replace(ids=int32_ids(x.ids))
  dtype = np.dtype(getattr(x, "dtype", np.int32))
  if dtype == np.int32 or not np.issubdtype(dtype, np.integer):
    return x  # nothing to convert (non-integers are refused by validate)
  xnp = jnp if isinstance(x, (jax.Array, jax.core.Tracer)) else np
  x = x if xnp is jnp else np.asarray(x)
  if dtype.itemsize < 4:  # int8/16, uint8/16: every value fits
    return x.astype(xnp.int32)
  return xnp.where(_in_range(x, dtype), x, INVALID_ID).astype(xnp.int32)
