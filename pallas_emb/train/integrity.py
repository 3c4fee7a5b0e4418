"""Checksums of saved arrays, and the seal on a checkpoint's metadata.

A checkpoint's metadata holds one checksum per saved array (the tables, the
slots, the dense state and the pending update) and a digest of the metadata
itself; restore recomputes both from what it read back.

The checksum of an array is two sums, modulo 2**32, over its bits as 32-bit
words w_i in C order (16- and 8-bit elements widened, 64-bit ones split):

    s1 = sum(w_i),   s2 = sum((2 i + 1) * w_i)

A flipped bit changes s1 and s2 (2 i + 1 is odd), and moving a value changes
s2. Integer sums do not depend on the order of the additions, so a sharded
array is summed where it lies, by its own devices, in parallel (nothing
table-sized reaches the host), and NumPy's sum of the same array read back to
the host is the same number.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_MASK = 0xFFFFFFFF
# Words summed at a time on the host: bounds the uint64 temporaries.
_HOST_CHUNK = 1 << 22


def path_name(path) -> str:
  """A pytree key path as "a/0/b": the same for dicts, sequences and named
  tuples, as orbax's metadata tree names them."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _host_words(x: np.ndarray) -> np.ndarray:
  x = np.ascontiguousarray(x)
  if x.dtype == np.bool_ or x.dtype.itemsize == 1:
    return x.view(np.uint8).reshape(-1).astype(np.uint32)
  if x.dtype.itemsize == 2:
    return x.view(np.uint16).reshape(-1).astype(np.uint32)
  return x.view(np.uint32).reshape(-1)


def host_checksum(x) -> str:
  """The checksum of a host array, as 16 hex digits."""
  words = _host_words(np.asarray(x))
  s1 = s2 = 0
  for start in range(0, words.size, _HOST_CHUNK):
    w = words[start : start + _HOST_CHUNK].astype(np.uint64)
    odd = 2 * np.arange(start, start + w.size, dtype=np.uint64) + 1
    # uint64 arithmetic wraps modulo 2**64, which keeps it exact mod 2**32.
    s1 += int(w.sum())
    s2 += int((w * (odd & np.uint64(_MASK))).sum())
  return f"{s1 & _MASK:08x}{s2 & _MASK:08x}"


def _device_words(x: jax.Array) -> jax.Array:
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  size = np.dtype(x.dtype).itemsize
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if size < 4:
    narrow = jnp.uint8 if size == 1 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: (..., 2)


def _device_sums(x: jax.Array) -> jax.Array:
  """(2,) uint32 sums of one array, traced (see the module docstring)."""
  w = _device_words(x)
  index = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for d in reversed(range(w.ndim)):
    index += jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride & _MASK)
    stride *= w.shape[d]
  odd = 2 * index + 1
  return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * odd, dtype=jnp.uint32)])


@jax.jit
def _all_device_sums(leaves: tuple[jax.Array, ...]) -> jax.Array:
  return jnp.stack([_device_sums(x) for x in leaves])


def checksums(tree: Any) -> dict[str, str]:
  """Path name -> checksum of every array leaf of `tree`.

  Device arrays are summed on their devices, one jitted program per set of
  devices (with several processes every process takes part and gets the
  same result); host arrays by NumPy.
  """
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  out, groups = {}, {}
  for p, x in leaves:
    if isinstance(x, jax.Array):
      groups.setdefault(frozenset(x.sharding.device_set), []).append((path_name(p), x))
    else:
      out[path_name(p)] = host_checksum(x)
  for group in groups.values():
    sums = _all_device_sums(tuple(x for _, x in group))
    sums = np.asarray(sums.addressable_data(0))
    for (name, _), (s1, s2) in zip(group, sums):
      out[name] = f"{int(s1):08x}{int(s2):08x}"
  return out


def mismatches(saved: Mapping[str, str], tree: Any) -> list[str]:
  """Why the arrays of `tree` are not the ones whose checksums are `saved`
  (empty when they are)."""
  got = checksums(tree)
  problems = [f"array {k!r} is missing" for k in sorted(set(saved) - set(got))]
  problems += [f"array {k!r} was not saved" for k in sorted(set(got) - set(saved))]
  problems += [
    f"array {k!r} reads back with checksum {got[k]}, but {saved[k]} was saved"
    for k in sorted(saved)
    if k in got and got[k] != saved[k]
  ]
  return problems


def _digest(meta: Mapping[str, Any]) -> str:
  body = {k: v for k, v in meta.items() if k != "digest"}
  text = json.dumps(body, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def seal(meta: Mapping[str, Any]) -> dict:
  """`meta` (JSON-serialisable) with the digest of its contents added."""
  return {**meta, "digest": _digest(meta)}


def seal_problem(meta: Any) -> str | None:
  """Why `meta` is not as sealed, or None if it is."""
  if not isinstance(meta, dict) or "digest" not in meta:
    return "its metadata has no digest"
  if meta["digest"] != _digest(meta):
    return "its metadata does not match its digest"
  return None
