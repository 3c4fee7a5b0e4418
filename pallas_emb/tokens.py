"""The order of one table's ids on each device, written once.

On each device a table's ids are its features' blocks of that device's
examples, each flattened, concatenated in feature order: feature f's block
of shape (B_f / S, L_f) becomes B_f / S * L_f consecutive tokens. Residuals,
per-token gradients and pending async updates follow this order; checkpoints
store per-feature arrays instead, so that a checkpoint does not depend on the
number of shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

# -- per device (inside shard_map) --------------------------------------------


def concat_tokens(blocks: Sequence[jax.Array]) -> jax.Array:
  """Per-feature (b, L, ...) blocks -> (sum of b * L, ...) tokens."""
  return jnp.concatenate([x.reshape((-1,) + x.shape[2:]) for x in blocks])


def split_tokens(tokens: jax.Array, shapes: Sequence[tuple[int, int]]) -> list[jax.Array]:
  """(n, ...) tokens -> per-feature (b, L, ...) blocks of the given (b, L)."""
  out, start = [], 0
  for b, l in shapes:
    out.append(tokens[start : start + b * l].reshape((b, l) + tokens.shape[1:]))
    start += b * l
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
  return jnp.concatenate([x.reshape((num_shards, -1) + tail) for x in blocks], axis=1).reshape(
    (-1,) + tail
  )


def from_device_order(
  tokens: jax.Array, names: Sequence[str], shapes: Sequence[tuple[int, int]], num_shards: int
) -> dict[str, jax.Array]:
  """(S * n, ...) in device order -> feature -> (B, L, ...) global arrays."""
  per_device = tokens.reshape((num_shards, -1) + tokens.shape[1:])
  out, start = {}, 0
  for name, (b, l) in zip(names, shapes):
    size = b // num_shards * l
    out[name] = per_device[:, start : start + size].reshape((b, l) + tokens.shape[1:])
    start += size
  return out
