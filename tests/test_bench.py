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

from pallas_emb.bench import plot, workloads
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
      "300",
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
      f"--plot={tmp_path}/b.png",
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert {"cpus", "jax", "copy_bandwidth_gbps"} <= set(r["machine"])
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
  results = {"machine": {"cpu": "AMD EPYC", "cpus": 2}, "workloads": [w]}
  readme = open(os.path.join(REPO, "README.md")).read()
  new = bench_report.update_readme(readme, results)
  row = (
    "| W1: V = 10,000,000, N = 65,536 | 29,096 | 5.0 ms | 1,600 ms | 6.0 ms | 1.5 ms | 0.83 | 320 |"
  )
  assert row in new and "| 1.00 | 5.00 |" in new
  start, end = new.index(bench_report.BEGIN), new.index(bench_report.END)
  assert new[:start] == readme[: readme.index(bench_report.BEGIN)]
  assert new[end:] == readme[readme.index(bench_report.END) :]
