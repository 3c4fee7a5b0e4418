"""Dynamic-vocabulary tables: raw ids -> rows, in one jitted program per
table, before the static path.

A table with `TableSpec(vocabulary=DynamicVocabulary(...))` is stored and
stepped exactly like any other table; what it adds is a translation that
runs first (`admit`): each feature's raw ids, as 64-bit key words
(`pallas_emb.vocabulary.vocab_keys`), become int32 logical rows through the
per-shard id maps (`sharding.id_map`), and the rows given a new id this
step are reset in the same program (the table row to the initializer,
every optimizer slot to its initial value). The rows then go to
`ShardedEmbedding.lookup` / `apply_gradients` unchanged: kernels, the async
pipeline and the metrics of the static path all apply, an id without a row
being an invalid id there (zero row, no update).

The map's state (`VocabState`) is a pytree beside the table states: it
changes only in `admit(train=True)`, which the caller threads through its
step like the tables.

    rows, tables, vocabs, vm = emb.admit(tables, vocabs, {"item": raw_ids})
    acts, res = emb.lookup(tables, rows)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_emb import kernels, packing, programs, stored_rows, threefry
from pallas_emb.capacity import key_capacity
from pallas_emb.errors import InputError, SpecError
from pallas_emb.inputs import ids_of, with_ids
from pallas_emb.kernels.backend import platform_of
from pallas_emb.sharded_table import ShardedTable
from pallas_emb.state import TableState, to_host
from pallas_emb.vocabulary import DynamicVocabulary, raw_ids, vocab_keys
from sharding import id_map, map_slots
from sharding.id_map import IdMap
from sharding.layout import round_up

ROWS, REPLICATED = programs.ROWS, programs.REPLICATED
# Where each field of a map lives: per-slot arrays and the sketch split by
# shard, the step replicated.
MAP_SPECS = IdMap(ROWS, ROWS, ROWS, ROWS, ROWS, REPLICATED)


class VocabState(NamedTuple):
  """A dynamic table's map and the key its new rows are drawn from.

  Attributes:
    map: the `sharding.id_map.IdMap` of every shard (global arrays).
    key: (2,) uint32 key data; a row given a new id at map step t starts
      from `initializer(jax.random.wrap_key_data(new_row_keys(key, [row],
      t)[0]), (dim,), float32)`, its slots from their initial values.
  """

  map: IdMap
  key: jax.Array


class VocabMetrics(NamedTuple):
  """Per-step metrics of a dynamic table (replicated int32 scalars; see
  `sharding.id_map.Translation`): occupancy (rows holding an id after the
  step), inserts, evictions, not_admitted (distinct ids under admit_after),
  failed (admitted ids with no free or evictable slot in their window),
  misses (tokens that got no row)."""

  occupancy: jax.Array
  inserts: jax.Array
  evictions: jax.Array
  not_admitted: jax.Array
  failed: jax.Array
  misses: jax.Array


def init_state(t: ShardedTable, key: jax.Array) -> VocabState:
  """An empty map for `t`, placed on its mesh."""
  v = t.spec.vocabulary
  rps = t.layout.rows_per_shard
  m = id_map.init_map(t.num_shards, rps, v.depth(), v.width_for(rps))
  put = lambda x, s: jax.device_put(x, NamedSharding(t.mesh, P(t.axis) if s == ROWS else P()))
  data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  return VocabState(
    IdMap(*(put(x, s) for x, s in zip(m, MAP_SPECS))),
    jax.device_put(jnp.asarray(data, jnp.uint32), NamedSharding(t.mesh, P())),
  )


# New rows (their table row and slots) are initialised this many at a time,
# for as many chunks as the step inserted: a step inserts a fraction of its
# keys (the drift benchmark: about 700 of 4,096), and on CPU a row's draw
# costs more than the map's step per key. A TPU draws 1,024 rows in about
# the time of 256 (its loop's steps cost more than their rows).
_INIT_CHUNK = {"tpu": 1024}
_INIT_CHUNK_DEFAULT = 256


def new_row_keys(key: jax.Array, rows: jax.Array, step) -> jax.Array:
  """(n, 2) uint32 threefry key data of rows given a new id at map step
  `step`: `key` (2,) uint32 (`VocabState.key`), `rows` (n,) int32 logical
  rows. Word 0 is a bijection of the row, word 1 of the step for a given
  row, so no two (row, step) pairs share a key. Integer mixing, not
  `fold_in`: a fold_in is a threefry hash, which XLA:CPU runs as a loop of
  its own, and a step's new rows would pay for two of them beside the draw.
  The draw itself goes through `pallas_emb.threefry.IMPL`: the bits of a
  default threefry key with this data, in one fused loop on CPU."""
  r = packing.fmix32(rows.astype(jnp.uint32) ^ key[0])
  t = jnp.asarray(step).astype(jnp.uint32) * np.uint32(0x9E3779B9)
  return jnp.stack([r, packing.fmix32(packing.fmix32(key[1] ^ t) ^ r)], axis=-1)


def _reset(t: ShardedTable, table, slots, reset, key, step):
  """This shard's table and slots with the slots in `reset` started afresh."""
  spec, layout = t.spec, t.layout
  rps = layout.rows_per_shard
  me = jax.lax.axis_index(t.axis)
  width = packing.storage_width(spec.dim, spec.dtype)
  chunk = _INIT_CHUNK.get(platform_of(t.mesh.devices.flat), _INIT_CHUNK_DEFAULT)
  # The reset slots come first (`OwnerStep.reset`): chunk c holds new slots
  # c * chunk onwards.
  n = reset.shape[0]
  packed = jnp.pad(reset, (0, round_up(n, chunk) - n), constant_values=-1)
  inserted = jnp.sum(reset >= 0, dtype=jnp.int32)
  specs = spec.optimizer.slot_specs()

  def init_chunk(c, state):
    table, slots = state
    slot = jax.lax.dynamic_slice_in_dim(packed, c * chunk, chunk)
    row = map_slots.slot_rows(layout, me, jnp.maximum(slot, 0))
    at = jnp.where(slot >= 0, row, rps)
    logical = jnp.maximum(layout.logical_of(me * rps + row), 0)
    keys_ = jax.random.wrap_key_data(new_row_keys(key, logical, step), impl=threefry.IMPL)
    rows = jax.vmap(lambda k: spec.initializer(k, (spec.dim,), jnp.float32))(keys_)
    # The table may be stored packed (rows narrower than 128 lanes): write sub-rows.
    new_rows = packing.pack_rows(rows.astype(jnp.float32), spec.dtype)
    table = stored_rows.put_rows(table, at, new_rows, width)
    fresh = {}
    for name, x in slots.items():
      w = specs[name].stored_width(spec.dim)
      init = jnp.full((chunk, w), specs[name].init, x.dtype)  # its pad words too, as `init`
      fresh[name] = stored_rows.put_rows(x, at, init, w)
    return table, fresh

  chunks = (inserted + chunk - 1) // chunk
  return jax.lax.fori_loop(0, chunks, init_chunk, (table, slots))


def _translate_args(t: ShardedTable, tokens: int, train: bool):
  v: DynamicVocabulary = t.spec.vocabulary
  return dict(
    layout=t.layout,
    axis_name=t.axis,
    key_capacity=key_capacity(t.spec, t.num_shards, tokens),
    probe_limit=min(v.probe_limit, t.layout.rows_per_shard),
    admit_after=v.admit_after,
    policy=v.policy,
    evict_on_insert=v.evict_on_insert,
    evict_every=v.evict_every,
    decay=float(v.decay),
    ttl=v.ttl,
    train=train,
    impl=_map_impl(t.backend),
    lane_dense=platform_of(t.mesh.devices.flat) == "tpu",
  )


def _map_impl(backend: str) -> id_map.MapImpl | None:
  impl = kernels.id_map_impl(backend)
  return None if impl is None else id_map.MapImpl(**impl)


def _metrics(tr: id_map.Translation) -> VocabMetrics:
  return VocabMetrics(**{f: getattr(tr, f) for f in VocabMetrics._fields})


def _split(rows, words):
  out, start = [], 0
  for w in words:
    n = int(np.prod(w.shape[:-1]))
    out.append(rows[start : start + n].reshape(w.shape[:-1]))
    start += n
  return tuple(out)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def admit(t: ShardedTable, state: TableState, vs: VocabState, words: tuple[jax.Array, ...]):
  """A training step's translation: (rows per feature, state, vocab state,
  `VocabMetrics`). `state` and `vs` are donated; `words`: per feature of
  `t`, (B, L, 2) uint32 key words."""

  def fn(table, slots, *args):
    m, key, words = IdMap(*args[:6]), args[6], args[7:]
    flat = jnp.concatenate([w.reshape(-1, 2) for w in words])
    step = m.step
    m, tr = id_map.translate(m, flat, **_translate_args(t, flat.shape[0], True))
    table, slots = _reset(t, table, slots, tr.reset, key, step)
    return _split(tr.rows, words), table, slots, m, _metrics(tr)

  rows, table, slots, m, metrics = programs.per_device(
    t,
    fn,
    [ROWS, ROWS, *MAP_SPECS, REPLICATED] + [ROWS] * len(words),
    (ROWS, ROWS, ROWS, MAP_SPECS, REPLICATED),
  )(state.table, state.slots, *vs.map, vs.key, *words)
  return rows, TableState(table, slots, state.step), VocabState(m, vs.key), metrics


@functools.partial(jax.jit, static_argnums=0)
def read(t: ShardedTable, vs: VocabState, words: tuple[jax.Array, ...]):
  """The read-only translation (evaluation, serving): (rows, metrics)."""

  def fn(*args):
    m, words = IdMap(*args[:6]), args[6:]
    flat = jnp.concatenate([w.reshape(-1, 2) for w in words])
    _, tr = id_map.translate(m, flat, **_translate_args(t, flat.shape[0], False))
    return _split(tr.rows, words), _metrics(tr)

  return programs.per_device(t, fn, [*MAP_SPECS] + [ROWS] * len(words), (ROWS, REPLICATED))(
    *vs.map, *words
  )


def as_words(feature: str, x: Any, vocabulary: DynamicVocabulary, num_shards: int):
  """A feature's ids as (..., 2) uint32 key words: raw NumPy ids (or
  strings) are converted on the host (`vocab_keys`, padding -1); uint32
  (..., 2) arrays are taken as words already. Ids are (B, L) or, of a
  `Ragged` input, (S * C,); the first dimension is split over the shards."""
  if isinstance(x, jax.Array) or (isinstance(x, np.ndarray) and x.dtype == np.uint32):
    if x.dtype != jnp.uint32 or x.ndim not in (2, 3) or x.shape[-1] != 2:
      raise InputError(
        f"feature {feature!r}: device ids of a dynamic table must be (B, L, 2) uint32 key "
        f"words, got {x.dtype}{tuple(x.shape)}; convert raw ids with pe.vocab_keys."
      )
    words = x
  else:
    raw = np.asarray(x)
    if raw.ndim not in (1, 2):
      raise InputError(
        f"feature {feature!r}: raw ids must be (B, L) (or a Ragged input's (S * C,)), "
        f"got shape {raw.shape}."
      )
    words = vocab_keys(raw, vocabulary)
  if words.shape[0] % num_shards:
    raise InputError(
      f"feature {feature!r}: batch {words.shape[0]} is not divisible by the {num_shards} "
      "shards; pad the batch with -1 ids."
    )
  return words


def resident(t: ShardedTable, vs: VocabState) -> tuple[np.ndarray, np.ndarray]:
  """(raw ids int64, logical rows int32) of every resident id, by row."""
  m = id_map.IdMap(*(to_host(x) for x in vs.map))
  held = np.flatnonzero(m.last >= 0)
  rows = t.layout.logical_of(map_slots.physical_rows(t.layout, held.astype(np.int64)))
  order = np.argsort(rows, kind="stable")
  words = np.stack([m.key_hi[held], m.key_lo[held]], -1)[order]
  return raw_ids(words, t.spec.vocabulary), rows[order].astype(np.int32)


def check_dynamic(t: ShardedTable) -> None:
  """Refuses a dynamic table stored in a way the maps do not support."""
  if t.members is not None or t.replicated:
    raise SpecError(
      f"table {t.name!r} has a dynamic vocabulary and is stacked or replicated; a dynamic "
      "table is stored alone and row-sharded (placement='sharded', outside stacking groups)."
    )


class DynamicTables:
  """The dynamic-vocabulary methods of `ShardedEmbedding` (a mixin: it uses
  the embedding's `groups`, `sharded_table`, `num_shards` and `check_tables`)."""

  def dynamic_tables(self) -> tuple[str, ...]:
    """The tables with a `DynamicVocabulary`."""
    return tuple(g.name for g in self.groups if g.spec.vocabulary is not None)

  def _dynamic(self, name: str, tokens_per_shard: int = 1) -> ShardedTable:
    if name not in self.dynamic_tables():
      raise InputError(
        f"table {name!r} has no dynamic vocabulary; the dynamic tables are "
        f"{list(self.dynamic_tables())}."
      )
    t = self.sharded_table(name, tokens_per_shard)
    check_dynamic(t)
    return t

  def init_vocabularies(self, key: jax.Array) -> dict[str, VocabState]:
    """Empty maps of every dynamic table: name -> `VocabState`. `key`: the
    PRNG key new rows are drawn from (table i uses `fold_in(key, i)`)."""
    names = [t.name for t in self.tables]
    return {
      n: init_state(self._dynamic(n), jax.random.fold_in(key, names.index(n)))
      for n in self.dynamic_tables()
    }

  def _words(self, ids: Mapping[str, Any]) -> dict[str, tuple]:
    """Table -> per-feature key words, every feature of each table given."""
    out = {}
    for name in self.dynamic_tables():
      feats = self.features_of(name)
      given = [f.name for f in feats if f.name in ids]
      if not given:
        continue
      if len(given) != len(feats):
        raise InputError(
          f"dynamic table {name!r} is read by features {[f.name for f in feats]}, but only "
          f"{given} were given; pass the ids of every feature of the table."
        )
      vocab = self.table_spec(name).vocabulary
      out[name] = tuple(
        as_words(f.name, ids_of(ids[f.name]), vocab, self.num_shards) for f in feats
      )
    unknown = set(ids) - {f.name for n in out for f in self.features_of(n)}
    if unknown:
      raise InputError(
        f"features {sorted(unknown)} do not read a dynamic table; pass them to lookup directly."
      )
    return out

  def _tokens(self, words) -> int:
    return sum(int(np.prod(w.shape[:-1])) for w in words) // self.num_shards

  def admit(self, tables, vocabs, ids: Mapping[str, Any]):
    """A training step's raw ids -> rows: admits, inserts and evicts.

    Args:
      tables: name -> `TableState` (the dynamic ones are donated: rows given
        a new id are reset in them).
      vocabs: name -> `VocabState` (donated).
      ids: feature -> (B, L) raw ids (NumPy int64 or strings, -1 padding)
        or (B, L, 2) uint32 key words (`pe.vocab_keys`), or a `Weighted` or
        `Ragged` input of them, for every feature of the dynamic tables
        stepped.

    Returns:
      (rows, tables, vocabs, metrics): feature -> the same input form with
      int32 logical rows for ids, for `lookup` (-1 padding, -2 no row: an
      invalid id there); the new states; table -> `VocabMetrics`.
    """
    words = self._words(ids)
    self.check_tables(tables, words)
    tables, vocabs, rows, metrics = dict(tables), dict(vocabs), {}, {}
    for name, w in words.items():
      t = self._dynamic(name, self._tokens(w))
      r, tables[name], vocabs[name], metrics[name] = admit(t, tables[name], vocabs[name], w)
      rows.update({f.name: with_ids(ids[f.name], x) for f, x in zip(t.features, r)})
    return rows, tables, vocabs, metrics

  def read_rows(self, vocabs, ids: Mapping[str, Any]):
    """The read-only `admit` (evaluation, serving): nothing is counted,
    inserted or evicted. Returns (rows, metrics) as `admit`."""
    rows, metrics = {}, {}
    for name, w in self._words(ids).items():
      t = self._dynamic(name, self._tokens(w))
      r, metrics[name] = read(t, vocabs[name], w)
      rows.update({f.name: with_ids(ids[f.name], x) for f, x in zip(t.features, r)})
    return rows, metrics

  def resident_ids(self, vocabs, name: str) -> np.ndarray:
    """(n,) int64 raw ids holding a row of dynamic table `name`, in
    ascending row order (strings: their FNV-1a-64 fingerprints); see
    `resident_rows` for the rows."""
    return resident(self._dynamic(name), vocabs[name])[0]

  def resident_rows(self, vocabs, name: str) -> tuple[np.ndarray, np.ndarray]:
    """((n,) int64 raw ids, (n,) int32 their logical rows), by row."""
    return resident(self._dynamic(name), vocabs[name])
