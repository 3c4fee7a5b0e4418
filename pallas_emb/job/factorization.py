"""The main job's model for ratings (MovieLens): biases and a dot product.

    logit = b + user_bias[u] + item_bias[i] + mean_j history_bias[t_j]
              + <mean_j history[t_j], item[i]>

where t_j are the user's earlier ratings as tokens `2 * item + liked`
(`pallas_emb.data.movielens`). Without a history feature the user's own
vector takes the history's place (a biased matrix factorization).

Why this form, measured on ml-100k with a validation window (train on the
first 80% of ratings by time, evaluate on the next 10%; README, "The main
job on MovieLens"): most of the latest ratings come from users with no
training ratings, so the user vector and bias learn little that transfers,
and the history is what describes a user. A mean-pooled bag of
(item, liked) tokens carries both what they liked and how often they like
(its bias table); dotting it with the item vector scores this item against
that taste. The user vector in the dot did not help (validation AUC 0.726
against 0.729), an MLP beside it did not either (0.722), nor did a bias as an
extra column of each table (0.712: row-wise Adagrad shares one accumulator
per row, so the bias column's large gradients shrink the vector's steps).
Small vectors at the start (N(0, 0.01)) keep untrained rows out of the dot.

Every table trains with the job's embedding optimizer; `l2` penalises the
looked-up activations (each table's rows in proportion to how often they
are read), which is what slows over-fitting here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pallas_emb.data.base import FeatureInfo
from pallas_emb.errors import ConfigError


def small_normal(key, shape, dtype=np.float32):
  """Truncated normal, stddev 0.01: a factor's initial dot products ~0."""
  return jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype) * 0.01


def zeros(key, shape, dtype=np.float32):
  """A bias starts at 0."""
  del key
  return jnp.zeros(shape, dtype)


@dataclasses.dataclass(frozen=True)
class Factorization:
  """Biases plus <query, item> (query: the pooled history, else the user).

  Attributes:
    query: the feature dotted with "item" ("history" or "user").
    biases: the dim-1 features summed into the logit.
    l2: weight of the mean squared norm of the looked-up activations.
  """

  query: str
  biases: tuple[str, ...]
  l2: float = 0.01

  def init(self, key: jax.Array) -> dict[str, jax.Array]:
    """{"bias": () float32}, the global bias (the dense parameters)."""
    del key
    return {"bias": jnp.zeros((), jnp.float32)}

  def logits(self, params, acts: Mapping[str, jax.Array]) -> jax.Array:
    """(B,) logits from feature -> (B, dim) activations."""
    z = params["bias"] + jnp.sum(acts[self.query] * acts["item"], axis=1)
    for f in self.biases:
      z = z + acts[f][:, 0]
    return z

  def loss(self, params, acts, batch):
    """Weighted mean log-loss plus the activations' L2 -> (loss, {"logits"})."""
    logits = self.logits(params, acts)
    weight = batch["weight"]
    total = jnp.maximum(jnp.sum(weight), 1.0)
    log_loss = optax.sigmoid_binary_cross_entropy(logits, batch["label"])
    squares = sum(jnp.sum(jnp.square(a), axis=1) for a in acts.values())
    return jnp.sum((log_loss + self.l2 * squares) * weight) / total, {"logits": logits}


def factorization_features(dataset) -> tuple[tuple[FeatureInfo, ...], dict[str, str]]:
  """The model's features and, for each, the dataset input whose ids it
  reads: item and history (or user) vectors, and a bias of each of user,
  item and history.

  Raises:
    ConfigError: the dataset lacks a "user" or "item" feature.
  """
  given = {f.name: f for f in dataset.features}
  missing = [n for n in ("user", "item") if n not in given]
  if missing:
    raise ConfigError(
      f"the factorization model needs features 'user' and 'item'; the dataset lacks "
      f"{missing}. Use --model=mlp for this data."
    )
  query = "history" if "history" in given else "user"
  features, inputs = [], {}
  for name in ("item", query):
    f = given[name]
    features.append(f._replace(table=name))
    inputs[name] = name
  for name in ("user", "item", "history"):
    if name in given:
      f = given[name]
      features.append(f._replace(name=f"{name}_bias", table=f"{name}_bias"))
      inputs[f"{name}_bias"] = name
  return tuple(features), inputs


def build_factorization(
  dataset,
  mesh,
  *,
  emb_dim: int,
  optimizer,
  backend: str | None = None,
  axis: str = "x",
  stacking="auto",
  l2: float = 0.01,
  table_options: Mapping[str, Mapping] | None = None,
):
  """The tables and the model for a ratings dataset.

  `table_options`: table name -> further `TableSpec` arguments (a
  vocabulary, "num_rows"), over the others.

  Returns:
    (ShardedEmbedding, Factorization, FeatureInputs): the inputs give each
    model feature its ids from the dataset's batches (a bias reads the ids
    of its vector's feature).
  """
  from pallas_emb.embedding import ShardedEmbedding  # pylint: disable=g-import-not-at-top
  from pallas_emb.job.feature_inputs import FeatureInputs  # pylint: disable=g-import-not-at-top
  from pallas_emb.spec import FeatureSpec, TableSpec  # pylint: disable=g-import-not-at-top

  features, inputs = factorization_features(dataset)
  tables = []
  for f in features:
    bias = f.table.endswith("_bias")
    options = dict((table_options or {}).get(f.table, {}))
    tables.append(
      TableSpec(
        f.table,
        options.pop("num_rows", f.num_rows),
        1 if bias else emb_dim,
        optimizer=optimizer,
        initializer=zeros if bias else small_normal,
        **options,
      )
    )
  specs = [FeatureSpec(f.name, f.table, f.combiner) for f in features]
  emb = ShardedEmbedding(tuple(tables), specs, mesh, axis, backend, stacking)
  query = features[1].name
  model = Factorization(query, tuple(f.name for f in features if f.table.endswith("_bias")), l2)
  return emb, model, FeatureInputs(dataset, features, inputs)
