"""How one feature's rows pool into its output, and its gradient back.

Runs per device, inside `shard_map` (called by `shard_ops`), on one data
shard's block of a feature in any input form (`pallas_emb.inputs`): padded
(b, L) ids, `Weighted` ids, or a `Ragged` block of C ids and b bag lengths.

Pooling is `combiner(sum_i w_i * row_i)` over a bag, with w_i the id's
weight (1 when none is given) times 1 if the id got a row, else 0 (padding,
invalid and capacity-dropped ids weigh nothing). "mean" divides by the bag's
sum of w, "sqrtn" by sqrt(sum of w^2). A bag whose sum (or sum of squares) is
0 pools to a zero row and gets zero gradients: no NaN, by definition (with
negative weights a "mean" bag can sum to 0; that bag is treated as empty).

The lookup keeps each feature's per-token weights for the backward
(`TableResiduals.weights`): a plain (b, L) array for padded ids (so the
"sum" backward can skip a token-sized multiply), a `BagWeights` for the
other forms.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_emb.inputs import Ragged, Weighted
from pallas_emb.tokens import Factored, flatten


class BagWeights(NamedTuple):
  """Per-token combiner weights of a weighted or ragged feature.

  Attributes:
    weights: (b, L) (weighted) or (C,) (ragged) float32.
    bags: None (weighted), or (C,) int32 bag of each token; b where a slot
      holds no id of any bag.
    lengths: None, or the (b,) int32 lengths of the ragged bags.
  """

  weights: jax.Array
  bags: jax.Array | None = None
  lengths: jax.Array | None = None


def ragged_bags(lengths: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
  """(b,) bag lengths -> ((C,) bag of each id slot, () ids dropped).

  Slot p belongs to the bag whose running length first exceeds p; slots
  past the shard's total (or past C) belong to none (bag b).
  """
  ends = jnp.cumsum(lengths.astype(jnp.int32))
  slot = jnp.arange(capacity, dtype=jnp.int32)
  bags = jnp.searchsorted(ends, slot, side="right").astype(jnp.int32)
  dropped = jnp.maximum(ends[-1] - capacity, 0)
  return bags, dropped


def token_ids(x: Any) -> tuple[jax.Array, jax.Array]:
  """A feature block -> ((n,) int32 ids in token order (`tokens`), () ids
  dropped).

  Ragged slots past the shard's total length read as padding (-1), so an
  id left in them cannot be looked up.
  """
  if isinstance(x, Ragged):
    bags, dropped = ragged_bags(x.lengths, x.ids.shape[0])
    return jnp.where(bags < x.lengths.shape[0], x.ids, -1), dropped
  ids = x.ids if isinstance(x, Weighted) else x
  return flatten(ids), jnp.zeros((), jnp.int32)


def _normalize(w, combiner, bag_sum, to_tokens):
  """Divides per-token weights by their bag's norm; zero for a zero norm."""
  if combiner == "mean":
    norm = to_tokens(bag_sum(w))
    return jnp.where(norm != 0, w / jnp.where(norm != 0, norm, 1.0), 0.0)
  if combiner == "sqrtn":
    sq = to_tokens(bag_sum(w * w))
    return jnp.where(sq > 0, w * jax.lax.rsqrt(jnp.where(sq > 0, sq, 1.0)), 0.0)
  return w


def _sum_positions(x: jax.Array) -> jax.Array:
  """(L, b, D) -> (b, D), the sum over L, as a (1, L) x (L, b * D) product.

  Why not `jnp.sum(x, axis=0)`: XLA:CPU hands a reduce over the major axis,
  with the dense layer it feeds, to XNNPACK, and a whole step with a 20-id
  history took 1.5 times as long (1.9 times with 100 ids) as with this
  product, which reads x once on every backend.
  """
  l, b, d = x.shape
  ones = jnp.ones((1, l), x.dtype)
  return jnp.dot(ones, x.reshape(l, b * d), precision="highest").reshape(b, d)


def pool(x: Any, rows: jax.Array, has_row: jax.Array, combiner, bags: jax.Array | None = None):
  """One feature's output from its token rows.

  Args:
    x: the feature block (its input form and weights).
    rows: (L, b, D) the feature's token rows (`tokens`; (1, C, D) when
      ragged), zero where no row.
    has_row: (L, b) (or (1, C)) bool, True where the id got a row.
    combiner: the feature's combiner (None: a sequence of padded ids).
    bags: of a ragged block, its (C,) bag of each slot if the caller has
      it (`ragged_bags`, or the serving program's form of it), else None.

  Returns:
    (output, weights): (b, D) float32 (or (b, L, D) for a sequence); the
    residual weights for `expand`.
  """
  w = has_row.T.astype(jnp.float32)
  if isinstance(x, Ragged):
    w = w[:, 0] if x.weights is None else w[:, 0] * x.weights.astype(jnp.float32)
    b = x.lengths.shape[0]
    if bags is None:
      bags, _ = ragged_bags(x.lengths, w.shape[0])
    bag_sum = lambda v: jax.ops.segment_sum(v, bags, num_segments=b, indices_are_sorted=True)
    w = _normalize(w, combiner, bag_sum, lambda v: jnp.take(v, bags, mode="fill", fill_value=0))
    return bag_sum(rows[0] * w[:, None]), BagWeights(w, bags, x.lengths)
  if isinstance(x, Weighted):
    w = w * x.weights.astype(jnp.float32)
  if combiner is None:
    return jnp.swapaxes(rows, 0, 1), w  # sequences: validated unweighted
  w = _normalize(w, combiner, lambda v: jnp.sum(v, axis=1, keepdims=True), lambda v: v)
  out = _sum_positions(rows * w.T[..., None])
  return out, (BagWeights(w) if isinstance(x, Weighted) else w)


def expand(grads: jax.Array, w: Any, combiner):
  """Gradient w.r.t. one feature's output -> its per-token gradients: an
  (L, b, D) block (`tokens`; (1, C, D) when ragged), as a `Factored`
  product except for a sequence."""
  grads = grads.astype(jnp.float32)
  if isinstance(w, BagWeights):
    if w.bags is not None:
      per_token = jnp.take(grads, w.bags, axis=0, mode="fill", fill_value=0)
      return Factored(per_token, w.weights[None])
    return Factored(grads, w.weights.T)
  if combiner is None:
    return jnp.swapaxes(grads, 0, 1)
  if combiner == "sum":
    # The weights are 1 for every id that has a row and 0 for the others,
    # whose slot is -1 anyway: ones spare the product reading them.
    return Factored(grads, jnp.ones(w.T.shape, jnp.float32))
  return Factored(grads, w.T)


def output_shape(combiner, w: Any, dim: int) -> tuple[int, ...]:
  """The (global) lookup output shape of a feature from its residual
  weights: (B, dim) pooled, (B, L, dim) a sequence."""
  if isinstance(w, BagWeights):
    w = w.weights if w.lengths is None else w.lengths[:, None]
  if combiner is None:
    return (*w.shape, dim)
  return (w.shape[0], dim)
