"""Benchmarks of the fused sparse update, against what a user has without it.

    python -m pallas_emb.bench --json bench.json [--vocab 1000000,10000000]
        [--ids 65536] [--steps 30] [--methods fused,fused_xla,dense,fbgemm]
        [--plot bench.png] [--profile_steps 10]
    python -m pallas_emb.bench --json dlrm.json --workload=dlrm  # see pallas_emb.bench.dlrm
    python -m pallas_emb.bench --json b.json --optimizers=sgd,lazy_adam,ftrl  # see .optimizers

Per workload (V rows x D float32, N ids drawn as `(rng(0).zipf(1.1, N) - 1) %
V`, one gradient row per id, row-wise Adagrad with lr 0.01, eps 1e-8, no
decay), in one process, it times the methods of `pallas_emb.bench.methods`:
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
stage by stage (`pallas_emb.bench.stages`) into the workload's "profile".

It also measures the memory bandwidth (a 1 GiB copy, --copy_bytes) and reports the floor
`bytes / bandwidth` with bytes = unique*D*4*2 + unique*4*2 + N*D*4 + N*4 (read
and write each touched row and accumulator once, read each gradient row and id
once), and, with --pipeline_steps, the examples/s of the main job's model with
the async and the exact embedding pipelines. Times are medians (and min/max)
over --steps steps after --warmup; a benchmark is a program, not a test.
--plot draws step time against V (per N) and against N (per V), log-log.
--optimizers adds, on V = --optimizer_vocab and the first N, every listed
optimizer's fused step against FBGEMM's nearest (`pallas_emb.bench.optimizers`).
The run records the load average and the copy bandwidth at its start and end;
`pallas_emb.bench.report` refuses to put a busy run's figures in the docs.
"""

import os

from pallas_emb.job import cpu_devices, startup

# Simulated devices for the pipeline comparison (the update methods use
# one), asked for before JAX creates its CPU client; no TPU probe on a
# machine without one (libtpu's errors), no JAX INFO lines.
cpu_devices.request("pipeline_devices", 8)
startup.cpu_unless_accelerator()
startup.quiet_jax_logging()
# torch's OpenMP threads spin after each FBGEMM call and would steal the
# cores from the method timed next; sleeping threads keep the interleaving
# fair (measured: fused 14.1 -> 12.2 ms, fbgemm 4.9 -> 4.2 ms on W1). Set
# before torch is first imported, which reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from absl import app, flags  # noqa: E402

from pallas_emb.bench.methods import METHODS  # noqa: E402
from pallas_emb.bench.optimizers import PAIRINGS  # noqa: E402
from pallas_emb.bench.run import BenchConfig, run  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("json", None, "Write the results to this JSON file.", required=True)
flags.DEFINE_enum(
  "workload",
  "update",
  ["update", "dlrm"],
  "update: the sparse update benchmarks; dlrm: the DLRM-shaped step with stacking off vs on.",
)
flags.DEFINE_integer("dlrm_max_rows", 20_000, "--workload=dlrm: cap of every table's rows.")
flags.DEFINE_list("vocab", ["1000000", "10000000"], "Table sizes V (rows).")
flags.DEFINE_list("ids", ["65536"], "Ids per step N.")
flags.DEFINE_integer("dim", 128, "Row width D.")
flags.DEFINE_integer("steps", 30, "Timed steps per method and workload (>= 20 recommended).")
flags.DEFINE_integer("warmup", 3, "Untimed steps first (compilation, first touch).")
flags.DEFINE_list("methods", list(METHODS), "Methods to time.")
flags.DEFINE_string("plot", None, "Write a log-log plot of step time vs V here (.png).")
flags.DEFINE_integer(
  "pipeline_steps", 40, "Steps of the async vs exact pipeline comparison (0: skip)."
)
flags.DEFINE_integer(
  "pipeline_devices", 8, "Devices of the pipeline comparison (simulated on CPU)."
)
flags.DEFINE_integer("pipeline_batch_size", 1024, "Batch size of the pipeline comparison.")
flags.DEFINE_integer(
  "profile_steps", 10, "Steps of the per-stage profile of each fused method (0: none)."
)
flags.DEFINE_bool(
  "huge_pages",
  True,
  "Put the tables (ours and FBGEMM's) on transparent huge pages (see pallas_emb.job.host_memory).",
)
flags.DEFINE_list(
  "optimizers",
  [],
  f"Optimizers to compare with FBGEMM's nearest on V = --optimizer_vocab: {', '.join(PAIRINGS)}.",
)
flags.DEFINE_integer("optimizer_vocab", 1_000_000, "Table size V of the --optimizers comparison.")
flags.DEFINE_integer(
  "copy_bytes",
  1 << 30,
  "Bytes of the array copy that measures the memory bandwidth (the floor's denominator) "
  "at the start and the end.",
  lower_bound=1 << 20,
)
flags.DEFINE_bool(
  "keep_freed_memory",
  True,
  "Keep freed heap memory (see pallas_emb.job.host_memory); "
  "--nokeep_freed_memory measures with the allocator's defaults.",
)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag.")
  methods = [m.strip() for m in FLAGS.methods]
  unknown = sorted(set(methods) - set(METHODS))
  if unknown:
    raise app.UsageError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}.")
  optimizers = [o.strip() for o in FLAGS.optimizers]
  unknown = sorted(set(optimizers) - set(PAIRINGS))
  if unknown:
    raise app.UsageError(f"--optimizers: unknown {unknown}; choose from {', '.join(PAIRINGS)}.")
  run(
    BenchConfig(
      json=FLAGS.json,
      workload=FLAGS.workload,
      dlrm_max_rows=FLAGS.dlrm_max_rows,
      vocab=tuple(int(float(v)) for v in FLAGS.vocab),
      ids=tuple(int(float(n)) for n in FLAGS.ids),
      dim=FLAGS.dim,
      steps=FLAGS.steps,
      warmup=FLAGS.warmup,
      methods=tuple(methods),
      plot=FLAGS.plot,
      pipeline_steps=FLAGS.pipeline_steps,
      pipeline_devices=FLAGS.pipeline_devices,
      pipeline_batch_size=FLAGS.pipeline_batch_size,
      profile_steps=FLAGS.profile_steps,
      huge_pages=FLAGS.huge_pages,
      keep_freed_memory=FLAGS.keep_freed_memory,
      copy_bytes=FLAGS.copy_bytes,
      optimizers=tuple(optimizers),
      optimizer_vocab=FLAGS.optimizer_vocab,
    )
  )


if __name__ == "__main__":
  app.run(main)
