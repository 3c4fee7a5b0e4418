"""The main job's ranking model: embeddings + dense features -> MLP -> click.

The embedding part goes only through the public API (`ShardedEmbedding`, the
trainer); this module is the dense part, in plain JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class RankingModel:
  """A click-through-rate MLP over concatenated embeddings and dense inputs.

  Attributes:
    features: feature names in concatenation order.
    input_dim: sum of their embedding dims plus the dense feature count.
    hidden: hidden layer widths (ReLU).
  """

  features: tuple[str, ...]
  input_dim: int
  hidden: tuple[int, ...] = (128, 64)

  def init(self, key: jax.Array) -> list[dict[str, jax.Array]]:
    """He-initialised layers: [{"w": (in, out), "b": (out,)}, ...]."""
    sizes = (self.input_dim, *self.hidden, 1)
    keys = jax.random.split(key, len(sizes) - 1)
    return [
      {
        "w": jax.random.normal(k, (i, o), jnp.float32) * jnp.sqrt(2.0 / i),
        "b": jnp.zeros((o,), jnp.float32),
      }
      for k, i, o in zip(keys, sizes[:-1], sizes[1:])
    ]

  def logits(
    self, params: Sequence[Mapping[str, jax.Array]], acts: Mapping[str, jax.Array], dense: jax.Array
  ) -> jax.Array:
    """(B,) click logits from feature -> (B, dim) embeddings and (B, F) dense."""
    x = jnp.concatenate([acts[f] for f in self.features] + [dense], axis=1)
    for layer in params[:-1]:
      x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return (x @ params[-1]["w"] + params[-1]["b"])[:, 0]

  def loss(self, params, acts, batch):
    """Weighted mean log-loss -> (loss, {"logits"})."""
    logits = self.logits(params, acts, batch["dense"])
    per_example = optax.sigmoid_binary_cross_entropy(logits, batch["label"])
    weight = batch["weight"]
    return jnp.sum(per_example * weight) / jnp.maximum(jnp.sum(weight), 1.0), {"logits": logits}


def item_history_loss(acts: Mapping[str, jax.Array], label: jax.Array) -> jax.Array:
  """W-TPU's one-table model (`pod_check.dynamic`, `bench.tpu_check`): the
  summed log-loss of the score <acts["item"], acts["history"]>, each (B, D)
  float32 (the pooled item and the mean of its history); label (B,) in
  {0, 1}."""
  logits = jnp.sum(acts["item"] * acts["history"], -1)
  return jnp.sum(jnp.logaddexp(0.0, logits) - label * logits)


def build_ranking(
  dataset,
  mesh,
  *,
  emb_dim: int,
  optimizer,
  backend: str | None = None,
  axis: str = "x",
  hidden: tuple[int, ...] = (128, 64),
  dtype=jnp.float32,
  table_options: Mapping[str, Mapping] | None = None,
  stacking="auto",
):
  """The sharded tables and the MLP for a dataset's features.

  Args:
    dataset: a `pallas_emb.data.Dataset` (its `features` and `num_dense`).
    mesh: the device mesh; tables and batches are sharded over `axis`.
    emb_dim: width of every table (unless its `table_options` give "dim",
      or the dataset has `dims`, table name -> width).
    optimizer: the embedding optimizer of every table.
    backend: kernel backend (None: by platform).
    axis: the mesh axis.
    hidden: MLP hidden widths.
    dtype: every table's dtype.
    table_options: table name -> further `TableSpec` arguments (e.g.
      capacities, a vocabulary, "num_rows"), over the arguments above.
    stacking: `ShardedEmbedding.stacking`.

  Returns:
    (ShardedEmbedding, RankingModel).
  """
  from pallas_emb.embedding import ShardedEmbedding  # pylint: disable=g-import-not-at-top
  from pallas_emb.spec import FeatureSpec, TableSpec  # pylint: disable=g-import-not-at-top

  tables = {}
  dims = getattr(dataset, "dims", {})
  for f in dataset.features:
    options = {
      "dim": dims.get(f.table, emb_dim),
      "optimizer": optimizer,
      "dtype": dtype,
      **dict((table_options or {}).get(f.table, {})),
    }
    rows = options.pop("num_rows", f.num_rows)
    tables.setdefault(f.table, TableSpec(f.table, rows, **options))
  features = [FeatureSpec(f.name, f.table, f.combiner) for f in dataset.features]
  emb = ShardedEmbedding(tuple(tables.values()), features, mesh, axis, backend, stacking)
  model = RankingModel(
    tuple(f.name for f in dataset.features),
    sum(tables[f.table].dim for f in features) + dataset.num_dense,
    hidden,
  )
  return emb, model
