"""The Colab quickstart runs on CPU (small sizes) and is committed clean."""

import json
import os

import nbformat
import pytest
from conftest import child_env
from nbclient import NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "colab", "quickstart.ipynb")

CPU_DEVICES = 8
# CI's sizes: enough steps to see learning, a benchmark of tiny tables.
SMALL = f"""
STEPS = 40
BATCH_SIZE = 256
EVAL_EVERY = 20
EVAL_BATCHES = 2
CPU_DEVICES = {CPU_DEVICES}
BENCH_VOCAB = [10_000, 100_000]
BENCH_IDS = 4096
BENCH_STEPS = 3
CHECKPOINT_DIR = {{ckpt!r}}
PALLAS_EMB_SOURCE = None
"""


def test_notebook_is_committed_without_outputs():
  nb = json.load(open(NOTEBOOK))
  for cell in nb["cells"]:
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None, cell["source"][:80]
  assert sum("parameters" in c["metadata"].get("tags", []) for c in nb["cells"]) == 1


@pytest.mark.slow
def test_notebook_runs_on_cpu(tmp_path, monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  params.source = SMALL.format(ckpt=str(tmp_path / "ckpt"))
  # A fresh kernel, as in Colab, with the device count the notebook asks
  # for and the suite's compile flags beside it.
  flags = child_env()["XLA_FLAGS"]
  monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count={CPU_DEVICES} {flags}")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.setenv("PYTHONPATH", REPO)
  NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
  ).execute()
  text = "\n".join(
    o.get("text", "")
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.outputs
    if o.get("output_type") == "stream"
  )
  assert "tables identical: True" in text
  assert "equal to float32 rounding: True" in text
  assert "eval AUC" in text and "fused" in text
