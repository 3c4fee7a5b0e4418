"""The async pipeline's part of a checkpoint: the pending update and the
started lookup, saved in batch order, restored as they were or applied.

A checkpoint of the async pipeline holds the deferred gradient of its last
step (the reference flushes it before a checkpoint and never saves it), per
logical table and feature: the (B, L, dim) token gradients and the (B, L)
row of the table each token's gradient updates (-1: none), and the (B, dim)
or (B, L, dim) embeddings of the started lookup of the next batch. None of
it depends on the device count or on how tables are stacked.

A trainer of the same pipeline and batch shapes restores both as they were
(`restore_as_saved`): routing plans are planned again on its mesh from the
batch at the data position, so a run restored onto the same mesh continues
bit for bit. Any other trainer (another batch size, the sync or the exact
pipeline) gets the tables with the saved update applied, as `Trainer.flush`
would have applied it at that step, and starts its own lookup of the batch
at the data position (`restore_flushed`): it continues as a run that flushed
at that step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import async_emb, placement, programs, tokens
from pallas_emb.capacity import Capacities
from pallas_emb.embedding import ShardedEmbedding
from sharding.layout import round_up


# Token arrays between the mesh's device order and per-feature arrays, both
# row-sharded (`sharding`).
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _to_features(x, names, shapes, num_shards, sharding):
  fn = lambda x: tokens.from_device_order(x, names, shapes, num_shards)
  return placement.rearrange(fn, sharding)(x)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _to_devices(per_feature, names, num_shards, sharding):
  fn = lambda x: tokens.to_device_order(x, names, num_shards)
  return placement.rearrange(fn, sharding)(per_feature)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _saved_ids(rows, pending, offsets, names, shapes, num_shards, sharding):
  """Each feature's (B, L) ids of its own table that the update applies."""
  per_feature = _to_features(rows, names, shapes, num_shards, sharding)
  return {
    n: jnp.where(pending & (per_feature[n] >= 0), per_feature[n] - o, -1)
    for n, o in zip(names, offsets)
  }


def token_layout(features, batch_shapes: Mapping[str, Any]):
  """(feature names, their (B, L)) of a table's token order, as static
  tuples."""
  names = tuple(f.name for f in features)
  return names, tuple(tuple(int(v) for v in batch_shapes[n]) for n in names)


def _group(emb: ShardedEmbedding, name: str):
  return next(g for g in emb.groups if g.name == name)


def members(emb: ShardedEmbedding, name: str) -> tuple[str, ...]:
  """The logical tables stored in physical table `name`."""
  return tuple(t.name for t in _group(emb, name).tables)


def per_table(emb: ShardedEmbedding, name: str, per_feature: Mapping) -> dict:
  """Feature -> value of physical table `name` -> logical table ->
  feature -> value."""
  return {
    t: {f.name: per_feature[f.name] for f in emb.logical_features(t)} for t in members(emb, name)
  }


def _table_of(emb: ShardedEmbedding) -> dict[str, str]:
  return {f.name: f.table for f in emb.features}


def save_items(trainer, state, batch_shapes: Mapping[str, Any]) -> tuple[dict, dict]:
  """(pending, lookup_acts): logical table -> feature -> what a checkpoint
  saves of `state`'s pipeline (empty for the sync pipeline)."""
  emb = trainer.emb
  pending, lookup_acts = {}, {}
  table_of = _table_of(emb)
  for name, ctx in trainer.contexts:
    names, shapes = token_layout(ctx.features, batch_shapes)
    update = state.pending[name]
    grads = _to_features(update.grads, names, shapes, ctx.group_size, emb.sharding())
    group = _group(emb, name)
    rows = programs.token_rows(ctx.sharded_table, update.segment_ids, update.unique_tokens)
    offsets = tuple(group.offset(table_of[n]) for n in names)
    ids = _saved_ids(rows, update.pending, offsets, names, shapes, ctx.group_size, emb.sharding())
    for t, g in per_table(emb, name, grads).items():
      pending[t] = {"pending": update.pending, "grads": g, "ids": {n: ids[n] for n in g}}
    # The started lookup's embeddings are saved rather than recomputed on
    # restore, so a resumed run is bit-identical whatever XLA fuses them
    # into.
    lookup_acts.update(per_table(emb, name, state.lookups[name].acts))
  return pending, lookup_acts


def _abstract(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def device_targets(trainer, template, batch_shapes: Mapping[str, Any]) -> tuple[dict, dict]:
  """(pending, lookup_acts) restore targets on this trainer's mesh, for a
  checkpoint of its own pipeline and batch shapes (`restore_as_saved`)."""
  emb = trainer.emb
  pending, lookup_acts = {}, {}
  for name, ctx in trainer.contexts:
    names, shapes = token_layout(ctx.features, batch_shapes)
    grads = {
      n: jax.ShapeDtypeStruct((*shape, ctx.emb_width), jnp.float32, sharding=emb.sharding())
      for n, shape in zip(names, shapes)
    }
    ids = {
      n: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=emb.sharding())
      for n, shape in zip(names, shapes)
    }
    flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=emb.sharding(rows=False))
    for t, g in per_table(emb, name, grads).items():
      pending[t] = {"pending": flag, "grads": g, "ids": {n: ids[n] for n in g}}
    lookup_acts.update(
      per_table(emb, name, jax.tree.map(_abstract, dict(template.lookups[name].acts)))
    )
  return pending, lookup_acts


def restore_as_saved(trainer, tables, item, batch_shapes, batch_at, step, translate=None):
  """(pending, lookups) of a checkpoint of this trainer's own pipeline and
  batch shapes: the saved update, routed again on this mesh from the batch
  at `step - 1` (a dynamic table's from its saved rows), and the saved
  embeddings of the lookup of batch `step` (its ids through `translate`,
  `checkpoint_maps.translator`)."""
  pending, lookups = {}, {}
  if not trainer.contexts:
    return pending, lookups
  pending_batch, next_batch = batch_at(step - 1), batch_at(step)
  next_ids = (translate or (lambda ids: ids))(next_batch["ids"])
  dynamic = set(trainer.emb.dynamic_tables())
  for name, ctx in trainer.contexts:
    logical = members(trainer.emb, name)
    started = async_emb.lookup_start(ctx, tables[name].table, ctx.table_inputs(next_ids))
    lookups[name] = started._replace(
      acts={k: v for t in logical for k, v in item["lookup_acts"][t].items()}
    )
    if trainer.config.exact or step == 0:
      pending[name] = async_emb.empty_gradient_update(ctx)
      continue
    # The members of a stack were saved with the same pending flag.
    flag = item["pending"][logical[0]]["pending"]
    grads = {k: v for t in logical for k, v in item["pending"][t]["grads"].items()}
    names, _ = token_layout(ctx.features, batch_shapes)
    ids = pending_batch["ids"]
    if name in dynamic:  # the rows the update applies, as saved
      saved = item["pending"][name]["ids"]
      ids = {n: jax.device_put(saved[n], trainer.emb.sharding()) for n in names}
    routed = programs.plan(ctx.sharded_table, tuple(ids[n] for n in names))
    pending[name] = async_emb.AsyncEmbGradientUpdate.from_residuals(
      routed,
      _to_devices(grads, names, ctx.group_size, trainer.emb.sharding()),
      flag,
      ctx.identity,
    )
  return pending, lookups


def apply_saved(emb: ShardedEmbedding, tables: dict, saved: Mapping) -> dict:
  """`tables` (physical table -> state, on `emb`'s mesh) with a checkpoint's
  pending updates applied, as `Trainer.flush` applies them: each table
  gated and clipped as in the update, its step advanced if applied.

  `saved`: the checkpoint's "pending" (logical table -> {"ids", "grads"}
  per feature, host arrays of the saved batch shapes). The saved ids are
  routed on this mesh with capacities that drop nothing (the ids dropped
  in the saved run are -1 already), the batch padded with -1 rows to a
  multiple of the shard count.
  """
  table_of, shards = _table_of(emb), emb.num_shards
  tables = dict(tables)
  for group in emb.groups:
    feats = emb.features_of(group.name)
    if not any(table_of[f.name] in saved for f in feats):
      continue
    ids, grads = {}, {}
    for f in feats:
      entry = saved.get(table_of[f.name])
      if entry is None:  # a member the saved run did not look up: nothing
        x, g = np.full((shards, 1), -1, np.int32), np.zeros((shards, 1, group.spec.dim))
      else:
        x, g = np.asarray(entry["ids"][f.name]), np.asarray(entry["grads"][f.name])
      pad = round_up(x.shape[0], shards) - x.shape[0]
      ids[f.name] = np.pad(x, ((0, pad), (0, 0)), constant_values=-1)
      grads[f.name] = np.pad(g, ((0, pad), (0, 0), (0, 0))).astype(np.float32)
    names, shapes = token_layout(feats, {k: v.shape for k, v in ids.items()})
    per_shard = sum(b // shards * l for b, l in shapes)
    t = emb.sharded_table(group.name, per_shard)
    exact = dataclasses.replace(t.spec, unique_capacity=None, route_capacity=per_shard)
    t = dataclasses.replace(t, capacities=Capacities.for_table(exact, t.layout, per_shard))
    put = lambda x: jax.device_put(x, emb.sharding())
    res = programs.plan(t, tuple(put(ids[n]) for n in names))
    token_grads = _to_devices({n: put(grads[n]) for n in names}, names, shards, emb.sharding())
    tables[group.name], _ = programs.apply_token_gradients(
      t, tables[group.name], res, token_grads, True
    )
  return tables


def restore_flushed(trainer, tables, batch_at, step, translate=None):
  """(pending, lookups) after `apply_saved`: nothing pending, and the
  lookup of batch `step` (its ids through `translate`) started on the
  updated tables."""
  pending, lookups = {}, {}
  if trainer.contexts:
    next_ids = (translate or (lambda ids: ids))(batch_at(step)["ids"])
    for name, ctx in trainer.contexts:
      lookups[name] = async_emb.lookup_start(ctx, tables[name].table, ctx.table_inputs(next_ids))
      pending[name] = async_emb.empty_gradient_update(ctx)
  return pending, lookups
