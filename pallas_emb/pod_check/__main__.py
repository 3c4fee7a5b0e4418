"""`python -m pallas_emb.pod_check`: compile a training step for TPU pods.

    python -m pallas_emb.pod_check --topology=v5e:2x2,v5e:4x4 \
        --workload=w_tpu --vocab=1000000 --json=report.json
    python -m pallas_emb.pod_check --config=model.json  # your own tables
    python -m pallas_emb.pod_check --workload=w_tpu --dynamic  # an id map

Prints one row per topology and pipeline (per chip: table and slot bytes,
temp, XLA's bytes accessed against the floor, all_to_all bytes, table-sized
copies, kernel launches, overlapped collectives) and writes the full reports
as JSON. Needs libtpu: `pip install "pallas-emb[tpu]"`. Run it without
network access if you can (`unshare -n python -m pallas_emb.pod_check ...`):
libtpu has nothing to reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

from pallas_emb.pod_check import env

EXAMPLES_PER_CHIP = 4096  # W-TPU's batch per chip


def _parse(argv):
  p = argparse.ArgumentParser(
    prog="python -m pallas_emb.pod_check", description=__doc__.split("\n\n")[0]
  )
  p.add_argument(
    "--topology",
    default="v5e:2x2",
    help="comma-separated TPU topologies (v5e:2x2, v6e:2x2, v5p:2x2x1, v5e:4x4, ...)",
  )
  p.add_argument(
    "--stacking",
    default="auto",
    choices=["auto", "off"],
    help="table stacking (pallas_emb.stacking)",
  )
  p.add_argument(
    "--dlrm_max_rows",
    type=int,
    default=20_000,
    help="--workload=dlrm: cap of every table's rows (0: Criteo's)",
  )
  p.add_argument(
    "--workload",
    default="main",
    choices=["main", "w_tpu", "dlrm"],
    help="main: the main job's model; w_tpu: one item table "
    "read by `item` (1 id) and `history` (20 ids)",
  )
  p.add_argument(
    "--config",
    default=None,
    help="a JSON file of your own tables and features (pallas_emb.pod_check.config); "
    "replaces --workload, --vocab, --dim, --dtype and --optimizer",
  )
  p.add_argument("--pipelines", default="async,exact", help="comma-separated: async, exact, sync")
  p.add_argument(
    "--dynamic",
    action="store_true",
    help="w_tpu: its table with a DynamicVocabulary (LFU, probe limit 16, a sweep every 4 "
    "steps), compiled beside the same step over a static table (pallas_emb.pod_check.dynamic); "
    "replaces --pipelines",
  )
  p.add_argument("--vocab", type=int, default=1_000_000, help="w_tpu: rows of the item table")
  p.add_argument(
    "--dim",
    default=None,
    help="table width (default: 128 for w_tpu, 16 for main); comma-separated: each one",
  )
  p.add_argument(
    "--dtype", default="float32", help="float32 or bfloat16; comma-separated: each one"
  )
  p.add_argument(
    "--optimizer",
    default="rowwise_adagrad",
    help=f"the embedding optimizer of every table, of {', '.join(sorted(OPTIMIZERS))}; "
    "comma-separated: each one (with several --dim, --dtype or --optimizer every "
    "combination compiles, in this process)",
  )
  p.add_argument(
    "--examples_per_chip",
    type=int,
    default=None,
    help=f"the batch per chip (default {EXAMPLES_PER_CHIP}; with --config, the file's if it "
    "sets one, which this flag overrides)",
  )
  p.add_argument("--unique_capacity", type=int, default=None)
  p.add_argument("--route_capacity", type=int, default=None)
  p.add_argument(
    "--no_async_all_to_all", action="store_true", help="leave XLA:TPU's all-to-alls synchronous"
  )
  p.add_argument(
    "--forms",
    default="auto",
    choices=["auto", "block", "xla"],
    help="the kernels' forms on the TPU (pallas_emb.kernels.forms): the cost model's pick "
    "(auto), or every table's gather and update in one form; each report says which ran",
  )
  p.add_argument("--json", default=None, help="write the reports here")
  p.add_argument(
    "--hlo_dir", default=None, help="write each compiled step's HLO text into this directory"
  )
  args = p.parse_args(argv)
  for name in ("vocab", "examples_per_chip", "unique_capacity", "route_capacity"):
    value = getattr(args, name)
    if value is not None and value < 1:
      p.error(f"--{name} must be a positive int, got {value}")
  args.dim = _choices(p, "dim", args.dim, None) if args.dim else [None]
  args.dtype = _choices(p, "dtype", args.dtype, ("float32", "bfloat16"))
  args.optimizer = _choices(p, "optimizer", args.optimizer, sorted(OPTIMIZERS))
  if args.config and len(args.dim) * len(args.dtype) * len(args.optimizer) > 1:
    p.error("--config sets each table's dim, dtype and optimizer: pass no lists with it")
  if args.dynamic and (args.config or args.workload != "w_tpu"):
    p.error("--dynamic compiles the w_tpu workload: pass --workload=w_tpu and no --config")
  return args


def _choices(parser, name: str, text: str, allowed) -> list:
  """The comma-separated values of --name: each one of `allowed`, or
  positive ints where `allowed` is None."""
  values = [v.strip() for v in text.split(",") if v.strip()]
  if not values:
    parser.error(f"--{name} is empty")
  for v in values:
    if allowed is None and not (v.isdigit() and int(v) > 0):
      parser.error(f"--{name} takes positive ints, got {v!r}")
    if allowed is not None and v not in allowed:
      parser.error(f"--{name}: {v!r} is not one of {', '.join(allowed)}")
  return [int(v) for v in values] if allowed is None else values


# Name -> an optimizer with the main job's default learning rate (the rate
# does not change what compiles).
OPTIMIZERS = {
  "sgd": lambda pe: pe.SGD(0.05),
  "adagrad": lambda pe: pe.Adagrad(0.05),
  "rowwise_adagrad": lambda pe: pe.RowWiseAdagrad(0.05, half_life_steps=None),
  "lazy_adam": lambda pe: pe.LazyAdam(0.005),
  "ftrl": lambda pe: pe.FTRL(5.0),
  # optax.adam per row: no fused kernel, so its math runs in XLA on rows the
  # kernels move (kernels.staged_update); synchronous only (--pipelines=sync).
  "optax_rows": lambda pe: pe.OptaxRows(_optax().adam(1e-3)),
}


def _optax():
  import optax  # pylint: disable=g-import-not-at-top

  return optax


def _row(r: dict) -> str:
  mib = lambda b: f"{b / 2**20:8.1f}"
  table = sum(t["table_bytes"] for t in r["tables"].values())
  slots = sum(t["slot_bytes"] for t in r["tables"].values())
  ov = r["overlap"]
  return (
    f"{r['topology']:>10} {r['pipeline']:>6} {r['chips']:>5} {mib(table)} "
    f"{mib(slots)} {mib(r['temp_bytes'])} {r['bytes_accessed'] / 1e9:8.2f} "
    f"{r['floor_bytes'] / 1e9:6.2f} {r['bytes_accessed'] / r['floor_bytes']:6.1f} "
    f"{r['net_bytes_accessed'] / r['floor_bytes']:6.1f} "
    f"{mib(r['all_to_all_bytes'])} {len(r['table_sized_copies']):>6} "
    f"{r['kernel_calls']:>7} {ov['overlapping']:>3}/{ov['async_collectives']:<3} "
    f"{r['compile_seconds']:6.0f}"
  )


HEADER = (
  "  topology   pipe chips table MiB slot MiB temp MiB  XLA GB floor GB   "
  "x  net x  a2a MiB copies kernels overlap compile s"
)


def _workload(args, dtype: str, dim: int | None, optimizer: str):
  """The workload the flags describe, for one case of dtype, dim and optimizer."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  from pallas_emb.pod_check import compile as compile_lib  # pylint: disable=g-import-not-at-top

  kw = dict(
    dtype=jnp.dtype(dtype),
    examples_per_chip=args.examples_per_chip or EXAMPLES_PER_CHIP,
    optimizer=OPTIMIZERS[optimizer](pe),
    stacking=args.stacking,
  )
  if args.config:
    from pallas_emb.pod_check import config  # pylint: disable=g-import-not-at-top

    workload = config.load(args.config, examples_per_chip=EXAMPLES_PER_CHIP, stacking=args.stacking)
    if args.examples_per_chip:  # given on the command line: it wins over the file
      workload = dataclasses.replace(workload, examples_per_chip=args.examples_per_chip)
  elif args.workload == "w_tpu":
    workload = compile_lib.w_tpu(args.vocab, dim or 128, **kw)
  elif args.workload == "dlrm":
    workload = compile_lib.dlrm(args.dlrm_max_rows or None, **kw)
  else:
    workload = compile_lib.main_job(dim or 16, **kw)
  caps = {
    k: v
    for k, v in (("unique_capacity", args.unique_capacity), ("route_capacity", args.route_capacity))
    if v
  }
  if caps:
    tables = {f.table for f in workload.features}
    options = {t: {**workload.table_options.get(t, {}), **caps} for t in tables}
    workload = dataclasses.replace(workload, table_options=options)
  return workload


def main(argv=None) -> int:
  args = _parse(argv if argv is not None else sys.argv[1:])
  env.prepare(async_all_to_all=not args.no_async_all_to_all)
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  from pallas_emb.kernels import forms  # pylint: disable=g-import-not-at-top

  with forms.forcing(args.forms):
    return _compile_all(args, pe)


def _compile_all(args, pe) -> int:
  """Every case, topology and pipeline of `args`; prints a row each."""
  from pallas_emb.pod_check import compile as compile_lib  # pylint: disable=g-import-not-at-top

  cases = list(itertools.product(args.dtype, args.dim, args.optimizer))
  reports = []
  print(HEADER, flush=True)
  for dtype, dim, optimizer in cases:
    workload = _workload(args, dtype, dim, optimizer)
    case = f"{dtype}_d{dim}_{optimizer}" if len(cases) > 1 else ""
    if case:
      print(f"{dtype} D={dim} {optimizer}:", flush=True)
    for topology in map(str.strip, args.topology.split(",")):

      def hlo_path(pipeline, topology=topology, case=case):
        if not args.hlo_dir:
          return None
        os.makedirs(args.hlo_dir, exist_ok=True)
        name = "_".join(filter(None, [topology.replace(":", "_"), case, pipeline]))
        return os.path.join(args.hlo_dir, f"{name}.hlo.txt")

      if args.dynamic:
        from pallas_emb.pod_check import dynamic  # pylint: disable=g-import-not-at-top

        vocabulary = pe.DynamicVocabulary(policy="lfu", evict_every=4, ttl=16, probe_limit=16)
        new = dynamic.compile_pair(topology, workload, vocabulary, hlo_path)
      else:
        new = (  # lazily: each row prints as its compile ends
          compile_lib.compile_step(topology, workload, pipeline=p, hlo_path=hlo_path(p))
          for p in map(str.strip, args.pipelines.split(","))
        )
      for report in new:
        reports.append(report)
        print(_row(report), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(reports, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
