"""Gradient norms that cannot overflow, and the gate and clip of an update.

Every norm of the library is computed here: a table's over all devices
(`global_norm`), each member's of a stacked table (`member_norms`), a
replicated table's (`local_norm`), and one over several tables
(`combine_norms`). `gate_and_clip` turns a norm into the update's decision:
apply or skip, and by how much to scale the gradients.

Why three sums: squaring overflows float32 once a norm passes ~1.8e19 although
every element is finite (and underflows below ~1e-19). So one pass over the
gradients sums three squares of each element: as it is, and scaled by 2**-64
and by 2**88 (`_square_sums`). A power-of-two scale moves exponents only,
so it is exact; the norm takes the sum that neither overflowed nor lost bits
to underflow (`_norm_of`), and a non-finite element still gives a
non-finite norm, which skips the update. One read of the gradients, where
rescaling after a max needs two (or a branch that XLA's cost model charges
although it rarely runs).

The functions with an `axis` run inside `shard_map` on one device's block;
the others on any array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# At or above this plain square sum, squares that underflowed (elements
# below ~1e-19) weigh nothing; below it the norm takes the upscaled sum.
_SAFE_SQUARE_SUM = 2.0**-60
# Upscaled, the smallest subnormal's square is normal, and a sum below
# _SAFE_SQUARE_SUM stays below 2**116; downscaled, a sum overflows only
# when the norm itself does.
_UP, _DOWN = 2.0**88, 2.0**-64


def _square_sums(x: jax.Array, axis=None) -> jax.Array:
  """(..., 3) sums over `axis` of x**2, (x * _DOWN)**2 and (x * _UP)**2."""
  return jnp.stack([jnp.sum(jnp.square(x * c), axis=axis) for c in (1.0, _DOWN, _UP)], axis=-1)


def _norm_of(sums: jax.Array) -> jax.Array:
  """The L2 norm from (..., 3) `_square_sums` (summed over devices)."""
  plain, down, up = sums[..., 0], sums[..., 1], sums[..., 2]
  small = jnp.sqrt(up) * (1.0 / _UP)
  large = jnp.sqrt(down) * (1.0 / _DOWN)  # NaN and inf elements land here
  return jnp.where(
    jnp.isfinite(plain) & (plain >= _SAFE_SQUARE_SUM),
    jnp.sqrt(plain),
    jnp.where(plain < _SAFE_SQUARE_SUM, small, large),
  )


def global_norm(x: jax.Array, axis: str) -> jax.Array:
  """() L2 norm of `x` over all devices of `axis`: one pass, one psum."""
  return _norm_of(jax.lax.psum(_square_sums(x), axis))


def member_norms(x: jax.Array, member: jax.Array, num: int, axis: str) -> jax.Array:
  """(num,) L2 norm of each member's rows of `x` over all devices of `axis`.

  Args:
    x: (C, D) this device's rows.
    member: (C,) int32 member of each row; `num` for rows of no member.
    num: the number of members.
  """
  sums = jax.ops.segment_sum(_square_sums(x, axis=1), member, num_segments=num)
  return _norm_of(jax.lax.psum(sums, axis))


def local_norm(x: jax.Array) -> jax.Array:
  """() L2 norm of `x`, where one device holds all of it."""
  return _norm_of(_square_sums(x))


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
