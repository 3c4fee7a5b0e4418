"""One table's kernel calls on one device: the fused update at a step (with
its stochastic-rounding keys), and which form runs it.

Shared by the sharded (`shard_ops`) and replicated (`replicated_ops`)
steps: both call `fused_update` on their owner rows; `kernel_forms` says,
from a table's static shapes alone, which form (`kernels.forms`) its update
and its owners' gather take, for reports (`embedding_forms`, `pod_check`,
the main job's report).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_emb import kernels, packing
from pallas_emb.sharded_table import ShardedTable
from pallas_emb.stacking import members as members_lib


def fused_update(t: ShardedTable, table, slots, step, rows, grads, write, steps=None):
  """`kernels.fused_update` of `t`'s optimizer at `step` on its backend.

  `steps`: a stack's (M,) per-member steps, which key each member's
  stochastic rounding (default `step`)."""
  opt, spec = t.spec.optimizer, t.spec
  return kernels.fused_update(
    table,
    slots,
    rows,
    packing.unpadded(grads, spec.dim),  # routed `route_width` wide
    opt.scalars(step),
    write,
    optimizer=opt,
    dtype=spec.dtype,
    backend=t.backend,
    rounding_keys=rounding_keys(t, step if steps is None else steps, rows)
    if spec.stochastic_rounding
    else None,
    dim=spec.dim,
  )


def rounding_keys(t: ShardedTable, step, rows: jax.Array) -> jax.Array:
  """(C,) uint32 stochastic-rounding keys of local rows `rows`: each keyed
  by what the row is, its table (a stack's member), seed, step and logical
  row, never by where it is stored (shard, stack offset, replica), so that
  every mesh, stacking and backend rounds it alike.

  Args:
    step: () int32, or a stack's (M,) per-member steps.
    rows: (C,) int32 local rows of this device's shard, -1 padding.
  """
  shard = 0 if t.replicated else jax.lax.axis_index(t.axis)
  logical = t.layout.logical_of(shard * t.layout.rows_per_shard + jnp.maximum(rows, 0))
  if t.members is None:
    tag, start = packing.table_tag(t.name), 0
  else:
    member = members_lib.member_of(t.members, logical)
    pick = lambda xs: jnp.asarray(tuple(xs) + (0,), jnp.uint32)[member]
    tag, start = pick(t.members.tags), pick(t.members.starts).astype(jnp.int32)
    step = jnp.concatenate([jnp.asarray(step, jnp.int32).reshape(-1), jnp.zeros((1,), jnp.int32)])
    step = step[jnp.minimum(member, step.shape[0] - 1)]
  key = packing.rounding_key(t.spec.rounding_seed, step, tag)
  return packing.row_rounding_keys(key, logical - start)


def embedding_forms(emb, batch_shapes) -> dict[str, dict[str, str]]:
  """Physical table of a `ShardedEmbedding` -> {"update": form, "gather":
  form} (`kernel_forms`), for a batch of `batch_shapes`: feature ->
  (global batch, ids per example)."""

  def tokens(name):
    return sum(
      batch_shapes[f.name][0] // emb.num_shards * batch_shapes[f.name][1]
      for f in emb.features_of(name)
    )

  return {n: kernel_forms(emb.sharded_table(n, tokens(n))) for n in emb.table_names}


def kernel_forms(t: ShardedTable) -> dict[str, str]:
  """Which form ("block" or "xla", `kernels.forms`) runs `t`'s update and
  its owners' gather on one device, from the shard's shapes and capacities
  alone: what `update_shard` and `lookup_shard` pick when traced ("xla" on
  the "xla" and "native" backends)."""
  spec, caps, rps = t.spec, t.capacities, t.layout.rows_per_shard
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  table = sds(
    packing.table_shape(rps, spec.dim, spec.dtype, rps), packing.storage_dtype(spec.dtype)
  )
  slots = {
    k: sds(s.shape_for(rps, spec.dim, rps), s.dtype) for k, s in spec.optimizer.slot_specs().items()
  }
  kw = dict(dim=spec.dim, dtype=spec.dtype)
  if t.backend not in ("pallas", "interpret"):
    return {"update": "xla", "gather": "xla"}
  return {
    "update": kernels.update_form(t.backend, table, slots, caps.owner, **kw),
    "gather": kernels.gather_form(
      t.backend, table, t.num_shards * caps.route, ascending=t.num_shards == 1, **kw
    ),
  }
