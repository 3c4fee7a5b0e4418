"""Gradient norms that cannot overflow, and the gate and clip of an update.

Every norm of the library is computed here: a table's over all devices
(`global_norm`), each member's of a stacked table (`member_norms`), a
replicated table's (`local_norm`), and one over several tables
(`combine_norms`). `gate_and_clip` turns a norm into the update's decision:
apply or skip, and by how much to scale the gradients.

Why rescaling: squaring overflows float32 once a norm passes ~1.8e19 although
every element is finite (and underflows below ~1e-19). Dividing the elements
by a power of two (`pow2_floor`) moves exponents only, so it is exact, and a
non-finite element still gives a non-finite norm, which skips the update.

The functions with an `axis` run inside `shard_map` on one device's block;
the others on any array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Below this square sum (or when it is not finite) a norm is recomputed
# rescaled: squares of elements near 1e-19 lose bits to underflow.
_SAFE_SQUARE_SUM = 2.0**-60


def pow2_floor(peak: jax.Array) -> jax.Array:
  """The largest power of two <= `peak` (> 0 and finite), else 1.

  The exponent bits of `peak` alone: exact, unlike float32 exp2/log2,
  which flush to zero near the smallest normal.
  """
  scale = jax.lax.bitcast_convert_type(
    jax.lax.bitcast_convert_type(peak, jnp.uint32) & jnp.uint32(0x7F800000), jnp.float32
  )
  return jnp.where(jnp.isfinite(peak) & (scale > 0), scale, 1.0)


def global_norm(x: jax.Array, axis: str) -> jax.Array:
  """() L2 norm of `x` over all devices of `axis`.

  One pass squares and sums. Only when that sum over- or underflows, decided
  on the replicated sum (every device takes the same branch), a second
  computation first divides by the largest power of two <= the global max |x|.
  """
  sq = jax.lax.psum(jnp.sum(x * x), axis)

  def rescaled():
    scale = pow2_floor(jax.lax.pmax(jnp.max(jnp.abs(x), initial=0.0), axis))
    scaled = x / scale
    return scale * jnp.sqrt(jax.lax.psum(jnp.sum(scaled * scaled), axis))

  safe = jnp.isfinite(sq) & (sq > _SAFE_SQUARE_SUM)
  return jax.lax.cond(safe, lambda: jnp.sqrt(sq), rescaled)


def member_norms(x: jax.Array, member: jax.Array, num: int, axis: str) -> jax.Array:
  """(num,) L2 norm of each member's rows of `x` over all devices of `axis`.

  Args:
    x: (C, D) this device's rows.
    member: (C,) int32 member of each row; `num` for rows of no member.
    num: the number of members.
  """
  row_peak = jnp.max(jnp.abs(x), axis=1, initial=0.0)
  peak = jax.lax.pmax(
    jnp.maximum(jax.ops.segment_max(row_peak, member, num_segments=num), 0.0), axis
  )
  # A NaN row may not survive segment_max; its square still reaches the sum.
  scale = pow2_floor(peak)
  scaled = x / jnp.concatenate([scale, jnp.ones((1,))])[member][:, None]
  sums = jax.ops.segment_sum(jnp.sum(scaled * scaled, axis=1), member, num_segments=num)
  return scale * jnp.sqrt(jax.lax.psum(sums, axis))


def local_norm(x: jax.Array) -> jax.Array:
  """() L2 norm of `x`, where one device holds all of it."""
  scale = pow2_floor(jnp.max(jnp.abs(x), initial=0.0))
  scaled = x / scale
  return scale * jnp.sqrt(jnp.sum(scaled * scaled))


def combine_norms(norms: jax.Array) -> jax.Array:
  """() sqrt(sum of squares) of (T,) norms, scaled by the largest."""
  peak = jnp.max(norms)
  safe = jnp.where(jnp.isfinite(peak) & (peak > 0), peak, 1.0)
  return jnp.where(jnp.isfinite(peak), safe * jnp.sqrt(jnp.sum((norms / safe) ** 2)), peak)


def gate_and_clip(
  norm: jax.Array, gate: jax.Array, has_rows: jax.Array, *, clip=None, max_norm: float | None = None
):
  """Whether an update applies, and the scale of its gradients.

  Args:
    norm: the update's gradient norm: () for a table, (M,) per member.
    gate: bool scalar; False skips the update.
    has_rows: like `norm`: some id has a row (an update of nothing is not
      applied, and does not advance the step).
    clip: None, or (max_norm, clip_norm) float32 scalars of a clipping over
      several tables (`ShardedEmbedding.apply_gradients(max_global_norm=)`).
    max_norm: without `clip`, the table's own `max_grad_norm` (None: no
      clipping): then clip_norm is `norm` itself.

  Returns:
    (apply, scale): apply is False where the norm (or clip_norm) is not
    finite, the gate is closed or there are no rows; scale is max_norm /
    clip_norm where clip_norm exceeds max_norm, else 1 (None without any
    clipping, so that the gradients are not touched).
  """
  apply = jnp.isfinite(norm) & gate & has_rows
  if clip is None and max_norm is not None:
    clip = (jnp.float32(max_norm), norm)
  if clip is None:
    return apply, None
  limit, clip_norm = clip
  finite = jnp.isfinite(clip_norm)
  scale = jnp.where(clip_norm > limit, limit / jnp.where(finite, clip_norm, 1.0), 1.0)
  return apply & finite, scale
