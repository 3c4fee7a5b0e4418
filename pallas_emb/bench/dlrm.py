"""The DLRM-shaped step with table stacking off and on (`bench --workload=dlrm`).

    python -m pallas_emb.bench --json dlrm.json --workload=dlrm [--steps 20]
        [--pipeline_devices 8] [--pipeline_batch_size 1024] [--dlrm_max_rows 20000]

26 Criteo-shaped tables (`pallas_emb.data.dlrm`), the main job's model and
async pipeline, both configurations built in one process and stepped
alternately, so the machine's noise hits both alike.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb.data.dlrm import DlrmClickLog
from pallas_emb.data.feed import GlobalBatches
from pallas_emb.job.model import build_ranking


def run_dlrm_stacking(
  steps: int, num_devices: int, batch_size: int, max_rows: int, warmup: int = 2
) -> dict:
  """Median step time of the DLRM-shaped main job (async pipeline) with
  stacking off, on, and on with the tables under 1000 rows replicated,
  interleaved step by step."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), ("x",))
  dataset = DlrmClickLog(max_rows=max_rows)
  runs = {}
  for mode in ("off", "auto", "auto+replicated"):
    emb, model = build_ranking(
      dataset,
      mesh,
      emb_dim=16,
      backend="xla",
      stacking=mode.split("+")[0],
      optimizer=pe.RowWiseAdagrad(0.05, half_life_steps=None),
    )
    if mode.endswith("replicated"):
      emb = dataclasses.replace(emb, replicate_below=1000)
    feeder = GlobalBatches(dataset, batch_size, emb.sharding())
    batches = [feeder.train(i) for i in range(8)]
    tr = pe.make_trainer(emb, model.loss, optax.adam(1e-3), pe.TrainConfig(), batches[0])
    state = tr.init(model.init(jax.random.key(1)), emb.init(jax.random.key(2)), batches[0])
    tic = time.perf_counter()
    state, m = tr.step(state, batches[0], batches[1])
    jax.block_until_ready(m["loss"])
    runs[mode] = {
      "tr": tr,
      "state": state,
      "batches": batches,
      "times": [],
      "first_step_s": time.perf_counter() - tic,
      "physical_tables": len(emb.table_names),
    }
  for t in range(1, steps + warmup + 1):
    for run in runs.values():
      tic = time.perf_counter()
      run["state"], m = run["tr"].step(
        run["state"], run["batches"][t % 8], run["batches"][(t + 1) % 8]
      )
      jax.block_until_ready(m["loss"])
      if t > warmup:
        run["times"].append(time.perf_counter() - tic)
  return {
    mode: {
      "median_step_ms": 1e3 * float(np.median(r["times"])),
      "min_step_ms": 1e3 * float(np.min(r["times"])),
      "max_step_ms": 1e3 * float(np.max(r["times"])),
      "first_step_s": r["first_step_s"],
      "steps": len(r["times"]),
      "physical_tables": r["physical_tables"],
      "logical_tables": 26,
      "devices": num_devices,
      "batch_size": batch_size,
      "max_rows": max_rows,
    }
    for mode, r in runs.items()
  }
