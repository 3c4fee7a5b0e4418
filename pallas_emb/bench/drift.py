"""A drifting stream of raw ids: a dynamic table against hashing and an
oracle, on AUC and step time, in one run.

    python -m pallas_emb.bench.drift [--rows 16384] [--steps 400]
        [--batch 4096] [--json drift.json]

The stream: example i of step t has one raw int64 id, never seen before the
stream reaches it. Ids are indexed k = 0, 1, ... in order of arrival; at
step t the live ones are k in [t * shift, t * shift + live), each drawn with
Zipf(1.1) popularity over a fixed shuffle of the window, so new ids keep
arriving and old ones fade out. The raw id of k is SplitMix64(k) (random
64-bit values), and its label is Bernoulli(sigmoid(2 z_k)) with z_k a
standard normal fixed per id: the model must learn a score per id.

The model: logit = sum of the id's embedding row (dim D, initialised near
zero), binary cross-entropy summed over the batch, Adagrad (lr 0.05) on the
table, trained by a `Trainer` (the default, asynchronous pipeline, as a
user would; `--sync` for the synchronous one). Three tables, trained on the
same batches:

* dynamic: R rows, `DynamicVocabulary` (LFU, probe limit 16, sweeps every
  4 steps evicting ids idle for 16), raw ids admitted in the step;
* hashed: R rows, `pe.hash_ids(raw, R)` (rows shared by colliding ids);
* oracle: one row per id of the whole stream (k itself), no collision.

AUC is progressive: each batch is scored by the step that trains on it,
from the table before that step's update, over the second half of the
stream. Step time is the median over the second half of each method's
`Trainer.step`, interleaved step by step (dynamic: the admission, lookup,
gradient and update in one program; the static tables: the same without
the admission), the batches placed on the device first: the host-side
conversion of raw ids (`vocab_keys`, `hash_ids`) is not timed. `main` first
keeps freed heap memory (`pallas_emb.job.host_memory.keep_freed_memory`),
as the main job and benchmark do on CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb.job import host_memory
from pallas_emb.train.metrics import auc


def _splitmix(k: np.ndarray) -> np.ndarray:
  return pe.hash64(k.astype(np.int64), seed=12345).view(np.int64)


def stream(steps: int, batch: int, live: int, shift: int, seed: int = 0):
  """(raw ids (steps, batch, 1) int64, index k of each, labels float32)."""
  rng = np.random.default_rng(seed)
  p = np.arange(1, live + 1, dtype=np.float64) ** -1.1
  order = rng.permutation(live)
  ranks = rng.choice(live, size=(steps, batch), p=p / p.sum())
  k = np.arange(steps)[:, None] * shift + order[ranks]
  z = np.random.default_rng(seed + 1).standard_normal(int(k.max()) + 1)
  labels = rng.random(k.shape) < 1 / (1 + np.exp(-2 * z[k]))
  return _splitmix(k)[..., None], k[..., None], labels.astype(np.float32)


def _trainer(emb, name: str, config, example):
  """A `Trainer` of table `name` alone, no dense parameters: logit = the sum
  of the id's row, binary cross-entropy summed over the batch."""

  def loss_fn(params, acts, batch):
    del params
    logits = jnp.sum(acts[name], axis=-1)
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, batch["label"])), {"logits": logits}

  return pe.make_trainer(emb, loss_fn, optax.sgd(0.0), config, example)


def _small_init(key, shape, dtype=np.float32):
  """Rows near zero: a new id starts with a logit near 0, not noise."""
  return 0.01 * jax.random.normal(key, shape, dtype)


def run(
  rows: int,
  steps: int,
  batch: int,
  dim: int = 16,
  live: int | None = None,
  shift=None,
  config: pe.TrainConfig | None = None,
):
  """The benchmark's result (a JSON-able dict); `config` the pipeline
  (default `TrainConfig()`, asynchronous)."""
  config = config or pe.TrainConfig()
  live = live or 2 * rows
  shift = shift or max(1, (10 * rows - live) // steps)  # ~10x the capacity in distinct ids
  raw, k, labels = stream(steps, batch, live, shift)
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  opt = pe.Adagrad(0.05)
  init = _small_init
  vocab = pe.DynamicVocabulary(policy="lfu", evict_every=4, ttl=16, probe_limit=16)
  specs = {
    "dynamic": pe.TableSpec(
      "dynamic", rows, dim, optimizer=opt, initializer=init, vocabulary=vocab
    ),
    "hashed": pe.TableSpec("hashed", rows, dim, optimizer=opt, initializer=init),
    "oracle": pe.TableSpec("oracle", int(k.max()) + 1, dim, optimizer=opt, initializer=init),
  }
  embs = {n: pe.ShardedEmbedding([s], [pe.FeatureSpec(n, n)], mesh) for n, s in specs.items()}
  tables = {n: e.init(jax.random.key(0)) for n, e in embs.items()}
  vocabs = embs["dynamic"].init_vocabularies(jax.random.key(1))
  ids = {
    "dynamic": pe.vocab_keys(raw, vocab),
    "hashed": pe.hash_ids(raw, rows),
    "oracle": k.astype(np.int32),
  }
  put = lambda n, t: jax.device_put(
    {"ids": {n: ids[n][min(t, steps - 1)]}, "label": labels[min(t, steps - 1)]}
  )
  trainers = {n: _trainer(e, n, config, put(n, 0)) for n, e in embs.items()}
  states = {
    n: trainers[n].init({}, tables[n], put(n, 0), vocabs if n == "dynamic" else None) for n in embs
  }
  scores = {n: [] for n in embs}
  times = {n: [] for n in embs}
  for t in range(steps):
    for n, tr in trainers.items():
      now, nxt = put(n, t), put(n, t + 1)
      jax.block_until_ready((now, nxt))
      start = time.perf_counter()
      states[n], m = tr.step(states[n], now, nxt)
      jax.block_until_ready((states[n], m))
      times[n].append(time.perf_counter() - start)
      scores[n].append(np.asarray(m["aux"]["logits"]))
      if n == "dynamic":
        occupancy = m["vocab"][n]["occupancy"]
  half = steps // 2
  lab = labels[half:].ravel()
  out = {
    "rows": rows,
    "steps": steps,
    "batch": batch,
    "dim": dim,
    "distinct_ids": int(np.unique(k).size),
    "platform": jax.devices()[0].platform,
    "pipeline": "async" if config.use_async_emb else "sync",
    "final_occupancy": int(occupancy),
    "methods": {
      n: {
        "auc": auc(np.concatenate(scores[n][half:]), lab),
        "step_ms_median": 1e3 * float(np.median(times[n][half:])),
      }
      for n in embs
    },
  }
  ms = {n: v["step_ms_median"] for n, v in out["methods"].items()}
  out["dynamic_over_hashed_step_time"] = ms["dynamic"] / ms["hashed"]
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--rows", type=int, default=16384)
  ap.add_argument("--steps", type=int, default=400)
  ap.add_argument("--batch", type=int, default=4096)
  ap.add_argument("--dim", type=int, default=16)
  ap.add_argument("--json", default=None)
  ap.add_argument("--sync", action="store_true", help="the synchronous pipeline")
  a = ap.parse_args(argv)
  # A training process on CPU keeps freed heap memory (as the main job and
  # benchmark do): XLA:CPU allocates each step's temporaries afresh.
  tuned = host_memory.keep_freed_memory()
  config = pe.TrainConfig(use_async_emb=not a.sync)
  out = dict(run(a.rows, a.steps, a.batch, a.dim, config=config), keep_freed_memory=tuned)
  print(json.dumps(out, indent=1))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
