"""The serving lookup of one feature: a pure function of its table, its id
map and its ids, exported with `jax.export` once per input form.

What it computes is what the training lookup (`ShardedEmbedding.lookup`,
after `read_rows` for a dynamic table) computes: each id becomes a row of the
exported table or none, the rows are read as float32, zero where there is
none, and pooled by the same `pooling.pool`. So a "sum" bag and a sequence
come out bit for bit as in training; "mean" and "sqrtn" to float rounding.

Why a program per input form and feature kind, with symbolic shapes: a
request may hold any subset of the features, each of any batch and bag size,
and the program must run where the library's Python is not (`jax.export`
keeps the StableHLO, not the trace). The tables, maps and row counts are
arguments, not constants: a program is a few kilobytes, shared by every
feature of its kind (combiner, dtype, dynamic or not), the weights are files
beside it, and a loader may place them on one device or row-sharded over a
mesh (an exported program of one device is partitioned by XLA when called
on sharded arguments).

The forms of a feature's ids (see `pallas_emb.inputs`):

- "bags": (b, l) ids and (b, l) float32 weights. A padded input is the
  weighted one with weights 1: multiplying by 1.0 is exact, and `pool`
  computes the same sums.
- "ragged": a training `Ragged` split into its S data shards: (S, c) ids,
  (S, k) bag lengths, (S, c) weights, pooled shard by shard as training
  pools each device's block (which ids a shard dropped for capacity is part
  of the input's meaning).

A static table's ids are int32 rows; a dynamic table's are (..., 2) uint32
key words (`pallas_emb.vocabulary.key_words`), found by binary search in the
map: its keys' words sorted as one 64-bit key, and the exported row of each.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import pooling
from pallas_emb.ids import INVALID_ID
from pallas_emb.inputs import Ragged, Weighted
from pallas_emb.vocabulary import PAD_WORD

FORMS = ("bags", "ragged")
# Lowered for both; a loader runs the one of its devices.
PLATFORMS = ("cpu", "tpu")
# Ids that get no row are the training lookup's invalid ids; -1 is padding.
NO_ROW = INVALID_ID
# Halvings of the binary search: any int32 count of keys.
_SEARCH_STEPS = 32


@dataclasses.dataclass(frozen=True)
class FeatureProgram:
  """What an exported lookup is specialised on: a kind of feature.

  Attributes:
    combiner: the feature's combiner ("sum", "mean", "sqrtn"; None: a
      sequence).
    dtype: the table's stored dtype name ("float32" or "bfloat16").
    dynamic: whether ids are key words found in a map.
    num_shards: S, the data shards a `Ragged` input is packed for.
  """

  combiner: str | None
  dtype: str
  dynamic: bool
  num_shards: int

  def forms(self) -> tuple[str, ...]:
    """The input forms this feature takes (a sequence is never ragged)."""
    return FORMS if self.combiner is not None else ("bags",)


def find_keys(keys: tuple[jax.Array, ...], words: jax.Array) -> jax.Array:
  """(..., 2) uint32 key words -> int32 rows: the map's row of each key,
  `NO_ROW` for a key not in it, -1 for padding.

  Args:
    keys: (hi, lo, rows): (n,) uint32 words of the resident keys, sorted
      by (hi, lo), and (n,) int32 their rows.
  """
  hi, lo, rows = keys
  qh, ql = words[..., 0], words[..., 1]
  n = hi.shape[0]

  def halve(_, bounds):
    a, b = bounds  # the first key >= the query lies in [a, b]
    m = jnp.minimum((a + b) // 2, n - 1)
    less = (hi[m] < qh) | ((hi[m] == qh) & (lo[m] < ql))
    open_ = a < b
    return jnp.where(open_ & less, m + 1, a), jnp.where(open_ & ~less, m, b)

  start = jnp.zeros(qh.shape, jnp.int32)
  a, _ = jax.lax.fori_loop(0, _SEARCH_STEPS, halve, (start, jnp.full(qh.shape, n, jnp.int32)))
  at = jnp.minimum(a, n - 1)
  found = (a < n) & (hi[at] == qh) & (lo[at] == ql)
  padding = (qh == PAD_WORD) & (ql == PAD_WORD)
  return jnp.where(padding, -1, jnp.where(found, rows[at], NO_ROW))


def translate(p: FeatureProgram, keys, num_rows, ids: jax.Array) -> jax.Array:
  """A feature's ids -> rows of the exported table (-1 padding, `NO_ROW`
  none): (...) int32 rows in [0, num_rows), or (..., 2) key words of a
  dynamic table. `num_rows`: () int32, the table's rows before the loader's
  padding."""
  if p.dynamic:
    return find_keys(keys, ids)
  return jnp.where((ids >= 0) & (ids < num_rows), ids, jnp.where(ids == -1, -1, NO_ROW))


def gather(table: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(v, D) table, (...) rows -> ((..., D) float32 rows, zero where none;
  (...) bool has a row)."""
  has_row = rows >= 0
  out = jnp.take(table, jnp.maximum(rows, 0), axis=0, mode="clip").astype(jnp.float32)
  return jnp.where(has_row[..., None], out, 0.0), has_row


def _misses(rows: jax.Array) -> jax.Array:
  """Ids (not padding) that got no row."""
  return jnp.sum(rows == NO_ROW, dtype=jnp.int32)


def lookup_bags(p: FeatureProgram, table, keys, num_rows, ids, weights):
  """The "bags" form: ((b, D) pooled or (b, l, D) sequence output float32,
  () int32 ids without a row)."""
  rows = translate(p, keys, num_rows, ids)  # (b, l)
  vals, has_row = gather(table, rows.T)  # (l, b, D), as `tokens` orders them
  out, _ = pooling.pool(Weighted(rows, weights), vals, has_row, p.combiner)
  return out, _misses(rows)


def slot_bags(lengths: jax.Array, capacity: int) -> jax.Array:
  """`pooling.ragged_bags`' (C,) bag of each slot, by a count rather than a
  search (`jnp.searchsorted` needs a constant size; the request's is
  symbolic): slot p is in the bag whose end first exceeds p, so its bag is
  the number of bag ends <= p, a running sum of the ends' histogram."""
  ends = jnp.minimum(_running_sum(lengths.astype(jnp.int32)), capacity)
  hist = jnp.zeros((capacity + 1,), jnp.int32).at[ends].add(1)
  return _running_sum(hist)[:capacity]


def _running_sum(x: jax.Array) -> jax.Array:
  """`jnp.cumsum` of (n,) int32 `x` by doubling (Hillis-Steele): after
  the step of shift s, x[i] sums the 2s values ending at i. Why not
  `jnp.cumsum`: of a symbolic size it lowers for a TPU to a
  `dynamic_reduce_window` custom call (and `associative_scan` refuses a
  symbolic size)."""
  n = x.shape[0]
  at = jnp.arange(n, dtype=jnp.int32)

  def step(state):
    x, s = state
    return x + jnp.where(at >= s, jnp.roll(x, s), 0), s * 2

  return jax.lax.while_loop(lambda state: state[1] < n, step, (x, jnp.int32(1)))[0]


def lookup_ragged(p: FeatureProgram, table, keys, num_rows, ids, lengths, weights):
  """The "ragged" form: ((S * k, D) float32, () int32 ids without a row)."""

  def shard(ids, lengths, weights):
    bags = slot_bags(lengths, ids.shape[0])
    # Slots past the shard's bags are padding, whatever they hold.
    rows = jnp.where(bags < lengths.shape[0], translate(p, keys, num_rows, ids), -1)
    vals, has_row = gather(table, rows[None])
    out, _ = pooling.pool(Ragged(rows, lengths, weights), vals, has_row, p.combiner, bags)
    return out, _misses(rows)

  out, misses = jax.vmap(shard)(ids, lengths, weights)
  return out.reshape(-1, out.shape[-1]), jnp.sum(misses)


def arg_shapes(p: FeatureProgram, form: str, sizes=None, shardings=(None, None)) -> tuple:
  """The abstract arguments (table, keys, num_rows, *ids) of `form`.

  Args:
    sizes: None, or some of the sizes by name: the table's rows v and width
      d, the map's keys n, and the request's b, l (bags) or c, k (ragged);
      the others are symbolic (what `export` lowers for).
    shardings: (the table's, every other argument's) placement, or None.
  """
  names = ("v", "d", "n", "b", "l", "c", "k")
  dims = dict(zip(names, jax.export.symbolic_shape(", ".join(names))))
  v, d, n, b, l, c, k = ({**dims, **(sizes or {})}[x] for x in names)
  on_table, elsewhere = shardings
  sds = lambda shape, dtype, s=elsewhere: jax.ShapeDtypeStruct(shape, dtype, sharding=s)
  table = sds((v, d), jnp.dtype(p.dtype), on_table)
  keys = (sds((n,), jnp.uint32), sds((n,), jnp.uint32), sds((n,), jnp.int32)) if p.dynamic else ()
  tail, id_dtype = ((2,), jnp.uint32) if p.dynamic else ((), jnp.int32)
  head = (table, keys, sds((), jnp.int32))
  if form == "bags":
    return *head, sds((b, l, *tail), id_dtype), sds((b, l), jnp.float32)
  s = p.num_shards
  return *head, sds((s, c, *tail), id_dtype), sds((s, k), jnp.int32), sds((s, c), jnp.float32)


def export(p: FeatureProgram, form: str) -> bytes:
  """The `jax.export` program of one kind of feature and form, for
  `PLATFORMS`, serialized and compressed (zlib: its StableHLO bytecode,
  shape checks and locations shrink to about 40%)."""
  fn = {"bags": lookup_bags, "ragged": lookup_ragged}[form]
  exported = jax.export.export(jax.jit(functools.partial(fn, p)), platforms=PLATFORMS)(
    *arg_shapes(p, form)
  )
  return zlib.compress(bytes(exported.serialize()), 9)


def deserialize(data: bytes) -> jax.export.Exported:
  """The inverse of `export`."""
  return jax.export.deserialize(bytearray(zlib.decompress(data)))


def custom_calls(exported: jax.export.Exported) -> list[str]:
  """The custom calls of an exported program's StableHLO, but jax.export's
  own `shape_assertion`s (the checks of its symbolic shapes, resolved when
  the program is refined for a call's shapes): none for the lookup, which
  runs on any XLA backend with no kernel or library of ours."""
  targets = re.findall(r"custom_call @(\w+)", exported.mlir_module())
  return [t for t in targets if t != "shape_assertion"]


def sentinel_keys() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """One map entry that no id reaches (the padding key, which `translate`
  answers first): appended to every map, so a map of no resident id still
  has a size (a symbolic size is at least 1)."""
  pad = np.array([PAD_WORD], np.uint32)
  return pad, pad, np.array([NO_ROW], np.int32)
