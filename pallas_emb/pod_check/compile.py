"""Compile the main job's training step for a TPU topology, without a TPU.

libtpu compiles for any TPU topology on a CPU host ("deviceless" ahead-of-time
compilation): `jax.experimental.topologies.get_topology_desc` gives abstract
TPU devices, a mesh over them places abstract arguments, and
`jax.jit(...).trace(...).lower(lowering_platforms=("tpu",)).compile()` runs
the full Mosaic and XLA:TPU compilers. What the compiled step reports is
what one chip of that pod would hold and move: `memory_analysis()` (argument,
output, alias and temp bytes per chip), `cost_analysis()` (XLA's cost model)
and the scheduled HLO (`hlo.py` reads collectives, copies and overlap).

The process must be started for it (`env.py`): libtpu reads its environment
when JAX first initialises, so call `compile_step` from
`python -m pallas_emb.pod_check` or another fresh process that imported
`pallas_emb.pod_check.env` first.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_emb import packing, shard_kernels
from pallas_emb.data.base import FeatureInfo
from pallas_emb.errors import ConfigError
from pallas_emb.job.model import build_ranking
from pallas_emb.pod_check import hlo, probes
from pallas_emb.spec import TableSpec
from pallas_emb.train import TrainConfig, make_trainer
from pallas_emb.train.step import _jit_step

AXIS = "x"


@dataclasses.dataclass(frozen=True)
class Workload:
  """The shapes of a training step: tables, features, batch, model.

  Attributes:
    name: for reports.
    features: the categorical features (their tables, vocabularies, bags).
    emb_dim: every table's width.
    dtype: every table's dtype.
    examples_per_chip: the batch is this times the chip count.
    num_dense: dense inputs per example.
    hidden: MLP widths.
    optimizer: the embedding optimizer of every table.
    table_options: table name -> further `TableSpec` arguments (capacities).
    backend: the kernels' backend (None: "pallas" on a TPU mesh).
    dims: table name -> width, where not `emb_dim`.
    stacking: `ShardedEmbedding.stacking`.
  """

  name: str
  features: tuple[FeatureInfo, ...]
  emb_dim: int
  dtype: Any = jnp.float32
  examples_per_chip: int = 4096
  num_dense: int = 0
  hidden: tuple[int, ...] = (128, 64)
  optimizer: Any = None
  table_options: Mapping[str, Mapping] = dataclasses.field(default_factory=dict)
  backend: str | None = None
  dims: Mapping[str, int] = dataclasses.field(default_factory=dict)
  stacking: Any = "auto"


def w_tpu(vocab: int = 1_000_000, dim: int = 128, **kw) -> Workload:
  """One item table: `item` (1 id, sum) and `history` (20 ids, mean)."""
  return Workload(
    "w_tpu",
    (
      FeatureInfo("item", "item", vocab, 1, "sum"),
      FeatureInfo("history", "item", vocab, 20, "mean"),
    ),
    emb_dim=dim,
    **kw,
  )


def main_job(emb_dim: int = 16, **kw) -> Workload:
  """The main job's model on its synthetic click log."""
  from pallas_emb.data.synthetic import SyntheticClickLog  # pylint: disable=g-import-not-at-top

  data = SyntheticClickLog()
  return Workload("main", data.features, emb_dim=emb_dim, num_dense=data.num_dense, **kw)


def dlrm(max_rows: int | None = 20_000, **kw) -> Workload:
  """26 Criteo-shaped tables, D=16..128 (`pallas_emb.data.dlrm`)."""
  from pallas_emb.data.dlrm import DlrmClickLog  # pylint: disable=g-import-not-at-top

  data = DlrmClickLog(max_rows=max_rows)
  return Workload("dlrm", data.features, emb_dim=16, num_dense=data.num_dense, dims=data.dims, **kw)


WORKLOADS = {"w_tpu": w_tpu, "main": main_job, "dlrm": dlrm}


def topology_mesh(topology: str) -> Mesh:
  """A 1-D mesh over every chip of a TPU topology such as "v5e:2x2"."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  try:
    topo = topologies.get_topology_desc(topology, "tpu")
  except Exception as e:  # libtpu missing, or a name it does not know
    raise ConfigError(
      f"cannot describe TPU topology {topology!r} ({type(e).__name__}: "
      f'{e}); install libtpu with `pip install "pallas-emb[tpu]"`, run in '
      "a process started by `python -m pallas_emb.pod_check`, and name a "
      "topology like 'v5e:2x2', 'v6e:2x2' or 'v5p:2x2x1'."
    ) from e
  return Mesh(np.array(topo.devices), (AXIS,))


def _abstract(tree, sharding):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _sharded(tree, mesh):
  """Abstract arrays: batch-like (ndim >= 1) split over the axis, scalars
  replicated, as the training step returns them."""
  rows, rep = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows if x.ndim else rep), tree
  )


def build(topology: str, workload: Workload, pipeline: str = "async"):
  """The trainer and the abstract arguments of one step on `topology`.

  Returns:
    (trainer, state, batch): abstract `TrainState` and batch, placed on the
    topology's mesh as a real run would place them.
  """
  mesh = topology_mesh(topology)
  opt = workload.optimizer
  if opt is None:
    from pallas_emb.optimizers import RowWiseAdagrad  # pylint: disable=g-import-not-at-top

    opt = RowWiseAdagrad(0.05, half_life_steps=None)
  emb, model = build_ranking(
    workload,
    mesh,
    emb_dim=workload.emb_dim,
    optimizer=opt,
    hidden=workload.hidden,
    dtype=workload.dtype,
    backend=workload.backend,
    table_options=workload.table_options,
    stacking=workload.stacking,
  )
  batch_size = workload.examples_per_chip * mesh.size
  rows = NamedSharding(mesh, P(AXIS))
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rows)
  batch = {
    "ids": {f.name: sds((batch_size, f.bag_size), jnp.int32) for f in workload.features},
    "dense": sds((batch_size, workload.num_dense), jnp.float32),
    "label": sds((batch_size,), jnp.float32),
    "weight": sds((batch_size,), jnp.float32),
  }
  config = {
    "async": TrainConfig(use_async_emb=True),
    "exact": TrainConfig(use_async_emb=True, exact=True),
    "sync": TrainConfig(use_async_emb=False),
  }[pipeline]
  trainer = make_trainer(emb, model.loss, optax.adam(1e-3), config, batch)
  replicated = NamedSharding(mesh, P())
  params = _abstract(jax.eval_shape(model.init, jax.random.key(0)), replicated)
  tables = jax.eval_shape(emb.init, jax.random.key(0))
  state = jax.eval_shape(trainer.init, params, tables, batch)
  state = state._replace(
    params=params,
    opt_state=_abstract(state.opt_state, replicated),
    step=_abstract(state.step, replicated),
    # A stack's step is (M,), one per member: replicated like a scalar.
    tables={
      n: t._replace(step=_abstract(t.step, replicated))
      for n, t in _sharded(state.tables, mesh).items()
    },
    pending=_sharded(state.pending, mesh),
    lookups=_sharded(state.lookups, mesh),
  )
  return trainer, state, batch


def floor_bytes(emb, workload: Workload, mesh_size: int) -> int:
  """The least a chip's step can move: each id reads its row in the lookup,
  reads and writes it in the update and brings its gradient, and each
  per-row scalar slot is read and written."""
  total = 0
  for spec in emb.tables:
    ids = sum(
      workload.examples_per_chip * f.bag_size for f in workload.features if f.table == spec.name
    )
    row = packing.row_words(spec.dim, spec.dtype) * 4  # padding is overhead, not floor
    scalars = sum(4 for s in spec.optimizer.slot_specs().values() if s.width == 1)
    wide = sum(
      s.width_for(spec.dim) * 4 for s in spec.optimizer.slot_specs().values() if s.width != 1
    )
    total += ids * (3 * row + spec.dim * 4 + 2 * (scalars + wide))
  del mesh_size  # per chip: ids per chip already
  return total


def _state_bytes(spec: TableSpec, rows_per_shard: int) -> tuple[int, int]:
  table = rows_per_shard * packing.storage_width(spec.dim, spec.dtype) * 4
  slots = sum(
    rows_per_shard * s.stored_width(spec.dim) * 4 for s in spec.optimizer.slot_specs().values()
  )
  return table, slots


def compile_step(
  topology: str, workload: Workload, *, pipeline: str = "async", hlo_path: str | None = None
) -> dict:
  """Compiles one training step for `topology` and reports per chip.

  Args:
    hlo_path: also write the compiled, scheduled HLO text here.

  Returns:
    A JSON-serialisable dict: table and slot bytes, memory analysis, XLA's
    bytes accessed against `floor_bytes` (and net of the all-to-alls' over-
    charge, `probes`), collectives (all_to_all bytes),
    copies the size of a table or slot shard, Pallas kernel calls, and
    whether the update's collectives overlap the dense compute.
  """
  tic = time.perf_counter()
  trainer, state, batch = build(topology, workload, pipeline)
  lowered = _jit_step.trace(trainer, state, batch, batch).lower(lowering_platforms=("tpu",))
  compiled = lowered.compile()
  return report(
    trainer.emb, workload, compiled, time.perf_counter() - tic, topology, pipeline, hlo_path
  )


def report(
  emb, workload: Workload, compiled, seconds: float, topology: str, pipeline: str, hlo_path=None
) -> dict:
  """What one chip of `topology` holds and moves in the `compiled` step of
  `emb`'s tables (`compile_step`'s report; the dynamic-vocabulary step of
  `pod_check.dynamic` reads the same)."""
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  text = compiled.as_text()
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(text)
  tables = {}
  for spec in map(emb.table_spec, emb.table_names):  # physical tables
    rps = emb.layout(spec.name).rows_per_shard
    table_bytes, slot_bytes = _state_bytes(spec, rps)
    stored = packing.storage_dtype(spec.dtype)
    arrays = {
      ((rps, packing.storage_width(spec.dim, spec.dtype)), stored),
      ((rps, packing.row_words(spec.dim, spec.dtype)), stored),  # its rows unpadded
      (packing.table_shape(rps, spec.dim, spec.dtype), stored),
      ((rps, spec.dim), np.dtype(spec.dtype)),  # its rows unpacked
    } | {
      (shape, np.dtype(s.dtype))
      for s in spec.optimizer.slot_specs().values()
      for shape in (
        s.shape_for(rps, spec.dim),
        (rps, s.stored_width(spec.dim)),
        (rps, s.width_for(spec.dim)),
      )
    }
    tables[spec.name] = {
      "rows": spec.num_rows,
      "dim": spec.dim,
      "dtype": str(np.dtype(spec.dtype)),
      "optimizer": type(spec.optimizer).__name__,
      "stochastic_rounding": spec.stochastic_rounding,
      "dynamic_vocabulary": spec.vocabulary is not None,
      "rows_per_chip": rps,
      "table_bytes": table_bytes,
      "slot_bytes": slot_bytes,
      "capacities": dataclasses.asdict(_table(emb, spec, workload).capacities),
      "forms": shard_kernels.kernel_forms(_table(emb, spec, workload)),
      "copies": hlo.copies_of(text, arrays),
      "prefetches": hlo.copies_of(text, arrays, prefetch=True),
    }
  floor = floor_bytes(emb, workload, len(emb.mesh.devices.flat))
  collectives = hlo.collectives(text)
  bytes_accessed = float(cost.get("bytes accessed", float("nan")))
  charges = probes.collective_charges(emb.mesh, collectives)
  return {
    "topology": topology,
    "chips": int(emb.mesh.size),
    "device_kind": emb.mesh.devices.flat[0].device_kind,
    "workload": workload.name,
    "pipeline": pipeline,
    "stacking": str(emb.stacking),
    "physical_tables": len(emb.table_names),
    "examples_per_chip": workload.examples_per_chip,
    "ids_per_chip": sum(workload.examples_per_chip * f.bag_size for f in workload.features),
    "backend": emb.backend,
    "compile_seconds": seconds,
    "tables": tables,
    "argument_bytes": mem.argument_size_in_bytes,
    "output_bytes": mem.output_size_in_bytes,
    "alias_bytes": mem.alias_size_in_bytes,
    "temp_bytes": mem.temp_size_in_bytes,
    "bytes_accessed": bytes_accessed,
    # Less what the cost model charges its all-to-alls over what they move
    # (`probes`).
    "net_bytes_accessed": probes.net_bytes_accessed(bytes_accessed, charges),
    "collective_charges": charges,
    "flops": float(cost.get("flops", float("nan"))),
    "floor_bytes": floor,
    "all_to_all_bytes": sum(c["bytes"] for c in collectives if "all-to-all" in c["op"]),
    "collectives": collectives,
    # Of the table or a slot of any table, relaid out every step.
    "table_sized_copies": sum((t["copies"] for t in tables.values()), []),
    "kernel_calls": hlo.kernel_calls(text),
    "kernels": hlo.kernels_by_name(text),
    "overlap": hlo.overlap(text),
  }


def _table(emb, spec: TableSpec, workload: Workload):
  """The `ShardedTable` of physical table `spec` at the workload's batch."""
  bags = {f.name: f.bag_size for f in workload.features}
  tokens = sum(workload.examples_per_chip * bags[f.name] for f in emb.features_of(spec.name))
  return emb.sharded_table(spec.name, tokens)
