"""The benchmark's workloads: the id distribution and the memory floor."""

from __future__ import annotations

import numpy as np


def zipf_ids(num_ids: int, vocab: int) -> np.ndarray:
  """The benchmark's id distribution: Zipf(1.1) folded into the vocabulary."""
  return ((np.random.default_rng(0).zipf(1.1, num_ids) - 1) % vocab).astype(np.int32)


def floor_bytes(unique: int, num_ids: int, dim: int) -> int:
  """Bytes a step must move at least: read and write each touched row and
  accumulator once, read each gradient row and id once."""
  return unique * dim * 4 * 2 + unique * 4 * 2 + num_ids * dim * 4 + num_ids * 4
