"""The order of one table's ids on each device, written once.

On each device a table's ids are its features' blocks of that device's
examples, each flattened position-major, concatenated in feature order:
feature f's block of shape (b, L) (b = B_f / S) becomes L * b consecutive
tokens, token l * b + e being example e's l-th id (a ragged feature's C ids
are one position of C). Residuals, per-token gradients and pending async
updates follow this order; checkpoints store per-feature arrays instead, so
that a checkpoint depends neither on the number of shards nor on this order.

Per-token arrays of one feature are handled as (L, b, ...) blocks. Why: a
TPU tiles an array's last two dimensions by (8, 128). A (b, L, D) block
whose L is not a multiple of 8 (a history of 20 ids) is not the same bytes
as its (b * L, D) tokens, so every reshape between them copies the whole
token array; (L, b, D) with b a multiple of 8 is. Features of one batch
size are joined along L before the reshape, so that pooling (a sum over L)
reads the gathered token rows in place and the backward's expansion (a
broadcast over L) writes the token array in one pass, with no slice or
concatenation of token-sized arrays between.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

# -- per device (inside shard_map) --------------------------------------------


def flatten(block: jax.Array) -> jax.Array:
  """One feature's (b, L, ...) array -> its (L * b, ...) tokens."""
  return jnp.swapaxes(block, 0, 1).reshape((-1,) + block.shape[2:])


def _runs(widths: Sequence[int]) -> list[tuple[int, int]]:
  """[start, end) of each run of consecutive features of one b."""
  runs, start = [], 0
  for i in range(1, len(widths) + 1):
    if i == len(widths) or widths[i] != widths[start]:
      runs.append((start, i))
      start = i
  return runs


class Factored(NamedTuple):
  """One feature's per-token values as the product `rows[None] *
  weights[..., None]`: a pooled feature's gradient expanded over its bag.

  Kept apart until the table's tokens are assembled, so that a run of them
  is written in one pass (`concat_tokens`), not as a block per feature and
  then a concatenation of token-sized blocks (on a TPU, W-TPU's step moved
  0.09 GB less per chip so).

  Attributes:
    rows: (b, D) float32, one per example (or per ragged id slot).
    weights: (L, b) float32, one per token.
  """

  rows: jax.Array
  weights: jax.Array

  def dense(self) -> jax.Array:
    """The (L, b, D) block."""
    return self.rows[None] * self.weights[..., None]


def _width(block) -> int:
  return (block.weights if isinstance(block, Factored) else block).shape[1]


def _product(run: Sequence[Factored]) -> jax.Array:
  """(sum of L, b, D): position p takes the rows of the feature it falls in
  (a chain of selects on p), times its weight; one elementwise pass."""
  weights = jnp.concatenate([x.weights for x in run])
  position = jax.lax.broadcasted_iota(jnp.int32, (weights.shape[0], 1, 1), 0)
  rows = run[-1].rows[None]
  ends = list(itertools.accumulate(x.weights.shape[0] for x in run))
  for x, stop in zip(reversed(run[:-1]), reversed(ends[:-1])):
    rows = jnp.where(position < stop, x.rows[None], rows)
  return rows * weights[..., None]


def concat_tokens(blocks: Sequence) -> jax.Array:
  """Per-feature (L, b, ...) blocks (or `Factored` values) -> the table's
  (sum of L * b, ...) tokens.

  A run of `Factored` values with some bag longer than one id is written as
  one product (`_product`). Of single ids the blocks are their rows already,
  and a concatenation is as cheap.
  """
  runs = []
  for i, j in _runs([_width(x) for x in blocks]):
    run = blocks[i:j]
    if all(isinstance(x, Factored) for x in run) and any(x.weights.shape[0] > 1 for x in run):
      # Held apart from the reshape: XLA would otherwise move the reshape
      # onto the product's operands and write each broadcast row out.
      block = jax.lax.optimization_barrier(_product(run))
    else:
      block = jnp.concatenate([x.dense() if isinstance(x, Factored) else x for x in run])
    runs.append(block.reshape((-1,) + block.shape[2:]))
  return runs[0] if len(runs) == 1 else jnp.concatenate(runs)


def split_tokens(tokens: jax.Array, shapes: Sequence[tuple[int, int]]) -> list[jax.Array]:
  """The table's (n, ...) tokens -> per feature of the given (b, L) its
  (L, b, ...) block."""
  out, start = [], 0
  for i, j in _runs([b for b, _ in shapes]):
    b, ls = shapes[i][0], [l for _, l in shapes[i:j]]
    run = tokens[start : start + b * sum(ls)].reshape((sum(ls), b) + tokens.shape[1:])
    start += b * sum(ls)
    offsets = [sum(ls[:k]) for k in range(len(ls) + 1)]
    out.extend(run[offsets[k] : offsets[k + 1]] for k in range(len(ls)))
  return out


# -- global arrays --------------------------------------------------------------
# They reshape the sharded dimension: on a mesh with Explicit axes, call them
# through `placement.rearrange`.


def to_device_order(
  per_feature: Mapping[str, jax.Array], names: Sequence[str], num_shards: int
) -> jax.Array:
  """feature -> (B, L, ...) global arrays -> (S * n, ...) in device order."""
  blocks = [per_feature[n] for n in names]
  tail = blocks[0].shape[2:]
  per_device = [
    jnp.swapaxes(x.reshape((num_shards, -1) + x.shape[1:]), 1, 2).reshape((num_shards, -1) + tail)
    for x in blocks
  ]
  return jnp.concatenate(per_device, axis=1).reshape((-1,) + tail)


def from_device_order(
  tokens: jax.Array, names: Sequence[str], shapes: Sequence[tuple[int, int]], num_shards: int
) -> dict[str, jax.Array]:
  """(S * n, ...) in device order -> feature -> (B, L, ...) global arrays."""
  per_device = tokens.reshape((num_shards, -1) + tokens.shape[1:])
  out, start = {}, 0
  for name, (b, l) in zip(names, shapes):
    size = b // num_shards * l
    block = per_device[:, start : start + size].reshape((num_shards, l, -1) + tokens.shape[1:])
    out[name] = jnp.swapaxes(block, 1, 2).reshape((b, l) + tokens.shape[1:])
    start += size
  return out
