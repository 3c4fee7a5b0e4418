"""The benchmarks page's CPU section, and README's results table, written
from the benchmark runs' JSON.

    python -m pallas_emb.bench.report docs/benchmarks/w1w2.json --page docs/benchmarks.md

Replaces what stands between the markers `<!-- bench:results -->` and
`<!-- /bench:results -->` in the page with the run's table (one row per
workload), the ratios the issue tracks (fused / FBGEMM, dense / fused),
the per-stage profile of the first workload's fused step and, when the run
compared optimizers (`--optimizers`), a row per optimizer against FBGEMM's
nearest with its stage profile. Numbers are never typed by hand:
`docs/benchmarks/regenerate.sh` runs the benchmark and this.

A busy machine's times are not results (other processes take the cores and
the memory bandwidth, and not evenly from each method): the page is only
rewritten from a run that started at a 1-minute load average of at most
`MAX_LOAD_PER_CORE` per core and during which other processes took at most
`MAX_OTHERS_CPU_SHARE` of the cores (the load average at the end counts the
run's own threads, so it cannot tell); otherwise this says why and writes
nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

BEGIN, END = "<!-- bench:results -->", "<!-- /bench:results -->"
MAX_LOAD_PER_CORE = 0.5
# What other processes may take of all cores' time during the run: on a
# quiet 2-core machine the system's own work is about 1%.
MAX_OTHERS_CPU_SHARE = 0.1
NAMES = {
  "fused": "fused",
  "fused_xla": "fused, XLA path",
  "dense": "dense",
  "fbgemm": "FBGEMM backward",
}


def _ms(x: float) -> str:
  return f"{x:,.0f} ms" if x >= 100 else f"{x:.1f} ms"


def _times(x: float) -> str:
  return f"{x:,.0f}" if x >= 10 else f"{x:.2f}"


def _load(machine: dict) -> str:
  """How busy the machine was: the 1-minute load average at the run's start
  and end, and the copy bandwidth measured, when recorded."""
  text = ""
  if "load_avg_at_start" in machine:
    text += (
      f"; load average {machine['load_avg_at_start'][0]:.1f} at the "
      f"start, {machine['load_avg_at_end'][0]:.1f} at the end"
    )
  if machine.get("others_cpu_share") is not None:
    text += f"; other processes took {machine['others_cpu_share']:.0%} of the cores"
  if "copy_bandwidth_gbps" in machine:
    size = machine.get("copy_bytes", 1 << 30) / 2**20
    size = f"{size / 1024:g} GiB" if size >= 1024 else f"{size:g} MiB"
    text += f"; a {size} copy ran at {machine['copy_bandwidth_gbps']:.1f} GB/s"
    if "copy_bandwidth_end_gbps" in machine:
      text += f" at the start, {machine['copy_bandwidth_end_gbps']:.1f} GB/s at the end"
  return text


def busy(machine: dict) -> str:
  """Why a run's times may not go in the docs ("" if they may)."""
  cores = machine.get("cpus") or 1
  limit = MAX_LOAD_PER_CORE * cores
  start, others = machine.get("load_avg_at_start"), machine.get("others_cpu_share")
  if start is None or others is None:
    return (
      "the run recorded no load average at its start or no share of the cores taken by "
      "other processes; rerun the benchmark"
    )
  if start[0] > limit:
    return (
      f"the 1-minute load average was {start[0]:.2f} at the start, over {MAX_LOAD_PER_CORE} "
      f"per core ({limit:.1f} on {cores} cores): other processes shared the cores and the "
      "memory bandwidth; rerun on a quiet machine"
    )
  if others > MAX_OTHERS_CPU_SHARE:
    return (
      f"other processes took {others:.0%} of the cores during the run, over "
      f"{MAX_OTHERS_CPU_SHARE:.0%}: they shared the cores and the memory bandwidth; rerun "
      "on a quiet machine"
    )
  return ""


def _optimizer_lines(opt: dict) -> list[str]:
  """The per-optimizer comparison: ratios, then each fused step's stages."""
  rows = opt["rows"]
  lines = [
    "",
    f"Every optimizer on V = {opt['vocab']:,}, N = {opt['ids']:,} ({opt['unique']:,} unique), "
    "against the nearest optimizer FBGEMM's CPU backward runs "
    "(`pallas_emb.bench.optimizers`):",
    "",
    "| optimizer | FBGEMM counterpart | fused | FBGEMM backward | memory floor | fused / FBGEMM |",
    "| --- | --- | ---: | ---: | ---: | ---: |",
  ]
  for r in rows:
    med = {m: v["median_ms"] for m, v in r["methods"].items()}
    counterpart = r["fbgemm_optimizer"] or "–"
    if r["note"]:
      counterpart += f" ({r['note']})"
    ratio = f"{med['fused'] / med['fbgemm']:.2f}" if "fbgemm" in med else "–"
    fbgemm = _ms(med["fbgemm"]) if "fbgemm" in med else "–"
    lines.append(
      f"| {r['optimizer']} | {counterpart} | {_ms(med['fused'])} | {fbgemm} | "
      f"{_ms(r['floor_ms'])} | {ratio} |"
    )
  profiled = [r for r in rows if "profile" in r]
  if profiled:
    stages = list(profiled[0]["profile"]["stages_ms"])
    lines += [
      "",
      f'Where each optimizer\'s fused step went (backend "{profiled[0]["profile"]["backend"]}"; '
      "median ms):",
      "",
      "| optimizer | " + " | ".join(stages) + " |",
      "| --- | " + " | ".join("---:" for _ in stages) + " |",
    ]
    for r in profiled:
      got = r["profile"]["stages_ms"]
      lines.append(
        f"| {r['optimizer']} | " + " | ".join(f"{got.get(k, 0.0):.2f}" for k in stages) + " |"
      )
  return lines


def render(results: dict) -> str:
  """The markdown of a run: table, ratios, profile."""
  ws = results["workloads"]
  methods = [m for m in NAMES if any(m in w["methods"] for w in ws)]
  machine = results["machine"]
  steps = ws[0]["methods"][methods[0]]["steps"]
  lines = [
    f"Results on {machine.get('cpu', 'CPU')} ({machine['cpus']} cores, "
    f"median of {steps} steps; D = {ws[0]['dim']}, float32; fused ran on "
    f'backend "{ws[0]["methods"].get("fused", {}).get("backend", "?")}"' + _load(machine) + "):",
    "",
    "| workload | unique ids | "
    + " | ".join(NAMES[m] for m in methods)
    + " | memory floor | fused / FBGEMM | dense / fused |",
    "| --- | ---: | " + " | ".join("---:" for _ in methods) + " | ---: | ---: | ---: |",
  ]
  for i, w in enumerate(ws):
    med = {m: w["methods"][m]["median_ms"] for m in methods if m in w["methods"]}
    ratio = lambda a, b, med=med: f"{med[a] / med[b]:.2f}" if a in med and b in med else "–"
    label = f"W{i + 1}: " if w["ids"] == 65536 and len(ws) <= 2 else ""
    lines.append(
      f"| {label}V = {w['vocab']:,}, N = {w['ids']:,} | {w['unique']:,} | "
      + " | ".join(_ms(med[m]) if m in med else "–" for m in methods)
      + f" | {_ms(w['floor_ms'])} | {ratio('fused', 'fbgemm')} | "
      + (_times(med["dense"] / med["fused"]) if "dense" in med and "fused" in med else "–")
      + " |"
    )
  for name, prof in ws[0].get("profile", {}).items():
    stages = prof["stages_ms"]
    lines += [
      "",
      f"Where the first workload's {NAMES.get(name, name)} step "
      f'went (backend "{prof["backend"]}", `pallas_emb.bench.stages`; median ms):',
      "",
      "| " + " | ".join(stages) + " |",
      "| " + " | ".join("---:" for _ in stages) + " |",
      "| " + " | ".join(f"{v:.2f}" for v in stages.values()) + " |",
    ]
  if "optimizers" in results:
    lines += _optimizer_lines(results["optimizers"])
  return "\n".join(lines)


class BusyMachineError(ValueError):
  """A run's times come from a busy machine (see `busy`)."""


def update_page(page: str, results: dict) -> str:
  """`page` with the text between the markers replaced by `render`.

  Raises:
    BusyMachineError: the run was on a busy machine (`busy` says why).
  """
  why = busy(results["machine"])
  if why:
    raise BusyMachineError(f"not writing the benchmark figures: {why}.")
  pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
  if not pattern.search(page):
    raise ValueError(
      f"the page has no {BEGIN} ... {END} section; add the two markers where the results go."
    )
  return pattern.sub(lambda _: f"{BEGIN}\n{render(results)}\n{END}", page)


def summary_table(chip: dict, cpu: dict) -> str:
  """README's results table: W-TPU's step on one TPU chip (the grid of
  `bench.tpu_grid`, from `docs/benchmarks/forms_v5e.json`) and the W1 and W2
  updates on CPU (`bench`, from `docs/benchmarks/w1w2.json`), each beside
  the XLA path and the nearest peer, with their ratio."""
  rows = [
    "| where | step | this library | XLA path | peer | ratio to XLA | ratio to peer |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
  ]
  grids = [c["grid"] for _, c in sorted(chip["calls"].items()) if "grid" in c]
  for r in grids[-1]:  # the latest call's grid
    if not r["case"].endswith("-1M-b4096"):
      continue
    ms = r["median_ms"]
    rows.append(
      f"| TPU v5e chip | {r['case'].replace('-1M-b4096', '')}, 1M rows, 86,016 ids | "
      f"{ms['default']:.2f} ms | {ms['xla']:.2f} ms | {ms['plain']:.2f} ms (plain JAX) | "
      f"{ms['default'] / ms['xla']:.2f} | {ms['default'] / ms['plain']:.2f} |"
    )
  for i, w in enumerate(cpu["workloads"]):
    med = {m: w["methods"][m]["median_ms"] for m in w["methods"]}
    rows.append(
      f"| CPU, {cpu['machine']['cpus']} cores | W{i + 1} update, V = {w['vocab']:,}, "
      f"N = {w['ids']:,} | {_ms(med['fused'])} | {_ms(med['fused_xla'])} | "
      f"{_ms(med['fbgemm'])} (FBGEMM) | {med['fused'] / med['fused_xla']:.2f} | "
      f"{med['fused'] / med['fbgemm']:.2f} |"
    )
  return "\n".join(rows)


def drift_table(result: dict) -> str:
  """README's drift table: per pipeline, the median over runs of each
  table's AUC and step and of the dynamic / hashed step ratio (from
  `docs/benchmarks/drift_trainer.json`, runs of `bench.drift`)."""
  rows = [
    "| where | pipeline | dynamic AUC | hashed AUC | oracle AUC | dynamic / hashed step |",
    "| --- | --- | ---: | ---: | ---: | ---: |",
  ]
  median = lambda xs: float(statistics.median(xs))
  for pipeline in ("async", "sync"):
    runs = [r for r in result["runs"] if r["pipeline"] == pipeline]
    auc = {
      n: median([r["methods"][n]["auc"] for r in runs]) for n in ("dynamic", "hashed", "oracle")
    }
    ratio = median([r["dynamic_over_hashed_step_time"] for r in runs])
    rows.append(
      f"| CPU, {runs[0]['steps']} steps of {runs[0]['batch']:,}, {len(runs)} runs | {pipeline} | "
      f"{auc['dynamic']:.3f} | {auc['hashed']:.3f} | {auc['oracle']:.3f} | {ratio:.2f} |"
    )
  return "\n".join(rows)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("json", help="a `python -m pallas_emb.bench` result")
  parser.add_argument(
    "--page", help="rewrite this page's results section (default: print the section)"
  )
  args = parser.parse_args(argv)
  with open(args.json) as f:
    results = json.load(f)
  if not args.page:
    print(render(results))
    return
  with open(args.page) as f:
    try:
      text = update_page(f.read(), results)
    except BusyMachineError as e:
      raise SystemExit(str(e)) from None
  with open(args.page, "w") as f:
    f.write(text)


if __name__ == "__main__":
  main()
