"""What a run trains: its data, tables, model, trainer and first state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from absl import app

import pallas_emb as pe
from pallas_emb import data as data_lib
from pallas_emb.data.dlrm import DlrmClickLog
from pallas_emb.data.feed import GlobalBatches
from pallas_emb.job import vocabularies
from pallas_emb.job.factorization import build_factorization, factorization_features
from pallas_emb.job.flags import FLAGS, embedding_optimizer
from pallas_emb.job.model import build_ranking


class Job(NamedTuple):
  """What a run trains: data, tables, model, trainer and its batches.

  `inputs` is the dataset as the model's features read it (`FeatureInputs`
  for the factorization model; the dataset itself for the MLP).
  """

  dataset: Any
  inputs: Any
  model: str  # "mlp" or "factorization"
  emb: pe.ShardedEmbedding
  config: pe.TrainConfig
  feeder: GlobalBatches
  trainer: pe.Trainer
  state: pe.TrainState
  steps: int

  @property
  def batch_shapes(self) -> dict[str, tuple[int, int]]:
    """Feature -> (global batch, bag size): what a checkpoint records."""
    return {f.name: (FLAGS.batch_size, f.bag_size) for f in self.inputs.features}


def model_kind() -> str:
  """--model, with "auto" resolved: factorization on MovieLens."""
  if FLAGS.model != "auto":
    return FLAGS.model
  movielens = FLAGS.workload == "default" and FLAGS.data.startswith("movielens:")
  return "factorization" if movielens else "mlp"


def build(mesh: jax.sharding.Mesh) -> Job:
  """The job the flags describe, on `mesh`, at its initial state."""
  if FLAGS.workload == "dlrm":
    dataset = DlrmClickLog(max_rows=FLAGS.dlrm_max_rows or None, seed=FLAGS.seed)
  else:
    dataset = data_lib.from_flag(
      FLAGS.data,
      seed=FLAGS.seed,
      history_len=FLAGS.history_len,
      validation_fraction=FLAGS.validation_fraction,
    )
  steps = total_steps(dataset)  # refuses --epochs before anything compiles
  kind = model_kind()
  common = {
    "emb_dim": FLAGS.emb_dim,
    "optimizer": embedding_optimizer(FLAGS.optimizer, FLAGS.emb_learning_rate, kind),
    "backend": FLAGS.backend,
    "stacking": FLAGS.stacking,
  }
  if kind == "factorization":
    features, sources = factorization_features(dataset)
    options = vocabularies.table_options(dataset, features, sources)
    emb, model, inputs = build_factorization(dataset, mesh, table_options=options, **common)
  else:
    features, sources = dataset.features, {f.name: f.name for f in dataset.features}
    options = vocabularies.table_options(dataset, features, sources)
    (emb, model), inputs = build_ranking(dataset, mesh, table_options=options, **common), dataset
  words = {
    f.name: (sources[f.name], emb.table_spec(f.table).vocabulary)
    for f in features
    if f.table in emb.dynamic_tables()
  }
  if words:
    inputs = vocabularies.KeyWordInputs(inputs, dataset, words)
  config = pe.TrainConfig(use_async_emb=FLAGS.async_emb, exact=FLAGS.exact_emb and FLAGS.async_emb)
  feeder = GlobalBatches(inputs, FLAGS.batch_size, emb.sharding(), words=frozenset(words))
  trainer = pe.make_trainer(
    emb, model.loss, optax.adam(FLAGS.dense_learning_rate), config, feeder.train(0)
  )
  key = jax.random.key(FLAGS.seed)
  state = trainer.init(
    model.init(jax.random.fold_in(key, 1)),
    emb.init(jax.random.fold_in(key, 2)),
    feeder.train(0),
    vocabs=emb.init_vocabularies(jax.random.fold_in(key, 3)),
  )
  return Job(dataset, inputs, kind, emb, config, feeder, trainer, state, steps)


def total_steps(dataset) -> int:
  """--steps, or --epochs passes over the training set."""
  if FLAGS.epochs is None:
    return FLAGS.steps
  if FLAGS["steps"].present:
    raise app.UsageError(
      "--epochs and --steps both set; give one: --epochs counts passes "
      "over the training set, --steps counts batches."
    )
  size = getattr(dataset, "train_size", None)
  if size is None:
    raise app.UsageError(
      f"--epochs needs a finite training set; {FLAGS.data!r} is an endless stream: give --steps."
    )
  return max(1, int(np.ceil(FLAGS.epochs * size / FLAGS.batch_size)))
