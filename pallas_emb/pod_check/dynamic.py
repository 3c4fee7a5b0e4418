"""A step over a dynamic-vocabulary table, compiled for a TPU topology.

The training step of a table with `TableSpec(vocabulary=DynamicVocabulary
(...))` is `admit` (raw ids' key words -> rows through the per-shard id maps,
new rows reset) then the static path (`lookup`, the model's gradient,
`apply_gradients`), in one jitted program. `compile_pair` compiles it for a
topology beside the same step over a static table of the same capacity fed
int32 rows, so that the report says what the id map adds per chip: temp
bytes, XLA's bytes accessed, kernel calls and copies of the table.

The model is W-TPU's shape (`compile.w_tpu`: `item`, one id, and `history`,
a bag of 20, both read from one table) scored by <item, mean(history)>
under a logistic loss; the step is synchronous (admit must see this step's
ids before the lookup).

Run in a process prepared by `pallas_emb.pod_check.env` (`python -m
pallas_emb.pod_check --dynamic`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_emb.dynamic import VocabState
from pallas_emb.embedding import ShardedEmbedding
from pallas_emb.errors import ConfigError
from pallas_emb.job.model import item_history_loss
from pallas_emb.pod_check.compile import AXIS, Workload, report, topology_mesh
from pallas_emb.spec import FeatureSpec, TableSpec
from pallas_emb.vocabulary import DynamicVocabulary


def _embedding(workload: Workload, mesh, vocabulary: DynamicVocabulary | None):
  [table] = {f.table for f in workload.features}
  spec = TableSpec(
    table,
    workload.features[0].num_rows,
    workload.emb_dim,
    optimizer=workload.optimizer,
    dtype=workload.dtype,
    vocabulary=vocabulary,
    **workload.table_options.get(table, {}),
  )
  feats = [FeatureSpec(f.name, f.table, f.combiner) for f in workload.features]
  return ShardedEmbedding([spec], feats, mesh, AXIS, workload.backend)


def step_fn(emb: ShardedEmbedding):
  """The jitted training step of `emb`'s one table: (tables, vocabs, ids,
  label) -> (tables, vocabs, metrics) for a dynamic table (ids: (B, L, 2)
  uint32 key words), (tables, ids, label) -> (tables, metrics) for a static
  one (ids: (B, L) int32 rows). States are donated."""

  def train(tables, rows, label):
    acts, res = emb.lookup(tables, rows)
    grads = jax.grad(item_history_loss)(acts, label)
    return emb.apply_gradients(tables, res, grads)

  def dynamic(tables, vocabs, words, label):
    rows, tables, vocabs, vocab_metrics = emb.admit(tables, vocabs, words)
    tables, metrics = train(tables, rows, label)
    return tables, vocabs, (metrics, vocab_metrics)

  if emb.dynamic_tables():
    return jax.jit(dynamic, donate_argnums=(0, 1))
  return jax.jit(train, donate_argnums=0)


def _abstract_args(emb: ShardedEmbedding, workload: Workload):
  mesh = emb.mesh
  rows, rep = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
  place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  # Tables: rows split over the axis, the (scalar) step replicated.
  tables = jax.tree.map(
    lambda x: place(x, rows if x.ndim else rep), jax.eval_shape(emb.init, jax.random.key(0))
  )
  batch = workload.examples_per_chip * mesh.size
  label = jax.ShapeDtypeStruct((batch,), jnp.float32, sharding=rows)
  if not emb.dynamic_tables():
    ids = {
      f.name: jax.ShapeDtypeStruct((batch, f.bag_size), jnp.int32, sharding=rows)
      for f in workload.features
    }
    return (tables, ids, label)
  vocabs = jax.eval_shape(emb.init_vocabularies, jax.random.key(1))
  # A map's per-slot arrays and sketch are shards concatenated on axis 0;
  # its step and the key are replicated (`pallas_emb.dynamic.init_state`).
  vocabs = {
    n: VocabState(
      v.map._replace(
        **{k: place(x, rows) for k, x in v.map._asdict().items() if k != "step"},
        step=place(v.map.step, rep),
      ),
      place(v.key, rep),
    )
    for n, v in vocabs.items()
  }
  words = {
    f.name: jax.ShapeDtypeStruct((batch, f.bag_size, 2), jnp.uint32, sharding=rows)
    for f in workload.features
  }
  return (tables, vocabs, words, label)


def compile_one(
  topology: str, workload: Workload, vocabulary: DynamicVocabulary | None, hlo_path=None
) -> dict:
  """Compiles the step of `workload`'s table, dynamic with `vocabulary` or
  static (None), for `topology`; returns `compile.report`'s dict (the
  compiled HLO written to `hlo_path` if given)."""
  tic = time.perf_counter()
  emb = _embedding(workload, topology_mesh(topology), vocabulary)
  args = _abstract_args(emb, workload)
  compiled = step_fn(emb).trace(*args).lower(lowering_platforms=("tpu",)).compile()
  pipeline = "dynamic" if vocabulary is not None else "static"
  seconds = time.perf_counter() - tic
  return report(emb, workload, compiled, seconds, topology, pipeline, hlo_path)


def compile_pair(
  topology: str, workload: Workload, vocabulary: DynamicVocabulary, hlo_path=None
) -> list[dict]:
  """[the dynamic table's step, the static table's step] on `topology`, the
  same shapes; `workload` must read one table. `hlo_path(pipeline)`: where
  to write each compiled HLO ("dynamic", "static"), or None."""
  if len({f.table for f in workload.features}) != 1:
    raise ConfigError(
      f"workload {workload.name!r} reads tables {sorted({f.table for f in workload.features})}; "
      "the dynamic-vocabulary compile takes a workload of one table (w_tpu)."
    )
  path = hlo_path or (lambda _: None)
  return [
    compile_one(topology, workload, vocabulary, path("dynamic")),
    compile_one(topology, workload, None, path("static")),
  ]
