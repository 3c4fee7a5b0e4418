"""Compile a serving artifact's programs for a TPU topology, without a TPU.

    python -m pallas_emb.pod_check.serving /tmp/model --topology=v5e:2x2 --json=report.json

The TPU half of each exported lookup (`pallas_emb.serving.program`), called
as `load_serving` calls it: every table on one chip, and row-sharded over all
of the topology's chips, at a request of `--batch` bags of `--bag` ids (a
ragged request: the same ids packed per data shard). Each compile reports its
bytes per chip (`memory_analysis()`) and the compiled HLO's custom calls, of
which there must be none (the exported lookup is XLA's path, no kernels).
Like `python -m pallas_emb.pod_check`, run it without network access
(`unshare -n`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from pallas_emb.pod_check import env

# What a Pallas (Mosaic) kernel compiles to on a TPU.
KERNEL_TARGETS = frozenset({"tpu_custom_call"})


def _args(manifest: dict, feature: str, form: str, chips, batch: int, bag: int):
  """Abstract (table, keys, num_rows, *ids) of `feature`'s `form` program,
  placed as `load_serving` places them on a mesh over `chips`."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  from pallas_emb.serving import program  # pylint: disable=g-import-not-at-top
  from pallas_emb.serving.model import placed_rows  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(chips), ("rows",))
  f = manifest["features"][feature]
  t = manifest["tables"][f["table"]]
  rows, dim = t["rows"]["shape"]
  per_shard = max(1, batch // manifest["num_shards"])
  sizes = {"v": placed_rows(rows, len(chips)), "d": dim, "b": batch, "l": bag}
  sizes.update(c=per_shard * bag, k=per_shard)
  if "dynamic" in t:
    sizes["n"] = t["dynamic"]["ids"]["shape"][0] + len(program.sentinel_keys()[0])
  shardings = (NamedSharding(mesh, P("rows")), NamedSharding(mesh, P()))
  return program.arg_shapes(program.FeatureProgram(**f["program"]), form, sizes, shardings)


def compile_artifact(path: str, topology: str, batch: int = 256, bag: int = 8) -> list[dict]:
  """A report per program file and placement ("one chip", "row-sharded")."""
  import jax  # pylint: disable=g-import-not-at-top

  from pallas_emb.pod_check.compile import topology_mesh  # pylint: disable=g-import-not-at-top
  from pallas_emb.serving import artifact, program  # pylint: disable=g-import-not-at-top

  manifest = artifact.read_manifest(path)
  files = artifact.read_files(path, manifest)
  chips = list(topology_mesh(topology).devices.flat)
  by_file = {}  # one feature per program file
  for name, f in manifest["features"].items():
    for form, file in f["programs"].items():
      by_file.setdefault(file, (name, form))
  reports = []
  for file, (feature, form) in sorted(by_file.items()):
    exported = program.deserialize(files[file])
    for placement, devices in (("one chip", chips[:1]), ("row-sharded", chips)):
      args = _args(manifest, feature, form, devices, batch, bag)
      compiled = jax.jit(exported.call).trace(*args).lower(lowering_platforms=("tpu",)).compile()
      targets = re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())
      mem = compiled.memory_analysis()
      reports.append(
        {
          "file": file,
          "feature": feature,
          "form": form,
          "placement": placement,
          "chips": len(devices),
          "topology": topology,
          "exported_custom_calls": program.custom_calls(exported),
          "kernels": [t for t in targets if t in KERNEL_TARGETS],
          "xla_custom_calls": sorted(set(targets) - KERNEL_TARGETS),
          "argument_bytes": int(mem.argument_size_in_bytes),
          "temp_bytes": int(mem.temp_size_in_bytes),
        }
      )
  return reports


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m pallas_emb.pod_check.serving", description=__doc__.split("\n\n")[0]
  )
  p.add_argument("path", help="a serving artifact (pallas_emb.export_serving's directory)")
  p.add_argument("--topology", default="v5e:2x2", help="a TPU topology: v5e:2x2, v6e:2x2, ...")
  p.add_argument("--batch", type=int, default=256, help="bags per request")
  p.add_argument("--bag", type=int, default=8, help="ids per bag")
  p.add_argument("--json", default=None, help="write the reports here")
  args = p.parse_args(argv if argv is not None else sys.argv[1:])
  if args.batch < 1 or args.bag < 1:
    p.error(f"--batch and --bag must be positive, got {args.batch}, {args.bag}")
  env.prepare()
  reports = compile_artifact(args.path, args.topology, args.batch, args.bag)
  for r in reports:
    print(
      f"{r['file']:>28} {r['form']:>6} {r['placement']:>11} {r['chips']:>3} chips  "
      f"args {r['argument_bytes'] / 2**20:7.2f} MiB  temp {r['temp_bytes'] / 2**20:7.2f} MiB  "
      f"kernels {len(r['kernels'])}, exported custom calls {len(r['exported_custom_calls'])}"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(reports, f, indent=2)
  return 1 if any(r["kernels"] or r["exported_custom_calls"] for r in reports) else 0


if __name__ == "__main__":
  sys.exit(main())
