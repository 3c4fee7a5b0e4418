"""Where the rows of a row-sharded table live.

A table of `num_rows` logical rows is stored as one physical array of
`num_shards * rows_per_shard` rows, sharded along its first dimension over a
mesh axis: shard `s` holds physical rows `[s * rows_per_shard, (s + 1) *
rows_per_shard)`. Physical rows that hold no logical row are padding.

Two placements are supported:

* `"mod"` (default): logical row `r` lives on shard `r % S` at local slot
  `r // S`. Recommender vocabularies are Zipf-distributed and their hot ids are
  the small ones, so striping spreads the hot rows over every shard.
* `"range"`: contiguous blocks; logical row `r` is physical row `r`.

Every function here works on NumPy arrays (host side: checkpoints, export) and
on JAX arrays (inside jitted code) alike.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

# The largest int32 is reserved: dedup sorts it last and treats it as "no row".
SENTINEL = np.iinfo(np.int32).max
# Rows per shard are padded to a multiple of the TPU sublane count, so every
# shard's block is (8, 128)-tile aligned; shards of GROUP_ALIGNMENT rows or
# more to a multiple of that, so that a per-row scalar state of the shard,
# (rows, 1), is whole 128-lane rows (lane-dense) when viewed (rows / 128, 128).
ROW_ALIGNMENT = 8
GROUP_ALIGNMENT = 128

LayoutKind = Literal["mod", "range"]


class LayoutError(ValueError):
  """A row layout was asked for with impossible sizes or a mismatched array."""


def round_up(x: int, m: int) -> int:
  """The least multiple of m that is >= x."""
  return -(-x // m) * m


def _xp(x):
  """numpy for host arrays, jax.numpy otherwise (lazily: no jax import here)."""
  if isinstance(x, (np.ndarray, np.generic, int)):
    return np
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return jnp


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """Placement of `num_rows` logical rows over `num_shards` row shards.

  Attributes:
    num_rows: logical rows V (the vocabulary size), 1 <= V < 2**31 - 1.
    num_shards: S >= 1, any integer (powers of two are not required).
    kind: "mod" (row r on shard r % S) or "range" (contiguous blocks).
  """

  num_rows: int
  num_shards: int
  kind: LayoutKind = "mod"

  def __post_init__(self):
    if not isinstance(self.num_rows, (int, np.integer)) or self.num_rows < 1:
      raise LayoutError(f"num_rows must be a positive int, got {self.num_rows!r}.")
    if not isinstance(self.num_shards, (int, np.integer)) or self.num_shards < 1:
      raise LayoutError(f"num_shards must be a positive int, got {self.num_shards!r}.")
    if self.kind not in ("mod", "range"):
      raise LayoutError(f"kind must be 'mod' or 'range', got {self.kind!r}.")
    if self.num_physical_rows >= SENTINEL:
      raise LayoutError(
        f"num_rows={self.num_rows} over {self.num_shards} shards needs "
        f"{self.num_physical_rows} physical rows, which does not fit the "
        f"int32 row ids (limit {SENTINEL - 1}); split the table."
      )

  @property
  def rows_per_shard(self) -> int:
    """Physical rows on each shard: a multiple of 8, and of 128 from 128."""
    rows = -(-self.num_rows // self.num_shards)
    return round_up(rows, ROW_ALIGNMENT if rows < GROUP_ALIGNMENT else GROUP_ALIGNMENT)

  @property
  def num_physical_rows(self) -> int:
    return self.rows_per_shard * self.num_shards

  # -- id arithmetic (NumPy or JAX integer arrays) ---------------------------

  def shard_of(self, rows):
    """Owner shard of each (valid) logical row."""
    if self.kind == "mod":
      return rows % self.num_shards
    return rows // self.rows_per_shard

  def local_of(self, rows):
    """Local slot of each (valid) logical row on its owner shard."""
    if self.kind == "mod":
      return rows // self.num_shards
    return rows % self.rows_per_shard

  def physical_of(self, rows):
    """Physical row index of each (valid) logical row.

    The physical index is monotone in the owner shard, so sorting by it groups
    rows by owner: routing relies on that.
    """
    if self.kind == "mod":
      return (rows % self.num_shards) * self.rows_per_shard + rows // self.num_shards
    return rows

  def logical_of(self, physical):
    """Logical row held at each physical index, or -1 for a padding slot."""
    xp = _xp(physical)
    if self.kind == "mod":
      shard, local = physical // self.rows_per_shard, physical % self.rows_per_shard
      rows = local * self.num_shards + shard
    else:
      rows = physical
    return xp.where(rows < self.num_rows, rows, -1)

  # -- whole-array conversions ---------------------------------------------

  def _check_rows(self, x, expected: int, what: str):
    if x.shape[0] != expected:
      raise LayoutError(
        f"{what} array has {x.shape[0]} rows, but the layout {self} expects "
        f"{expected}; pass an array of shape ({expected}, ...)."
      )

  def to_physical(self, logical):
    """(num_rows, ...) logical order -> (num_physical_rows, ...), zero padding."""
    self._check_rows(logical, self.num_rows, "logical")
    xp = _xp(logical)
    src = self.logical_of(xp.arange(self.num_physical_rows))
    return _take_rows(logical, src)

  def to_logical(self, physical):
    """(num_physical_rows, ...) -> (num_rows, ...) in logical row order."""
    self._check_rows(physical, self.num_physical_rows, "physical")
    xp = _xp(physical)
    return physical[self.physical_of(xp.arange(self.num_rows))]

  def reshard(self, physical, target: RowLayout):
    """Moves a physical array of this layout into `target`'s physical order.

    One gather, no logical-order temporary. `target` may differ in shard count
    and kind but must describe the same number of rows.
    """
    if target.num_rows != self.num_rows:
      raise LayoutError(
        f"cannot reshard {self.num_rows} rows into a layout of "
        f"{target.num_rows} rows; the vocabulary must match."
      )
    self._check_rows(physical, self.num_physical_rows, "physical")
    xp = _xp(physical)
    rows = target.logical_of(xp.arange(target.num_physical_rows))
    src = xp.where(rows >= 0, self.physical_of(xp.maximum(rows, 0)), -1)
    return _take_rows(physical, src)


def _take_rows(x, idx):
  """x[idx] along axis 0 with zero rows where idx < 0."""
  xp = _xp(x)
  out = x[xp.maximum(idx, 0)]
  mask = (idx >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
  return xp.where(mask, out, xp.zeros((), x.dtype))
