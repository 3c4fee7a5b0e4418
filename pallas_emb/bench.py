"""Benchmarks of the fused sparse update, against what a user has without it.

    python -m pallas_emb.bench --json bench.json [--vocab 1000000,10000000]
        [--ids 65536] [--steps 30] [--methods fused,fused_xla,dense,fbgemm]
        [--plot bench.png] [--profile_steps 10]
    python -m pallas_emb.bench --json dlrm.json --workload=dlrm  # see bench_dlrm

Per workload (V rows x D float32, N ids drawn as `(rng(0).zipf(1.1, N) - 1) %
V`, one gradient row per id, row-wise Adagrad with lr 0.01, eps 1e-8, no
decay), in one process, it times the methods of `bench_methods`:
fused (this project's update on the platform's default backend: "native"
on CPU when its library is built), fused_xla (the XLA path), dense (a dense
gradient and row-wise Adagrad over the whole table) and fbgemm (FBGEMM's CPU
backward, when `torch` and `fbgemm_gpu` import: `pip install ".[bench]"`).
The fused methods and fbgemm are interleaved step by step, so the machine's
noise hits them alike; dense, which holds a table-sized gradient, runs after
them with FBGEMM's table freed.

Tables, ours and FBGEMM's alike, are put on transparent huge pages
(`host_memory.use_huge_pages`; --nohuge_pages to measure without). After the
timed steps, --profile_steps more steps of each fused method are profiled
stage by stage (`bench_stages`) into the workload's "profile".

It also measures the memory bandwidth (a 1 GiB copy) and reports the floor
`bytes / bandwidth` with bytes = unique*D*4*2 + unique*4*2 + N*D*4 + N*4 (read
and write each touched row and accumulator once, read each gradient row and id
once), and, with --pipeline_steps, the examples/s of the main job's model with
the async and the exact embedding pipelines. Times are medians (and min/max)
over --steps steps after --warmup; a benchmark is a program, not a test.
--plot draws step time against V (per N) and against N (per V), log-log.
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
from pallas_emb import bench_stages  # noqa: E402
from pallas_emb import host_memory  # noqa: E402
from pallas_emb.bench_methods import (  # noqa: E402  pylint: disable=unused-import
    METHODS, Dense, FbgemmBackward, Fused, SharedTable, fbgemm_available)

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
  flags.DEFINE_list("methods", list(METHODS), "Methods to time.")
  flags.DEFINE_string("plot", None, "Write a log-log plot of step time vs V here (.png).")
  flags.DEFINE_integer("pipeline_steps", 40, "Steps of the async vs exact pipeline comparison (0: skip).")
  flags.DEFINE_integer("pipeline_devices", 8, "Devices of the pipeline comparison (simulated on CPU).")
  flags.DEFINE_integer("pipeline_batch_size", 1024, "Batch size of the pipeline comparison.")
  flags.DEFINE_integer("profile_steps", 10, "Steps of the per-stage profile of each fused method "
                       "(0: none).")
  flags.DEFINE_bool("huge_pages", True, "Put the tables (ours and FBGEMM's) on transparent huge "
                    "pages (see pallas_emb.host_memory).")
  flags.DEFINE_bool("keep_freed_memory", True, "Keep freed heap memory (see pallas_emb.host_memory); "
                    "--nokeep_freed_memory measures with the allocator's defaults.")



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


def _summary(times, peak_rss) -> dict:
  ms = np.asarray(times) * 1e3
  return {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()),
          "max_ms": float(ms.max()), "peak_rss_mb": peak_rss / 2**20,
          "steps": len(ms)}


def _time_steps(runners, steps: int, warmup: int) -> dict:
  """name -> the summary of `steps` timed steps of each runner, interleaved
  step by step (noise hits every method alike), after `warmup` steps."""
  for r in runners:  # compile, first touch
    for _ in range(warmup):
      r.step()
  times = {r.name: [] for r in runners}
  rss = {r.name: PeakRss() for r in runners}
  for _ in range(steps):
    for r in runners:
      with rss[r.name]:
        tic = time.perf_counter()
        inner = r.step()
        elapsed = time.perf_counter() - tic
      times[r.name].append(inner if isinstance(inner, float) else elapsed)
  return {name: _summary(t, rss[name].peak) for name, t in times.items()}


def run_workload(vocab: int, num_ids: int, dim: int, methods, bandwidth: float,
                 steps: int, warmup: int, *, profile_steps: int = 0,
                 huge_pages: bool = True) -> dict:
  """Times `methods` (names of `bench_methods.METHODS`) on one workload."""
  ids = zipf_ids(num_ids, vocab)
  unique = int(len(np.unique(ids)))
  # The capacity a user would set from the unique counts the metrics report.
  capacity = 1 << int(np.ceil(np.log2(unique)))
  grads_np = np.random.default_rng(1).normal(size=(num_ids, dim)).astype(np.float32)
  fused, shared, grads = [], None, None
  if any(m != "fbgemm" for m in methods):
    shared = SharedTable(vocab, dim, capacity, huge_pages=huge_pages)
    grads = jax.device_put(grads_np)
    fused = [Fused(shared, ids, grads, backend=None if m == "fused" else m[len("fused_"):])
             for m in methods if m.startswith("fused")]
  fbgemm = (FbgemmBackward(vocab, dim, ids, grads_np, huge_pages=huge_pages)
            if "fbgemm" in methods else None)
  huge_page_bytes = ({"fbgemm": fbgemm.huge_page_bytes} if fbgemm else {}) | (
      {"jax": shared.huge_page_bytes} if shared else {})
  summary = _time_steps(fused + ([fbgemm] if fbgemm else []), steps, warmup)
  if "dense" in methods:
    # The dense update holds a table-sized gradient beside the table. Next
    # to FBGEMM's own copy of the table, W2 (V = 10M: 5.1 GB each) outgrew a
    # 24 GB machine, so dense is timed after the others, FBGEMM's table freed.
    del fbgemm
    gc.collect()
    host_memory.release_free_memory()
    summary |= _time_steps([Dense(shared, ids, grads)], steps, warmup)
  for r in fused:
    summary[r.name]["backend"] = r.backend
  result = {"vocab": vocab, "ids": num_ids, "dim": dim, "unique": unique,
            "unique_capacity": capacity,
            "floor_ms": floor_bytes(unique, num_ids, dim) / bandwidth * 1e3,
            "huge_page_bytes": huge_page_bytes, "methods": summary}
  if profile_steps:
    result["profile"] = {r.name: profile(r, profile_steps) for r in fused}
  return result


def profile(r: Fused, steps: int) -> dict:
  """The per-stage profile of one fused method; see `bench_stages`."""
  stages = (bench_stages.native_stages(r.step, lambda: r.plan(r.ids), steps)
            if r.backend == "native" else
            bench_stages.xla_stages(r.emb, r.shared, r.ids, r.grads, r.step, steps))
  return {"backend": r.backend, "stages_ms": stages}


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
    emb, model = build_ranking(dataset, mesh, emb_dim=16,
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
          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
          "load_avg": list(os.getloadavg())}
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
  """Log-log step time against V (one line per method and N) and, when the
  run has several N, against N (one line per method and V)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ws = results["workloads"]
  sizes = {"vocab": sorted({w["vocab"] for w in ws}), "ids": sorted({w["ids"] for w in ws})}
  axes_over = [x for x in ("vocab", "ids") if len(sizes[x]) > 1] or ["vocab"]
  fig, axes = plt.subplots(1, len(axes_over), figsize=(6.5 * len(axes_over), 4.5), squeeze=False)
  methods = sorted({m for w in ws for m in w["methods"]})
  colors = {m: f"C{i}" for i, m in enumerate(methods)}
  for ax, x in zip(axes[0], axes_over):
    other = "ids" if x == "vocab" else "vocab"
    styles = dict(zip(sizes[other], ["-", "--", ":", "-."] * 4))
    markers = dict(zip(sizes[other], "osD^v<>" * 4))
    for method in methods:
      for o in sizes[other]:
        pts = sorted((w[x], w["methods"][method]["median_ms"]) for w in ws
                     if w[other] == o and method in w["methods"])
        if pts:
          ax.plot(*zip(*pts), color=colors[method], ls=styles[o], marker=markers[o],
                  label=f"{method}, {'N' if other == 'ids' else 'V'}={o:,}")
    for o in sizes[other]:
      pts = sorted((w[x], w["floor_ms"]) for w in ws if w[other] == o)
      ax.plot(*zip(*pts), color="k", ls=styles[o], lw=0.8, alpha=0.6,
              label=f"memory floor, {'N' if other == 'ids' else 'V'}={o:,}")
    ax.set(xscale="log", yscale="log",
           xlabel="table rows V" if x == "vocab" else "ids per step N",
           ylabel="update step time (ms, median)",
           title=f"row-wise Adagrad update, D={ws[0]['dim']}")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def run(argv=()) -> dict:
  del argv
  tuned = host_memory.keep_freed_memory() if FLAGS.keep_freed_memory else False
  methods = [m.strip() for m in FLAGS.methods]
  unknown = sorted(set(methods) - set(METHODS))
  if unknown:
    raise app.UsageError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}.")
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
  order = [(int(float(n)), int(float(v))) for n in FLAGS.ids for v in FLAGS.vocab]
  done = {}
  # Largest table first: its peak (two 5 GB tables and a dense 5 GB gradient
  # at V = 10M) then lands on a fresh heap; run after the smaller workloads,
  # on the heap they fragmented, it outgrew a 23 GB machine.
  for num_ids, vocab in sorted(order, key=lambda nv: (-nv[1], -nv[0])):
    w = run_workload(vocab, num_ids, FLAGS.dim, methods, bandwidth, FLAGS.steps, FLAGS.warmup,
                     profile_steps=FLAGS.profile_steps, huge_pages=FLAGS.huge_pages)
    done[num_ids, vocab] = w
    # The kept heap would hold this workload's tables next to the next's.
    gc.collect()
    host_memory.release_free_memory()
    line = "  ".join(f"{k} {v['median_ms']:.2f} ms" for k, v in w["methods"].items())
    print(f"V={vocab:>11,} N={num_ids:>8,} unique={w['unique']:>7,}  {line}  "
          f"floor {w['floor_ms']:.2f} ms", flush=True)
  results["workloads"] = [done[k] for k in order]
  if FLAGS.pipeline_steps:
    results["pipelines"] = run_pipelines(FLAGS.pipeline_steps, FLAGS.pipeline_devices,
                                         FLAGS.pipeline_batch_size)
    print("pipelines: " + "  ".join(f"{k} {v['examples_per_sec']:.0f} ex/s"
                                    for k, v in results["pipelines"].items()), flush=True)
  # Other processes share the cores: the load during the run says how far
  # its absolute times can be trusted (the ratios, interleaved, hold better).
  results["machine"]["load_avg_at_start"] = results["machine"].pop("load_avg")
  results["machine"]["load_avg_at_end"] = list(os.getloadavg())
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
