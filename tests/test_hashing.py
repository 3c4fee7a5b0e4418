"""Hashing raw ids into rows: pinned values, stable across processes, the
documented definition, padding, and the collision rate."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pallas_emb as pe

M64 = 2**64 - 1


def _splitmix64(key: int, seed: int) -> int:
  """The module docstring's definition with Python ints, as a second,
  independent implementation."""
  z = (key + 0x9E3779B97F4A7C15 * (seed + 1)) & M64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
  return z ^ (z >> 31)


def _fnv1a64(data: bytes) -> int:
  h = 0xCBF29CE484222325
  for b in data:
    h = ((h ^ b) * 0x100000001B3) & M64
  return h


# Pinned forever: a change here invalidates every table trained on hashed ids.
PINNED_INTS = [0, 1, -1, 2**31, 2**63 - 1, -(2**63), 123456789012345]
PINNED_INT_HASHES = [
  0xE220A8397B1DCDAF,
  0x910A2DEC89025CC1,
  0xE4D971771B652C20,
  0x25493CC63225736C,
  0x2A67D7552E039EA7,
  0x481EC0A212A9F3DB,
  0xD85E134B80BE5CFB,
]
PINNED_STRINGS = ["", "a", "foobar", "user:42", "naïve"]
PINNED_STRING_HASHES_SEED3 = [
  0x2C65920724651C72,
  0xAF99D20610C74918,
  0xAE74A3F6A0B5C01A,
  0x36D531D498BE3B4E,
  0xDA7DFFC04EAEB053,
]


def test_integer_hashes_follow_the_definition_and_the_published_vector():
  got = pe.hash64(np.array(PINNED_INTS, np.int64))
  assert got.dtype == np.uint64
  assert got.tolist() == PINNED_INT_HASHES
  assert got.tolist() == [_splitmix64(x & M64, 0) for x in PINNED_INTS]
  # With seed 0, key k * 0x9E3779B97F4A7C15 hashes to SplitMix64's output
  # k + 1 from state 0: the published sequence.
  gamma = 0x9E3779B97F4A7C15
  keys = np.array([0, gamma, 2 * gamma & M64], np.uint64)
  assert pe.hash64(keys).tolist() == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_string_hashes_follow_the_definition_and_fnv_vectors():
  # FNV-1a-64 test vectors (Fowler/Noll/Vo).
  assert [_fnv1a64(s) for s in (b"", b"a", b"foobar")] == [
    0xCBF29CE484222325,
    0xAF63DC4C8601EC8C,
    0x85944171F73967E8,
  ]
  want = [_splitmix64(_fnv1a64(s.encode()), 3) for s in PINNED_STRINGS]
  assert want == PINNED_STRING_HASHES_SEED3
  for raw in (
    np.array(PINNED_STRINGS),
    np.array(PINNED_STRINGS, object),
    [s.encode() for s in PINNED_STRINGS],
    PINNED_STRINGS,
  ):
    assert pe.hash64(raw, seed=3).tolist() == want


PINNED = {  # hash_ids(raw, 1000, seed=...) on any machine, any process
  "ints": ([[5, 2**40, -1], [-7, 123456789012345, 0]], 0, -1),
  "strings": ([["user:1", "naïve", ""], ["", "user:1", "x" * 40]], 11, ""),
}


def _pinned_rows():
  return {
    k: pe.hash_ids(np.array(raw), 1000, seed=seed, pad=pad).tolist()
    for k, (raw, seed, pad) in PINNED.items()
  }


def test_hash_ids_pinned_values_and_padding():
  rows = _pinned_rows()
  want = {}
  for k, (raw, seed, pad) in PINNED.items():
    key = (lambda v: v & M64) if k == "ints" else (lambda v: _fnv1a64(v.encode()))
    want[k] = [[-1 if v == pad else _splitmix64(key(v), seed) % 1000 for v in row] for row in raw]
  assert rows == want
  assert rows == {
    "ints": [[618, 641, -1], [752, 75, 535]],
    "strings": [[972, 643, -1], [-1, 972, 431]],
  }
  out = pe.hash_ids(np.array(PINNED["ints"][0], np.int64), 1000, pad=-1)
  assert out.dtype == np.int32 and out.shape == (2, 3)


def test_hashes_are_stable_across_processes():
  # Another interpreter with another PYTHONHASHSEED (str hashing differs):
  # the same rows.
  code = "import json; from test_hashing import _pinned_rows; print(json.dumps(_pinned_rows()))"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(
    os.environ,
    PYTHONHASHSEED="12345",
    PYTHONPATH=os.pathsep.join(
      [root, os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")]
    ),
  )
  out = subprocess.run(
    [sys.executable, "-c", code], cwd=root, env=env, check=True, capture_output=True, text=True
  ).stdout
  assert json.loads(out) == _pinned_rows()


def test_seeds_decorrelate_and_object_arrays_with_none_pad():
  raw = np.arange(10_000)
  a, b = pe.hash_ids(raw, 1000, seed=0), pe.hash_ids(raw, 1000, seed=1)
  assert (a == b).mean() < 0.01  # independent: 1/1000 expected
  obj = np.array([["a", None], [None, b"a"]], object)
  rows = pe.hash_ids(obj, 50)
  assert rows[0, 1] == rows[1, 0] == -1 and rows[0, 0] == rows[1, 1]  # str == its UTF-8
  assert pe.hash_ids(np.array([[7, None]], object), 50).tolist() == [[int(pe.hash64(7) % 50), -1]]


def test_measured_collisions_match_the_formula():
  # n distinct ids into V rows: the fraction sharing a row with another id.
  for n, rows in ((20_000, 20_000), (2_000, 50_000)):
    for kind, raw in (
      ("int", np.arange(n, dtype=np.int64) * 7919 + 3),
      ("str", np.array([f"item-{i}" for i in range(n)])),
    ):
      got = pe.hash_ids(raw, rows)
      counts = np.bincount(got, minlength=rows)
      measured = (counts[got] > 1).mean()
      want = pe.expected_collision_fraction(n, rows)
      # Colliding ids come (mostly) in pairs of a Poisson number of pairs:
      # the fraction's standard deviation is about sqrt(2 * want / n).
      assert abs(measured - want) < 4 * np.sqrt(2 * want / n), (kind, n, measured, want)
  assert pe.expected_collision_fraction(100_000, 100_000) == pytest.approx(1 - np.exp(-1), abs=1e-5)
  assert pe.expected_collision_fraction(1, 10) == 0.0


@pytest.mark.parametrize(
  "call,match",
  [
    (
      lambda: pe.hash_ids(np.ones((2, 2)), 10),
      r"raw ids must be integers, str or bytes, got an array of float64",
    ),
    (lambda: pe.hash_ids(np.array([True]), 10), r"got an array of bool"),
    (lambda: pe.hash_ids(np.array(["a", 3], object), 10), r"raw id 3 of type int is neither"),
    (
      lambda: pe.hash_ids(np.array([2**70], object), 10),
      r"raw id 1180591620717411303424 does not fit 64 bits",
    ),
    (lambda: pe.hash_ids([1], 0), r"num_rows must be a positive int, got 0"),
    (lambda: pe.hash_ids([1], 2**31), r"num_rows must be < 2\*\*31"),
    (lambda: pe.hash_ids([1], 10, seed=-1), r"seed must be an int >= 0, got -1"),
  ],
)
def test_bad_raw_ids_raise_input_error(call, match):
  with pytest.raises(pe.InputError, match=match):
    call()
