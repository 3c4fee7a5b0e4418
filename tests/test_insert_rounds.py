"""The id map's insertion rounds (`sharding.insert_rounds`) against a
plain loop over rounds and keys, in both forms: the CPU's (a claims array)
and a TPU's (the few keys' rounds as (k, k) reductions), on crowded maps
where windows overlap, wrap, and keys share homes."""

import jax
import numpy as np
import pytest
from conftest import use_tpu_reorder

from sharding import insert_rounds


def _reference(free, home, waiting, capacity):
  """Round r: each waiting key claims slot home + r if its bit r is set and
  no earlier round took the slot; the lowest rank wins."""
  n, probe_limit = free.shape
  slot, taken = np.full(n, -1), set()
  for r in range(probe_limit):
    claimed = {}
    for i in range(n):
      s = (home[i] + r) % capacity
      if waiting[i] and slot[i] < 0 and free[i, r] and s not in taken:
        claimed.setdefault(s, i)
    for s, i in claimed.items():
      slot[i] = s
      taken.add(s)
  return slot


def _bits(free):
  n, probe_limit = free.shape
  words = np.zeros((n, -(-probe_limit // 32)), np.uint32)
  for r in range(probe_limit):
    words[:, r // 32] |= free[:, r].astype(np.uint32) << np.uint32(r % 32)
  return words


@pytest.mark.parametrize("form", ["cpu", "tpu"])
@pytest.mark.parametrize(
  "n,capacity,probe_limit,p_free,crowd",
  [
    (200, 64, 16, 0.3, 0),
    (120, 128, 40, 0.1, 0),
    (300, 2048, 16, 0.9, 25),
    (300, 2048, 40, 0.9, 30),
    (1200, 4096, 16, 0.5, 60),  # more keys than a TPU's few: rounds by claims first
  ],
)
def test_rounds_equal_a_loop_over_rounds(
  n, capacity, probe_limit, p_free, crowd, form, monkeypatch
):
  """Without a crowd, each key's free bits are its own. With one, `p_free`
  of the slots are free for every key whose window holds them (a map's
  case), but for 52 slots around the wrap, 30% free, where `crowd` keys
  have their homes: the other keys win in the first rounds, and the crowd
  is left to the few keys' rounds."""
  rng = np.random.default_rng(n + capacity)
  home = rng.integers(0, capacity, n).astype(np.int32)
  if crowd:
    home[:crowd] = (rng.integers(0, 24, crowd) + capacity - 12) % capacity
    slot_free = rng.random(capacity) < p_free
    slot_free[np.arange(-12, 40) % capacity] = rng.random(52) < 0.3
    free = slot_free[(home[:, None] + np.arange(probe_limit)) % capacity]
  else:
    home[: n // 4] = home[n // 4 : n // 2]  # keys sharing a home
    free = rng.random((n, probe_limit)) < p_free
  waiting = rng.random(n) < 0.8
  if form == "tpu":
    use_tpu_reorder(monkeypatch)
  got = jax.jit(
    lambda f, h, w: insert_rounds.insert(f, h, w, capacity, probe_limit, lane_dense=False)
  )(_bits(free), home, waiting)
  want = _reference(free, home, waiting, capacity)
  assert (want >= 0).sum() > n // 10
  np.testing.assert_array_equal(np.asarray(got), want)
