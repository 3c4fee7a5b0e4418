"""Benchmarks of the fused sparse update, against what a user has without it.

    python -m pallas_emb.bench --json bench.json [--vocab 1000000,10000000]
        [--ids 65536] [--steps 30] [--methods fused,dense,fbgemm] [--plot bench.png]
    python -m pallas_emb.bench --json dlrm.json --workload=dlrm  # see bench_dlrm

Per workload (V rows x D float32, N ids drawn as `(rng(0).zipf(1.1, N) - 1) %
V`, one gradient row per id, row-wise Adagrad with lr 0.01, eps 1e-8, no
decay), in one process and interleaved step by step, so that the machine's
noise hits every method alike:

* fused: this project's sparse update (dedup, segment sum, fused row update
  in place), XLA path, one device: `apply_gradients(plan(ids), grads)`;
* dense: what a JAX user writes without it: `jax.vjp` of the lookup (a dense
  (V, D) gradient) and row-wise Adagrad over the whole table, jitted, donated;
* fbgemm: FBGEMM's CPU table-batched embedding with EXACT_ROWWISE_ADAGRAD,
  SUM pooling of bags of one id, timed as backward only (when `torch` and
  `fbgemm_gpu` import: `pip install ".[bench]"`).

It also measures the memory bandwidth (a 1 GiB copy) and reports the floor
`bytes / bandwidth` with bytes = unique*D*4*2 + unique*4*2 + N*D*4 + N*4 (read
and write each touched row and accumulator once, read each gradient row and id
once), and, with --pipeline_steps, the examples/s of the main job's model with
the async and the exact embedding pipelines. Times are medians (and min/max)
over --steps steps after --warmup; a benchmark is a program, not a test.
"""

from __future__ import annotations

import os
import re
import sys

# Simulated devices for the pipeline comparison; the update methods use one.
_COUNT_FLAG = "--xla_force_host_platform_device_count"
_m = re.search(r"--pipeline_devices[= ](\d+)", " ".join(sys.argv[1:]))
if __name__ == "__main__" and _COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" {_COUNT_FLAG}={_m.group(1) if _m else 8}").strip()

import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_emb as pe  # noqa: E402
from pallas_emb import host_memory  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The program's flags; defined only when it runs, so that importing this
  module (the notebook does) adds none to the importer's absl flags."""
  flags.DEFINE_string("json", None, "Write the results to this JSON file.", required=True)
  flags.DEFINE_enum("workload", "update", ["update", "dlrm"], "update: the sparse update "
                    "benchmarks; dlrm: the DLRM-shaped step with stacking off vs on.")
  flags.DEFINE_integer("dlrm_max_rows", 20_000, "--workload=dlrm: cap of every table's rows.")
  flags.DEFINE_list("vocab", ["1000000", "10000000"], "Table sizes V (rows).")
  flags.DEFINE_list("ids", ["65536"], "Ids per step N.")
  flags.DEFINE_integer("dim", 128, "Row width D.")
  flags.DEFINE_integer("steps", 30, "Timed steps per method and workload (>= 20 recommended).")
  flags.DEFINE_integer("warmup", 3, "Untimed steps first (compilation, first touch).")
  flags.DEFINE_list("methods", ["fused", "dense", "fbgemm"], "Methods to time.")
  flags.DEFINE_string("plot", None, "Write a log-log plot of step time vs V here (.png).")
  flags.DEFINE_integer("pipeline_steps", 40, "Steps of the async vs exact pipeline comparison (0: skip).")
  flags.DEFINE_integer("pipeline_devices", 8, "Devices of the pipeline comparison (simulated on CPU).")
  flags.DEFINE_integer("pipeline_batch_size", 1024, "Batch size of the pipeline comparison.")
  flags.DEFINE_bool("keep_freed_memory", True, "Keep freed heap memory (see pallas_emb.host_memory); "
                    "--nokeep_freed_memory measures with the allocator's defaults.")


LEARNING_RATE, EPS = 0.01, 1e-8


def zipf_ids(num_ids: int, vocab: int) -> np.ndarray:
  """The benchmark's id distribution: Zipf(1.1) folded into the vocabulary."""
  return ((np.random.default_rng(0).zipf(1.1, num_ids) - 1) % vocab).astype(np.int32)


def floor_bytes(unique: int, num_ids: int, dim: int) -> int:
  return unique * dim * 4 * 2 + unique * 4 * 2 + num_ids * dim * 4 + num_ids * 4


def copy_bandwidth(size: int = 1 << 30, repeats: int = 5) -> float:
  """Bytes per second moved by a `size`-byte array copy (read + write)."""
  src = np.ones(size // 4, np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)
  times = []
  for _ in range(repeats):
    tic = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - tic)
  return 2 * size / float(np.median(times))


class PeakRss:
  """Samples this process's resident set while active; reports the peak."""

  def __init__(self, interval: float = 0.002):
    self.interval, self.peak, self._stop = interval, 0, threading.Event()
    self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

  def _rss(self) -> int:
    try:
      with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * self._page
    except OSError:
      import resource  # pylint: disable=g-import-not-at-top
      return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

  def __enter__(self):
    self.peak = self._rss()
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()
    return self

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, self._rss())
      time.sleep(self.interval)

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, self._rss())


class SharedTable:
  """One (V, D) table and accumulator in JAX, passed between the JAX
  methods (each donates it and hands on the result), so a 10M-row workload
  holds a single table."""

  def __init__(self, vocab: int, dim: int, capacity: int):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    spec = pe.TableSpec("t", vocab, dim, dtype=jnp.float32,
                        optimizer=pe.RowWiseAdagrad(LEARNING_RATE, eps=EPS,
                                                    half_life_steps=None),
                        initializer=jax.nn.initializers.zeros,
                        unique_capacity=capacity)
    self.emb = pe.ShardedEmbedding([spec], [pe.FeatureSpec("f", "t", "sum")],
                                   mesh, "x", backend="xla")
    self.state = self.emb.init(jax.random.key(0))


class Fused:
  name = "fused"

  def __init__(self, shared: SharedTable, ids: np.ndarray, grads: jax.Array):
    self.shared, emb = shared, shared.emb
    self.ids = jax.device_put(ids.reshape(-1, 1))
    self.grads = grads
    self._step = jax.jit(
        lambda state, ids, g: emb.apply_gradients(state, emb.plan({"f": ids}),
                                                  {"f": g})[0],
        donate_argnums=0)

  def step(self):
    self.shared.state = self._step(self.shared.state, self.ids, self.grads)
    jax.block_until_ready(self.shared.state)


class Dense:
  name = "dense"

  def __init__(self, shared: SharedTable, ids: np.ndarray, grads: jax.Array):
    self.shared = shared
    self.ids, self.grads = jax.device_put(ids), grads

    def step(table, acc, ids, g):
      _, vjp = jax.vjp(lambda t: t[ids], table)
      (dense_grad,) = vjp(g)
      # The accumulator as (rows, 1), whatever its stored shape.
      rows = acc.reshape(-1, 1) + jnp.mean(dense_grad * dense_grad, axis=1,
                                           keepdims=True)
      return (table - LEARNING_RATE * dense_grad / (jnp.sqrt(rows) + EPS),
              rows.reshape(acc.shape))

    self._step = jax.jit(step, donate_argnums=(0, 1))

  def step(self):
    ts = self.shared.state["t"]
    table, acc = self._step(ts.table, ts.slots["acc"], self.ids, self.grads)
    self.shared.state = {"t": pe.TableState(table, {"acc": acc}, ts.step)}
    jax.block_until_ready(table)


class FbgemmBackward:
  name = "fbgemm"

  def __init__(self, vocab: int, dim: int, ids: np.ndarray, grads: np.ndarray):
    import torch  # pylint: disable=g-import-not-at-top
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # pylint: disable=g-import-not-at-top
        EmbeddingLocation, PoolingMode)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # pylint: disable=g-import-not-at-top
        ComputeDevice, OptimType, SplitTableBatchedEmbeddingBagsCodegen)
    self.torch = torch
    self.module = SplitTableBatchedEmbeddingBagsCodegen(
        [(vocab, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LEARNING_RATE,
        eps=EPS, pooling_mode=PoolingMode.SUM)
    self.ids = torch.from_numpy(ids.astype(np.int64))
    self.offsets = torch.arange(len(ids) + 1, dtype=torch.int64)
    self.grads = torch.from_numpy(np.asarray(grads))

  def step(self) -> float:
    out = self.module(self.ids, self.offsets)  # the forward is not timed
    tic = time.perf_counter()
    out.backward(self.grads)
    return time.perf_counter() - tic


def fbgemm_available() -> str | None:
  """None if FBGEMM imports, else why not."""
  try:
    import torch  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    import fbgemm_gpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"
  return None


def _summary(times, peak_rss) -> dict:
  ms = np.asarray(times) * 1e3
  return {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()),
          "max_ms": float(ms.max()), "peak_rss_mb": peak_rss / 2**20,
          "steps": len(ms)}


def run_workload(vocab: int, num_ids: int, dim: int, methods, bandwidth: float,
                 steps: int, warmup: int) -> dict:
  ids = zipf_ids(num_ids, vocab)
  unique = int(len(np.unique(ids)))
  # The capacity a user would set from the unique counts the metrics report.
  capacity = 1 << int(np.ceil(np.log2(unique)))
  grads_np = np.random.default_rng(1).normal(size=(num_ids, dim)).astype(np.float32)
  runners = []
  needs_jax = [m for m in methods if m in ("fused", "dense")]
  if needs_jax:
    shared = SharedTable(vocab, dim, capacity)
    grads = jax.device_put(grads_np)
    for m in needs_jax:
      runners.append((Fused if m == "fused" else Dense)(shared, ids, grads))
  if "fbgemm" in methods:
    runners.append(FbgemmBackward(vocab, dim, ids, grads_np))
  for r in runners:  # compile, first touch
    for _ in range(warmup):
      r.step()
  times = {r.name: [] for r in runners}
  rss = {r.name: PeakRss() for r in runners}
  for _ in range(steps):
    for r in runners:  # interleaved: noise hits every method alike
      with rss[r.name]:
        tic = time.perf_counter()
        inner = r.step()
        elapsed = time.perf_counter() - tic
      times[r.name].append(inner if isinstance(inner, float) else elapsed)
  floor_s = floor_bytes(unique, num_ids, dim) / bandwidth
  return {"vocab": vocab, "ids": num_ids, "dim": dim, "unique": unique,
          "unique_capacity": capacity, "floor_ms": floor_s * 1e3,
          "methods": {name: _summary(t, rss[name].peak) for name, t in times.items()}}


def run_pipelines(steps: int, num_devices: int, batch_size: int) -> dict:
  """Examples/s of the main job's model with the async and exact pipelines,
  interleaved step by step."""
  import optax  # pylint: disable=g-import-not-at-top
  from pallas_emb import data as data_lib  # pylint: disable=g-import-not-at-top
  from pallas_emb.data.feed import GlobalBatches  # pylint: disable=g-import-not-at-top
  from pallas_emb.model import build_ranking  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), ("x",))
  dataset = data_lib.SyntheticClickLog()
  runs = {}
  for name, config in (("async", pe.TrainConfig(use_async_emb=True)),
                       ("exact", pe.TrainConfig(use_async_emb=True, exact=True))):
    emb, model = build_ranking(dataset, mesh, emb_dim=16, backend="xla",
                               optimizer=pe.RowWiseAdagrad(0.05, half_life_steps=None))
    feeder = GlobalBatches(dataset, batch_size, emb.sharding())
    batches = [feeder.train(i) for i in range(8)]
    tr = pe.make_trainer(emb, model.loss, optax.adam(1e-3), config, batches[0])
    state = tr.init(model.init(jax.random.key(1)), emb.init(jax.random.key(2)), batches[0])
    runs[name] = [tr, state, batches, []]
  for t in range(steps + 2):
    for name, run in runs.items():
      tr, state, batches, times = run
      tic = time.perf_counter()
      state, m = tr.step(state, batches[t % 8], batches[(t + 1) % 8])
      jax.block_until_ready(m["loss"])
      if t >= 2:
        times.append(time.perf_counter() - tic)
      run[1] = state
  return {name: {"examples_per_sec": batch_size / float(np.median(run[3])),
                 "median_step_ms": 1e3 * float(np.median(run[3])), "devices": num_devices,
                 "batch_size": batch_size}
          for name, run in runs.items()}


def machine_info(bandwidth: float, malloc_tuned: bool) -> dict:
  info = {"platform": platform.platform(), "python": platform.python_version(),
          "cpus": os.cpu_count(), "jax": jax.__version__,
          "jax_backend": jax.default_backend(), "copy_bandwidth_gbps": bandwidth / 1e9,
          "keep_freed_memory": malloc_tuned,
          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
  try:
    with open("/proc/cpuinfo") as f:
      models = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    info["cpu"] = models[0] if models else platform.processor()
    with open("/proc/meminfo") as f:
      info["mem_gb"] = int(f.readline().split()[1]) / 2**20
  except OSError:
    info["cpu"] = platform.processor()
  if fbgemm_available() is None:
    import torch  # pylint: disable=g-import-not-at-top
    import fbgemm_gpu  # pylint: disable=g-import-not-at-top
    info["torch"], info["fbgemm_gpu"] = torch.__version__, fbgemm_gpu.__version__
    info["torch_threads"] = torch.get_num_threads()
  return info


def plot(results: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  num_ids = results["workloads"][0]["ids"]
  ws = sorted((w for w in results["workloads"] if w["ids"] == num_ids), key=lambda w: w["vocab"])
  for method in sorted({m for w in ws for m in w["methods"]}):
    pts = [(w["vocab"], w["methods"][method]["median_ms"]) for w in ws if method in w["methods"]]
    ax.plot(*zip(*pts), marker="o", label=method)
  ax.plot([w["vocab"] for w in ws], [w["floor_ms"] for w in ws], "k--", label="memory floor")
  ax.set(xscale="log", yscale="log", xlabel="table rows V",
         ylabel="update step time (ms, median)",
         title=f"row-wise Adagrad update, N={num_ids} ids, D={ws[0]['dim']}")
  ax.legend()
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def run(argv=()) -> dict:
  del argv
  tuned = host_memory.keep_freed_memory() if FLAGS.keep_freed_memory else False
  methods = [m.strip() for m in FLAGS.methods]
  unknown = sorted(set(methods) - {"fused", "dense", "fbgemm"})
  if unknown:
    raise app.UsageError(f"--methods: unknown {unknown}; choose from fused, dense, fbgemm.")
  skipped = {}
  if "fbgemm" in methods:
    why = fbgemm_available()
    if why:
      methods.remove("fbgemm")
      skipped["fbgemm"] = f"not installed ({why}); pip install '.[bench]'"
  bandwidth = copy_bandwidth()
  results = {"machine": machine_info(bandwidth, tuned), "workloads": [], "skipped": skipped}
  if FLAGS.workload == "dlrm":
    from pallas_emb.bench_dlrm import run_dlrm_stacking  # pylint: disable=g-import-not-at-top
    results["dlrm_stacking"] = run_dlrm_stacking(
        FLAGS.steps, FLAGS.pipeline_devices, FLAGS.pipeline_batch_size, FLAGS.dlrm_max_rows)
    print("dlrm: " + json.dumps(results["dlrm_stacking"]), flush=True)
    with open(FLAGS.json, "w") as f:
      json.dump(results, f, indent=2)
    return results
  for num_ids in (int(float(x)) for x in FLAGS.ids):
    for vocab in (int(float(x)) for x in FLAGS.vocab):
      w = run_workload(vocab, num_ids, FLAGS.dim, methods, bandwidth, FLAGS.steps, FLAGS.warmup)
      results["workloads"].append(w)
      # The kept heap would hold this workload's tables next to the next's.
      gc.collect()
      host_memory.release_free_memory()
      line = "  ".join(f"{k} {v['median_ms']:.2f} ms" for k, v in w["methods"].items())
      print(f"V={vocab:>11,} N={num_ids:>8,} unique={w['unique']:>7,}  {line}  "
            f"floor {w['floor_ms']:.2f} ms", flush=True)
  if FLAGS.pipeline_steps:
    results["pipelines"] = run_pipelines(FLAGS.pipeline_steps, FLAGS.pipeline_devices,
                                         FLAGS.pipeline_batch_size)
    print("pipelines: " + "  ".join(f"{k} {v['examples_per_sec']:.0f} ex/s"
                                    for k, v in results["pipelines"].items()), flush=True)
  with open(FLAGS.json, "w") as f:
    json.dump(results, f, indent=2)
  if FLAGS.plot:
    plot(results, FLAGS.plot)
  return results


def main(argv):
  # torch's OpenMP threads spin after each FBGEMM call and would steal the
  # cores from the method timed next; sleeping threads keep the interleaving
  # fair (measured: fused 14.1 -> 12.2 ms, fbgemm 4.9 -> 4.2 ms on W1). Set
  # before torch is first imported, which reads it once.
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  run(argv)


if __name__ == "__main__":
  define_flags()
  app.run(main)
