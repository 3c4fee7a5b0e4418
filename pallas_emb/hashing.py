"""Stable hashing of raw ids (integers or strings) into a table's rows.

For unbounded vocabularies: user ids, URLs, query strings. Runs on the host,
in NumPy, vectorised; its values are fixed forever (they depend on no
process state, `PYTHONHASHSEED` included), so a table trained with them stays
valid across runs, processes and versions.

The definition, all arithmetic modulo 2**64:

    key(x)  = x as a 64-bit two's complement word       for an integer id
            = FNV-1a-64 of its bytes (UTF-8 for str)    for a string or bytes
              (offset basis 0xCBF29CE484222325, prime 0x100000001B3:
               h = basis; for each byte b: h = (h ^ b) * prime)
    hash64  = SplitMix64's finaliser of key + 0x9E3779B97F4A7C15 * (seed + 1):
              z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9
              z = (z ^ z >> 27) * 0x94D049BB133111EB
              z =  z ^ z >> 31
    row     = hash64 % num_rows

For integers this is a bijection of the 64-bit words before the `% num_rows`
(two distinct ids never share a hash64); FNV-1a's weak low bits are mixed by
the finaliser. The integer 5 and the string "5" get different rows. These
are not TensorFlow's or Keras' buckets (those use FarmHash).

Collisions are the price of the table size. With n distinct raw ids hashed
into V rows, the expected fraction of them that share their row with at
least one other is `expected_collision_fraction(n, V)` = 1 - (1 - 1/V)**(n-1)
(about n / V for n << V; 63% at n = V). Distinct strings can also collide in
hash64 itself, with probability about n**2 / 2**65 for the whole set.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from pallas_emb.errors import InputError, SpecError, check_int

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_FNV_BASIS = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
# Rows must be int32 ids on the device.
_MAX_ROWS = 2**31 - 1


def _mix(key: np.ndarray, seed: int) -> np.ndarray:
  """SplitMix64 of uint64 `key` words under `seed` (uint64 wraps silently)."""
  z = key + _GAMMA * np.uint64((seed + 1) % 2**64)
  z = (z ^ (z >> np.uint64(30))) * _MIX1
  z = (z ^ (z >> np.uint64(27))) * _MIX2
  return z ^ (z >> np.uint64(31))


def _fnv1a(strings: list[bytes]) -> np.ndarray:
  """FNV-1a-64 of each byte string, one pass per byte position."""
  lens = np.fromiter(map(len, strings), np.int64, len(strings))
  width = int(lens.max(initial=0))
  data = np.zeros((len(strings), width), np.uint8)
  data[np.arange(width) < lens[:, None]] = np.frombuffer(b"".join(strings), np.uint8)
  h = np.full(len(strings), _FNV_BASIS)
  for j in range(width):
    h = np.where(lens > j, (h ^ data[:, j].astype(np.uint64)) * _FNV_PRIME, h)
  return h


def _as_bytes(value) -> bytes:
  if isinstance(value, bytes):
    return value
  if isinstance(value, str):
    return value.encode("utf-8")
  raise InputError(
    f"raw id {value!r} of type {type(value).__name__} is neither an "
    "integer nor a str/bytes; hash one kind of id per array."
  )


def _keys(raw: np.ndarray) -> np.ndarray:
  """The uint64 key of every element of a flat array of raw ids."""
  if np.issubdtype(raw.dtype, np.integer):
    return raw.astype(np.uint64)  # two's complement for negative ids
  if raw.dtype.kind in "US":  # 'S' arrays drop trailing NUL bytes (NumPy)
    return _fnv1a([_as_bytes(v) for v in raw.tolist()])
  if raw.dtype == object:
    values = raw.tolist()
    if all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
      wide = [v for v in values if not -(2**63) <= v < 2**64]
      if wide:
        raise InputError(
          f"raw id {wide[0]} does not fit 64 bits; hash it as a string "
          "(str(id)) so that it is not truncated."
        )
      return np.array([int(v) % 2**64 for v in values], np.uint64)
    return _fnv1a([_as_bytes(v) for v in values])
  raise InputError(
    f"raw ids must be integers, str or bytes, got an array of {raw.dtype}; "
    "hash float or bool features after mapping them to integers or strings."
  )


def hash64(raw: Any, *, seed: int = 0) -> np.ndarray:
  """The stable 64-bit hash of raw ids (see the module docstring).

  Args:
    raw: integers (any NumPy integer dtype, or Python ints), or strings
      (str, bytes; NumPy unicode, bytes or object arrays), of any shape.
    seed: int >= 0; different seeds give independent hashes (salt one table
      or feature from another).

  Returns:
    uint64 array of `raw`'s shape.

  Raises:
    InputError: ids of another type (float, bool, a mixed object array).
  """
  check_int(seed, "seed", minimum=0, error=InputError)
  raw = np.asarray(raw)
  with np.errstate(over="ignore"):
    return _mix(_keys(raw.reshape(-1)), seed).reshape(raw.shape)


def hash_ids(raw: Any, num_rows: int, *, seed: int = 0, pad: Any = None) -> np.ndarray:
  """Raw ids -> int32 row ids in [0, num_rows), padding kept as -1.

  Use it on a feature's raw ids before the lookup (or the `Trainer`), e.g.
  `ids["query"] = pe.hash_ids(raw_queries, spec.num_rows, pad="")`.

  Args:
    raw: (B, L) (or any shape) raw ids: integers or strings, as `hash64`
      takes. Elements that are None (object arrays) are padding.
    num_rows: the table's rows V, 1 <= V < 2**31.
    seed: int >= 0, as `hash64`.
    pad: the raw value that marks padding (e.g. -1, or "" for strings), or
      None if there is none.

  Returns:
    int32 array of `raw`'s shape: `hash64(raw, seed=seed) % num_rows`, and -1
    where `raw` is padding.
  """
  check_int(num_rows, "num_rows", error=InputError)
  if num_rows > _MAX_ROWS:
    raise InputError(f"num_rows must be < 2**31 (rows are int32 ids), got {num_rows}.")
  raw = np.asarray(raw)
  padding = np.zeros(raw.shape, bool)
  if raw.dtype == object:
    padding |= np.vectorize(lambda v: v is None, otypes=[bool])(raw)
  if pad is not None:
    padding |= np.broadcast_to(np.asarray(raw == pad, bool), raw.shape)
  rows = np.full(raw.shape, -1, np.int32)
  if (~padding).any():
    rows[~padding] = (hash64(raw[~padding], seed=seed) % np.uint64(num_rows)).astype(np.int32)
  return rows


@dataclasses.dataclass(frozen=True)
class HashRule:
  """How a feature's raw ids were made rows: `hash_ids(raw, num_rows,
  seed=seed, pad=pad)`, with num_rows its table's.

  The library does not hash for the caller in training (the caller's input
  pipeline calls `hash_ids`); a serving artifact records the rule, so that
  whoever serves the model hashes as training did
  (`pallas_emb.export_serving(features={"query": HashRule(seed=3, pad="")})`).

  Attributes:
    seed: int >= 0, as `hash64`.
    pad: the raw value that marks padding (an int or a str), or None.
  """

  seed: int = 0
  pad: int | str | None = None

  def __post_init__(self):
    check_int(self.seed, "HashRule: seed", minimum=0, error=SpecError)
    if self.pad is not None and (
      isinstance(self.pad, bool) or not isinstance(self.pad, (numbers.Integral, str))
    ):
      raise SpecError(
        f"HashRule: pad must be None, an int or a str (it is written to a JSON manifest), "
        f"got {self.pad!r} of type {type(self.pad).__name__}."
      )
    if isinstance(self.pad, numbers.Integral):
      object.__setattr__(self, "pad", int(self.pad))  # NumPy ints: as JSON writes them

  def rows(self, raw: Any, num_rows: int) -> np.ndarray:
    """`hash_ids(raw, num_rows)` under this rule: int32, -1 padding."""
    return hash_ids(raw, num_rows, seed=self.seed, pad=self.pad)


def expected_collision_fraction(num_ids: int, num_rows: int) -> float:
  """The expected fraction of `num_ids` distinct raw ids, hashed uniformly
  into `num_rows` rows, that share their row with another id:
  1 - (1 - 1/num_rows) ** (num_ids - 1)."""
  check_int(num_ids, "num_ids", error=InputError)
  check_int(num_rows, "num_rows", error=InputError)
  # log1p keeps (1 - 1/V) ** n exact for large V.
  return -math.expm1((num_ids - 1) * math.log1p(-1.0 / num_rows))
