"""The admission sketch of a dynamic vocabulary: a count-min sketch of the
keys not resident, per shard, that ages so its error stays bounded.

An owner counts each waiting key's occurrences in `depth` rows of `width`
int32 counters (`sketch_slots` picks a key's counter in each row); a key's
estimate is its least counter, never below its true count. Before a step
counts, a shard whose fullest row holds `sketch_sample(width)` (a quarter of
the width) or more halves every counter (`age_sketch`, TinyLFU's reset):
then a counter another key shares reads 1/4 on average however long the
stream, where a sketch that is never halved fills and reads every key as
seen. The native map (csrc/id_map.cc) and the tests' reference compute the
same bits.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# A sketch row is halved once it holds width / SKETCH_SAMPLE_DIVISOR increments.
SKETCH_SAMPLE_DIVISOR = 4
_MUL1, _MUL2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_SALTS = np.array([0x9E3779B9, 0x7F4A7C15, 0xF39CC060, 0x5CEDC834, 0x1B873593, 0xCC9E2D51,
                   0xE6546B64, 0x27D4EB2F], np.uint32)  # fmt: skip


def sketch_slots(hi, lo, depth: int, width: int):
  """(depth, n) counter of each key in each sketch row (NumPy or JAX)."""
  xp = np if isinstance(hi, np.ndarray) else jnp
  out = []
  for d in range(depth):
    x = (hi ^ _SALTS[d % len(_SALTS)]) * _MUL1
    x = (x ^ lo ^ np.uint32(d)) * _MUL2
    x = x ^ (x >> np.uint32(16))
    out.append((x % np.uint32(width)).astype(xp.int32))
  return xp.stack(out) if out else xp.zeros((0, hi.shape[0]), xp.int32)


def sketch_sample(width: int) -> int:
  """Increments a sketch row may hold before it is halved (`age_sketch`)."""
  return max(width // SKETCH_SAMPLE_DIVISOR, 1)


def age_sketch(sketch):
  """The sketch halved (every counter, rounded down) when its fullest row
  holds `sketch_sample(width)` or more: TinyLFU's reset. A row then never
  holds more than a quarter of its width plus one step's increments, so a
  counter another key shares reads 1/4 on average however long the stream
  (without it a full sketch reads every key as seen). (depth, width) int32,
  NumPy or JAX; the native map (csrc/id_map.cc) does the same."""
  xp = np if isinstance(sketch, np.ndarray) else jnp
  full = xp.max(xp.sum(sketch, axis=1)) >= sketch_sample(sketch.shape[1])
  return xp.where(full, sketch >> 1, sketch)
