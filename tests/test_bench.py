"""The benchmark program runs on a tiny workload and writes its JSON schema.

Times are not asserted: a benchmark is a program, not a test.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import child_env

from pallas_emb.bench import optimizers, plot, workloads
from pallas_emb.bench import report as bench_report
from pallas_emb.kernels import native_lib
from pallas_emb.kernels.backend import default_backend

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = {
  "native": {"dedup", "dedup.native_unique_keys", "other", "step"}
  | {p for p in native_lib.PHASES if not p.startswith("unique_")},
  "xla": {"dedup", "segment_sum", "norm", "gather", "update_rows", "write_back", "other", "step"},
}


@pytest.mark.slow
def test_bench_writes_the_documented_schema(tmp_path):
  out = tmp_path / "bench.json"
  env = child_env()
  proc = subprocess.run(
    [
      "timeout",
      "-k",
      "5",
      "600",
      sys.executable,
      "-m",
      "pallas_emb.bench",
      f"--json={out}",
      "--vocab=1000,20000",
      "--ids=512",
      "--dim=16",
      "--steps=3",
      "--warmup=1",
      "--methods=fused,fused_xla,dense,fbgemm",
      "--profile_steps=2",
      "--pipeline_steps=2",
      "--pipeline_devices=2",
      "--pipeline_batch_size=64",
      "--optimizers=lazy_adam",
      "--optimizer_vocab=2000",
      f"--plot={tmp_path}/b.png",
      f"--copy_bytes={1 << 24}",
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert {"cpus", "jax", "copy_bandwidth_gbps", "copy_bandwidth_end_gbps"} <= set(r["machine"])
  assert {"load_avg_at_start", "load_avg_at_end", "others_cpu_share"} <= set(r["machine"])
  assert r["machine"]["copy_bytes"] == 1 << 24
  assert [w["vocab"] for w in r["workloads"]] == [1000, 20000]
  for w in r["workloads"]:
    assert {"vocab", "ids", "dim", "unique", "floor_ms", "methods"} <= set(w)
    assert w["unique"] == len(np.unique(workloads.zipf_ids(512, w["vocab"])))
    assert w["floor_ms"] > 0
    expected = {"fused", "fused_xla", "dense"} | (
      {"fbgemm"} if "fbgemm" not in r["skipped"] else set()
    )
    assert set(w["methods"]) == expected
    for m in w["methods"].values():
      assert {"median_ms", "min_ms", "max_ms", "peak_rss_mb"} <= set(m) and m["steps"] == 3
      assert 0 < m["min_ms"] <= m["median_ms"] <= m["max_ms"]
    assert w["methods"]["fused"]["backend"] == default_backend()
    assert w["methods"]["fused_xla"]["backend"] == "xla"
    # The per-stage profile of each fused method, named by its backend.
    assert set(w["profile"]) == {"fused", "fused_xla"}
    for name, p in w["profile"].items():
      assert p["backend"] == w["methods"][name]["backend"]
      stages = STAGES[p["backend"]]
      assert set(p["stages_ms"]) == stages
      assert all(v >= 0 for v in p["stages_ms"].values()) and p["stages_ms"]["step"] > 0
  # Each optimizer against FBGEMM's nearest, with its fused step's stages.
  opt = r["optimizers"]
  assert (opt["vocab"], opt["ids"]) == (2000, 512)
  assert [row["optimizer"] for row in opt["rows"]] == ["lazy_adam"]
  for row in opt["rows"]:
    fbgemm = "fbgemm" not in r["skipped"]
    assert set(row["methods"]) == {"fused"} | ({"fbgemm"} if fbgemm else set())
    assert row["fbgemm_optimizer"] == ("EXACT_ROWWISE_ADAGRAD" if fbgemm else None)
    assert row["floor_ms"] > 0 and row["methods"]["fused"]["steps"] == 3
    assert set(row["profile"]["stages_ms"]) == STAGES[row["profile"]["backend"]]
  assert opt["rows"][0]["note"]  # LazyAdam has no FBGEMM CPU counterpart
  assert set(r["pipelines"]) == {"async", "exact"}
  assert all(p["examples_per_sec"] > 0 for p in r["pipelines"].values())
  assert (tmp_path / "b.png").stat().st_size > 0


def test_floor_bytes_formula():
  # unique*D*4*2 + unique*4*2 + N*D*4 + N*4
  assert workloads.floor_bytes(10, 20, 4) == 10 * 4 * 4 * 2 + 10 * 4 * 2 + 20 * 4 * 4 + 20 * 4


def test_zipf_ids_are_the_issue_distribution():
  ids = workloads.zipf_ids(65536, 1_000_000)
  want = (np.random.default_rng(0).zipf(1.1, 65536) - 1) % 1_000_000
  np.testing.assert_array_equal(ids, want)
  assert len(np.unique(ids)) == 28768  # the unique count the issue quotes


def test_plot_draws_time_against_v_and_n(tmp_path):
  # A sweep over V and N gets two panels; the figures are made up.
  ws = [
    {
      "vocab": v,
      "ids": n,
      "dim": 16,
      "floor_ms": n / 1e4,
      "methods": {m: {"median_ms": n / 1e3 * k} for m, k in (("fused", 1), ("fbgemm", 2))},
    }
    for v in (1000, 10000)
    for n in (256, 1024)
  ]
  plot.plot({"workloads": ws}, str(tmp_path / "sweep.png"))
  from PIL import Image  # matplotlib's own dependency

  width, height = Image.open(tmp_path / "sweep.png").size
  assert width > 1.5 * height  # two panels side by side


def test_report_rewrites_only_the_readme_results_section():
  w = {
    "vocab": 10_000_000,
    "ids": 65536,
    "dim": 128,
    "unique": 29096,
    "floor_ms": 1.5,
    "methods": {
      "fused": {"median_ms": 5.0, "steps": 20, "backend": "native"},
      "dense": {"median_ms": 1600.0, "steps": 20},
      "fbgemm": {"median_ms": 6.0, "steps": 20},
    },
    "profile": {"fused": {"backend": "native", "stages_ms": {"dedup": 1.0, "step": 5.0}}},
  }
  quiet = {
    "load_avg_at_start": [0.3, 0.2, 0.1],
    "load_avg_at_end": [1.9, 0.3, 0.1],  # the run's own threads
    "others_cpu_share": 0.01,
  }
  results = {"machine": {"cpu": "AMD EPYC", "cpus": 2, **quiet}, "workloads": [w]}
  readme = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
  new = bench_report.update_page(readme, results)
  row = (
    "| W1: V = 10,000,000, N = 65,536 | 29,096 | 5.0 ms | 1,600 ms | 6.0 ms | 1.5 ms | 0.83 | 320 |"
  )
  assert row in new and "| 1.00 | 5.00 |" in new
  start, end = new.index(bench_report.BEGIN), new.index(bench_report.END)
  assert new[:start] == readme[: readme.index(bench_report.BEGIN)]
  assert new[end:] == readme[readme.index(bench_report.END) :]


def _optimizer_results(load_at_start, others=0.02):
  w = {
    "vocab": 1_000_000,
    "ids": 65536,
    "dim": 128,
    "unique": 28768,
    "floor_ms": 2.0,
    "methods": {"fused": {"median_ms": 5.0, "steps": 20, "backend": "native"}},
  }
  rows = [
    {
      "optimizer": name,
      "fbgemm_optimizer": optimizers.PAIRINGS[name].fbgemm,
      "note": optimizers.PAIRINGS[name].note,
      "methods": {"fused": {"median_ms": fused}, "fbgemm": {"median_ms": 8.0}},
      "floor_ms": 3.0,
      "profile": {"backend": "native", "stages_ms": {"dedup": 1.0, "step": fused}},
    }
    for name, fused in (("rowwise_adagrad", 6.0), ("lazy_adam", 10.0))
  ]
  machine = {
    "cpus": 2,
    "load_avg_at_start": [load_at_start, 0, 0],
    "load_avg_at_end": [2.0, 0, 0],
    "others_cpu_share": others,
  }
  return {
    "machine": machine,
    "workloads": [w],
    "optimizers": {"vocab": 1_000_000, "ids": 65536, "unique": 28768, "rows": rows},
  }


def test_report_has_a_row_per_optimizer():
  text = bench_report.render(_optimizer_results(0.5))
  assert "| rowwise_adagrad | EXACT_ROWWISE_ADAGRAD | 6.0 ms | 8.0 ms | 3.0 ms | 0.75 |" in text
  assert "| lazy_adam | EXACT_ROWWISE_ADAGRAD (no Adam on FBGEMM's CPU path) |" in text
  assert "| 10.0 ms | 8.0 ms | 3.0 ms | 1.25 |" in text
  assert "| lazy_adam | 1.00 | 10.00 |" in text  # its stage profile


def test_report_refuses_the_page_a_busy_run():
  readme = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
  # 0.5 per core at the start, and the run's own load at the end: quiet.
  assert bench_report.update_page(readme, _optimizer_results(1.0))
  with pytest.raises(
    bench_report.BusyMachineError, match=r"load average was 1.20 at the start.*\(1.0 on 2 cores\)"
  ):
    bench_report.update_page(readme, _optimizer_results(1.2))
  with pytest.raises(bench_report.BusyMachineError, match=r"took 35% of the cores"):
    bench_report.update_page(readme, _optimizer_results(0.1, others=0.35))
  no_share = _optimizer_results(0.1)
  del no_share["machine"]["others_cpu_share"]
  with pytest.raises(bench_report.BusyMachineError, match="no share of the cores"):
    bench_report.update_page(readme, no_share)


def test_others_cpu_share_leaves_out_this_process():
  from pallas_emb.bench.machine import OthersCpu

  # 10 s on 2 cores; the machine was busy 15 CPU-seconds, 10 of them this
  # process's: the others took 5 of 20.
  assert OthersCpu.between((0.0, 100.0, 10.0), (10.0, 115.0, 20.0), 2) == 0.25
  assert OthersCpu.between((0.0, 100.0, 10.0), (10.0, 110.0, 20.0), 2) == 0.0
  assert OthersCpu.between((0.0, 100.0, 10.0), None, 2) is None
  share = OthersCpu().share()
  assert share is None or 0.0 <= share <= 1.0


def test_optimizer_floor_counts_every_slot():
  # LazyAdam: row, m and v (D floats each) and an int32 count per row.
  got = optimizers.floor_bytes(optimizers.PAIRINGS["lazy_adam"].ours, 10, 20, 4)
  assert got == 10 * (4 * 4 * 3 + 4) * 2 + 20 * 4 * 4 + 20 * 4


def test_dense_is_skipped_with_a_reason_when_it_would_not_fit(monkeypatch):
  from pallas_emb.bench import run as run_lib

  table = 5_120_000_000  # V = 10M rows of 128 float32
  monkeypatch.setattr(run_lib, "available_memory", lambda: 8_000_000_000)
  why = run_lib._dense_does_not_fit(table)
  assert why and "10.2 GB" in why and "8.0 GB available" in why and "--vocab" in why
  monkeypatch.setattr(run_lib, "available_memory", lambda: 20_000_000_000)
  assert run_lib._dense_does_not_fit(table) is None


@pytest.mark.slow
def test_tpu_check_compares_the_kernels_with_the_xla_path(tmp_path):
  """`python -m pallas_emb.bench.tpu_check` (run on a TPU for the docs'
  figures) on CPU: the interpreted kernels equal the XLA path bit for bit
  on a packed bf16 table rounded stochastically (its per-row scalar slot
  and sub-rows are the kernels' hardest layout)."""
  from pallas_emb.bench import tpu_check

  report = tpu_check.main(["--quick", "--json", str(tmp_path / "tpu_check.json")])
  assert report["pallas_backend"] == "interpret"
  assert [c["case"] for c in report["cases"]] == ["bfloat16-D64-rowwise_adagrad+sr"]
  for case in report["cases"]:
    assert "error" not in case, case
    assert case["table"]["identical"] and case["acts"]["identical"], case
    assert case["slots"] and all(s["identical"] for s in case["slots"].values()), case
  assert json.loads((tmp_path / "tpu_check.json").read_text()) == report
