"""Threefry-2x32 as a JAX PRNG implementation that XLA:CPU runs fused.

JAX lowers its threefry hash on CPU as a rolled loop (five iterations, each
copying its carried arrays), and a dynamic table pays for it on every row
given a new id: drawing 256 rows of 16 values took 135 us on CPU, where the
same hash written out, one elementwise chain that XLA fuses into one loop,
takes 40 us (768 rows: 203 against 51 us).

`IMPL` is that hash. Its keys are threefry keys ((2,) uint32 data) and its
bits are, for any shape, the bits `jax.random.bits` gives a default-impl
key with the same data under `jax_threefry_partitionable` (JAX's default):
element i of a draw is threefry2x32(key, (i >> 32, i & 0xFFFFFFFF)), its two
words xored (32 bits and fewer) or concatenated (64). So an initializer
called with `jax.random.wrap_key_data(data, impl=IMPL)` returns what it
would with `jax.random.wrap_key_data(data)`, bit for bit. Seeding, split
and fold_in are the default impl's own functions (the same keys, JAX's
loop): a row's initializer draws, it rarely splits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import random as jex_random

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotl(x, d: int):
  return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


def hash2x32(k1, k2, x1, x2):
  """Threefry-2x32 (20 rounds) of the counter words (x1, x2) under the key
  (k1, k2), all uint32 and broadcastable: the two output words."""
  ks = (k1, k2, k1 ^ k2 ^ _PARITY)
  x1, x2 = x1 + ks[0], x2 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x1 = x1 + x2
      x2 = _rotl(x2, r) ^ x1
    x1 = x1 + ks[(i + 1) % 3]
    x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x1, x2


def _random_bits(key, bit_width: int, shape):
  size = math.prod(shape)
  if size >= 2**32:
    raise ValueError(
      f"pallas_emb.threefry draws fewer than 2**32 values at once, got shape {shape}; "
      "draw with a default-impl key instead."
    )
  low = jax.lax.iota(jnp.uint32, size).reshape(shape)
  b1, b2 = hash2x32(key[0], key[1], jnp.zeros_like(low), low)
  if bit_width == 64:
    return (b1.astype(jnp.uint64) << np.uint64(32)) | b2.astype(jnp.uint64)
  dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bit_width]
  return (b1 ^ b2).astype(dtype)


_DEFAULT = jex_random.threefry_prng_impl

IMPL = jex_random.define_prng_impl(
  key_shape=(2,),
  seed=_DEFAULT.seed,
  split=_DEFAULT.split,
  random_bits=_random_bits,
  fold_in=_DEFAULT.fold_in,
  name="pallas_emb_threefry2x32",
  tag="pe_fry",
)
