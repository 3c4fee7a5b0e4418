"""The benchmark program runs on a tiny workload and writes its JSON schema.

Times are not asserted: a benchmark is a program, not a test.
"""

import json
import os
import subprocess
import sys

import numpy as np

from pallas_emb import bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_writes_the_documented_schema(tmp_path):
  out = tmp_path / "bench.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run(
      ["timeout", "-k", "5", "300", sys.executable, "-m", "pallas_emb.bench",
       f"--json={out}", "--vocab=1000,20000", "--ids=512", "--dim=16", "--steps=3",
       "--warmup=1", "--methods=fused,dense,fbgemm", "--pipeline_steps=2",
       "--pipeline_devices=2", "--pipeline_batch_size=64", f"--plot={tmp_path}/b.png"],
      cwd=REPO, env=env, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert {"cpus", "jax", "copy_bandwidth_gbps"} <= set(r["machine"])
  assert [w["vocab"] for w in r["workloads"]] == [1000, 20000]
  for w in r["workloads"]:
    assert {"vocab", "ids", "dim", "unique", "floor_ms", "methods"} <= set(w)
    assert w["unique"] == len(np.unique(bench.zipf_ids(512, w["vocab"])))
    assert w["floor_ms"] > 0
    expected = {"fused", "dense"} | ({"fbgemm"} if "fbgemm" not in r["skipped"] else set())
    assert set(w["methods"]) == expected
    for m in w["methods"].values():
      assert {"median_ms", "min_ms", "max_ms", "peak_rss_mb"} <= set(m) and m["steps"] == 3
      assert 0 < m["min_ms"] <= m["median_ms"] <= m["max_ms"]
  assert set(r["pipelines"]) == {"async", "exact"}
  assert all(p["examples_per_sec"] > 0 for p in r["pipelines"].values())
  assert (tmp_path / "b.png").stat().st_size > 0


def test_floor_bytes_formula():
  # unique*D*4*2 + unique*4*2 + N*D*4 + N*4
  assert bench.floor_bytes(10, 20, 4) == 10 * 4 * 4 * 2 + 10 * 4 * 2 + 20 * 4 * 4 + 20 * 4


def test_zipf_ids_are_the_issue_distribution():
  ids = bench.zipf_ids(65536, 1_000_000)
  want = (np.random.default_rng(0).zipf(1.1, 65536) - 1) % 1_000_000
  np.testing.assert_array_equal(ids, want)
  assert len(np.unique(ids)) == 28768  # the unique count the issue quotes
