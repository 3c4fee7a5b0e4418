"""Where global arrays go, on meshes with Auto or with Explicit axes.

A mesh axis is Auto (`jax.sharding.Mesh(...)`'s default: XLA's partitioner
propagates shardings) or Explicit (`jax.make_mesh`'s default: every array's
sharding is part of its type, and JAX refuses an op whose result sharding it
cannot infer, e.g. a gather of rows across shards or a reshape that splits
the sharded dimension). Every placement and every op of the library on
global sharded arrays outside `shard_map` goes through the two functions
here, so that both kinds of mesh take the same code path everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import AxisType, NamedSharding


def is_explicit(sharding: NamedSharding) -> bool:
  """Whether arrays placed at `sharding` carry it in their type: some axis
  of its mesh is Explicit and its spec names no Auto axis (a mesh may mix
  both kinds)."""
  mesh = sharding.mesh
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  named = [a for part in sharding.spec if part is not None for a in jax.tree.leaves(part)]
  explicit = lambda a: types[a] == AxisType.Explicit
  return any(map(explicit, types)) and all(map(explicit, named))


def place(tree, sharding: NamedSharding):
  """Every array of `tree` placed at `sharding` (inside `jax.jit`).

  Explicit axes need `jax.reshard` (a sharding constraint does not change
  an array's type), Auto axes a sharding constraint.
  """
  if is_explicit(sharding):
    return jax.tree.map(lambda x: jax.reshard(x, sharding), tree)
  return jax.lax.with_sharding_constraint(tree, sharding)


def rearrange(fn: Callable, sharding: NamedSharding) -> Callable:
  """`fn` over global arrays, every result placed at `sharding`.

  For ops that move data across shards (gathers of rows, reshapes of the
  sharded dimension): under Explicit axes `fn` runs with the axes made Auto
  (`jax.sharding.auto_axes`) and XLA's partitioner places its intermediate
  values, as it does on an Auto mesh.
  """

  def call(*args):
    if not is_explicit(sharding):
      return place(fn(*args), sharding)
    # The results' structure, traced without shardings (the sharded trace is
    # what Explicit axes refuse).
    shapes = jax.eval_shape(
      fn, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    )
    out = jax.tree.map(lambda _: sharding, shapes)
    return jax.sharding.auto_axes(fn, out_sharding=out)(*args)

  return call
