"""The plan of a block sweep: which table blocks hold a step's ids, and which
ids each visit of a block handles.

The block forms of the kernels (`block_update`, `block_gather`) do not copy
rows one DMA at a time. They stream the table through VMEM in blocks of B
logical rows with a BlockSpec pipeline (one DMA per block, issued by Pallas
ahead of use) and move the step's rows inside VMEM. On a TPU a DMA costs
about as much to issue from the scalar core as to move a few KiB, so one
block of B rows costs about what a handful of rows cost one by one.

A *visit* is one grid step: a pair (table block b, chunk k of ids), where
chunk k is ids [k * G, (k + 1) * G) of the ascending id list, and the visit
handles the ids of chunk k that lie in block b. Ids ascending, both b and k
are non-decreasing along the visits, so the pipeline fetches each block that
holds ids once (Pallas skips the copy when a block index repeats), writes it
back once, and never touches a block that holds none. There are at most
min(blocks, ids) + chunks visits: a static grid, whose unused tail repeats
the last visit with nothing to do.

Everything here is XLA on (n,) arrays, run before the kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_emb.errors import ConfigError
from pallas_emb.kernels import checks
from pallas_emb.kernels.chip import SUBLANES, round_up

# Rows of every block: a multiple of 1024 keeps each array's block whole
# (8, 128) tiles, a per-row scalar slot's (B / 128, 128) included.
BLOCK_ALIGNMENT = 1024


class Plan(NamedTuple):
  """The visits of one kernel call, (V,) int32 each (scalar-prefetched).

  Attributes:
    block: the table block of each visit.
    chunk: its chunk of ids.
    lo, hi: the ids [lo, hi) it handles (lo == hi: none).
  """

  block: jax.Array
  chunk: jax.Array
  lo: jax.Array
  hi: jax.Array


def block_rows(num_rows: int, row_bytes: int, block_bytes: int) -> int:
  """Logical rows per block: a multiple of `BLOCK_ALIGNMENT` whose table
  block is about `block_bytes`, or the whole shard if it is smaller (a
  block as large as its array is always legal).

  Args:
    num_rows: the shard's logical rows R.
    row_bytes: stored bytes per logical row (of the table, or the largest
      array swept).
    block_bytes: the target size of one block of that array.
  """
  rows = max(BLOCK_ALIGNMENT, block_bytes // max(row_bytes, 1) // BLOCK_ALIGNMENT * BLOCK_ALIGNMENT)
  return num_rows if num_rows <= rows else rows


class Array(NamedTuple):
  """One swept array (the table, then each slot), static.

  Attributes:
    name: the slot's name ("" for the table).
    width: words of a logical row (1 for a per-row scalar).
    shift: log2 of logical rows per stored row (0: stored as rows).
  """

  name: str
  width: int
  shift: int


def arrays(table, slots, specs, dim: int, dtype) -> tuple[Array, ...]:
  """The table and each slot (of `specs`, the optimizer's) as swept arrays."""
  out = []
  for name, x, width in [("", table, checks.row_width(table, dim, dtype))] + [
    (n, slots[n], specs[n].stored_width(dim)) for n in slots
  ]:
    out.append(Array(name, width, shift_of(width, x.shape[1])))
  return tuple(out)


def block_shape(a: Array, x, block: int) -> tuple[int, int]:
  """Array a's block: the stored rows of `block` logical rows, or all of
  them for a shard of one block."""
  return (min(block >> a.shift, x.shape[0]), x.shape[1])


def check_block(block: int, num_rows: int) -> None:
  """A block is the whole shard or a multiple of `BLOCK_ALIGNMENT`."""
  if block != num_rows and (block <= 0 or block % BLOCK_ALIGNMENT):
    raise ConfigError(
      f"block_rows={block}: a block is the shard's {num_rows} rows or a positive multiple of "
      f"{BLOCK_ALIGNMENT}; use block_rows={BLOCK_ALIGNMENT} or None."
    )


def num_visits(num_ids: int, num_blocks: int, chunk: int) -> int:
  """The static grid of a call of `num_ids` ids: every visit that ids in
  ascending order can need."""
  return min(num_blocks, num_ids) + -(-num_ids // chunk)


def plan(
  rows: jax.Array,
  *,
  num_rows: int,
  block: int,
  chunk: int,
  visit_padding: bool,
  apply: jax.Array | bool = True,
) -> Plan:
  """The visits of a sweep over `rows`.

  Args:
    rows: (n,) int32 local row ids, ascending, padding (any id outside
      [0, num_rows)) after every valid id; n a multiple of `chunk`.
    num_rows: the shard's rows R.
    block: rows per block B.
    chunk: ids per chunk G, a multiple of 8.
    visit_padding: give every chunk a visit, padding-only ones too (a
      gather writes each chunk's output block, zeros for padding); else
      padding ids make no visit (an update has nothing to do there).
    apply: bool scalar; False plans one empty visit of block 0 (and the
      rest repeat it): nothing is read but that block, nothing changes.

  Returns:
    A `Plan` of `num_visits` visits.
  """
  n = rows.shape[0]
  if n % chunk or chunk % SUBLANES:
    raise ValueError(f"ids ({n}) must be whole chunks of a multiple of {SUBLANES} ({chunk}).")
  num_blocks = -(-num_rows // block)
  size = num_visits(n, num_blocks, chunk)
  valid = (rows >= 0) & (rows < num_rows)
  num_valid = jnp.sum(valid, dtype=jnp.int32)
  idx = jnp.arange(n, dtype=jnp.int32)
  # Padding ids take the last valid id's block: the sweep stays where it is.
  blk = jnp.maximum(jax.lax.cummax(jnp.where(valid, rows // block, -1)), 0)
  chk = idx // chunk
  if not visit_padding:
    chk = jnp.minimum(chk, jnp.maximum(num_valid - 1, 0) // chunk)
  new = jnp.concatenate([jnp.ones((1,), bool), (blk[1:] != blk[:-1]) | (chk[1:] != chk[:-1])])
  visit = jnp.cumsum(new, dtype=jnp.int32) - 1
  count = visit[-1] + 1
  at = jnp.where(new, visit, size)
  lo = jnp.zeros((size + 1,), jnp.int32).at[at].set(idx, mode="drop", unique_indices=True)
  lo = jnp.where(jnp.arange(size + 1) < count, lo, n)
  first = lambda x: jnp.zeros((size,), jnp.int32).at[at].set(x, mode="drop", unique_indices=True)
  block_of, chunk_of = first(blk), first(chk)
  used = jnp.arange(size) < count
  # The unused tail repeats the last visit's block and chunk: no DMA.
  last = lambda x: jnp.where(used, x, x[count - 1])
  hi = jnp.minimum(lo[1:], num_valid)
  lo = jnp.minimum(lo[:-1], num_valid)
  apply = jnp.asarray(apply)
  keep = lambda x: jnp.where(apply, x, 0)
  return Plan(
    block=keep(last(block_of)),
    chunk=keep(last(chunk_of)),
    lo=keep(jnp.where(used, lo, 0)),
    hi=keep(jnp.where(used, hi, 0)),
  )


UNROLL = 8


def shift_of(width: int, cols: int) -> int:
  """log2 of the logical rows per stored row of an array of rows `width`
  words wide stored with `cols` columns: 0 when stored as rows, else
  packed 128 / width to a 128-lane row (`pallas_emb.packing`; a per-row
  scalar slot, width 1, packs 128)."""
  if cols == width:
    return 0
  return (128 // width).bit_length() - 1


def for_each_id(lo, hi, body) -> None:
  """`body(j)` for each id j in [lo, hi), in order, inside a kernel.

  Eight ids at a time in straight-line code, then the rest one by one: a
  loop of one id per iteration runs its scalar load, address arithmetic and
  vector load and store back to back (about 60 ns an id on a v5e), where
  eight independent ids' instructions interleave. `body` may also take a
  list of ids (`body.many`), to issue all their loads before their stores.
  """
  many = getattr(body, "many", None)

  def eight(g, carry):
    first = lo + g * UNROLL
    ids = [first + u for u in range(UNROLL)]
    if many is not None:
      many(ids)
    else:
      for j in ids:
        body(j)
    return carry

  count = (hi - lo) >> 3
  jax.lax.fori_loop(0, count, eight, 0)

  def one(j, carry):
    body(j)
    return carry

  jax.lax.fori_loop(lo + count * UNROLL, hi, one, 0)


def load_then_store(load, store):
  """An id body for `for_each_id` that, given a batch of ids, issues every
  id's `load(j)` before any `store(j, value)`: for copies whose stores cannot
  alias their loads (another buffer, or distinct rows)."""

  def body(j):
    store(j, load(j))

  def many(ids):
    values = [load(j) for j in ids]
    for j, v in zip(ids, values):
      store(j, v)

  body.many = many
  return body


def pad_ids(rows: jax.Array, chunk: int, fill: int = -1) -> jax.Array:
  """`rows` padded with `fill` to whole chunks."""
  n = rows.shape[0]
  return jnp.pad(rows, (0, round_up(max(n, 1), chunk) - n), constant_values=fill)


def padded_to_blocks(x, rows: int):
  """`x` with zero rows to whole blocks of `rows` (the interpreter's form)."""
  return jnp.pad(x, ((0, -x.shape[0] % rows), (0, 0)))
