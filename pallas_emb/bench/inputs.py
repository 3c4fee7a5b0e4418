"""What each input form costs per step, against padded ids, on the main job's
model: `python -m pallas_emb.bench.inputs [--steps 30 --batch_size 4096]`.

One process times four variants of the same training step (sparse lookup,
the ranking MLP's loss and gradient, the fused update of every table), with
the "history" feature (a bag of up to 8 recent items, -1 padded, about 4 ids
per bag on average) given as

- padded: (B, 8) int32 ids, the main job's form;
- weighted: `Weighted` ids with every weight 1 (the same result);
- ragged: `Ragged` bags of the same ids, C = the most ids a data shard had;
- int64: the padded ids as int64 (converted on the host).

Steps are interleaved variant by variant, so load on the machine hits all of
them alike; the table gives the median step and its ratio to padded.
"""

from __future__ import annotations

import json
import os
import statistics
import time


def _flags():
  from absl import flags  # pylint: disable=g-import-not-at-top

  flags.DEFINE_integer("steps", 30, "timed steps per variant")
  flags.DEFINE_integer("batch_size", 4096, "global batch")
  flags.DEFINE_integer("devices", 8, "simulated CPU devices")
  flags.DEFINE_string("json", None, "write the results here")
  return flags.FLAGS


def _forms(batch, num_shards):
  import numpy as np  # pylint: disable=g-import-not-at-top

  import pallas_emb as pe  # pylint: disable=g-import-not-at-top

  hist = batch["ids"]["history"]
  bags = [row[row >= 0] for row in hist]
  per = len(bags) // num_shards
  most = max(sum(len(b) for b in bags[s * per : (s + 1) * per]) for s in range(num_shards))
  capacity = -(-most // 8) * 8
  with_hist = lambda h: {**batch, "ids": {**batch["ids"], "history": h}}
  return {
    "padded": with_hist(hist),
    "weighted": with_hist(pe.Weighted(hist, np.ones(hist.shape, np.float32))),
    "ragged": with_hist(pe.ragged(bags, num_shards=num_shards, capacity=capacity)),
    "int64": with_hist(hist.astype(np.int64)),
  }, capacity


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top

  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  from pallas_emb import data as data_lib  # pylint: disable=g-import-not-at-top
  from pallas_emb.job.model import build_ranking  # pylint: disable=g-import-not-at-top

  flags = FLAGS
  mesh = jax.make_mesh((flags.devices,), ("x",))
  dataset = data_lib.SyntheticClickLog()
  emb, model = build_ranking(
    dataset, mesh, emb_dim=32, backend="xla", optimizer=pe.RowWiseAdagrad(0.05)
  )
  params = model.init(jax.random.key(1))

  @jax.jit
  def step(tables, ids, batch):
    acts, res = emb.lookup(tables, ids)
    (_, _), g = jax.value_and_grad(model.loss, argnums=1, has_aux=True)(params, acts, batch)
    tables, metrics = emb.apply_gradients(tables, res, g)
    return tables, metrics

  host = dataset.train_batch(0, flags.batch_size)
  forms, capacity = _forms(host, flags.devices)
  dense = {k: host[k] for k in ("dense", "label", "weight")}
  tables = {k: emb.init(jax.random.key(0)) for k in forms}
  times = {k: [] for k in forms}
  for i in range(flags.steps + 2):
    for name, batch in forms.items():
      ids = pe.int32_ids(batch["ids"])  # what the Trainer does on the host
      t0 = time.perf_counter()
      tables[name], m = step(tables[name], ids, dense)
      jax.block_until_ready(m)
      if i >= 2:  # the first two compile and warm up
        times[name].append(time.perf_counter() - t0)
  med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
  print(
    f"history: {flags.batch_size} bags of <= 8 ids, "
    f"{int((host['ids']['history'] >= 0).sum())} ids; ragged capacity "
    f"{capacity} per shard of {flags.devices}; load {os.getloadavg()[0]:.1f}"
  )
  print(f"{'form':>9} {'median ms':>10} {'x padded':>9}")
  for k, v in med.items():
    print(f"{k:>9} {v:10.2f} {v / med['padded']:9.2f}")
  if flags.json:
    with open(flags.json, "w") as f:
      json.dump(
        {
          "median_ms": med,
          "steps": flags.steps,
          "batch_size": flags.batch_size,
          "devices": flags.devices,
          "ragged_capacity": capacity,
        },
        f,
        indent=1,
      )


if __name__ == "__main__":
  FLAGS = _flags()
  # Before JAX starts: enough simulated devices for --devices <= 8.
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  from absl import app  # pylint: disable=g-import-not-at-top

  app.run(main)
