"""One benchmark run: its workloads timed method by method, to JSON.

`python -m pallas_emb.bench` (see `__main__` for what is measured and the
flags) builds a `BenchConfig` and calls `run`. Each workload's methods
(`methods`) are interleaved step by step, so the machine's noise hits them
alike; the machine's state (`machine`) is recorded at the start and end.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb import data as data_lib
from pallas_emb.bench.dlrm import run_dlrm_stacking
from pallas_emb.bench.machine import OthersCpu, available_memory, copy_bandwidth, machine_info
from pallas_emb.bench.methods import Dense, FbgemmBackward, Fused, SharedTable, fbgemm_available
from pallas_emb.bench.optimizers import run_optimizers
from pallas_emb.bench.plot import plot
from pallas_emb.bench.timing import profile, time_steps
from pallas_emb.bench.workloads import floor_bytes, zipf_ids
from pallas_emb.data.feed import GlobalBatches
from pallas_emb.job import host_memory
from pallas_emb.job.model import build_ranking


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What one run measures (the flags of `python -m pallas_emb.bench`)."""

  json: str
  workload: str = "update"
  dlrm_max_rows: int = 20_000
  vocab: tuple[int, ...] = (1_000_000, 10_000_000)
  ids: tuple[int, ...] = (65_536,)
  dim: int = 128
  steps: int = 30
  warmup: int = 3
  methods: tuple[str, ...] = ("fused", "fused_xla", "dense", "fbgemm")
  plot: str | None = None
  pipeline_steps: int = 40
  pipeline_devices: int = 8
  pipeline_batch_size: int = 1024
  profile_steps: int = 10
  huge_pages: bool = True
  keep_freed_memory: bool = True
  optimizers: tuple[str, ...] = ()
  optimizer_vocab: int = 1_000_000
  copy_bytes: int = 1 << 30


# What the dense step holds at its peak, in table-sized buffers beyond the
# table itself: the gradient and XLA's temporaries of its update (measured
# at V = 10M: the process grew past 14 GB beside a 5.1 GB table).
DENSE_TABLE_BUFFERS = 2
# Below this table size the dense step runs in this process: its buffers are
# small beside what the heap holds, and a child process costs seconds (a
# JAX start and a compile) per workload.
DENSE_IN_PROCESS_BYTES = 64 << 20


def _dense_does_not_fit(table_bytes: int) -> str | None:
  """Why the dense step would not fit in memory now, or None."""
  free = available_memory()
  need = DENSE_TABLE_BUFFERS * table_bytes
  if free is None or need < free:
    return None
  return (
    f"needs about {need / 1e9:.1f} GB beyond the table ({DENSE_TABLE_BUFFERS} table-sized "
    f"buffers), {free / 1e9:.1f} GB available; run this vocabulary alone (--vocab) to time it"
  )


def run_workload(
  vocab: int,
  num_ids: int,
  dim: int,
  methods,
  bandwidth: float,
  steps: int,
  warmup: int,
  *,
  profile_steps: int = 0,
  huge_pages: bool = True,
) -> dict:
  """Times `methods` (names of `methods.METHODS`) on one workload."""
  ids = zipf_ids(num_ids, vocab)
  unique = int(len(np.unique(ids)))
  # The capacity a user would set from the unique counts the metrics report.
  capacity = 1 << int(np.ceil(np.log2(unique)))
  grads_np = np.random.default_rng(1).normal(size=(num_ids, dim)).astype(np.float32)
  fused, shared, grads = [], None, None
  if any(m != "fbgemm" for m in methods):
    shared = SharedTable(vocab, dim, capacity, huge_pages=huge_pages)
    grads = jax.device_put(grads_np)
    fused = [
      Fused(shared, ids, grads, backend=None if m == "fused" else m[len("fused_") :])
      for m in methods
      if m.startswith("fused")
    ]
  fbgemm = (
    FbgemmBackward(vocab, dim, ids, grads_np, huge_pages=huge_pages)
    if "fbgemm" in methods
    else None
  )
  huge_page_bytes = ({"fbgemm": fbgemm.huge_page_bytes} if fbgemm else {}) | (
    {"jax": shared.huge_page_bytes} if shared else {}
  )
  summary = time_steps(fused + ([fbgemm] if fbgemm else []), steps, warmup)
  for r in fused:
    summary[r.name]["backend"] = r.backend
  profiles = {r.name: profile(r, profile_steps) for r in fused} if profile_steps else None
  skipped = {}
  if "dense" in methods:
    # The dense update holds a table-sized gradient and temporaries beside
    # the table; on the heap this process keeps (`keep_freed_memory`), next
    # to the others' tables, W2 (V = 10M: 5.1 GB a table) grew past 24 GB.
    # So it runs after the others, their tables freed, and in a child
    # process of its own when anything else ran here and its table is not
    # small.
    if list(methods) == ["dense"] or vocab * dim * 4 <= DENSE_IN_PROCESS_BYTES:
      why = _dense_does_not_fit(vocab * dim * 4)
      if why is None:
        summary |= time_steps([Dense(shared, ids, grads)], steps, warmup)
    else:
      del fbgemm, fused, shared
      gc.collect()
      host_memory.release_free_memory()
      dense, why = _dense_in_child(vocab, num_ids, dim, steps, warmup, huge_pages)
      summary |= dense
    if why:
      skipped["dense"] = why
      print(f"V={vocab:,}: dense skipped: {why}", flush=True)
  result = {
    "vocab": vocab,
    "ids": num_ids,
    "dim": dim,
    "unique": unique,
    "unique_capacity": capacity,
    "floor_ms": floor_bytes(unique, num_ids, dim) / bandwidth * 1e3,
    "huge_page_bytes": huge_page_bytes,
    "methods": summary,
    "skipped": skipped,
  }
  if profiles:
    result["profile"] = profiles
  return result


def _dense_in_child(
  vocab: int, num_ids: int, dim: int, steps: int, warmup: int, huge_pages: bool
) -> tuple[dict, str | None]:
  """({"dense": summary} or {}, why it was skipped or None), timed by
  `python -m pallas_emb.bench --methods dense` on the same workload."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "dense.json")
    cmd = [sys.executable, "-m", "pallas_emb.bench", f"--json={out}", f"--vocab={vocab}"]
    cmd += [f"--ids={num_ids}", f"--dim={dim}", f"--steps={steps}", f"--warmup={warmup}"]
    # Only its dense timing is read: its bandwidth is measured on 1 MiB.
    cmd += ["--methods=dense", "--pipeline_steps=0", "--profile_steps=0", f"--copy_bytes={1 << 20}"]
    cmd += [] if huge_pages else ["--nohuge_pages"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      return {}, f"its process failed (exit {proc.returncode}): {proc.stderr[-500:]}"
    with open(out) as f:
      w = json.load(f)["workloads"][0]
  return {k: v for k, v in w["methods"].items() if k == "dense"}, w["skipped"].get("dense")


def run_pipelines(steps: int, num_devices: int, batch_size: int) -> dict:
  """Examples/s of the main job's model with the async and exact pipelines,
  interleaved step by step."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), ("x",))
  dataset = data_lib.SyntheticClickLog()
  runs = {}
  for name, config in (
    ("async", pe.TrainConfig(use_async_emb=True)),
    ("exact", pe.TrainConfig(use_async_emb=True, exact=True)),
  ):
    emb, model = build_ranking(
      dataset, mesh, emb_dim=16, optimizer=pe.RowWiseAdagrad(0.05, half_life_steps=None)
    )
    feeder = GlobalBatches(dataset, batch_size, emb.sharding())
    batches = [feeder.train(i) for i in range(8)]
    tr = pe.make_trainer(emb, model.loss, optax.adam(1e-3), config, batches[0])
    state = tr.init(model.init(jax.random.key(1)), emb.init(jax.random.key(2)), batches[0])
    runs[name] = [tr, state, batches, []]
  for t in range(steps + 2):
    for run in runs.values():
      tr, state, batches, times = run
      tic = time.perf_counter()
      state, m = tr.step(state, batches[t % 8], batches[(t + 1) % 8])
      jax.block_until_ready(m["loss"])
      if t >= 2:
        times.append(time.perf_counter() - tic)
      run[1] = state
  return {
    name: {
      "examples_per_sec": batch_size / float(np.median(run[3])),
      "median_step_ms": 1e3 * float(np.median(run[3])),
      "devices": num_devices,
      "batch_size": batch_size,
    }
    for name, run in runs.items()
  }


def run(config: BenchConfig) -> dict:
  """Runs `config`, writes its JSON and returns the results."""
  tuned = host_memory.keep_freed_memory() if config.keep_freed_memory else False
  methods = list(config.methods)
  skipped = {}
  if "fbgemm" in methods:
    why = fbgemm_available()
    if why:
      methods.remove("fbgemm")
      skipped["fbgemm"] = f"not installed ({why}); pip install '.[bench]'"
  others = OthersCpu()
  bandwidth = copy_bandwidth(config.copy_bytes)
  machine = machine_info(bandwidth, tuned) | {"copy_bytes": config.copy_bytes}
  results = {"machine": machine, "workloads": [], "skipped": skipped}
  if config.workload == "dlrm":
    results["dlrm_stacking"] = run_dlrm_stacking(
      config.steps, config.pipeline_devices, config.pipeline_batch_size, config.dlrm_max_rows
    )
    print("dlrm: " + json.dumps(results["dlrm_stacking"]), flush=True)
    with open(config.json, "w") as f:
      json.dump(results, f, indent=2)
    return results
  order = [(n, v) for n in config.ids for v in config.vocab]
  done = {}
  # Largest table first: its peak (two 5 GB tables and a dense 5 GB gradient
  # at V = 10M) then lands on a fresh heap; run after the smaller workloads,
  # on the heap they fragmented, it outgrew a 23 GB machine.
  for num_ids, vocab in sorted(order, key=lambda nv: (-nv[1], -nv[0])):
    w = run_workload(
      vocab,
      num_ids,
      config.dim,
      methods,
      bandwidth,
      config.steps,
      config.warmup,
      profile_steps=config.profile_steps,
      huge_pages=config.huge_pages,
    )
    done[num_ids, vocab] = w
    # The kept heap would hold this workload's tables next to the next's.
    gc.collect()
    host_memory.release_free_memory()
    line = "  ".join(f"{k} {v['median_ms']:.2f} ms" for k, v in w["methods"].items())
    print(
      f"V={vocab:>11,} N={num_ids:>8,} unique={w['unique']:>7,}  {line}  "
      f"floor {w['floor_ms']:.2f} ms",
      flush=True,
    )
  results["workloads"] = [done[k] for k in order]
  if config.optimizers:
    results["optimizers"] = run_optimizers(
      config.optimizers,
      config.optimizer_vocab,
      config.ids[0],
      config.dim,
      bandwidth,
      config.steps,
      config.warmup,
      profile_steps=config.profile_steps,
      huge_pages=config.huge_pages,
      with_fbgemm="fbgemm" in methods,
    )
  if config.pipeline_steps:
    results["pipelines"] = run_pipelines(
      config.pipeline_steps, config.pipeline_devices, config.pipeline_batch_size
    )
    print(
      "pipelines: "
      + "  ".join(f"{k} {v['examples_per_sec']:.0f} ex/s" for k, v in results["pipelines"].items()),
      flush=True,
    )
  # Other processes share the cores and the memory: the load at the start,
  # the cores they took during the run and the copy bandwidth at the start and
  # the end say how far its times can be trusted (the ratios, interleaved,
  # hold better). The load at the end counts this run's own threads.
  results["machine"]["load_avg_at_start"] = results["machine"].pop("load_avg")
  results["machine"]["load_avg_at_end"] = list(os.getloadavg())
  results["machine"]["others_cpu_share"] = others.share()
  results["machine"]["copy_bandwidth_end_gbps"] = copy_bandwidth(config.copy_bytes) / 1e9
  with open(config.json, "w") as f:
    json.dump(results, f, indent=2)
  if config.plot:
    plot(results, config.plot)
  return results
