"""The rows of one visit of a block sweep, inside VMEM: each id's row read
out of its table block into a tile, and written back from it.

A visit (`blocks.Plan`) holds one block of each swept array and one chunk of
ids. An id's row of an array stored as rows is one (1, W) row of the block;
of a packed array (rows narrower than 128 lanes, `pallas_emb.packing`), a
sub-row of a 128-lane physical row, rotated to lane 0 when read and merged
back into its lanes when written. Ids are ascending, so ids that share a
physical row are consecutive: `merge_packed` folds them in registers, a
batch of ids at a time. Shared by `block_update` (read, update, write back)
and `block_gather` (read).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb.kernels import blocks

LANES = 128


def bits(x):
  """`x`'s 32-bit words as int32 (the tiles' type)."""
  return lax.bitcast_convert_type(x, jnp.int32)


class Visit(NamedTuple):
  """What one grid step reads and writes: the swept arrays' output blocks
  (aliased to the table and slots) and their tiles, and where the visit
  lies (its block's first logical row, its chunk's first id)."""

  arrays: tuple[blocks.Array, ...]  # static: each array's width and shift
  rows: Any  # (n,) int32 SMEM ref: the ids
  outs: tuple  # per array, its block, updated in place
  tiles: tuple  # per array, a (G, stored width) int32 tile of the chunk's rows
  base: jax.Array  # the block's first logical row
  first_id: jax.Array  # the chunk's first id

  def place(self, a: blocks.Array, r):
    """(stored row in the block, lane offset) of local row r in array a."""
    return (r >> a.shift) - (self.base >> a.shift), (r & ((1 << a.shift) - 1)) * a.width

  def read(self, j) -> list:
    """Id j's row of each array, its sub-row rotated to lane 0 (words)."""
    r, out = self.rows[j], []
    for a, ref in zip(self.arrays, self.outs):
      phys, off = self.place(a, r)
      x = bits(ref[pl.ds(phys, 1), :])
      out.append(pltpu.roll(x, (LANES - off) % LANES, 1) if a.shift else x)
    return out

  def to_tile(self, j, rows: list) -> None:
    for tile, x in zip(self.tiles, rows):
      tile[pl.ds(j - self.first_id, 1), :] = x

  def scatter(self):
    """The id body (`blocks.for_each_id`) that writes each id's new rows
    back from the tiles: rows stored as they are by plain stores, loads
    before stores; a packed array's by `merge_packed`."""
    wide = [k for k, a in enumerate(self.arrays) if not a.shift]

    def load(j):
      return [self.tiles[k][pl.ds(j - self.first_id, 1), :] for k in wide]

    def store(j, rows):
      for k, x in zip(wide, rows):
        phys, _ = self.place(self.arrays[k], self.rows[j])
        self.outs[k][pl.ds(phys, 1), :] = lax.bitcast_convert_type(x, self.outs[k].dtype)

    plain = blocks.load_then_store(load, store)

    def body(j):
      plain(j)
      self.merge_packed([j])

    def many(ids):
      plain.many(ids)
      self.merge_packed(ids)

    body.many = many
    return body

  def merge_packed(self, ids) -> None:
    """Each id's new sub-row merged into its physical row, a batch at once:
    every id's row is read before any is written, and ids of one physical
    row (consecutive, ids ascending) fold into the same merged row in
    registers; each id then writes the row merged so far, so the run's last
    write holds the whole run (its earlier ones are superseded)."""
    lane = lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
    rs = [self.rows[j] for j in ids]
    for a, out, tile in zip(self.arrays, self.outs, self.tiles):
      if not a.shift:
        continue
      places = [self.place(a, r) for r in rs]
      old = [bits(out[pl.ds(phys, 1), :]) for phys, _ in places]
      new = [
        pltpu.roll(tile[pl.ds(j - self.first_id, 1), :], off, 1) for j, (_, off) in zip(ids, places)
      ]
      merged = []
      for u, (phys, off) in enumerate(places):
        base = old[u] if u == 0 else jnp.where(phys == places[u - 1][0], merged[-1], old[u])
        merged.append(jnp.where((lane >= off) & (lane < off + a.width), new[u], base))
      for (phys, _), row in zip(places, merged):
        out[pl.ds(phys, 1), :] = lax.bitcast_convert_type(row, out.dtype)
