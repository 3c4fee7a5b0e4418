"""Isolated probes: what XLA's cost model charges for one op of a step,
against the bytes that op moves.

`cost_analysis()["bytes accessed"]` sums a charge per instruction of the
compiled step; it is a model, and for some ops it charges more than moves.
A probe compiles the op alone, on the same topology, with the operand the
step's HLO gives it (shape, dtype, and so the same tiled layout), and reads
the charge of that one-op program.

All-to-all: one chip's all-to-all of a B-byte block reads B and writes B
of HBM (3/4 of it crosses the interconnect on 4 chips). On v5e, libtpu
charges an isolated all-to-all of a (107776, 128) float32 block 4B: twice
its operand and twice its result. `net_bytes_accessed` takes that excess
out of the step's figure, op by op.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

_DTYPES = {"f32": "float32", "s32": "int32", "u32": "uint32", "bf16": "bfloat16"}


@functools.cache
def all_to_all_charge(mesh: Mesh, dtype: str, dims: tuple[int, ...]) -> float:
  """XLA's bytes accessed for one all-to-all alone, compiled for `mesh`'s
  chips: per chip an operand of `dims` (the step's HLO shape, split along
  its first dimension, one slice per chip) and `dtype` (an HLO type name
  such as "f32")."""
  axis = mesh.axis_names[0]
  per_chip = (dims[0] * dims[1], *dims[2:])
  dt = jnp.dtype(_DTYPES[dtype])
  x = jax.ShapeDtypeStruct(
    (mesh.size * per_chip[0], *per_chip[1:]), dt, sharding=NamedSharding(mesh, P(axis))
  )
  fn = jax.jit(
    jax.shard_map(
      lambda b: jax.lax.all_to_all(b, axis, 0, 0, tiled=True),
      mesh=mesh,
      in_specs=P(axis),
      out_specs=P(axis),
    )
  )
  cost = fn.trace(x).lower(lowering_platforms=("tpu",)).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["bytes accessed"])


def collective_charges(mesh: Mesh, collectives: list[dict]) -> list[dict]:
  """Per all-to-all of the step (`hlo.collectives`): its operand bytes,
  what moves (read and written once: 2x) and what the isolated op is
  charged."""
  out = []
  for c in collectives:
    probed = (
      c["op"] == "all-to-all"
      and c["dtype"] in _DTYPES
      and c["dimensions"] == (0,)
      and len(c["dims"]) >= 2
      and c["dims"][0] == mesh.size
    )
    if not probed:  # another form than the steps' all-to-alls: left as charged
      continue
    charged = all_to_all_charge(mesh, c["dtype"], tuple(c["dims"]))
    out.append(
      {"name": c["name"], "bytes": c["bytes"], "moved": 2 * c["bytes"], "charged": charged}
    )
  return out


def net_bytes_accessed(bytes_accessed: float, charges: list[dict]) -> float:
  """The step's bytes accessed less each probed op's charge over what it
  moves."""
  return bytes_accessed - sum(max(c["charged"] - c["moved"], 0.0) for c in charges)
