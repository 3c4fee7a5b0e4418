"""An owner's step of the id map three ways, the same bits: XLA reading the
probe windows by gathers (CPU's reads), XLA reading them as 128-lane rows (a
TPU's), and the native CPU kernels (csrc/id_map.cc); and a source's buckets
in XLA and natively. Random maps, with ties, wrapping windows, unusable
slots, duplicate and padded keys."""

import hashlib
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import child_env, use_tpu_reorder
from jax.sharding import PartitionSpec as P

from pallas_emb.kernels import native_id_map, native_lib
from sharding import id_map, key_route
from sharding.id_map import IdMap
from sharding.layout import RowLayout

needs_native = pytest.mark.skipif(
  not native_lib.available(), reason=f"native library: {native_lib.status().reason}"
)
STEP = 9


def _case(seed, capacity, probe_limit, n, sketch=(1, 1), fill=0.75):
  """(map, recv_hi, recv_lo, recv_count, usable) of one owner, `fill` of
  its slots holding a key within its window."""
  rng = np.random.default_rng(seed)
  m = id_map.init_map(1, capacity, 0, 1)._replace(
    sketch=rng.integers(0, 3, sketch).astype(np.int32), step=np.int32(STEP)
  )
  resident = []
  for at in np.flatnonzero(rng.random(capacity) < fill):
    home = (at - rng.integers(0, probe_limit)) % capacity
    hi = np.uint32(rng.integers(0, 2**32))
    lo = np.uint32(rng.integers(0, 2**32 // capacity) * capacity + home)
    m.key_hi[at], m.key_lo[at] = hi, lo
    m.last[at] = rng.integers(0, STEP + 1)  # used this step, the last, or long ago
    m.count[at] = rng.integers(0, 8)  # small integers: ties in every window
    resident.append((hi, lo))
  keys = [
    resident[i] for i in rng.choice(len(resident), min(n // 3, len(resident) // 2), replace=False)
  ]
  keys += [
    tuple(rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32)) for _ in range(n // 3)
  ]
  keys += [keys[i] for i in rng.integers(0, len(keys), n // 6)]  # a key from two sources
  hi = np.full(n, key_route.PAD, np.uint32)
  lo = np.full(n, key_route.PAD, np.uint32)
  count = np.zeros(n, np.int32)
  at = rng.permutation(n)[: len(keys)]  # the rest are empty slots
  hi[at], lo[at] = np.array(keys, np.uint32).T
  count[at] = rng.integers(1, 4, len(keys))
  usable = rng.random(capacity) > 0.05
  return m, hi, lo, count, usable


POLICY = dict(decay=0.5, evict_every=3, evict_on_insert=True)
CASES = {
  "lfu": dict(policy="lfu", ttl=None, admit_after=1, **POLICY),
  "lru-sketch": dict(policy="lru", ttl=None, admit_after=2, **POLICY),
  "ttl": dict(policy="ttl", ttl=3, admit_after=1, **POLICY),
}


def _run(step_fn, case, params, train):
  m, hi, lo, count, usable = case
  out = jax.jit(lambda *a: step_fn(IdMap(*a[:6]), *a[6:], train=train, **params))(
    *m, hi, lo, count, usable
  )
  flat = list(out[0]) + list(out[1:])
  return [np.asarray(x) for x in flat]


@pytest.mark.parametrize("train", [True, False], ids=["train", "read"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize(
  "capacity,probe_limit,fill",
  [(256, 16, 0.75), (128, 100, 0.75), (256, 16, 0.99)],
  ids=["256-16", "128-100-wrapping", "256-16-full"],  # full: few keys find a free slot
)
def test_owner_step_is_the_same_bits_every_way(capacity, probe_limit, fill, name, train):
  params = dict(CASES[name], probe_limit=probe_limit)
  sketch = (2, 64) if params["admit_after"] > 1 else (1, 1)
  case = _case(capacity + probe_limit, capacity, probe_limit, 300, sketch, fill)
  want = _run(id_map.owner_step, case, params, train)
  if train:  # the case exercises every rule (short windows fill: some keys fail)
    evicted, inserted, _, failed = (int(x) for x in want[-4:])
    assert evicted > 0 and inserted > 0 and (failed > 0 or probe_limit > 16), want[-4:]
  ways = {"lane_dense": lambda *a, **k: id_map.owner_step(*a, lane_dense=True, **k)}
  if native_lib.available():
    ways["native"] = native_id_map.owner_step
  for way, fn in ways.items():
    for i, (g, x) in enumerate(zip(_run(fn, case, params, train), want)):
      np.testing.assert_array_equal(g, x, err_msg=f"{way}: output {i}")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize(
  "capacity,probe_limit,fill",
  [(256, 16, 0.75), (128, 100, 0.75), (256, 16, 0.5)],
  ids=["256-16", "128-100-wrapping", "256-16-half"],
)
def test_owner_step_on_a_tpu_is_the_same_bits(capacity, probe_limit, fill, name, monkeypatch):
  """A TPU's training step (lane-dense windows, `sharding.reorder`'s forms:
  sorts, the few keys' rounds without claims) against the CPU's."""
  params = dict(CASES[name], probe_limit=probe_limit)
  sketch = (2, 64) if params["admit_after"] > 1 else (1, 1)
  case = _case(capacity + probe_limit, capacity, probe_limit, 300, sketch, fill)
  train = True
  want = _run(id_map.owner_step, case, params, train)
  use_tpu_reorder(monkeypatch)
  got = _run(lambda *a, **k: id_map.owner_step(*a, lane_dense=True, **k), case, params, train)
  for i, (g, x) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(g, x, err_msg=f"output {i}")


@pytest.mark.parametrize("num_shards,capacity", [(1, 64), (4, 8)])
def test_buckets_on_a_tpu_are_the_same_bits(num_shards, capacity, monkeypatch):
  rng = np.random.default_rng(num_shards)
  keys = rng.integers(0, 2**32, (60, 2), dtype=np.uint64).astype(np.uint32)
  words = keys[rng.integers(0, 60, 200)]
  valid = rng.random(200) > 0.1
  words[~valid] = key_route.PAD
  args = (words[:, 0], words[:, 1], valid)
  run = lambda: jax.jit(lambda *a: key_route.buckets(*a, num_shards=num_shards, capacity=capacity))(
    *args
  )
  want = run()
  use_tpu_reorder(monkeypatch)
  for g, x in zip(run(), want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(x))


@needs_native
@pytest.mark.parametrize("spread", ["hashes", "clustered"])
@pytest.mark.parametrize("num_shards,capacity", [(1, 64), (4, 8)])
def test_native_buckets_equal_xla(num_shards, capacity, spread):
  rng = np.random.default_rng(num_shards)
  t = 200
  keys = rng.integers(0, 2**32, (60, 2), dtype=np.uint64).astype(np.uint32)
  if spread == "clustered":  # 50 keys in one of the native sort's buckets, two far apart
    keys[:50, 0] = 0x12345678
    keys[50, 0], keys[51, 0] = 0, 0xFFFFFFF0
  words = keys[rng.integers(0, 60, t)]
  valid = rng.random(t) > 0.1
  words[~valid] = key_route.PAD
  args = (words[:, 0], words[:, 1], valid)
  kw = dict(num_shards=num_shards, capacity=capacity)
  want = jax.jit(lambda *a: key_route.buckets(*a, **kw))(*args)
  got = jax.jit(lambda *a: native_id_map.plan(*a, **kw))(*args)
  if num_shards == 4:  # some owner gets more distinct keys than its capacity
    assert (np.asarray(want[0]) < 0).sum() > (~valid).sum()
  for g, x in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(x))


# The native step's outputs on the every-way cases, as one digest: the child
# process below runs it with the window scans' scalar path.
_NATIVE_DIGEST = """
import hashlib, sys
sys.path.insert(0, sys.argv[1])
import test_owner_step as t
digest = hashlib.sha256()
for arrays in t._native_outputs():
  for x in arrays:
    digest.update(x.tobytes())
print(digest.hexdigest())
"""


def _native_outputs():
  """The native step's outputs on the train cases with windows of 16 (on
  this host, its AVX2 scans where a window does not wrap)."""
  for name in sorted(CASES):
    for fill in (0.75, 0.99):
      params = dict(CASES[name], probe_limit=16)
      sketch = (2, 64) if params["admit_after"] > 1 else (1, 1)
      yield _run(native_id_map.owner_step, _case(272, 256, 16, 300, sketch, fill), params, True)


@needs_native
@pytest.mark.slow
def test_native_scalar_and_vector_scans_give_the_same_bits():
  """csrc/probe_window.h scans a window scalar or 8 slots at a time (AVX2);
  the quick tests run the host's. A child on the scalar path
  (PE_NATIVE_ISA=base) gives the same outputs as this process."""
  here = hashlib.sha256()
  for arrays in _native_outputs():
    for x in arrays:
      here.update(x.tobytes())
  tests = os.path.dirname(os.path.abspath(__file__))
  out = subprocess.run(
    [sys.executable, "-c", _NATIVE_DIGEST, tests],
    env=child_env(PE_NATIVE_ISA="base"),
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  )
  assert out.stdout.strip().splitlines()[-1] == here.hexdigest()


def test_distinct_sums_each_keys_counts():
  # `key_route.distinct` against NumPy: sorted distinct keys, their counts
  # summed over every slot that received them, empty slots ignored.
  rng = np.random.default_rng(3)
  n = 64
  keys = rng.integers(0, 2**32, (12, 2), dtype=np.uint64).astype(np.uint32)
  pick = rng.integers(0, 12, n)
  hi, lo = keys[pick, 0], keys[pick, 1]
  count = np.where(rng.random(n) < 0.3, 0, rng.integers(1, 9, n)).astype(np.int32)
  u_hi, u_lo, u_count, u_valid, slot_uid = map(
    np.asarray, jax.jit(key_route.distinct)(hi, lo, count)
  )
  live = count > 0
  want = sorted({(int(h), int(l)) for h, l in zip(hi[live], lo[live])})
  k = len(want)
  assert u_valid.sum() == k and u_valid[:k].all()
  np.testing.assert_array_equal(np.stack([u_hi[:k], u_lo[:k]], 1), np.array(want, np.uint32))
  for u, (h, l) in enumerate(want):
    mine = live & (hi == h) & (lo == l)
    assert u_count[u] == count[mine].sum()
    assert (slot_uid[mine] == u).all()
  assert (slot_uid[~live] == -1).all()


@needs_native
@pytest.mark.parametrize("train", [True, False], ids=["train", "read"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("key_capacity", [256, 40], ids=["all-fit", "overflow"])
def test_native_one_shard_step_equals_plan_and_owner_step(name, train, key_capacity):
  # One shard's whole translation in one native call gives what the plan,
  # the owner's step and the answers give separately: map, rows, reset and
  # counts (with more distinct keys than key_capacity: the rest miss).
  m, hi, lo, count, usable = _case(7, 256, 16, 300, (2, 64), 0.75)
  live = count > 0
  words = np.repeat(np.stack([hi[live], lo[live]], 1), count[live], axis=0)
  words = np.concatenate([words, np.full((20, 2), key_route.PAD, np.uint32)])
  words = words[np.random.default_rng(1).permutation(len(words))]
  layout = RowLayout(256, 1)
  params = dict(CASES[name], probe_limit=16)

  def translate(impl):
    def fn(*a):
      out_map, tr = id_map.translate(
        IdMap(*a[:6]),
        a[6],
        layout=layout,
        axis_name="x",
        key_capacity=key_capacity,
        train=train,
        impl=impl,
        **params,
      )
      return tuple(out_map), tuple(tr)

    mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
    run = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    out = jax.jit(run)(*m, words)
    return [np.asarray(x) for x in jax.tree.leaves(out)]

  separate = translate(id_map.MapImpl(native_id_map.plan, native_id_map.owner_step))
  fused = translate(
    id_map.MapImpl(native_id_map.plan, native_id_map.owner_step, native_id_map.one_shard_step)
  )
  for i, (g, x) in enumerate(zip(fused, separate)):
    np.testing.assert_array_equal(g, x, err_msg=f"output {i}")
  rows = separate[6]  # Translation.rows follows the map's 6 arrays
  distinct = len({tuple(w) for w in words[words[:, 0] != key_route.PAD].tolist()})
  missed = len({tuple(w) for w in words[rows == id_map.MISS].tolist()})
  assert missed >= distinct - key_capacity > 0 or key_capacity > distinct
