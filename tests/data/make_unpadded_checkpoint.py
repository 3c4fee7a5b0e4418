"""Writes tests/data/unpadded_checkpoint: checkpoints from before padded
storage (commit 2c6a638, where a float32 table of D=96 was stored
(rows, 96) and a bfloat16 one of D=48 (rows, 24)), for
`test_padded_rows.py`'s restore tests: OUT/trainer (a `Checkpointer` of a
`Trainer`) and OUT/vocab (a `VocabCheckpointer` with a dynamic table).

    git worktree add /tmp/old 2c6a638
    JAX_PLATFORMS=cpu PYTHONPATH=/tmp/old python tests/data/make_unpadded_checkpoint.py OUT

Each holds its tables after two steps as that code read them back
(expected.npz: logical_table, logical_slots, resident ids).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb.train.checkpoint import Checkpointer

BATCH = 8


def trainer(mesh):
  tables = [
    pe.TableSpec("wide", 64, 96, optimizer=pe.LazyAdam(0.05)),
    pe.TableSpec("half", 64, 48, optimizer=pe.Adagrad(0.1), dtype=jnp.bfloat16),
  ]
  feats = [pe.FeatureSpec("w", "wide", "sum"), pe.FeatureSpec("h", "half", "sum")]
  emb = pe.ShardedEmbedding(tables, feats, mesh, "x", "xla")

  def loss_fn(params, acts, batch):
    return params["s"] * (jnp.sum(acts["w"] ** 2) + jnp.sum(acts["h"])), {}

  first = {"ids": batch(0)}
  tr = pe.make_trainer(emb, loss_fn, optax.sgd(0.0), pe.TrainConfig(), first)
  return tr, {"s": jnp.ones((), jnp.float32)}


def batch(t):
  rng = np.random.default_rng(t)
  return {
    "w": rng.integers(0, 64, (BATCH, 3)).astype(np.int32),
    "h": rng.integers(0, 64, (BATCH, 2)).astype(np.int32),
  }


def vocab_emb(mesh):
  vocab = pe.DynamicVocabulary(policy="lfu", probe_limit=8)
  tables = [
    pe.TableSpec("dyn", 64, 96, optimizer=pe.Adagrad(0.1), vocabulary=vocab),
    pe.TableSpec("half", 64, 48, optimizer=pe.Adagrad(0.1), dtype=jnp.bfloat16),
  ]
  feats = [pe.FeatureSpec("d", "dyn", "sum"), pe.FeatureSpec("h", "half", "sum")]
  return pe.ShardedEmbedding(tables, feats, mesh, "x", "xla")


def vocab_batch(t):
  rng = np.random.default_rng(10 + t)
  return rng.integers(0, 40, (BATCH, 3)).astype(np.int64) * 1_000_003, batch(t)["h"]


def save_vocab(mesh, out):
  from pallas_emb.train.checkpoint_vocab import VocabCheckpointer

  emb = vocab_emb(mesh)
  tables, vocabs = emb.init(jax.random.key(0)), emb.init_vocabularies(jax.random.key(1))
  for t in range(2):
    raw, h = vocab_batch(t)
    rows, tables, vocabs, _ = emb.admit(tables, vocabs, {"d": raw})
    acts, res = emb.lookup(tables, {**rows, "h": h})
    tables, _ = emb.apply_gradients(tables, res, {k: jnp.ones_like(v) for k, v in acts.items()})
  VocabCheckpointer(out, emb).save(2, tables, vocabs)
  expected = {"dyn/resident": emb.resident_ids(vocabs, "dyn")}
  for name in ("dyn", "half"):
    expected[f"{name}/table"] = emb.logical_table(tables, name).astype(np.float32)
    for k, v in emb.logical_slots(tables, name).items():
      expected[f"{name}/{k}"] = v
  np.savez(f"{out}/expected.npz", **expected)


def main(out):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  save_vocab(mesh, f"{out}/vocab")
  out = f"{out}/trainer"
  tr, params = trainer(mesh)
  state = tr.init(params, tr.emb.init(jax.random.key(0)), {"ids": batch(0)})
  for t in range(2):
    state, _ = tr.step(state, {"ids": batch(t)}, {"ids": batch(t + 1)})
  Checkpointer(out, tr).save(state, {"w": (BATCH, 3), "h": (BATCH, 2)})
  expected = {}
  for name in ("wide", "half"):
    expected[f"{name}/table"] = tr.emb.logical_table(state.tables, name).astype(np.float32)
    for k, v in tr.emb.logical_slots(state.tables, name).items():
      expected[f"{name}/{k}"] = v
  np.savez(f"{out}/expected.npz", **expected)


if __name__ == "__main__":
  main(sys.argv[1])
